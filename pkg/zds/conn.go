package zds

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"sync"
	"time"

	"go.uber.org/zap"
	"golang.org/x/sys/unix"

	"github.com/mesh-cni/mesh-cni/pkg/zds/zdspb"
)

// connError means a proxy connection failed (write, read, deadline or protocol
// violation) and has been closed. A request that fails this way may or may not
// have reached the proxy; the proxy's next connection starts with a snapshot.
type connError struct {
	id  uint64
	err error
}

func (e *connError) Error() string {
	return fmt.Sprintf("proxy connection %d: %v", e.id, e.err)
}

func (e *connError) Unwrap() error { return e.err }

// sentState is what a connection's proxy was told about one pod.
type sentState struct {
	// id is the namespace sent with the AddWorkload; zero for a KeepWorkload.
	id NetnsID
	// acked is set when the proxy acked the AddWorkload without error.
	acked bool
}

// conn is the server's side of one proxy connection, past its hello.
type conn struct {
	id      uint64
	pid     int32 // the peer's process (SO_PEERCRED)
	uc      *net.UnixConn
	log     *zap.Logger
	timeout time.Duration

	// sem admits one request at a time (the protocol is lock-step) and is held
	// for the whole snapshot, so adds and deletes queue behind it.
	sem chan struct{}
	// Guarded by sem.
	sent map[string]sentState
	buf  []byte
	oob  []byte
	peek [1]byte

	closed    chan struct{}
	closeOnce sync.Once

	// ready is set once the snapshot was acked; guarded by Server.mu.
	ready bool
}

func newConn(id uint64, uc *net.UnixConn, timeout time.Duration, log *zap.Logger) *conn {
	return &conn{
		id:      id,
		uc:      uc,
		log:     log,
		timeout: timeout,
		sem:     make(chan struct{}, 1),
		sent:    map[string]sentState{},
		buf:     make([]byte, maxResponseSize),
		oob:     oobBuffer(),
		closed:  make(chan struct{}),
	}
}

func (c *conn) close() {
	c.closeOnce.Do(func() {
		close(c.closed)
		_ = c.uc.Close()
	})
}

func (c *conn) isClosed() bool {
	select {
	case <-c.closed:
		return true
	default:
		return false
	}
}

// fail closes the connection and returns err as a connError.
func (c *conn) fail(err error) error {
	c.close()
	return &connError{id: c.id, err: err}
}

func (c *conn) acquire(ctx context.Context) error {
	// A closed connection must never win the race against its own sem.
	if c.isClosed() {
		return &connError{id: c.id, err: net.ErrClosed}
	}
	select {
	case c.sem <- struct{}{}:
		if c.isClosed() {
			<-c.sem
			return &connError{id: c.id, err: net.ErrClosed}
		}
		return nil
	case <-c.closed:
		return &connError{id: c.id, err: net.ErrClosed}
	case <-ctx.Done():
		return fmt.Errorf("waiting for proxy connection %d: %w", c.id, ctx.Err())
	}
}

func (c *conn) tryAcquire() bool {
	select {
	case c.sem <- struct{}{}:
		return true
	default:
		return false
	}
}

func (c *conn) release() { <-c.sem }

// readHello reads and checks the proxy's first packet and returns the version
// it announced.
func (c *conn) readHello() (zdspb.Version, error) {
	if err := c.uc.SetReadDeadline(time.Now().Add(c.timeout)); err != nil {
		return 0, fmt.Errorf("set hello deadline: %w", err)
	}
	pkt, err := readPacket(c.uc, c.buf, c.oob)
	if err != nil {
		return 0, fmt.Errorf("read hello: %w", err)
	}
	_, fds, err := handlePacket(expectHello, pkt.data, pkt.oob, pkt.flags)
	closeFds(fds)
	if err != nil {
		return 0, err
	}
	return decodeHello(pkt.data)
}

// request sends req (with fd when fd >= 0) and waits for its ack; the caller holds
// sem. One deadline covers the write and the ack. The exchange is deliberately not
// cut short by a caller's context: abandoning it would leave an ack in flight and
// the lock-step pairing broken, so only the deadline (or a closed connection)
// ends it. It returns the ack's error text; any failure closes the connection
// and is a *connError.
func (c *conn) request(req *zdspb.WorkloadRequest, fd int) (string, error) {
	deadline := time.Now().Add(c.timeout)
	if err := writePacket(c.uc, req, fd, deadline); err != nil {
		return "", c.fail(fmt.Errorf("send %s: %w", requestKind(req), err))
	}
	if err := c.uc.SetReadDeadline(deadline); err != nil {
		return "", c.fail(fmt.Errorf("set ack deadline: %w", err))
	}
	pkt, err := readPacket(c.uc, c.buf, c.oob)
	if err != nil {
		return "", c.fail(fmt.Errorf("wait for ack of %s: %w", requestKind(req), err))
	}
	ackErr, fds, err := handlePacket(expectAck, pkt.data, pkt.oob, pkt.flags)
	closeFds(fds)
	if err != nil {
		return "", c.fail(fmt.Errorf("ack of %s: %w", requestKind(req), err))
	}
	return ackErr, nil
}

