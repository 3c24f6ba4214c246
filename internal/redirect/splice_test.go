package redirect

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"math"
	"math/rand/v2"
	"net"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strconv"
	"sync"
	"syscall"
	"testing"
	"time"

	"go.uber.org/zap/zaptest"
	"golang.org/x/sys/unix"

	"github.com/mesh-cni/mesh-cni/test/fixtures"
)

// spliceDatapath opens a data path with splicing asked for, skipping where the
// kernel cannot splice.
func spliceDatapath(t testing.TB, maxUnread int64) (*Datapath, Config) {
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
	return d, cfg
}

// tcpBytesReceived is tcpi_bytes_received of a connection: what reached its
// socket through TCP.
// On error it returns the maximum, which no check lets pass.
func tcpBytesReceived(c net.Conn) uint64 {
	rc, err := c.(*net.TCPConn).SyscallConn()
	if err != nil {
		return math.MaxUint64
	}
	var (
		info *unix.TCPInfo
		ierr error
	)
	if err := rc.Control(func(fd uintptr) { info, ierr = unix.GetsockoptTCPInfo(int(fd), unix.IPPROTO_TCP, unix.TCP_INFO) }); err != nil || ierr != nil {
		return math.MaxUint64
	}
	return info.Bytes_received
}

// relay copies between the proxy's two connections with read(2) and
// write(2), as the splice's proxy contract asks (the wrappers hide ReadFrom
// and WriteTo, which would splice(2)), and passes half-closes on. It returns
// what it read from each.
func relay(client, upstream net.Conn) (fromClient, fromUpstream int64) {
	done := make(chan struct{})
	go func() {
		defer close(done)
		fromUpstream, _ = io.Copy(struct{ io.Writer }{client}, struct{ io.Reader }{upstream})
		_ = client.(*net.TCPConn).CloseWrite()
	}()
	fromClient, _ = io.Copy(struct{ io.Writer }{upstream}, struct{ io.Reader }{client})
	_ = upstream.(*net.TCPConn).CloseWrite()
	<-done
	return fromClient, fromUpstream
}

// relayed is what one relayed connection's pod-side socket (the one the
// splice feeds) got: all it read, and what of that came through TCP; pod
// names the proxy's pod.
type relayed struct {
	read, tcp uint64
	pod       string
}

// proxyOpts change what the outbound test proxy does before it relays.
type proxyOpts struct {
	// peek: first peek at this many bytes (MSG_PEEK), as a proxy sniffing
	// the protocol does, and check they are what is then read.
	peek int
	// readThenClose: relay this many bytes, then close both connections
	// with the rest unread.
	readThenClose int64
}

// spliceChain is one pod-to-pod path with splicing on and both pods enrolled:
// an application in a, a's outbound proxy, b's inbound proxy, a server in b.
// Both proxies relay with read(2). received gets each relayed connection's
// count.
type spliceChain struct {
	d        *Datapath
	cfg      Config
	a, b     *pod
	received chan relayed
	errs     chan error
}

func newSpliceChain(t testing.TB, maxUnread int64, o proxyOpts, server func(net.Conn)) *spliceChain {
	t.Helper()
	d, cfg := spliceDatapath(t, maxUnread)
	return newChain(t, d, cfg, o, server)
}

// newChain is the path of newSpliceChain on a data path of the caller's, with
// or without splicing; both pods ask for the splice.
func newChain(t testing.TB, d *Datapath, cfg Config, o proxyOpts, server func(net.Conn)) *spliceChain {
	t.Helper()
	return newChainAsking(t, d, cfg, o, server, true, true)
}

// newChainAsking is newChain with each pod's Settings.Splice given: whether
// a's application's writes to a's proxy, and b's to b's, may be spliced.
func newChainAsking(t testing.TB, d *Datapath, cfg Config, o proxyOpts, server func(net.Conn), aAsks, bAsks bool) *spliceChain {
	t.Helper()
	a, b := newPodPair(t)
	c := &spliceChain{d: d, cfg: cfg, a: a, b: b, received: make(chan relayed, 64), errs: make(chan error, 64)}
	s := testSettings()
	fixtures.Serve(t, a.listen(t, fmt.Sprintf("[::]:%d", s.OutboundPort)), func(conn net.Conn) { c.proxy(conn, a, o) })
	fixtures.Serve(t, b.listen(t, fmt.Sprintf("[::]:%d", s.InboundPort)), func(conn net.Conn) { c.proxy(conn, b, proxyOpts{}) })
	fixtures.Serve(t, b.listen(t, fmt.Sprintf("[::]:%d", appPort)), server)
	s.Splice = aAsks
	enroll(t, d, a, s)
	s.Splice = bAsks
	enroll(t, d, b, s)
	return c
}

// proxy relays one connection to its original destination. The outbound
// proxy's pod-side socket is the accepted one; the inbound proxy's, the one
// it dials into its pod.
func (c *spliceChain) proxy(conn net.Conn, p *pod, o proxyOpts) {
	orig, err := originalDst(conn)
	if err != nil {
		c.errs <- fmt.Errorf("original destination: %w", err)
		return
	}
	up, err := p.dial(orig.String(), dialOpts{mark: testMark})
	if err != nil {
		c.errs <- fmt.Errorf("upstream %s: %w", orig, err)
		return
	}
	defer up.Close()
	if o.peek > 0 {
		peeked, err := peekThenRead(conn, o.peek)
		if err != nil {
			c.errs <- err
			return
		}
		if _, err := up.Write(peeked); err != nil {
			c.errs <- err
			return
		}
	}
	if o.readThenClose > 0 {
		_, _ = io.CopyN(struct{ io.Writer }{up}, struct{ io.Reader }{conn}, o.readThenClose)
		return
	}
	fromClient, fromUpstream := relay(conn, up)
	podSide, fromPod := conn, fromClient
	if p == c.b {
		podSide, fromPod = up, fromUpstream
	}
	c.received <- relayed{read: uint64(fromPod), tcp: tcpBytesReceived(podSide), pod: p.name}
}

