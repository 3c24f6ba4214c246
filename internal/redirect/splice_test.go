package redirect

import (
	"bytes"
	"context"
	"crypto/sha256"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"net"
	"path/filepath"
	"testing"
	"time"

	"go.uber.org/zap/zaptest"
	"golang.org/x/sys/unix"

	"github.com/mesh-cni/mesh-cni/test/fixtures"
)

// spliceDatapath opens a data path with splicing asked for, skipping where the
// kernel cannot splice.
func spliceDatapath(t *testing.T, maxUnread int64) *Datapath {
	t.Helper()
	requireRoot(t)
	if err := SpliceSupport(); err != nil {
		t.Skipf("kernel cannot splice: %v", err)
	}
	cfg := Config{PinRoot: filepath.Join(t.TempDir(), "bpf"), Logger: zaptest.NewLogger(t), Splice: true, SpliceMaxUnread: maxUnread}
	d, err := Open(context.Background(), cfg)
	if err != nil {
		t.Fatalf("open: %v", err)
	}
	t.Cleanup(func() {
		d.Close()
		if err := Uninstall(context.Background(), cfg); err != nil {
			t.Errorf("uninstall: %v", err)
		}
	})
	st, err := d.Splice()
	if err != nil {
		t.Fatal(err)
	}
	if errors.Is(d.spliceErr, unix.EPERM) {
		// Some kernels refuse tracing programs even to root (this one does
		// with BPF LSM programs too): the read accounting cannot load.
		t.Skipf("this kernel refuses the splice's programs: %v", d.spliceErr)
	}
	if !st.Enabled {
		t.Fatalf("splice status %+v", st)
	}
	return d
}

// tcpBytesReceived is tcpi_bytes_received of a connection: what reached its
// socket through TCP.
func tcpBytesReceived(t *testing.T, c net.Conn) uint64 {
	t.Helper()
	rc, err := c.(*net.TCPConn).SyscallConn()
	if err != nil {
		t.Fatal(err)
	}
	var (
		info *unix.TCPInfo
		ierr error
	)
	if err := rc.Control(func(fd uintptr) { info, ierr = unix.GetsockoptTCPInfo(int(fd), unix.IPPROTO_TCP, unix.TCP_INFO) }); err != nil {
		t.Fatal(err)
	}
	if ierr != nil {
		t.Fatal(ierr)
	}
	return info.Bytes_received
}

// startReadingProxy is an outbound proxy that reads with read(2), as the
// splice's proxy contract asks, and relays to the original destination. Each
// accepted connection's TCP-received byte count goes to got once the client's
// side ended.
func startReadingProxy(t *testing.T, p *pod, port uint16, got chan<- uint64) {
	ln := p.listen(t, fmt.Sprintf("[::]:%d", port))
	fixtures.Serve(t, ln, func(conn net.Conn) {
		orig, err := originalDst(conn)
		if err != nil {
			t.Errorf("original destination: %v", err)
			return
		}
		up, err := p.dial(orig.String(), dialOpts{mark: testMark})
		if err != nil {
			t.Errorf("upstream: %v", err)
			return
		}
		defer up.Close()
		done := make(chan struct{})
		go func() {
			defer close(done)
			_, _ = io.Copy(struct{ io.Writer }{conn}, struct{ io.Reader }{up})
			_ = conn.(*net.TCPConn).CloseWrite()
		}()
		// Plain reads: the wrappers hide ReadFrom, which would splice(2).
		_, _ = io.Copy(struct{ io.Writer }{up}, struct{ io.Reader }{conn})
		got <- tcpBytesReceived(t, conn)
		_ = up.(*net.TCPConn).CloseWrite()
		<-done
	})
}

