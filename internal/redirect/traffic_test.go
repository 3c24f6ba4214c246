package redirect

import (
	"context"
	"errors"
	"net"
	"net/netip"
	"os"
	"reflect"
	"slices"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/mesh-cni/mesh-cni/internal/netns"
	"github.com/mesh-cni/mesh-cni/test/fixtures"
)

const appPort = 8080

// meshPair is two enrolled pods, each with its outbound and inbound test proxies.
type meshPair struct {
	d    *Datapath
	cfg  Config
	a, b *pod
}

func newMeshPair(t *testing.T, sa, sb Settings) *meshPair {
	t.Helper()
	requireRoot(t)
	d, cfg := testDatapath(t)
	a, b := newPodPair(t)
	for _, x := range []struct {
		p *pod
		s Settings
	}{{a, sa}, {b, sb}} {
		startOutboundProxy(t, x.p, x.s.OutboundPort)
		startInboundProxy(t, x.p, x.s.InboundPort)
		enroll(t, d, x.p, x.s)
	}
	return &meshPair{d: d, cfg: cfg, a: a, b: b}
}

func expectLines(t *testing.T, from *pod, addr string, o dialOpts, want ...string) net.Addr {
	t.Helper()
	lines, peer, err := from.fetch(addr, o)
	if err != nil {
		t.Fatalf("%s -> %s: %v (got %q)", from.name, addr, err, joinLines(lines))
	}
	if !slices.Equal(lines, want) {
		t.Fatalf("%s -> %s: got %q, want %q", from.name, addr, joinLines(lines), joinLines(want))
	}
	return peer
}

func TestRedirectBothWays(t *testing.T) {
	t.Parallel()
	m := newMeshPair(t, testSettings(), testSettings())
	for _, dst := range []netip.Addr{m.b.addr4, m.b.addr6} {
		t.Run(dst.String(), func(t *testing.T) {
			target := hostPort(dst, appPort)
			peer := expectLines(t, m.a, target, dialOpts{}, "OUT "+target, "IN "+target)
			// getpeername restored: the client sees the original peer, not the proxy.
			if got := unmapAddrPort(peer).String(); got != target {
				t.Errorf("client's peer address %s, want %s", got, target)
			}
			// An MPTCP client is redirected through its subflow, and sees its
			// original peer too.
			peer = expectLines(t, m.a, target, dialOpts{mptcp: true}, "OUT "+target, "IN "+target)
			if got := unmapAddrPort(peer).String(); got != target {
				t.Errorf("MPTCP client's peer address %s, want %s", got, target)
			}
		})
	}
	c, err := m.d.Counters()
	if err != nil {
		t.Fatal(err)
	}
	// Two client connects redirected, and the proxies' own (marked) connects passed;
	// each reached b as a new inbound connection.
	if c.Outbound.Redirected < 2 || c.Outbound.Passed < 2 || c.Inbound.Redirected < 2 {
		t.Errorf("counters did not move: %+v", c)
	}
}

// A dual-stack AF_INET6 socket connecting to ::ffff:a.b.c.d goes through connect6
// only; it must be redirected to ::ffff:127.0.0.1 and keep its IPv4 original.
func TestRedirectIPv4MappedDestination(t *testing.T) {
	t.Parallel()
	m := newMeshPair(t, testSettings(), testSettings())
	mapped := netip.AddrFrom16(m.b.addr4.As16())
	var (
		lines []string
		peer  netip.AddrPort
	)
	m.a.do(t, func() error {
		fd, err := unix.Socket(unix.AF_INET6, unix.SOCK_STREAM|unix.SOCK_CLOEXEC, 0)
		if err != nil {
			return err
		}
		f := os.NewFile(uintptr(fd), "mapped")
		defer f.Close()
		if err := unix.Connect(fd, &unix.SockaddrInet6{Port: appPort, Addr: mapped.As16()}); err != nil {
			return err
		}
		sa, err := unix.Getpeername(fd)
		if err != nil {
			return err
		}
		if in6, ok := sa.(*unix.SockaddrInet6); ok {
			peer = netip.AddrPortFrom(netip.AddrFrom16(in6.Addr), uint16(in6.Port))
		}
		conn, err := net.FileConn(f)
		if err != nil {
			return err
		}
		defer conn.Close()
		lines, err = readLines(conn)
		return err
	})
	target := hostPort(m.b.addr4, appPort)
	if want := []string{"OUT " + target, "IN " + target}; !slices.Equal(lines, want) {
		t.Fatalf("got %q, want %q", joinLines(lines), joinLines(want))
	}
	if want := netip.AddrPortFrom(mapped, appPort); peer != want {
		t.Errorf("getpeername %s, want %s", peer, want)
	}
}

