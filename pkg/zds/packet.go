package zds

import (
	"errors"
	"fmt"
	"io"
	"net"
	"time"

	"golang.org/x/sys/unix"
	"google.golang.org/protobuf/proto"

	"github.com/mesh-cni/mesh-cni/pkg/zds/zdspb"
)

// MaxRequestSize is the largest request the server sends. ztunnel reads each request
// into a 1024-byte buffer and rejects a truncated packet, so a pod whose AddWorkload
// would not fit is refused here with an error instead of breaking the connection.
const MaxRequestSize = 1024

const (
	// maxResponseSize is the read buffer for packets from a proxy. Acks are tiny; an
	// error text in a nack can be long, so leave plenty of room.
	maxResponseSize = 64 << 10
	// maxFdsPerPacket sizes the control buffer. One fd is the most a ZDS packet ever
	// carries; room for a few more lets a misbehaving peer's extra fds be received
	// (and closed) rather than silently dropped by the kernel.
	maxFdsPerPacket = 8
)

// ErrProtocol is wrapped by every error about a packet that breaks the protocol.
var ErrProtocol = errors.New("zds protocol violation")

func protocolErrorf(format string, args ...any) error {
	return fmt.Errorf("%w: %s", ErrProtocol, fmt.Sprintf(format, args...))
}

func oobBuffer() []byte {
	return make([]byte, unix.CmsgSpace(maxFdsPerPacket*4))
}

// rawPacket is one packet as read from the socket.
type rawPacket struct {
	data  []byte
	oob   []byte
	flags int
}

// readPacket reads one packet under the connection's current read deadline. A zero-length read is the peer's
// orderly close (SOCK_SEQPACKET reports it that way; an empty packet carries no
// message and is not part of the protocol either) and returns io.EOF. The returned
// slices alias buf and oob.
func readPacket(c *net.UnixConn, buf, oob []byte) (rawPacket, error) {
	n, oobn, flags, _, err := c.ReadMsgUnix(buf, oob)
	if err != nil {
		// Whatever fds arrived with a failed read still belong to us.
		closeFds(rightsOrNil(oob[:oobn]))
		return rawPacket{}, plainNetErr(err)
	}
	if n == 0 && oobn == 0 {
		return rawPacket{}, io.EOF
	}
	return rawPacket{data: buf[:n], oob: oob[:oobn], flags: flags}, nil
}

// writePacket sends msg as one packet, with fd in SCM_RIGHTS when fd >= 0.
func writePacket(c *net.UnixConn, msg proto.Message, fd int, deadline time.Time) error {
	b, err := proto.Marshal(msg)
	if err != nil {
		return fmt.Errorf("encode %T: %w", msg, err)
	}
	return writeRaw(c, b, fd, deadline)
}

func writeRaw(c *net.UnixConn, b []byte, fd int, deadline time.Time) error {
	var oob []byte
	if fd >= 0 {
		oob = unix.UnixRights(fd)
	}
	if err := c.SetWriteDeadline(deadline); err != nil {
		return fmt.Errorf("set write deadline: %w", err)
	}
	n, _, err := c.WriteMsgUnix(b, oob, nil)
	if err != nil {
		return plainNetErr(err)
	}
	if n != len(b) {
		return fmt.Errorf("short write: %d of %d bytes", n, len(b))
	}
	return nil
}

// plainNetErr drops the addresses from a *net.OpError. The server's socket was
// bound under a temporary name and renamed into place (see unixsock.Listen), and the
// kernel keeps reporting the temporary name as the local address, which would only
// confuse whoever reads the logs.
func plainNetErr(err error) error {
	var op *net.OpError
	if errors.As(err, &op) {
		return fmt.Errorf("%s: %w", op.Op, op.Err)
	}
	return err
}

