package bench

import (
	"bufio"
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"net"
	"net/netip"
	"testing"
	"time"

	"github.com/mesh-cni/mesh-cni/internal/netns"
	"github.com/mesh-cni/mesh-cni/test/fixtures"
	"github.com/mesh-cni/mesh-cni/test/harness"
)

// The application protocol of the benchmark's server: a connection whose first
// byte is sinkMode is a bulk upload (the server counts bytes until EOF and
// answers with the count as 8 bytes, big-endian); any other connection is
// echoed. One port serves both, so a proxy that forwards every connection to one
// fixed address can carry all the measurements.
const sinkMode = 'S'

// appPort is where the server application listens in the server pods.
const appPort = 8080

// rrSize is the request (and response) size of the request/response
// measurements: one small RPC.
const rrSize = 64

// serveApp runs the benchmark's server application in pod on [::]:port (IPv4
// and IPv6) until the benchmark ends.
func serveApp(tb testing.TB, pod *harness.Pod, port int) {
	tb.Helper()
	ln := pod.Listen(tb, "tcp", fmt.Sprintf("[::]:%d", port))
	fixtures.Serve(tb, ln, func(c net.Conn) { serveConn(c.(*net.TCPConn)) })
}

func serveConn(c *net.TCPConn) {
	r := bufio.NewReaderSize(c, 64<<10)
	first, err := r.Peek(1)
	if err != nil {
		return
	}
	if first[0] != sinkMode {
		if _, err := r.WriteTo(c); err == nil {
			_ = c.CloseWrite()
		}
		return
	}
	n, err := r.WriteTo(io.Discard)
	if err != nil {
		return
	}
	var reply [8]byte
	binary.BigEndian.PutUint64(reply[:], uint64(n))
	if _, err := c.Write(reply[:]); err == nil {
		_ = c.CloseWrite()
	}
}

// client runs measurements from inside a pod's network namespace: each
// measurement is one call of netns.Do, in which one goroutine locked to a
// thread in the pod makes every connection. Switching namespaces once per batch
// instead of once per dial keeps the client's own cost small and the same for
// every variant.
type client struct {
	netns  string
	target netip.AddrPort
}

// cycles makes n connections one after another, each: connect, one rrSize
// request and its echo, close. It returns each cycle's duration and the time
// the whole batch took.
func (c client) cycles(ctx context.Context, n int) (lat []time.Duration, total time.Duration, err error) {
	err = netns.Do(c.netns, func() error {
		req := make([]byte, rrSize)
		resp := make([]byte, rrSize)
		var d net.Dialer
		lat = make([]time.Duration, 0, n)
		begin := time.Now()
		for i := range n {
			start := time.Now()
			conn, err := d.DialContext(ctx, "tcp", c.target.String())
			if err != nil {
				return fmt.Errorf("connection %d of %d: dial %s: %w", i+1, n, c.target, err)
			}
			if err := roundTrip(conn, req, resp); err != nil {
				conn.Close()
				return fmt.Errorf("connection %d of %d: %w", i+1, n, err)
			}
			if err := conn.Close(); err != nil {
				return fmt.Errorf("close: %w", err)
			}
			lat = append(lat, time.Since(start))
		}
		total = time.Since(begin)
		return nil
	})
	return lat, total, err
}

// requests makes one connection (not timed) and n request/responses on it,
// returning each one's duration.
func (c client) requests(ctx context.Context, n int) (lat []time.Duration, err error) {
	err = c.connected(ctx, func(conn *net.TCPConn, _ time.Time) error {
		req := make([]byte, rrSize)
		resp := make([]byte, rrSize)
		lat = make([]time.Duration, 0, n)
		for range n {
			start := time.Now()
			if err := roundTrip(conn, req, resp); err != nil {
				return err
			}
			lat = append(lat, time.Since(start))
		}
		return nil
	})
	return lat, err
}

// connected runs fn on one connection to the target, dialled from c's netns
// at start and closed when fn returns or ctx ends.
func (c client) connected(ctx context.Context, fn func(conn *net.TCPConn, start time.Time) error) error {
	return netns.Do(c.netns, func() error {
		start := time.Now()
		var d net.Dialer
		conn, err := d.DialContext(ctx, "tcp", c.target.String())
		if err != nil {
			return fmt.Errorf("dial %s: %w", c.target, err)
		}
		defer conn.Close()
		stop := context.AfterFunc(ctx, func() { conn.Close() })
		defer stop()
		return fn(conn.(*net.TCPConn), start)
	})
}

func roundTrip(conn net.Conn, req, resp []byte) error {
	if _, err := conn.Write(req); err != nil {
		return fmt.Errorf("write request: %w", err)
	}
	if _, err := io.ReadFull(conn, resp); err != nil {
		return fmt.Errorf("read response: %w", err)
	}
	return nil
}

// transfer runs one timed bulk transfer on a new connection to the target:
// xfer sends and reads on it; the time is from the connect to xfer's end.
func (c client) transfer(ctx context.Context, xfer func(conn *net.TCPConn) error) (took time.Duration, err error) {
	err = c.connected(ctx, func(conn *net.TCPConn, start time.Time) error {
		if err := xfer(conn); err != nil {
			return err
		}
		took = time.Since(start)
		return nil
	})
	return took, err
}

// upload is one bulk transfer of size bytes to the sink: connect, send, half
// close, wait for the server's count. It returns the time from connect to the
// count.
func (c client) upload(ctx context.Context, size int64, buf []byte) (time.Duration, error) {
	return c.transfer(ctx, func(conn *net.TCPConn) error {
		buf[0] = sinkMode
		if _, err := io.Copy(conn, io.LimitReader(repeatReader(buf), size)); err != nil {
			return fmt.Errorf("send: %w", err)
		}
		if err := conn.CloseWrite(); err != nil {
			return fmt.Errorf("half close: %w", err)
		}
		var reply [8]byte
		if _, err := io.ReadFull(conn, reply[:]); err != nil {
			return fmt.Errorf("read count: %w", err)
		}
		if got := int64(binary.BigEndian.Uint64(reply[:])); got != size {
			return fmt.Errorf("server counted %d bytes, sent %d", got, size)
		}
		return nil
	})
}

// echoTransfer sends size bytes and reads them back at the same time, for a
// proxy that answers itself (echo mode): the capture's cost on a bulk stream
// in both directions.
func (c client) echoTransfer(ctx context.Context, size int64, buf []byte) (time.Duration, error) {
	return c.transfer(ctx, func(conn *net.TCPConn) error {
		buf[0] = 'E'
		sent := make(chan error, 1)
		go func() {
			_, err := io.Copy(conn, io.LimitReader(repeatReader(buf), size))
			if err == nil {
				err = conn.CloseWrite()
			}
			sent <- err
		}()
		got, readErr := io.Copy(io.Discard, conn)
		if err := errors.Join(<-sent, readErr); err != nil {
			return fmt.Errorf("echo transfer: %w", err)
		}
		if got != size {
			return fmt.Errorf("echo returned %d bytes, sent %d", got, size)
		}
		return nil
	})
}

// repeatReader reads buf over and over.
type repeatReader []byte

func (r repeatReader) Read(p []byte) (int, error) {
	n := 0
	for n < len(p) {
		n += copy(p[n:], r)
	}
	return n, nil
}
