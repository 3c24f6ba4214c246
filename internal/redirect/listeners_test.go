package redirect

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"go.uber.org/zap/zaptest"
	"golang.org/x/sys/unix"

	"github.com/mesh-cni/mesh-cni/internal/netns"
	"github.com/mesh-cni/mesh-cni/test/fixtures"
)

// listenReusePort opens a dual-stack listener with SO_REUSEPORT in the pod, as each
// of Envoy's workers does, answering "IN<n> <orig>".
func listenReusePort(t *testing.T, p *pod, port uint16, n int) net.Listener {
	t.Helper()
	var ln net.Listener
	p.do(t, func() error {
		lc := net.ListenConfig{Control: func(_, _ string, c syscall.RawConn) error {
			var serr error
			err := c.Control(func(fd uintptr) { serr = unix.SetsockoptInt(int(fd), unix.SOL_SOCKET, unix.SO_REUSEPORT, 1) })
			return errors.Join(err, serr)
		}}
		lc.SetMultipathTCP(false)
		var err error
		ln, err = lc.Listen(context.Background(), "tcp", fmt.Sprintf("[::]:%d", port))
		return err
	})
	t.Cleanup(func() { ln.Close() })
	fixtures.Serve(t, ln, func(conn net.Conn) { announce(conn, fmt.Sprintf("IN%d", n)) })
	return ln
}

// An SO_REUSEPORT proxy: connections are captured while any listener of the group
// is open, and the kernel spreads them over the whole group.
func TestReusePortListeners(t *testing.T) {
	d, a, b := parallelRig(t)
	enroll(t, d, b, testSettings())
	var lns []net.Listener
	for n := range 4 {
		lns = append(lns, listenReusePort(t, b, 15006, n))
	}
	target := hostPort(b.addr4, appPort)
	seen := map[string]bool{}
	for range 64 {
		lines, _, err := a.fetch(target, dialOpts{mark: testMark})
		if err != nil || len(lines) != 1 || !strings.HasSuffix(lines[0], " "+target) {
			t.Fatalf("fetch %s: %q, %v", target, joinLines(lines), err)
		}
		seen[strings.Fields(lines[0])[0]] = true
	}
	if len(seen) < 2 {
		t.Errorf("64 connections all reached %v: the reuseport group is not used", seen)
	}
	// Close all but the last listener, in the order they were collected.
	for _, ln := range lns[:3] {
		ln.Close()
	}
	for _, dst := range []netip.Addr{b.addr4, b.addr6} {
		target := hostPort(dst, appPort)
		expectLines(t, a, target, dialOpts{mark: testMark}, "IN3 "+target)
	}
	lns[3].Close()
	if _, err := a.dial(target, dialOpts{mark: testMark}); !errors.Is(err, unix.ECONNREFUSED) {
		t.Errorf("with every listener closed: %v, want ECONNREFUSED", err)
	}
}

// A proxy listening before its pod is enrolled (or before the data path was
// installed) was not seen by sockops when it started listening: Enroll finds it.
func TestListenerBeforeEnroll(t *testing.T) {
	// The data path does not know port 15106 before the pod's enrollment names it.
	d, a, b := parallelRig(t)
	s := testSettings()
	s.InboundPort = 15106
	startInboundProxy(t, b, s.InboundPort)
	e := enroll(t, d, b, s)
	if n, err := d.Listeners(e.Cookie); err != nil || n != 2 {
		t.Fatalf("listeners collected for b: %d, %v; want its one dual-stack listener in both families' slots", n, err)
	}
	for _, dst := range []netip.Addr{b.addr4, b.addr6} {
		target := hostPort(dst, appPort)
		expectLines(t, a, target, dialOpts{mark: testMark}, "IN "+target)
	}
}