// peekThenRead peeks at n bytes of conn, reads them and checks they are the
// same; it returns them.
func peekThenRead(conn net.Conn, n int) ([]byte, error) {
	rc, err := conn.(*net.TCPConn).SyscallConn()
	if err != nil {
		return nil, err
	}
	peeked := make([]byte, n)
	got := 0
	var perr error
	if err := rc.Read(func(fd uintptr) bool {
		got, _, perr = unix.Recvfrom(int(fd), peeked, unix.MSG_PEEK|unix.MSG_WAITALL)
		return perr != unix.EAGAIN
	}); err != nil {
		return nil, err
	}
	if perr != nil {
		return nil, fmt.Errorf("peek: %w", perr)
	}
	read := make([]byte, got)
	if _, err := io.ReadFull(struct{ io.Reader }{conn}, read); err != nil {
		return nil, fmt.Errorf("read after peek: %w", err)
	}
	if !bytes.Equal(read, peeked[:got]) {
		return nil, fmt.Errorf("read %x after peeking %x", read, peeked[:got])
	}
	return read, nil
}

// dial connects the application in a to the server in b.
func (c *spliceChain) dial(t testing.TB, v6 bool) *net.TCPConn {
	t.Helper()
	addr := c.b.addr4
	if v6 {
		addr = c.b.addr6
	}
	conn, err := c.a.dial(hostPort(addr, appPort), dialOpts{})
	if err != nil {
		t.Fatalf("dial: %v", err)
	}
	t.Cleanup(func() { conn.Close() })
	return conn.(*net.TCPConn)
}

// checkSpliced waits for conns relayed connections and fails the test for a
// proxy error, or one whose pod-side socket got more through TCP than its FIN
// (the one sequence number TCP carries): for a proxy that keeps up, so that
// the bound is never reached.
func (c *spliceChain) checkSpliced(t *testing.T, conns int) {
	t.Helper()
	c.waitRelayed(t, conns, func(r relayed) error {
		if r.tcp > 1 {
			return fmt.Errorf("a proxy's pod-side socket received %d of %d bytes through TCP, want only the FIN", r.tcp, r.read)
		}
		return nil
	})
}

// checkPartlySpliced is checkSpliced for a writer that may outrun its proxy
// by the bound, sending the rest through TCP: some bytes must be spliced.
func (c *spliceChain) checkPartlySpliced(t *testing.T, conns int) {
	t.Helper()
	c.waitRelayed(t, conns, func(r relayed) error {
		if r.read > 1 && r.tcp >= r.read {
			return fmt.Errorf("all %d bytes a proxy's pod-side socket received came through TCP", r.read)
		}
		return nil
	})
}

// drainReceived waits for conns relayed connections, whatever way their bytes
// came.
func (c *spliceChain) drainReceived(t *testing.T, conns int) {
	t.Helper()
	c.waitRelayed(t, conns, func(relayed) error { return nil })
}

func (c *spliceChain) waitRelayed(t *testing.T, conns int, check func(relayed) error) {
	t.Helper()
	for i := 0; i < conns; i++ {
		select {
		case r := <-c.received:
			if err := check(r); err != nil {
				t.Error(err)
			}
		case err := <-c.errs:
			t.Fatalf("proxy: %v", err)
		case <-time.After(30 * time.Second):
			t.Fatalf("%d of %d relayed connections did not finish", conns-i, conns)
		}
	}
}

// randomPayload is n bytes of a seeded sequence, and sizes for its writes:
// random, from 1 byte to 4 MiB.
func randomPayload(seed uint64, n int) ([]byte, []int) {
	rng := rand.New(rand.NewPCG(seed, seed+1))
	b := make([]byte, n)
	for i := range b {
		b[i] = byte(rng.Uint32())
	}
	var sizes []int
	for left := n; left > 0; {
		k := min(left, 1+rng.IntN(4<<20))
		sizes = append(sizes, k)
		left -= k
	}
	return b, sizes
}

// echo is a server that echoes with read(2) and write(2) and passes the
// client's half-close on.
func echo(conn net.Conn) {
	if _, err := io.Copy(struct{ io.Writer }{conn}, struct{ io.Reader }{conn}); err == nil {
		_ = conn.(*net.TCPConn).CloseWrite()
	}
}

// echoInWrites sends payload in writes of the given sizes while reading the
// echo, half-closes, and checks that exactly payload came back.
func echoInWrites(ctx context.Context, conn *net.TCPConn, payload []byte, sizes []int) error {
	stop := context.AfterFunc(ctx, func() { conn.Close() })
	defer stop()
	werr := make(chan error, 1)
	go func() {
		off := 0
		for _, n := range sizes {
			if _, err := conn.Write(payload[off : off+n]); err != nil {
				werr <- fmt.Errorf("write at %d: %w", off, err)
				return
			}
			off += n
		}
		werr <- conn.CloseWrite()
	}()
	got, rerr := io.ReadAll(struct{ io.Reader }{conn})
	if err := errors.Join(<-werr, rerr); err != nil {
		return err
	}
	return sameBytes(got, payload)
}