// The bytes an application writes to its proxy arrive whole and in order, in
// writes of random sizes up to 4 MiB, and none of them crossed TCP (the
// proxy's socket received nothing through it); the echo back, into the
// application, is plain TCP.
func TestSpliceIntoProxy(t *testing.T) {
	d := spliceDatapath(t, 64<<20)
	a, b := newPodPair(t)
	s := testSettings()
	got := make(chan uint64, 4)
	startReadingProxy(t, a, s.OutboundPort, got)
	enroll(t, d, a, s)
	fixtures.ServeEcho(t, b.listen(t, fmt.Sprintf("[::]:%d", appPort)))

	for _, dst := range []string{hostPort(b.addr4, appPort), hostPort(b.addr6, appPort)} {
		conn, err := a.dial(dst, dialOpts{})
		if err != nil {
			t.Fatalf("dial %s: %v", dst, err)
		}
		var payload bytes.Buffer
		rng := rand.New(rand.NewPCG(1, 2))
		for payload.Len() < 16<<20 {
			chunk := make([]byte, 1+rng.IntN(4<<20))
			for i := range chunk {
				chunk[i] = byte(rng.Uint32())
			}
			payload.Write(chunk)
		}
		want := sha256.Sum256(payload.Bytes())
		ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
		err = fixtures.EchoRoundTrip(ctx, conn, payload.Bytes())
		cancel()
		if err != nil {
			t.Fatalf("%s: round trip of %d bytes (sha256 %x): %v", dst, payload.Len(), want[:8], err)
		}
		select {
		case n := <-got:
			// The FIN is the one sequence number TCP carries.
			if n > 1 {
				t.Errorf("%s: the proxy's socket received %d of %d bytes through TCP, want only the FIN", dst, n, payload.Len())
			}
		case <-time.After(10 * time.Second):
			t.Fatalf("%s: the proxy did not finish", dst)
		}
	}
}

// A proxy that does not read leaves at most the bound unread in the splice:
// past it the connection goes back to TCP, whose buffers stop the writer.
// Once the proxy reads, every byte arrives in order.
func TestSpliceBoundedWhenProxyDoesNotRead(t *testing.T) {
	const bound = 256 << 10
	d := spliceDatapath(t, bound)
	a, _ := newPodPair(t)
	s := testSettings()
	ln := a.listen(t, fmt.Sprintf("[::]:%d", s.OutboundPort))
	accepted := make(chan net.Conn, 1)
	go func() {
		c, err := ln.Accept()
		if err == nil {
			accepted <- c
		}
	}()
	enroll(t, d, a, s)
	conn, err := a.dial("192.0.2.1:80", dialOpts{})
	if err != nil {
		t.Fatalf("dial: %v", err)
	}
	defer conn.Close()
	proxy := <-accepted
	defer proxy.Close()

	payload := make([]byte, 64<<20)
	for i := range payload {
		payload[i] = byte(i * 7)
	}
	_ = conn.SetWriteDeadline(time.Now().Add(3 * time.Second))
	n, werr := conn.Write(payload)
	if werr == nil {
		t.Fatalf("all %d bytes were taken with nobody reading", n)
	}
	// Loopback TCP buffers hold a few MiB; the bound adds 256 KiB.
	if n > bound+16<<20 {
		t.Errorf("the writer got %d bytes in with nobody reading, want the bound (%d) plus TCP's buffers", n, bound)
	}
	t.Logf("writer stopped after %d bytes", n)
	st, err := d.Splice()
	if err != nil {
		t.Fatal(err)
	}
	if st.TCP != 1 || st.Spliced != 0 {
		t.Errorf("splice status %+v, want the connection on TCP", st)
	}
	read := make([]byte, n)
	_ = proxy.SetReadDeadline(time.Now().Add(10 * time.Second))
	if _, err := io.ReadFull(struct{ io.Reader }{proxy}, read); err != nil {
		t.Fatalf("proxy read: %v", err)
	}
	if !bytes.Equal(read, payload[:n]) {
		t.Fatalf("the proxy read %d bytes that differ from what was written", n)
	}
}