// parseRights returns every fd passed in SCM_RIGHTS messages in oob. The fds are
// the caller's to close, also when an error is returned with them; other control
// message types are ignored.
func parseRights(oob []byte) ([]int, error) {
	if len(oob) == 0 {
		return nil, nil
	}
	msgs, err := unix.ParseSocketControlMessage(oob)
	if err != nil {
		return nil, fmt.Errorf("parse control messages: %w", err)
	}
	var fds []int
	var errs []error
	for i := range msgs {
		if msgs[i].Header.Level != unix.SOL_SOCKET || msgs[i].Header.Type != unix.SCM_RIGHTS {
			continue
		}
		// unix.ParseUnixRights indexes past its slice (panics) when the data is
		// not whole 4-byte fds; the kernel never sends that, a fuzzer does.
		if len(msgs[i].Data)%4 != 0 {
			errs = append(errs, fmt.Errorf("SCM_RIGHTS data of %d bytes is not a whole number of fds", len(msgs[i].Data)))
			continue
		}
		got, err := unix.ParseUnixRights(&msgs[i])
		if err != nil {
			errs = append(errs, fmt.Errorf("parse SCM_RIGHTS: %w", err))
			continue
		}
		fds = append(fds, got...)
	}
	return fds, errors.Join(errs...)
}

func rightsOrNil(oob []byte) []int {
	fds, _ := parseRights(oob)
	return fds
}

func closeFds(fds []int) {
	for _, fd := range fds {
		_ = unix.Close(fd)
	}
}

// checkFlags rejects packets the kernel had to cut: a truncated message cannot be
// decoded reliably and truncated control data means fds were lost.
func checkFlags(flags int) error {
	if flags&unix.MSG_TRUNC != 0 {
		return protocolErrorf("packet truncated")
	}
	if flags&unix.MSG_CTRUNC != 0 {
		return protocolErrorf("control data truncated (too many fds)")
	}
	return nil
}

// stage is what the server expects next from a proxy.
type stage int

const (
	expectHello stage = iota
	expectAck
)

func (s stage) String() string {
	if s == expectHello {
		return "hello"
	}
	return "ack"
}

// decodeHello returns the version a proxy announced. Any version is accepted,
// as Istio's node agent does (it logs the version and serves V1): V1 is the
// only version there is, and refusing a proxy over the number would only make
// a newer ztunnel retry forever against an agent that could serve it.
func decodeHello(data []byte) (zdspb.Version, error) {
	var hello zdspb.ZdsHello
	if err := proto.Unmarshal(data, &hello); err != nil {
		return 0, protocolErrorf("decode hello: %v", err)
	}
	return hello.GetVersion(), nil
}

// handlePacket interprets one packet a proxy sent to the server. For expectHello
// it succeeds for any ZdsHello (see decodeHello); for expectAck only for a
// WorkloadResponse holding an Ack, whose error text it returns (empty: success).
// A proxy never sends fds: any fds in oob are returned for the caller to close, and
// the packet is rejected.
func handlePacket(st stage, data, oob []byte, flags int) (ackErr string, fds []int, err error) {
	fds, err = parseRights(oob)
	if err != nil {
		return "", fds, protocolErrorf("%s packet: %v", st, err)
	}
	if err := checkFlags(flags); err != nil {
		return "", fds, err
	}
	if len(fds) > 0 {
		return "", fds, protocolErrorf("%s packet carries %d unexpected fds", st, len(fds))
	}
	switch st {
	case expectHello:
		if _, err := decodeHello(data); err != nil {
			return "", nil, err
		}
		return "", nil, nil
	default:
		var resp zdspb.WorkloadResponse
		if err := proto.Unmarshal(data, &resp); err != nil {
			return "", nil, protocolErrorf("decode response: %v", err)
		}
		ack := resp.GetAck()
		if ack == nil {
			return "", nil, protocolErrorf("response without ack")
		}
		return ack.GetError(), nil, nil
	}
}

// parseRequest interprets one packet the server sent to a proxy. It returns the
// request and the fds that came with it; the fds are the caller's to close, also on
// error.
func parseRequest(data, oob []byte, flags int) (*zdspb.WorkloadRequest, []int, error) {
	fds, err := parseRights(oob)
	if err != nil {
		return nil, fds, protocolErrorf("request: %v", err)
	}
	if err := checkFlags(flags); err != nil {
		return nil, fds, err
	}
	var req zdspb.WorkloadRequest
	if err := proto.Unmarshal(data, &req); err != nil {
		return nil, fds, protocolErrorf("decode request: %v", err)
	}
	if req.GetPayload() == nil {
		return nil, fds, protocolErrorf("request without payload")
	}
	return &req, fds, nil
}