// sameBytes says where got and want part.
func sameBytes(got, want []byte) error {
	if bytes.Equal(got, want) {
		return nil
	}
	for i := range min(len(got), len(want)) {
		if got[i] != want[i] {
			return fmt.Errorf("got %d bytes of %d, first differing at %d", len(got), len(want), i)
		}
	}
	return fmt.Errorf("got %d bytes of %d, a prefix", len(got), len(want))
}

// Through the whole chain, with both pods' applications writing into their
// proxies spliced, every byte arrives once and in order each way, in writes of
// random sizes up to 4 MiB, and none of them crossed loopback TCP: the pod-side
// sockets of both proxies received only the FIN through it.
func TestSpliceIntoProxy(t *testing.T) {
	c := newSpliceChain(t, 64<<20, proxyOpts{}, echo)
	for i, v6 := range []bool{false, true} {
		payload, sizes := randomPayload(uint64(i), 16<<20)
		ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
		err := echoInWrites(ctx, c.dial(t, v6), payload, sizes)
		cancel()
		if err != nil {
			t.Fatalf("IPv6 %v: round trip of %d bytes in %d writes: %v", v6, len(payload), len(sizes), err)
		}
		c.checkSpliced(t, 2)
	}
	st, err := c.d.Splice()
	if err != nil {
		t.Fatal(err)
	}
	if st.TCP != 0 {
		t.Errorf("splice status %+v: a connection went back to TCP", st)
	}
}

// Only a pod that asks for the splice (Settings.Splice) has its applications'
// writes to its proxy spliced: in a chain where one pod asks and the other
// does not, the asking pod's proxy gets its application's bytes past TCP and
// the other's through it, whichever pod asks.
func TestSpliceOnlyPodsThatAsk(t *testing.T) {
	d, cfg := spliceDatapath(t, 0)
	for _, aAsks := range []bool{true, false} {
		c := newChainAsking(t, d, cfg, proxyOpts{}, echo, aAsks, !aAsks)
		payload, sizes := randomPayload(11, 1<<20)
		ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
		err := echoInWrites(ctx, c.dial(t, false), payload, sizes)
		cancel()
		if err != nil {
			t.Fatal(err)
		}
		asking := map[string]bool{"a": aAsks, "b": !aAsks}
		c.waitRelayed(t, 2, func(r relayed) error {
			switch {
			case asking[r.pod] && r.tcp > 1:
				return fmt.Errorf("pod %s asks for the splice, yet its proxy received %d of %d bytes through TCP", r.pod, r.tcp, r.read)
			case !asking[r.pod] && r.tcp < r.read:
				return fmt.Errorf("pod %s does not ask for the splice, yet its proxy received only %d of %d bytes through TCP", r.pod, r.tcp, r.read)
			}
			return nil
		})
	}
}

// Why a pod asks for the splice only when its applications read their
// sockets non-blocking: a socket in a sockhash is read by the kernel's sockmap
// reader (tcp_bpf_recvmsg), which ends a blocking read whose wait a signal
// interrupts with EAGAIN, where TCP's reader restarts it (SA_RESTART, as Go
// installs its handlers). An application of a pod that does not ask reads
// every byte without an error; one of a pod that asks sees EAGAIN on the
// kernels this runs on. Should a kernel ever wait like TCP, the second half
// fails, and the splice's requirement can be lifted there.
func TestSpliceBlockingReaderUnderSignals(t *testing.T) {
	d, _ := spliceDatapath(t, 0)
	a, b := newPodPair(t)
	s := testSettings()
	const n = 100
	for _, p := range []*pod{a, b} {
		serveDrip(t, p, s.OutboundPort)
	}
	s.Splice = true
	enroll(t, d, a, s)
	s.Splice = false
	enroll(t, d, b, s)

	for _, tc := range []struct {
		from *pod
		to   netip.Addr
	}{{b, a.addr4}, {a, b.addr4}} {
		conn, err := tc.from.dial(hostPort(tc.to, appPort), dialOpts{})
		if err != nil {
			t.Fatal(err)
		}
		read, eagain, err := blockingReadUnderSignals(conn, n)
		conn.Close()
		if err != nil {
			t.Fatalf("pod %s: a blocking read after %d bytes: %v", tc.from.name, read, err)
		}
		asks := tc.from == a
		t.Logf("pod %s (asks for the splice: %v): %d bytes read blocking, %d reads ended with EAGAIN", tc.from.name, asks, read, eagain)
		switch {
		case !asks && eagain > 0:
			t.Errorf("pod %s does not ask for the splice, yet %d of its application's blocking reads ended with EAGAIN", tc.from.name, eagain)
		case asks && eagain == 0:
			t.Errorf("no blocking read of a spliced application's socket ended with EAGAIN under signals: this kernel's sockmap reader waits as TCP's does, and the splice's requirement (docs/design.md) is out of date here")
		}
	}
}