func TestNotRedirected(t *testing.T) {
	t.Parallel()
	sa := testSettings()
	sa.OutboundExcludedPorts = []uint16{9000}
	sa.ExcludedCIDRs = []netip.Prefix{netip.MustParsePrefix("10.77.0.2/32"), netip.MustParsePrefix("fd00:77::2/128")}
	sb := testSettings()
	sb.InboundExcludedPorts = append(sb.InboundExcludedPorts, 9000)
	m := newMeshPair(t, sa, sb)
	startApp(t, m.b, 9000)
	startApp(t, m.b, appPort)

	for _, dst := range []netip.Addr{m.b.addr4, m.b.addr6} {
		t.Run(dst.String(), func(t *testing.T) {
			// Excluded outbound at a and inbound at b: straight to the application.
			excluded := hostPort(dst, 9000)
			expectLines(t, m.a, excluded, dialOpts{}, "APP "+excluded)
			// Excluded CIDR at a: no outbound proxy, but b still takes it inbound.
			target := hostPort(dst, appPort)
			expectLines(t, m.a, target, dialOpts{}, "IN "+target)
			// b -> a is not excluded anywhere: marked sockets skip b's outbound
			// proxy, a's inbound proxy still answers.
			back := hostPort(m.a.addr4, appPort)
			if dst.Is6() {
				back = hostPort(m.a.addr6, appPort)
			}
			expectLines(t, m.b, back, dialOpts{mark: testMark}, "IN "+back)
			expectLines(t, m.b, back, dialOpts{mark: testMark | 0x1000}, "IN "+back) // only the mask's bits count
			expectLines(t, m.b, back, dialOpts{}, "OUT "+back, "IN "+back)
		})
	}

	t.Run("udp", func(t *testing.T) {
		var pc net.PacketConn
		m.b.do(t, func() error {
			var err error
			pc, err = net.ListenPacket("udp", "[::]:8080")
			return err
		})
		t.Cleanup(func() { pc.Close() })
		for _, dst := range []netip.Addr{m.b.addr4, m.b.addr6} {
			var conn net.Conn
			m.a.do(t, func() error {
				var err error
				conn, err = net.Dial("udp", hostPort(dst, appPort))
				return err
			})
			_, err := conn.Write([]byte("ping"))
			conn.Close()
			if err != nil {
				t.Fatal(err)
			}
			buf := make([]byte, 16)
			if err := pc.SetReadDeadline(time.Now().Add(5 * time.Second)); err != nil {
				t.Fatal(err)
			}
			n, _, err := pc.ReadFrom(buf)
			if err != nil || string(buf[:n]) != "ping" {
				t.Errorf("UDP to %s: got %q, %v", dst, buf[:n], err)
			}
		}
	})

	t.Run("loopback", func(t *testing.T) {
		startApp(t, m.a, 7000)
		for _, lo := range []string{"127.0.0.1:7000", "[::1]:7000"} {
			expectLines(t, m.a, lo, dialOpts{}, "APP "+lo)
		}
	})

	t.Run("not enrolled", func(t *testing.T) {
		// c has only loopback, with an extra address that is not loopback.
		c := newNetns(t, "c")
		addr := netip.MustParseAddr("10.77.1.1")
		c.do(t, func() error { return fixtures.AddAddr("lo", netip.PrefixFrom(addr, 32)) })
		startApp(t, c, appPort)
		startOutboundProxy(t, c, 15001)
		target := hostPort(addr, appPort)
		expectLines(t, c, target, dialOpts{}, "APP "+target)
		// Enrolled, the same connect is redirected; the proxy's own connection to
		// the pod's address (source and destination the same) is not captured.
		enroll(t, m.d, c, testSettings())
		expectLines(t, c, target, dialOpts{}, "OUT "+target, "APP "+target)
	})
}

func TestProxyUID(t *testing.T) {
	t.Parallel()
	sa := testSettings()
	uid := uint32(os.Geteuid())
	sa.ProxyUID = &uid
	m := newMeshPair(t, sa, testSettings())
	// The test runs as the proxy uid: a's connects are never redirected outbound.
	target := hostPort(m.b.addr4, appPort)
	expectLines(t, m.a, target, dialOpts{}, "IN "+target)
}

func TestProbeSources(t *testing.T) {
	t.Parallel()
	sb := testSettings()
	sb.ProbeSources = []netip.Prefix{netip.MustParsePrefix("10.77.0.1/32"), netip.MustParsePrefix("fd00:77::1/128")}
	m := newMeshPair(t, testSettings(), sb)
	startApp(t, m.b, appPort)
	for _, dst := range []netip.Addr{m.b.addr4, m.b.addr6} {
		target := hostPort(dst, appPort)
		// The kubelet-probe path: from a probe source straight to the application.
		expectLines(t, m.a, target, dialOpts{mark: testMark}, "APP "+target)
	}
	// From b to a (a has no probe sources) the inbound proxy still answers.
	back := hostPort(m.a.addr4, appPort)
	expectLines(t, m.b, back, dialOpts{mark: testMark}, "IN "+back)
}