// Go's net.Listen makes MPTCP listeners (since Go 1.24), which a SOCKHASH refuses:
// the data path reports the listener it could not capture, and the pod fails
// closed.
func TestMPTCPListenerRefused(t *testing.T) {
	d, a, b := parallelRig(t)
	e := enroll(t, d, b, testSettings())
	var ln net.Listener
	b.do(t, func() error {
		var lc net.ListenConfig
		lc.SetMultipathTCP(true)
		var err error
		ln, err = lc.Listen(context.Background(), "tcp", "[::]:15006")
		return err
	})
	t.Cleanup(func() { ln.Close() })
	if !isMPTCP(t, ln) {
		fixtures.RequireFeature(t, mptcpFeature(b), errors.New("a listener asked for MPTCP is plain TCP"))
	}
	refusals, err := d.Refusals()
	if err != nil {
		t.Fatal(err)
	}
	var found bool
	for _, r := range refusals {
		if r.Cookie == e.Cookie && r.Port == 15006 {
			found = true
			if !strings.Contains(r.Reason, "not supported") {
				t.Errorf("refusal reason %q", r.Reason)
			}
		}
	}
	if !found {
		t.Errorf("refusals %+v: the MPTCP listener is not reported", refusals)
	}
	c, err := d.Counters()
	if err != nil || c.ListenersRefused == 0 {
		t.Errorf("counters %+v, %v: no refused listener counted", c, err)
	}
	if _, err := a.dial(hostPort(b.addr4, appPort), dialOpts{mark: testMark}); !errors.Is(err, unix.ECONNREFUSED) {
		t.Errorf("to a pod whose proxy listens with MPTCP: %v, want ECONNREFUSED (fail closed)", err)
	}
}

func isMPTCP(t *testing.T, ln net.Listener) bool {
	t.Helper()
	return listenerSockopt(t, ln, unix.GetsockoptInt, unix.SO_PROTOCOL) == unix.IPPROTO_MPTCP
}

// The inbound proxy forwards to the application inside the pod from another local
// address (Envoy's inbound passthrough binds 127.0.0.6): that connection is the
// proxy's own and must reach the application, not come back to the proxy.
func TestProxyConnectionIntoPod(t *testing.T) {
	d, a, b := parallelRig(t)
	startApp(t, b, appPort)
	ln := b.listen(t, "[::]:15006")
	fixtures.Serve(t, ln, func(conn net.Conn) {
		orig, ok := announce(conn, "IN")
		if !ok {
			return
		}
		src := netip.MustParseAddr("127.0.0.6")
		if orig.Addr().Is6() {
			src = netip.MustParseAddr("::1")
		}
		var up net.Conn
		err := netns.Do(b.path, func() error {
			dl := net.Dialer{LocalAddr: &net.TCPAddr{IP: src.AsSlice()}, Timeout: 5 * time.Second, Control: fixtures.MarkControl(testMark)}
			var err error
			up, err = dl.Dial("tcp", orig.String())
			return err
		})
		relay(conn, up, err)
	})
	enroll(t, d, b, testSettings())
	for _, dst := range []netip.Addr{b.addr4, b.addr6} {
		target := hostPort(dst, appPort)
		expectLines(t, a, target, dialOpts{mark: testMark}, "IN "+target, "APP "+target)
	}
}

// A start that fails undoes what it did: no bpffs left mounted, no pins.
func TestOpenFailureUndoes(t *testing.T) {
	t.Parallel()
	requireRoot(t)
	cfg := Config{
		PinRoot:    filepath.Join(t.TempDir(), "bpf"),
		CgroupRoot: t.TempDir(), // not a cgroup: attaching fails after the maps are pinned
		Logger:     zaptest.NewLogger(t),
	}
	if _, err := Open(context.Background(), cfg); err == nil {
		t.Fatal("open with a cgroup root that is not a cgroup succeeded")
	}
	if _, err := os.Stat(cfg.PinRoot); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("pin root left after a failed open: %v", err)
		_ = unix.Unmount(cfg.PinRoot, unix.MNT_DETACH)
	}
}