// A pod that stops asking for the splice (enrolled again without it, the
// agent's SetSplice, or released) takes its open connections off it: their
// applications' sockets leave the sockhash, so their blocking reads wait as on
// TCP again, and their writes go through TCP.
func TestSpliceStopsWhenThePodStopsAsking(t *testing.T) {
	d, _ := spliceDatapath(t, 0)
	a, b := newPodPair(t)
	s := testSettings()
	const n = 100
	serveDrip(t, a, s.OutboundPort)
	s.Splice = true
	enroll(t, d, a, s)
	applications := func() int { return countSplicedApplications(t, d, a.cookie) }
	dial := func() net.Conn {
		conn, err := a.dial(hostPort(b.addr4, appPort), dialOpts{})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { conn.Close() })
		return conn
	}
	conn := dial()
	if got := applications(); got != 1 {
		t.Fatalf("%d of the pod's application sockets in the sockhash while it asks, want 1", got)
	}

	s.Splice = false
	enroll(t, d, a, s)
	if got := applications(); got != 0 {
		t.Errorf("%d of the pod's application sockets still in the sockhash after it was enrolled without the splice", got)
	}
	if st, err := d.Splice(); err != nil || st.Spliced != 0 || st.TCP != 1 {
		t.Errorf("splice status %+v (%v) after the pod stopped asking, want its open connection on TCP", st, err)
	}
	if read, eagain, err := blockingReadUnderSignals(conn, n); err != nil || eagain > 0 {
		t.Errorf("after the pod stopped asking, its open connection's blocking reads: %d bytes, %d ended with EAGAIN, %v; want none", read, eagain, err)
	}

	for _, stop := range []struct {
		name string
		fn   func() error
	}{
		{"SetSplice(false)", func() error {
			_, err := d.SetSplice(context.Background(), a.cookie, false)
			return err
		}},
		{"Release", func() error { return d.Release(context.Background(), a.cookie) }},
	} {
		if changed, err := d.SetSplice(context.Background(), a.cookie, true); err != nil || !changed {
			t.Fatalf("SetSplice(true): changed %v, %v", changed, err)
		}
		dial()
		if got := applications(); got != 1 {
			t.Fatalf("%d of the pod's application sockets in the sockhash after SetSplice(true), want 1", got)
		}
		if err := stop.fn(); err != nil {
			t.Fatalf("%s: %v", stop.name, err)
		}
		if got := applications(); got != 0 {
			t.Errorf("%d of the pod's application sockets still in the sockhash after %s", got, stop.name)
		}
	}
	if _, err := d.SetSplice(context.Background(), a.cookie, true); !errors.Is(err, ErrNotEnrolled) {
		t.Errorf("SetSplice on a released pod: %v, want ErrNotEnrolled", err)
	}
}

// countSplicedApplications counts the applications' sockets of netns cookie in
// splice_socks.
func countSplicedApplications(t *testing.T, d *Datapath, cookie uint64) int {
	t.Helper()
	socks, err := d.splicedApplications(cookie)
	if err != nil {
		t.Fatal(err)
	}
	return len(socks)
}

// Inbound, a connection the proxy opened to the application while the pod
// asked, whose application's side is established only after the pod stopped
// asking (the application listens with TCP_DEFER_ACCEPT: its socket is made
// when the first byte arrives): that socket stays out of the sockhash.
func TestSpliceAcceptedAfterThePodStoppedAsking(t *testing.T) {
	d, _ := spliceDatapath(t, 0)
	a, _ := newPodPair(t)
	s := testSettings()
	var ln net.Listener
	a.do(t, func() error {
		lc := net.ListenConfig{Control: func(_, _ string, c syscall.RawConn) error {
			var serr error
			if err := c.Control(func(fd uintptr) { serr = unix.SetsockoptInt(int(fd), unix.IPPROTO_TCP, unix.TCP_DEFER_ACCEPT, 5) }); err != nil {
				return err
			}
			return serr
		}}
		lc.SetMultipathTCP(false)
		var err error
		ln, err = lc.Listen(context.Background(), "tcp", hostPort(a.addr4, appPort))
		return err
	})
	// The application keeps its connection open, reading, until the test
	// ends: a closed socket leaves the sockhash by itself.
	accepted := make(chan struct{}, 1)
	fixtures.Serve(t, ln, func(conn net.Conn) {
		accepted <- struct{}{}
		_, _ = io.Copy(io.Discard, struct{ io.Reader }{conn})
	})
	s.Splice = true
	enroll(t, d, a, s)
	proxy, err := a.dial(hostPort(a.addr4, appPort), dialOpts{mark: testMark})
	if err != nil {
		t.Fatal(err)
	}
	defer proxy.Close()
	s.Splice = false
	enroll(t, d, a, s)
	if _, err := proxy.Write([]byte("first")); err != nil {
		t.Fatal(err)
	}
	select {
	case <-accepted:
	case <-time.After(10 * time.Second):
		t.Fatal("the application did not accept")
	}
	if got := countSplicedApplications(t, d, a.cookie); got != 0 {
		t.Errorf("%d application sockets accepted after the pod stopped asking joined the sockhash", got)
	}
}

// An application's write that reached TCP without the splice's program (one
// that started before its socket joined the sockhash, and waited there for
// the handshake) is read by the proxy before any later, spliced, write: a
// blocking socket that connects with sendto(MSG_FASTOPEN) and no cookie, or
// writes from a second thread while another connects.
func TestSpliceWriteBeforeTheSocketJoined(t *testing.T) {
	d, _ := spliceDatapath(t, 0)
	a, b := newPodPair(t)
	s := testSettings()
	s.Splice = true
	got := make(chan []byte, 64)
	fixtures.Serve(t, a.listen(t, fmt.Sprintf("[::]:%d", s.OutboundPort)), func(conn net.Conn) {
		_ = conn.SetReadDeadline(time.Now().Add(10 * time.Second))
		all, _ := io.ReadAll(struct{ io.Reader }{conn})
		got <- all
	})
	enroll(t, d, a, s)
	first, second := bytes.Repeat([]byte{'A'}, 300), bytes.Repeat([]byte{'B'}, 300)
	dst := &unix.SockaddrInet4{Addr: b.addr4.As4(), Port: appPort}
	connects := map[string]func(fd int) error{
		"sendto(MSG_FASTOPEN)": func(fd int) error { return unix.Sendto(fd, first, unix.MSG_FASTOPEN, dst) },
		"write while connecting": func(fd int) error {
			werr := make(chan error, 1)
			go func() {
				// Until the connect is under way, the write fails
				// with ENOTCONN or EPIPE: try again.
				for {
					_, err := unix.Write(fd, first)
					if err != unix.ENOTCONN && err != unix.EPIPE {
						werr <- err
						return
					}
					runtime.Gosched()
				}
			}()
			if err := unix.Connect(fd, dst); err != nil {
				return err
			}
			return <-werr
		},
	}
	for name, connect := range connects {
		bad := 0
		const conns = 30
		for range conns {
			var fd int
			a.do(t, func() error {
				var err error
				fd, err = unix.Socket(unix.AF_INET, unix.SOCK_STREAM|unix.SOCK_CLOEXEC, 0)
				return err
			})
			err := connect(fd)
			if err == nil {
				_, err = unix.Write(fd, second)
			}
			_ = unix.Shutdown(fd, unix.SHUT_WR)
			if err != nil {
				unix.Close(fd)
				t.Fatalf("%s: %v", name, err)
			}
			select {
			case b := <-got:
				if !bytes.Equal(b, append(append([]byte{}, first...), second...)) {
					bad++
				}
			case <-time.After(15 * time.Second):
				t.Fatalf("%s: the proxy did not read to the end", name)
			}
			unix.Close(fd)
		}
		if bad > 0 {
			t.Errorf("%s: %d of %d connections reached the proxy out of order", name, bad, conns)
		}
	}
}

