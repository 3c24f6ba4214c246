package podsock

import (
	"context"
	"errors"
	"net"
	"net/netip"
	"os"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/mesh-cni/mesh-cni/internal/netns"
	"github.com/mesh-cni/mesh-cni/test/fixtures"
)

// testMark is ztunnel's mark, what the node proxies set.
const testMark = 0x539

func addrPortOf(a net.Addr) netip.AddrPort {
	ap, _ := netip.ParseAddrPort(a.String())
	return netip.AddrPortFrom(ap.Addr().Unmap(), ap.Port())
}

// acceptAndClose accepts on ln until it is closed, closing every connection at once.
func acceptAndClose(tb testing.TB, ln net.Listener) {
	done := make(chan struct{})
	go func() {
		defer close(done)
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			c.Close()
		}
	}()
	tb.Cleanup(func() {
		ln.Close()
		<-done
	})
}

// podListener listens on 127.0.0.1 (port chosen by the kernel) inside pod.
func podListener(tb testing.TB, pod *fixtures.Pod) (netip.AddrPort, *os.File) {
	tb.Helper()
	var ln net.Listener
	if err := netns.Do(pod.Path, func() error {
		var err error
		ln, err = net.Listen("tcp4", "127.0.0.1:0")
		return err
	}); err != nil {
		tb.Fatal(err)
	}
	acceptAndClose(tb, ln)
	ns, err := os.Open(pod.Path)
	if err != nil {
		tb.Fatal(err)
	}
	tb.Cleanup(func() { ns.Close() })
	return addrPortOf(ln.Addr()), ns
}

// TestDial checks that Dial's socket lives in the pod's namespace and
// carries the mark, and that failures come back as errors.
func TestDial(t *testing.T) {
	fixtures.RequireRoot(t, "creates network namespaces")
	ctx := fixtures.Context(t, time.Minute)
	pod, _ := fixtures.NewPodPair(t)
	dst, ns := podListener(t, pod)
	// The listener is only reachable inside the pod: a dial from the host
	// namespace would be refused or reach something else.
	c, err := Dial(ctx, int(ns.Fd()), dst, DialOptions{Mark: testMark, Timeout: time.Second})
	if err != nil {
		t.Fatal(err)
	}
	raw, err := c.SyscallConn()
	if err != nil {
		t.Fatal(err)
	}
	var mark int
	var optErr error
	if err := raw.Control(func(fd uintptr) { mark, optErr = unix.GetsockoptInt(int(fd), unix.SOL_SOCKET, unix.SO_MARK) }); err != nil || optErr != nil {
		t.Fatal(err, optErr)
	}
	if mark != testMark {
		t.Errorf("onward socket mark %#x, want %#x", mark, testMark)
	}
	if got := addrPortOf(c.RemoteAddr()); got != dst {
		t.Errorf("connected to %s, want %s", got, dst)
	}
	c.Close()

	// Nothing listens on the port any more: refused, not hung.
	closed := netip.AddrPortFrom(dst.Addr(), 1)
	if _, err := Dial(ctx, int(ns.Fd()), closed, DialOptions{Mark: testMark, Timeout: time.Second}); err == nil {
		t.Error("dial to a closed port succeeded")
	}
	// A cancelled context ends a dial that would otherwise wait: nobody owns this
	// address in the pod's subnet, so the SYN waits for neighbour discovery.
	cctx, ccancel := context.WithCancel(ctx)
	ccancel()
	if _, err := Dial(cctx, int(ns.Fd()), netip.MustParseAddrPort("10.77.0.99:9"), DialOptions{Mark: testMark, Timeout: time.Minute}); !errors.Is(err, context.Canceled) {
		t.Errorf("dial with a cancelled context: %v", err)
	}
}

// BenchmarkPodDial measures what a node proxy pays per onward connection to have
// its socket in the pod's namespace: socket-only creates just the socket inside
// netns.DoFd and connects from any thread (what Dial does); whole-dial runs
// the entire net.Dialer dial inside netns.DoFd (the thread stays locked in the
// pod for the handshake); same-netns is a plain dial with no namespace switch, the
// floor. Each iteration is connect + close against an accept-and-close listener
// on loopback inside the pod (on the host's loopback for same-netns).
func BenchmarkPodDial(b *testing.B) {
	fixtures.RequireRoot(b, "creates network namespaces")
	ctx := context.Background()
	pod, _ := fixtures.NewPodPair(b)
	dst, ns := podListener(b, pod)
	closeFast := func(b *testing.B, c *net.TCPConn) {
		// No TIME_WAIT: thousands of iterations must not run out of ports.
		_ = c.SetLinger(0)
		c.Close()
	}
	b.Run("socket-only", func(b *testing.B) {
		for b.Loop() {
			c, err := Dial(ctx, int(ns.Fd()), dst, DialOptions{Mark: testMark, Timeout: time.Second})
			if err != nil {
				b.Fatal(err)
			}
			closeFast(b, c)
		}
	})
	b.Run("whole-dial", func(b *testing.B) {
		d := net.Dialer{Timeout: time.Second, Control: fixtures.MarkControl(testMark)}
		for b.Loop() {
			var c net.Conn
			err := netns.DoFd(int(ns.Fd()), func() error {
				var err error
				c, err = d.DialContext(ctx, "tcp4", dst.String())
				return err
			})
			if err != nil {
				b.Fatal(err)
			}
			closeFast(b, c.(*net.TCPConn))
		}
	})
	b.Run("same-netns", func(b *testing.B) {
		ln, err := net.Listen("tcp4", "127.0.0.1:0")
		if err != nil {
			b.Fatal(err)
		}
		acceptAndClose(b, ln)
		d := net.Dialer{Timeout: time.Second, Control: fixtures.MarkControl(testMark)}
		for b.Loop() {
			c, err := d.DialContext(ctx, "tcp4", ln.Addr().String())
			if err != nil {
				b.Fatal(err)
			}
			closeFast(b, c.(*net.TCPConn))
		}
	})
}