// No proxy listening: fail closed unless the pod is fail-open.
func TestNoProxyListening(t *testing.T) {
	d, a, b := parallelRig(t)
	startApp(t, b, appPort)
	s := testSettings()
	enroll(t, d, a, s)
	enroll(t, d, b, s)

	for _, dst := range []netip.Addr{b.addr4, b.addr6} {
		target := hostPort(dst, appPort)
		// Outbound: the connect is rewritten to a closed port.
		_, err := a.dial(target, dialOpts{})
		if !errors.Is(err, unix.ECONNREFUSED) {
			t.Errorf("outbound to %s with no proxy: %v, want ECONNREFUSED", target, err)
		}
		// Inbound: the connection is reset, as by a closed port, although the
		// application listens.
		_, err = a.dial(target, dialOpts{mark: testMark, timeout: 5 * time.Second})
		if !errors.Is(err, unix.ECONNREFUSED) {
			t.Errorf("inbound to %s with no proxy: %v, want ECONNREFUSED", target, err)
		}
	}
	c, err := d.Counters()
	if err != nil {
		t.Fatal(err)
	}
	if c.Outbound.Dropped < 2 || c.Inbound.Dropped < 2 {
		t.Errorf("drops not counted: %+v", c)
	}

	s.FailOpen = true
	enroll(t, d, a, s)
	enroll(t, d, b, s)
	for _, dst := range []netip.Addr{b.addr4, b.addr6} {
		target := hostPort(dst, appPort)
		expectLines(t, a, target, dialOpts{}, "APP "+target)
	}
}

func TestReleaseAndReenroll(t *testing.T) {
	t.Parallel()
	m := newMeshPair(t, testSettings(), testSettings())
	ctx := context.Background()
	target := hostPort(m.b.addr4, appPort)
	expectLines(t, m.a, target, dialOpts{}, "OUT "+target, "IN "+target)

	if err := m.d.Release(ctx, m.a.cookie); err != nil {
		t.Fatal(err)
	}
	expectLines(t, m.a, target, dialOpts{}, "IN "+target)
	if err := m.d.Check(ctx, m.a.cookie); !errors.Is(err, ErrNotEnrolled) {
		t.Errorf("check after release: %v, want ErrNotEnrolled", err)
	}
	if err := m.d.Release(ctx, m.a.cookie); err != nil {
		t.Errorf("second release: %v", err)
	}
	if _, err := os.Stat(m.d.pins.pod(m.a.cookie)); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("pod pins left after release: %v", err)
	}

	enroll(t, m.d, m.a, testSettings())
	expectLines(t, m.a, target, dialOpts{}, "OUT "+target, "IN "+target)

	// Releasing b stops inbound redirection at once: a's outbound proxy now reaches
	// b's (absent) application directly, and the connect is refused.
	if err := m.d.Release(ctx, m.b.cookie); err != nil {
		t.Fatal(err)
	}
	lines, _, _ := m.a.fetch(target, dialOpts{})
	if len(lines) != 2 || lines[0] != "OUT "+target || !startsWith(lines[1], "UPSTREAM ERR") {
		t.Errorf("after releasing b: %q", joinLines(lines))
	}
}

func startsWith(s, prefix string) bool { return len(s) >= len(prefix) && s[:len(prefix)] == prefix }