// serveDrip is an outbound proxy in p that sends each connection a byte
// every 2 ms through TCP, the direction never spliced, until it is closed:
// an application reading it waits for each byte.
func serveDrip(t *testing.T, p *pod, port uint16) {
	fixtures.Serve(t, p.listen(t, fmt.Sprintf("[::]:%d", port)), func(conn net.Conn) {
		for {
			if _, err := conn.Write([]byte{1}); err != nil {
				return
			}
			time.Sleep(2 * time.Millisecond)
		}
	})
}

// blockingReadUnderSignals reads n bytes from conn's socket in blocking mode,
// one read(2) at a time, on a thread that gets a signal (SIGURG, which the Go
// runtime handles with SA_RESTART) every 200 µs meanwhile. It counts the reads
// that ended with EAGAIN, which a blocking read never should, and reads on.
func blockingReadUnderSignals(conn net.Conn, n int) (read, eagain int, err error) {
	fd, err := blockingFd(conn)
	if err != nil {
		return 0, 0, err
	}
	defer unix.Close(fd)
	tid := make(chan int, 1)
	done := make(chan struct{})
	defer close(done)
	go func() {
		t := <-tid
		tick := time.NewTicker(200 * time.Microsecond)
		defer tick.Stop()
		for {
			select {
			case <-done:
				return
			case <-tick.C:
				_ = unix.Tgkill(unix.Getpid(), t, unix.SIGURG)
			}
		}
	}()
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	tid <- unix.Gettid()
	buf := make([]byte, 1)
	for read < n {
		k, rerr := unix.Read(fd, buf)
		switch {
		case rerr == unix.EAGAIN:
			eagain++
		case rerr != nil:
			return read, eagain, rerr
		case k == 0:
			return read, eagain, io.ErrUnexpectedEOF
		default:
			read += k
		}
	}
	return read, eagain, nil
}

// A proxy that peeks before it reads (protocol sniffing) sees the spliced
// bytes, and reads them afterwards, once.
func TestSplicePeek(t *testing.T) {
	c := newSpliceChain(t, 0, proxyOpts{peek: 100}, echo)
	payload, _ := randomPayload(3, 1<<20)
	// The peek spans writes; what the kernel returns of it at once is its
	// choice, and every byte of it must be read afterwards.
	sizes := []int{7, 93, len(payload) - 100}
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	if err := echoInWrites(ctx, c.dial(t, false), payload, sizes); err != nil {
		t.Fatal(err)
	}
	c.checkSpliced(t, 2)
}

// The server ends its side first and keeps reading: the application reads its
// answer to the end and all it writes afterwards still arrives.
func TestSpliceHalfCloseFromServer(t *testing.T) {
	answer, _ := randomPayload(4, 1<<20)
	got := make(chan []byte, 1)
	c := newSpliceChain(t, 0, proxyOpts{}, func(conn net.Conn) {
		_, _ = conn.Write(answer)
		_ = conn.(*net.TCPConn).CloseWrite()
		b, _ := io.ReadAll(struct{ io.Reader }{conn})
		got <- b
	})
	conn := c.dial(t, true)
	_ = conn.SetDeadline(time.Now().Add(60 * time.Second))
	read, err := io.ReadAll(struct{ io.Reader }{conn})
	if err != nil {
		t.Fatalf("read the answer: %v", err)
	}
	if err := sameBytes(read, answer); err != nil {
		t.Fatalf("answer: %v", err)
	}
	payload, sizes := randomPayload(5, 8<<20)
	off := 0
	for _, n := range sizes {
		if _, err := conn.Write(payload[off : off+n]); err != nil {
			t.Fatalf("write after the server's half-close, at %d: %v", off, err)
		}
		off += n
	}
	if err := conn.CloseWrite(); err != nil {
		t.Fatal(err)
	}
	select {
	case b := <-got:
		if err := sameBytes(b, payload); err != nil {
			t.Fatalf("what the server read after its half-close: %v", err)
		}
	case <-time.After(60 * time.Second):
		t.Fatal("the server did not see the end")
	}
	c.checkPartlySpliced(t, 2)
}