// podRequest sends req about pod uid (kind names it in an AckError) and waits
// for its ack; a NACK is an *AckError.
func (c *conn) podRequest(uid, kind string, req *zdspb.WorkloadRequest, fd int) error {
	ackErr, err := c.request(req, fd)
	if err != nil {
		return err
	}
	if ackErr != "" {
		return &AckError{UID: uid, Request: kind, Msg: ackErr}
	}
	return nil
}

// addPod sends an AddWorkload with the netns fd; the caller holds sem. A pod the
// proxy already acked with the same namespace is not sent again.
func (c *conn) addPod(pod Pod, req *zdspb.WorkloadRequest, fd int, id NetnsID) error {
	if st, ok := c.sent[pod.UID]; ok && st.acked && st.id == id {
		c.log.Debug("proxy already has pod", zap.String("uid", pod.UID))
		return nil
	}
	// Until acked the proxy may hold the pod (ztunnel retries a pod it failed to
	// start), so a later delete must still reach it.
	c.sent[pod.UID] = sentState{id: id}
	if err := c.podRequest(pod.UID, "add", req, fd); err != nil {
		return err
	}
	c.sent[pod.UID] = sentState{id: id, acked: true}
	return nil
}

// keepPod sends a KeepWorkload (snapshot only); the caller holds sem.
func (c *conn) keepPod(uid string) error {
	c.sent[uid] = sentState{}
	req := &zdspb.WorkloadRequest{Payload: &zdspb.WorkloadRequest_Keep{Keep: &zdspb.KeepWorkload{Uid: uid}}}
	return c.podRequest(uid, "keep", req, -1)
}

// delPod sends a DelWorkload if this connection's proxy was ever given the pod.
func (c *conn) delPod(ctx context.Context, uid string) error {
	if err := c.acquire(ctx); err != nil {
		return err
	}
	defer c.release()
	if _, ok := c.sent[uid]; !ok {
		return nil
	}
	delete(c.sent, uid)
	req := &zdspb.WorkloadRequest{Payload: &zdspb.WorkloadRequest_Del{Del: &zdspb.DelWorkload{Uid: uid}}}
	return c.podRequest(uid, "delete", req, -1)
}

// watch checks an idle connection every interval until it is closed or ctx ends.
// A request in flight checks the connection itself, so a busy connection is
// skipped.
func (c *conn) watch(ctx context.Context, interval time.Duration) {
	t := time.NewTicker(interval)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-c.closed:
			return
		case <-t.C:
		}
		if !c.tryAcquire() {
			continue
		}
		err := c.probe()
		c.release()
		if err != nil {
			c.log.Info("proxy connection is gone", zap.Error(err))
			c.close()
			return
		}
	}
}

// probe tells a live idle connection from a dead one without consuming anything:
// recv with MSG_PEEK|MSG_DONTWAIT. EAGAIN means alive and silent, as a proxy must
// be between requests; a zero-length result is the peer's close (SOCK_SEQPACKET
// reports EOF that way); a pending packet is a proxy speaking out of turn, which
// breaks the lock-step pairing of requests and acks, so it counts as dead too.
func (c *conn) probe() error {
	// Clear the last request's deadline, which would otherwise fail the check.
	if err := c.uc.SetReadDeadline(time.Time{}); err != nil {
		return err
	}
	raw, err := c.uc.SyscallConn()
	if err != nil {
		return err
	}
	var (
		n       int
		peekErr error
	)
	if err := raw.Read(func(fd uintptr) bool {
		n, _, peekErr = unix.Recvfrom(int(fd), c.peek[:], unix.MSG_PEEK|unix.MSG_DONTWAIT)
		return true // never wait: this is a poll
	}); err != nil {
		return err
	}
	switch {
	case errors.Is(peekErr, unix.EAGAIN):
		return nil
	case peekErr != nil:
		return peekErr
	case n == 0:
		return io.EOF
	default:
		return protocolErrorf("unsolicited packet from proxy")
	}
}

func requestKind(req *zdspb.WorkloadRequest) string {
	switch p := req.GetPayload().(type) {
	case *zdspb.WorkloadRequest_Add:
		return "AddWorkload " + p.Add.GetUid()
	case *zdspb.WorkloadRequest_Del:
		return "DelWorkload " + p.Del.GetUid()
	case *zdspb.WorkloadRequest_Keep:
		return "KeepWorkload " + p.Keep.GetUid()
	case *zdspb.WorkloadRequest_SnapshotSent:
		return "SnapshotSent"
	default:
		return "request"
	}
}