// An agent restart: Close leaves everything pinned and redirecting; Open adopts it.
func TestCloseAndAdopt(t *testing.T) {
	t.Parallel()
	m := newMeshPair(t, testSettings(), testSettings())
	ctx := context.Background()
	before, err := m.d.List(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if len(before) != 2 {
		t.Fatalf("list: %d enrollments, want 2", len(before))
	}
	if err := m.d.Close(); err != nil {
		t.Fatal(err)
	}
	if _, err := m.d.List(ctx); !errors.Is(err, ErrClosed) {
		t.Errorf("list after close: %v, want ErrClosed", err)
	}

	// No Datapath open in this process: the pinned data path still works.
	target := hostPort(m.b.addr6, appPort)
	expectLines(t, m.a, target, dialOpts{}, "OUT "+target, "IN "+target)

	d2, err := Open(ctx, m.cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { d2.Close() })
	after, err := d2.List(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if !equalEnrollments(before, after) {
		t.Errorf("list after adopt:\n%+v\nwant\n%+v", after, before)
	}
	for _, p := range []*pod{m.a, m.b} {
		if err := d2.Check(ctx, p.cookie); err != nil {
			t.Errorf("check %s after adopt: %v", p.name, err)
		}
	}
	expectLines(t, m.a, target, dialOpts{}, "OUT "+target, "IN "+target)
	c, err := d2.Counters()
	if err != nil {
		t.Fatal(err)
	}
	if c.Outbound.Redirected < 2 {
		t.Errorf("counters lost across restart: %+v", c)
	}
}

// Check notices the namespace going away; Release still cleans up after it is gone.
func TestCheckAndReleaseGoneNetns(t *testing.T) {
	d, a, _ := parallelRig(t)
	ctx := context.Background()
	enroll(t, d, a, testSettings())
	if err := d.Check(ctx, a.cookie); err != nil {
		t.Fatalf("check: %v", err)
	}
	if err := netns.Remove(a.path); err != nil {
		t.Fatal(err)
	}
	// The namespace is freed asynchronously: wait for its link to notice.
	fixtures.WaitFor(t, 10*time.Second, "check to say ErrLinkBroken after the netns is gone", func() bool {
		return errors.Is(d.Check(ctx, a.cookie), ErrLinkBroken)
	})
	if err := d.Release(ctx, a.cookie); err != nil {
		t.Fatalf("release after the netns is gone: %v", err)
	}
	list, err := d.List(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if len(list) != 0 {
		t.Errorf("list after release: %+v", list)
	}
}

func equalEnrollments(a, b []Enrollment) bool {
	return reflect.DeepEqual(a, b)
}

// The inbound proxy closes first, so its side of a connection stays in TIME_WAIT. A
// client that reconnects from the same port sends a SYN that matches that TIME_WAIT
// socket: the kernel then looks for a listener again, and the capture hands the
// connection to the proxy, whether or not the application listens on the port.
func TestInboundSYNOnTimeWaitTuple(t *testing.T) {
	t.Parallel()
	m := newMeshPair(t, testSettings(), testSettings())
	const appListening = 9090
	startApp(t, m.b, appListening)
	for i, dst := range []netip.Addr{m.b.addr4, m.b.addr6} {
		local := &net.TCPAddr{IP: m.a.addr4.AsSlice(), Port: 41234 + i}
		if dst.Is6() {
			local.IP = m.a.addr6.AsSlice()
		}
		for _, port := range []uint16{appPort, appListening} {
			target := hostPort(dst, port)
			for n := range 2 {
				lines, err := fetchFrom(m.a, local, target, 10*time.Second)
				if want := []string{"IN " + target}; err != nil || !slices.Equal(lines, want) {
					t.Fatalf("connection %d to %s: got %q, %v; want %q", n, target, joinLines(lines), err, joinLines(want))
				}
			}
			local.Port += 10
		}
	}
}

// fetchFrom is fetch from a fixed local address, with the proxy mark (so only the
// inbound side redirects). It retries while the previous connection from the same
// port is still closing on this side.
func fetchFrom(p *pod, local *net.TCPAddr, addr string, timeout time.Duration) ([]string, error) {
	var (
		conn net.Conn
		err  error
	)
	fixtures.Eventually(context.Background(), 10*time.Second, fixtures.WaitInterval, func() bool {
		err = netns.Do(p.path, func() error {
			d := net.Dialer{LocalAddr: local, Timeout: timeout}
			d.Control = func(_, _ string, c syscall.RawConn) error {
				var serr error
				err := c.Control(func(fd uintptr) {
					serr = errors.Join(
						unix.SetsockoptInt(int(fd), unix.SOL_SOCKET, unix.SO_MARK, testMark),
						unix.SetsockoptInt(int(fd), unix.SOL_SOCKET, unix.SO_REUSEADDR, 1))
				})
				return errors.Join(err, serr)
			}
			var err error
			conn, err = d.Dial("tcp", addr)
			return err
		})
		return !errors.Is(err, unix.EADDRINUSE) && !errors.Is(err, unix.EADDRNOTAVAIL)
	})
	if err != nil {
		return nil, err
	}
	defer conn.Close()
	return readLines(conn)
}

// Only the proxy's HBONE port is excluded inbound, and only inbound: a pod
// connecting to another host's 15008 still goes through its outbound proxy, and
// an application listening on another of ztunnel's well-known ports (15001,
// 15020, 15021, 15053, 15090) is captured like any other, so nobody reaches it
// past the proxy.
func TestProxyPortsCaptured(t *testing.T) {
	t.Parallel()
	m := newMeshPair(t, testSettings(), testSettings())
	startApp(t, m.b, HBONEPort)
	target := hostPort(m.b.addr4, HBONEPort)
	// Through a's outbound proxy, then straight to b's listener on its HBONE
	// port, which is b's proxy's own.
	expectLines(t, m.a, target, dialOpts{}, "OUT "+target, "APP "+target)
	for _, port := range []uint16{15020, 15021, 15053, 15090} {
		startApp(t, m.b, port)
		target := hostPort(m.b.addr4, port)
		expectLines(t, m.a, target, dialOpts{}, "OUT "+target, "IN "+target)
	}
}
