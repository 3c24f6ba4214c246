package zds

import (
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"time"

	"github.com/mesh-cni/mesh-cni/pkg/zds/zdspb"
)

// ProxyConn is the proxy's end of a ZDS connection, as ztunnel implements it. The
// agent does not need it; the reference proxy and the tests do.
type ProxyConn struct {
	uc      *net.UnixConn
	timeout time.Duration
	buf     []byte
	oob     []byte
}

// Request is one request from the agent. Netns is the namespace fd that came with
// it (an AddWorkload's), or nil; the receiver owns it and must close it.
type Request struct {
	*zdspb.WorkloadRequest
	Netns *os.File
}

// Dial connects to the agent's ZDS socket. Writes (hello, acks) are bounded by
// DefaultAckTimeout. It does not send the hello: call Hello.
func Dial(ctx context.Context, path string) (*ProxyConn, error) {
	var d net.Dialer
	c, err := d.DialContext(ctx, "unixpacket", path)
	if err != nil {
		return nil, fmt.Errorf("connect to zds socket %s: %w", path, err)
	}
	return &ProxyConn{
		uc:      c.(*net.UnixConn),
		timeout: DefaultAckTimeout,
		buf:     make([]byte, MaxRequestSize),
		oob:     oobBuffer(),
	}, nil
}

// Hello announces the protocol version; V1 is the only one there is.
func (c *ProxyConn) Hello(v zdspb.Version) error {
	if err := writePacket(c.uc, &zdspb.ZdsHello{Version: v}, -1, time.Now().Add(c.timeout)); err != nil {
		return fmt.Errorf("send hello: %w", err)
	}
	return nil
}

// Recv waits for the next request until ctx ends. The agent closing the
// connection is io.EOF. A packet that is not a valid request (truncated,
// undecodable, no payload, more than one fd) is an error wrapping ErrProtocol;
// any fds it carried are closed. Checking which requests may carry an fd is left
// to the caller, which knows what it expects.
func (c *ProxyConn) Recv(ctx context.Context) (*Request, error) {
	// Clear the deadline before arming the context's, so a cancellation that
	// fires at once is not undone.
	if err := c.uc.SetReadDeadline(time.Time{}); err != nil {
		return nil, fmt.Errorf("clear read deadline: %w", err)
	}
	stop := context.AfterFunc(ctx, func() { _ = c.uc.SetReadDeadline(time.Now()) })
	pkt, err := readPacket(c.uc, c.buf, c.oob)
	if !stop() && ctx.Err() != nil {
		// The deadline was moved to stop this read: report why.
		return nil, fmt.Errorf("receive zds request: %w", ctx.Err())
	}
	if err != nil {
		return nil, err
	}
	req, fds, err := parseRequest(pkt.data, pkt.oob, pkt.flags)
	if err == nil && len(fds) > 1 {
		err = protocolErrorf("request carries %d fds, at most 1 is allowed", len(fds))
	}
	if err != nil {
		closeFds(fds)
		return nil, err
	}
	r := &Request{WorkloadRequest: req}
	if len(fds) == 1 {
		r.Netns = os.NewFile(uintptr(fds[0]), "zds-netns")
	}
	return r, nil
}

// Ack answers the current request; a non-empty msg reports an error.
func (c *ProxyConn) Ack(msg string) error {
	resp := &zdspb.WorkloadResponse{Payload: &zdspb.WorkloadResponse_Ack{Ack: &zdspb.Ack{Error: msg}}}
	if err := writePacket(c.uc, resp, -1, time.Now().Add(c.timeout)); err != nil {
		return fmt.Errorf("send ack: %w", err)
	}
	return nil
}

// SendRaw sends b as one packet with fds in SCM_RIGHTS, for tests that play a
// misbehaving proxy.
func (c *ProxyConn) SendRaw(b []byte, fds ...int) error {
	if len(fds) > 1 {
		return errors.New("SendRaw sends at most one fd")
	}
	fd := -1
	if len(fds) == 1 {
		fd = fds[0]
	}
	return writeRaw(c.uc, b, fd, time.Now().Add(c.timeout))
}

// Close closes the connection.
func (c *ProxyConn) Close() error {
	return c.uc.Close()
}