// An application that resets its connection mid-stream: the server gets a
// prefix of what it wrote, never other bytes, and sees the end.
func TestSpliceResetByApplication(t *testing.T) {
	got := make(chan []byte, 1)
	c := newSpliceChain(t, 0, proxyOpts{}, func(conn net.Conn) {
		b, _ := io.ReadAll(struct{ io.Reader }{conn})
		got <- b
	})
	payload, sizes := randomPayload(6, 4<<20)
	conn := c.dial(t, false)
	off := 0
	for _, n := range sizes {
		if _, err := conn.Write(payload[off : off+n]); err != nil {
			t.Fatalf("write: %v", err)
		}
		off += n
	}
	_ = conn.SetLinger(0)
	conn.Close()
	select {
	case b := <-got:
		if !bytes.HasPrefix(payload, b) {
			t.Fatalf("after a reset the server read %d bytes that are not a prefix of what was written: %v", len(b), sameBytes(b, payload))
		}
		t.Logf("the server read %d of %d bytes before the reset", len(b), len(payload))
	case <-time.After(30 * time.Second):
		t.Fatal("the server did not see the reset")
	}
}

// A server that resets mid-stream, and a proxy that closes with spliced bytes
// unread: either way the application's writes fail soon after, as on TCP,
// instead of going on into a socket nobody reads.
func TestSpliceWriteFailsWhenFarEndGoes(t *testing.T) {
	cases := []struct {
		name   string
		opts   proxyOpts
		server func(net.Conn)
	}{
		{"server resets", proxyOpts{}, func(conn net.Conn) {
			_, _ = io.CopyN(io.Discard, struct{ io.Reader }{conn}, 1<<20)
			_ = conn.(*net.TCPConn).SetLinger(0)
		}},
		{"proxy closes with unread bytes", proxyOpts{readThenClose: 64 << 10}, func(conn net.Conn) {
			_, _ = io.Copy(io.Discard, struct{ io.Reader }{conn})
		}},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			c := newSpliceChain(t, 0, tc.opts, tc.server)
			conn := c.dial(t, false)
			_ = conn.SetWriteDeadline(time.Now().Add(30 * time.Second))
			chunk := make([]byte, 64<<10)
			var written int64
			for {
				n, err := conn.Write(chunk)
				written += int64(n)
				if err == nil {
					if written > 1<<30 {
						t.Fatalf("%d bytes taken after the far end went away", written)
					}
					continue
				}
				if errors.Is(err, os.ErrDeadlineExceeded) {
					t.Fatalf("the writer blocked after %d bytes instead of failing", written)
				}
				t.Logf("the write failed after %d bytes: %v", written, err)
				break
			}
		})
	}
}

// A server that reads far slower than the application writes: the
// application's proxy falls behind, the connection goes to TCP at the bound
// (and back whenever the proxy has caught up), and every byte arrives once, in
// order.
func TestSpliceSlowReader(t *testing.T) {
	got := make(chan error, 1)
	// Writes smaller than the bound, so the first ones are spliced: one
	// larger than it goes through TCP at once.
	payload, _ := randomPayload(7, 8<<20)
	var sizes []int
	for left := len(payload); left > 0; left -= 16 << 10 {
		sizes = append(sizes, min(left, 16<<10))
	}
	c := newSpliceChain(t, 64<<10, proxyOpts{}, func(conn net.Conn) {
		var b bytes.Buffer
		buf := make([]byte, 16<<10)
		for {
			n, err := conn.Read(buf)
			b.Write(buf[:n])
			if err != nil {
				break
			}
			time.Sleep(time.Millisecond)
		}
		got <- sameBytes(b.Bytes(), payload)
	})
	conn := c.dial(t, false)
	off := 0
	for _, n := range sizes {
		if _, err := conn.Write(payload[off : off+n]); err != nil {
			t.Fatalf("write at %d: %v", off, err)
		}
		off += n
	}
	_ = conn.CloseWrite()
	select {
	case err := <-got:
		if err != nil {
			t.Fatalf("the slow reader: %v", err)
		}
	case <-time.After(120 * time.Second):
		t.Fatal("the slow reader did not finish")
	}
	c.checkPartlySpliced(t, 2)
}

// An application that sends with sendfile(2) and splice(2) instead of write:
// every byte arrives once, in order.
func TestSpliceSendfileAndSplice(t *testing.T) {
	payload, _ := randomPayload(8, 8<<20)
	file := filepath.Join(t.TempDir(), "payload")
	if err := os.WriteFile(file, payload, 0o600); err != nil {
		t.Fatal(err)
	}
	c := newSpliceChain(t, 0, proxyOpts{}, echo)
	senders := map[string]func(*net.TCPConn) error{
		// TCPConn.ReadFrom a file is sendfile(2).
		"sendfile": func(conn *net.TCPConn) error {
			f, err := os.Open(file)
			if err != nil {
				return err
			}
			defer f.Close()
			_, err = conn.ReadFrom(f)
			return err
		},
		"splice": func(conn *net.TCPConn) error { return spliceFromPipe(conn, payload) },
	}
	for name, send := range senders {
		t.Run(name, func(t *testing.T) {
			conn := c.dial(t, false)
			_ = conn.SetDeadline(time.Now().Add(60 * time.Second))
			echoed := make(chan []byte, 1)
			go func() {
				b, _ := io.ReadAll(struct{ io.Reader }{conn})
				echoed <- b
			}()
			if err := send(conn); err != nil {
				t.Fatalf("%s: %v", name, err)
			}
			_ = conn.CloseWrite()
			if err := sameBytes(<-echoed, payload); err != nil {
				t.Fatalf("echo of what %s sent: %v", name, err)
			}
			c.checkPartlySpliced(t, 2)
		})
	}
}

// spliceFromPipe writes payload into a pipe and moves it to conn with
// splice(2).
func spliceFromPipe(conn *net.TCPConn, payload []byte) error {
	var p [2]int
	if err := unix.Pipe2(p[:], unix.O_CLOEXEC); err != nil {
		return err
	}
	r, w := os.NewFile(uintptr(p[0]), "pipe"), os.NewFile(uintptr(p[1]), "pipe")
	defer r.Close()
	werr := make(chan error, 1)
	go func() {
		_, err := w.Write(payload)
		werr <- errors.Join(err, w.Close())
	}()
	rc, err := conn.SyscallConn()
	if err != nil {
		return err
	}
	// Without SPLICE_F_NONBLOCK a call waits for the pipe, in this thread,
	// but not for the socket, which is non-blocking: an EAGAIN is then the
	// socket's, the one the poller can wait for.
	var serr error
	for moved := 0; moved < len(payload); {
		var n int64
		if err := rc.Write(func(fd uintptr) bool {
			n, serr = unix.Splice(int(r.Fd()), nil, int(fd), nil, 1<<20, unix.SPLICE_F_MOVE)
			return serr != unix.EAGAIN
		}); err != nil {
			return err
		}
		if serr != nil {
			return fmt.Errorf("splice after %d bytes: %w", moved, serr)
		}
		if n == 0 {
			return fmt.Errorf("the pipe ended after %d of %d bytes", moved, len(payload))
		}
		moved += int(n)
	}
	return <-werr
}

// The agent restarting mid-stream (the data path closed and opened again, as
// after a SIGKILL), and then restarting without --splice: the streams going
// on meanwhile lose nothing, and connections made after splicing was switched
// off stay on TCP.
func TestSpliceAgentRestartMidStream(t *testing.T) {
	c := newSpliceChain(t, 0, proxyOpts{}, echo)
	payload, _ := randomPayload(9, 16<<20)
	// Small writes, so the stream is still going at each restart.
	var sizes []int
	for left := len(payload); left > 0; left -= 64 << 10 {
		sizes = append(sizes, min(left, 64<<10))
	}
	var wg sync.WaitGroup
	errs := make(chan error, 2)
	for i, v6 := range []bool{false, true} {
		conn := c.dial(t, v6)
		wg.Go(func() {
			ctx, cancel := context.WithTimeout(context.Background(), 120*time.Second)
			defer cancel()
			if err := echoInWrites(ctx, conn, payload, sizes); err != nil {
				errs <- fmt.Errorf("stream %d: %w", i, err)
			}
		})
	}
	reopen := func(splice bool) {
		if err := c.d.Close(); err != nil {
			t.Errorf("close: %v", err)
		}
		cfg := c.cfg
		cfg.Splice = splice
		d, err := Open(context.Background(), cfg)
		if err != nil {
			t.Fatalf("open again: %v", err)
		}
		t.Cleanup(func() { d.Close() })
		c.d = d
	}
	time.Sleep(200 * time.Millisecond)
	reopen(true)
	time.Sleep(200 * time.Millisecond)
	reopen(false)
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Error(err)
	}
	// Once splicing is off, the streams' writes go through TCP: what counts
	// is that the echoes above were exact.
	c.drainReceived(t, 4)

	payload, sizes = randomPayload(10, 1<<20)
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	if err := echoInWrites(ctx, c.dial(t, false), payload, sizes); err != nil {
		t.Fatal(err)
	}
	c.waitRelayed(t, 2, func(r relayed) error {
		if r.tcp < uint64(len(payload)) {
			return fmt.Errorf("with splicing off, a proxy's pod-side socket received %d of %d bytes through TCP", r.tcp, len(payload))
		}
		return nil
	})
	st, err := c.d.Splice()
	if err != nil {
		t.Fatal(err)
	}
	if st.Enabled {
		t.Errorf("splice status %+v after an open without splicing", st)
	}
}

// Thousands of connections open at once, each spliced, each exact; the
// splice's maps hold them all and are empty once they closed.
func TestSpliceManyConnections(t *testing.T) {
	const conns = 10000
	d, _ := spliceDatapath(t, 0)
	// The applications' sockets are this process's; the proxy's, another's,
	// so that each stays within a file limit that only CAP_SYS_RESOURCE
	// could raise past 2*conns.
	raiseFileLimit(t, conns+4096)
	a, _ := newPodPair(t)
	s := testSettings()
	s.Splice = true
	// The proxy answers itself: the test is the pod-local hop.
	startEchoProcess(t, a, int(s.OutboundPort), conns+4096)
	enroll(t, d, a, s)

	open := make([]*net.TCPConn, 0, conns)
	defer func() {
		for _, c := range open {
			c.Close()
		}
	}()
	for i := range conns {
		c, err := a.dial(fmt.Sprintf("192.0.2.%d:%d", 1+i%200, 1000+i/200), dialOpts{timeout: 30 * time.Second})
		if err != nil {
			t.Fatalf("connection %d: %v", i, err)
		}
		open = append(open, c.(*net.TCPConn))
	}
	var wg sync.WaitGroup
	errs := make(chan error, conns)
	sem := make(chan struct{}, 256)
	for i, c := range open {
		wg.Go(func() {
			sem <- struct{}{}
			defer func() { <-sem }()
			msg := []byte(fmt.Sprintf("connection %d of %d", i, conns))
			_ = c.SetDeadline(time.Now().Add(60 * time.Second))
			if _, err := c.Write(msg); err != nil {
				errs <- fmt.Errorf("connection %d: %w", i, err)
				return
			}
			got := make([]byte, len(msg))
			if _, err := io.ReadFull(c, got); err != nil || !bytes.Equal(got, msg) {
				errs <- fmt.Errorf("connection %d: read %q (%v)", i, got, err)
			}
		})
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Fatal(err)
	}
	st, err := d.Splice()
	if err != nil {
		t.Fatal(err)
	}
	if st.Spliced != conns {
		t.Errorf("splice status %+v with %d connections open, want all spliced", st, conns)
	}
	for _, c := range open {
		c.Close()
	}
	open = nil
	deadline := time.Now().Add(60 * time.Second)
	for {
		st, err = d.Splice()
		if err != nil {
			t.Fatal(err)
		}
		if st.Spliced+st.Behind+st.TCP+st.Pending == 0 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("splice status %+v after every connection closed", st)
		}
		time.Sleep(100 * time.Millisecond)
	}
}

// echoServer is a proxy that answers itself, in a process of its own: python3
// with asyncio, which holds ten thousand connections in one thread. It
// echoes with read(2) and write(2), as the splice's proxy contract asks.
const echoServer = `
import asyncio, resource, sys
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, int(sys.argv[2])), hard))
async def echo(r, w):
    try:
        while True:
            b = await r.read(65536)
            if not b:
                break
            w.write(b)
            await w.drain()
    finally:
        w.close()
async def main():
    s = await asyncio.start_server(echo, host=None, port=int(sys.argv[1]), backlog=4096)
    print("ready", flush=True)
    async with s:
        await s.serve_forever()
asyncio.run(main())
`

// startEchoProcess runs echoServer in p's namespace on port, its file limit
// raised to files, until the test ends.
func startEchoProcess(t *testing.T, p *pod, port, files int) {
	t.Helper()
	py, err := exec.LookPath("python3")
	if err != nil {
		t.Skipf("no python3 for the echoing proxy: %v", err)
	}
	cmd := exec.Command("nsenter", "--net="+p.path, py, "-c", echoServer, strconv.Itoa(port), strconv.Itoa(files))
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	out, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatalf("start the echoing proxy: %v", err)
	}
	t.Cleanup(func() {
		_ = cmd.Process.Kill()
		_ = cmd.Wait()
	})
	ready := make(chan error, 1)
	go func() {
		line, err := bufio.NewReader(out).ReadString('\n')
		if err == nil && line != "ready\n" {
			err = fmt.Errorf("said %q", line)
		}
		ready <- err
	}()
	select {
	case err := <-ready:
		if err != nil {
			t.Fatalf("echoing proxy: %v (%s)", err, stderr.String())
		}
	case <-time.After(30 * time.Second):
		t.Fatalf("echoing proxy not ready (%s)", stderr.String())
	}
}

// raiseFileLimit raises RLIMIT_NOFILE to at least n for the test.
func raiseFileLimit(t *testing.T, n uint64) {
	t.Helper()
	var old unix.Rlimit
	if err := unix.Getrlimit(unix.RLIMIT_NOFILE, &old); err != nil {
		t.Fatal(err)
	}
	if old.Cur >= n {
		return
	}
	lim := unix.Rlimit{Cur: n, Max: max(n, old.Max)}
	if err := unix.Setrlimit(unix.RLIMIT_NOFILE, &lim); err != nil {
		t.Skipf("cannot raise the file limit to %d: %v", n, err)
	}
	t.Cleanup(func() { _ = unix.Setrlimit(unix.RLIMIT_NOFILE, &old) })
}

// A proxy that does not read leaves at most the bound unread in the splice:
// past it the connection goes back to TCP, whose buffers stop the writer.
// Once the proxy reads, every byte arrives in order.
func TestSpliceBoundedWhenProxyDoesNotRead(t *testing.T) {
	const bound = 256 << 10
	d, _ := spliceDatapath(t, bound)
	a, _ := newPodPair(t)
	s := testSettings()
	s.Splice = true
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
	if st.Behind != 1 || st.Spliced != 0 {
		t.Errorf("splice status %+v, want the connection behind, on TCP", st)
	}
	read := make([]byte, n)
	_ = proxy.SetReadDeadline(time.Now().Add(10 * time.Second))
	if _, err := io.ReadFull(struct{ io.Reader }{proxy}, read); err != nil {
		t.Fatalf("proxy read: %v", err)
	}
	if !bytes.Equal(read, payload[:n]) {
		t.Fatalf("the proxy read %d bytes that differ from what was written", n)
	}

	// The proxy has read everything: writes are spliced again, and arrive
	// after all the earlier ones. Not always the very next one: after a send
	// that failed for lack of buffer (the writer's deadline above), the
	// kernel passes one more write to TCP without asking the program.
	_ = conn.SetWriteDeadline(time.Now().Add(10 * time.Second))
	spliced := false
	for i := 0; i < 3 && !spliced; i++ {
		before := tcpBytesReceived(proxy)
		more := fmt.Appendf(nil, "after catching up, %d", i)
		if _, err := conn.Write(more); err != nil {
			t.Fatalf("write after the proxy caught up: %v", err)
		}
		got := make([]byte, len(more))
		if _, err := io.ReadFull(struct{ io.Reader }{proxy}, got); err != nil {
			t.Fatalf("proxy read after catching up: %v", err)
		}
		if !bytes.Equal(got, more) {
			t.Fatalf("the proxy read %q after catching up, want %q", got, more)
		}
		spliced = tcpBytesReceived(proxy) == before
	}
	if !spliced {
		t.Error("3 writes after the proxy caught up all came through TCP, want them spliced again")
	}
	if st, err := d.Splice(); err != nil || st.Spliced != 1 || st.Behind != 0 {
		t.Errorf("splice status %+v (%v) after the proxy caught up, want the connection spliced", st, err)
	}
}
