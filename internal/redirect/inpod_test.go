package redirect

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"os"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/containernetworking/plugins/pkg/netlinksafe"
	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"

	"github.com/mesh-cni/mesh-cni/internal/netns"
	"github.com/mesh-cni/mesh-cni/test/fixtures"
)

// What a node proxy sees and does inside a pod, as ztunnel does by default:
// sources, its own source-preserving connects and their replies, device-bound and
// link-local clients.

// startPeerApp listens on a pod port and answers "APP <local> FROM <peer>".
func startPeerApp(t testing.TB, p *pod, port uint16) {
	ln := p.listen(t, fmt.Sprintf("[::]:%d", port))
	fixtures.Serve(t, ln, func(conn net.Conn) {
		fmt.Fprintf(conn, "APP %s FROM %s\n", unmapAddrPort(conn.LocalAddr()), unmapAddrPort(conn.RemoteAddr()).Addr())
	})
}

// startPeerProxy listens on the pod's outbound port and answers "OUT <orig> FROM
// <peer address>".
func startPeerProxy(t testing.TB, p *pod, port uint16) {
	ln := p.listen(t, fmt.Sprintf("[::]:%d", port))
	fixtures.Serve(t, ln, func(conn net.Conn) {
		orig, err := originalDst(conn)
		fmt.Fprintf(conn, "OUT %s FROM %s %v\n", orig, unmapAddrPort(conn.RemoteAddr()).Addr(), err)
	})
}

// transparentControl sets what ztunnel sets on a socket it makes in a pod: its
// mark, and for a source-preserving connect IP_TRANSPARENT and IP_FREEBIND (both
// families).
func transparentControl(mark uint32, transparent bool) func(string, string, syscall.RawConn) error {
	return func(network, _ string, c syscall.RawConn) error {
		var errs []error
		err := c.Control(func(fd uintptr) {
			errs = append(errs, unix.SetsockoptInt(int(fd), unix.SOL_SOCKET, unix.SO_MARK, int(mark)))
			if !transparent {
				return
			}
			if strings.HasSuffix(network, "6") {
				errs = append(errs, unix.SetsockoptInt(int(fd), unix.SOL_IPV6, unix.IPV6_TRANSPARENT, 1),
					unix.SetsockoptInt(int(fd), unix.SOL_IPV6, unix.IPV6_FREEBIND, 1))
			} else {
				errs = append(errs, unix.SetsockoptInt(int(fd), unix.SOL_IP, unix.IP_TRANSPARENT, 1),
					unix.SetsockoptInt(int(fd), unix.SOL_IP, unix.IP_FREEBIND, 1))
			}
		})
		return errors.Join(append(errs, err)...)
	}
}

// startTransparentInbound is an inbound proxy as ztunnel's default inbound is: a
// transparent listener on port; each connection is carried to its original
// destination from a socket bound to the client's address (IP_TRANSPARENT), with
// the proxy mark. It answers "IN <orig>" and then relays what the application says.
func startTransparentInbound(t testing.TB, p *pod, port uint16) {
	var ln net.Listener
	p.do(t, func() error {
		lc := net.ListenConfig{Control: transparentControl(testMark, true)}
		lc.SetMultipathTCP(false)
		var err error
		ln, err = lc.Listen(context.Background(), "tcp", fmt.Sprintf("[::]:%d", port))
		return err
	})
	t.Cleanup(func() { ln.Close() })
	fixtures.Serve(t, ln, func(conn net.Conn) {
		orig, ok := announce(conn, "IN")
		if !ok {
			return
		}
		client := unmapAddrPort(conn.RemoteAddr()).Addr()
		var up net.Conn
		err := netns.Do(p.path, func() error {
			d := net.Dialer{
				Timeout:   2 * time.Second,
				LocalAddr: &net.TCPAddr{IP: client.AsSlice()},
				Control:   transparentControl(testMark, true),
			}
			var err error
			up, err = d.Dial("tcp", orig.String())
			return err
		})
		relay(conn, up, err)
	})
}

// A proxy that carries an inbound connection to the application with the client's
// address as source (ztunnel's default: IP_TRANSPARENT with the NET_ADMIN Istio
// grants it) gets the application's replies back: they carry the reply mark and
// the pod's reply route delivers them on loopback, where otherwise they would be
// routed out of eth0 to the client, which has no such connection. The application
// sees the client's address. Without the reply mark the same proxy gets nothing
// through.
func TestTransparentInboundReplies(t *testing.T) {
	d, a, b := parallelRig(t)
	startTransparentInbound(t, b, 15006)
	startPeerApp(t, b, appPort)
	enroll(t, d, b, testSettings())
	for _, pair := range []struct{ src, dst netip.Addr }{{a.addr4, b.addr4}, {a.addr6, b.addr6}} {
		target := hostPort(pair.dst, appPort)
		expectLines(t, a, target, dialOpts{}, "IN "+target, fmt.Sprintf("APP %s FROM %s", target, pair.src))
	}

	noReply := testSettings()
	noReply.ReplyMark = 0
	if err := d.ReleaseNetns(t.Context(), b.path); err != nil {
		t.Fatal(err)
	}
	enroll(t, d, b, noReply)
	target := hostPort(b.addr4, appPort)
	lines, _, err := a.fetch(target, dialOpts{})
	if len(lines) != 2 || !strings.HasPrefix(lines[1], "UPSTREAM ERR") {
		t.Errorf("without the reply route: %q (%v), want the proxy's connect to the application to fail", lines, err)
	}
}

// The pod's reply route is in its namespace while it is enrolled and gone once it
// is released with its namespace: rules, routes and tcp_fwmark_accept.
func TestReplyRouteReleased(t *testing.T) {
	d, a, _ := parallelRig(t)
	state := func() (rules, routes int, accept string) {
		a.do(t, func() error {
			for _, fam := range []int{netlink.FAMILY_V4, netlink.FAMILY_V6} {
				rs, err := netlinksafe.RuleList(fam)
				if err != nil {
					return err
				}
				for _, r := range rs {
					if r.Table == ReplyTable {
						rules++
					}
				}
				rts, err := netlinksafe.RouteListFiltered(fam, &netlink.Route{Table: ReplyTable}, netlink.RT_FILTER_TABLE)
				if err != nil {
					return err
				}
				routes += len(rts)
			}
			b, err := os.ReadFile("/proc/" + fwmarkAcceptSysctl)
			accept = strings.TrimSpace(string(b))
			return err
		})
		return
	}
	enroll(t, d, a, testSettings())
	enroll(t, d, a, testSettings()) // again: still one of each
	if rules, routes, accept := state(); rules != 2 || routes != 2 || accept != "1" {
		t.Errorf("enrolled: %d rules, %d routes in table %d, tcp_fwmark_accept %s; want 2, 2, 1", rules, routes, ReplyTable, accept)
	}
	if err := d.ReleaseNetns(t.Context(), a.path); err != nil {
		t.Fatal(err)
	}
	if rules, routes, accept := state(); rules != 0 || routes != 0 || accept != "0" {
		t.Errorf("released: %d rules, %d routes, tcp_fwmark_accept %s; want none and 0", rules, routes, accept)
	}
}

// The proxy sees the pod's own address as the source of its outbound connections,
// as after iptables REDIRECT, not loopback: for IPv4, IPv6 and an IPv4-mapped
// destination of a dual-stack socket.
func TestOutboundSourceIsPodAddress(t *testing.T) {
	d, a, b := parallelRig(t)
	startPeerProxy(t, a, 15001)
	enroll(t, d, a, testSettings())
	for _, c := range []struct {
		addr string
		orig netip.AddrPort
		src  netip.Addr
	}{
		{hostPort(b.addr4, appPort), netip.AddrPortFrom(b.addr4, appPort), a.addr4},
		{hostPort(b.addr6, appPort), netip.AddrPortFrom(b.addr6, appPort), a.addr6},
		{fmt.Sprintf("[::ffff:%s]:%d", b.addr4, appPort), netip.AddrPortFrom(b.addr4, appPort), a.addr4},
	} {
		expectLines(t, a, c.addr, dialOpts{}, fmt.Sprintf("OUT %s FROM %s <nil>", c.orig, c.src))
	}
}

// A pod connecting to its own address stays in the pod, as with Istio's `-o lo`
// exclusion: neither its outbound proxy nor its inbound capture takes it.
func TestOwnAddressNotRedirected(t *testing.T) {
	t.Parallel()
	m := newMeshPair(t, testSettings(), testSettings())
	startApp(t, m.a, appPort)
	for _, addr := range []netip.Addr{m.a.addr4, m.a.addr6} {
		target := hostPort(addr, appPort)
		expectLines(t, m.a, target, dialOpts{}, "APP "+target)
	}
}

// A socket bound to the pod's interface (SO_BINDTODEVICE) connects through its
// proxy like any other: it cannot reach loopback, so its connect goes to the
// proxy's wildcard listener on the pod's own address.
func TestBoundToDeviceRedirected(t *testing.T) {
	t.Parallel()
	m := newMeshPair(t, testSettings(), testSettings())
	startApp(t, m.b, appPort)
	for _, dst := range []netip.Addr{m.b.addr4, m.b.addr6} {
		target := hostPort(dst, appPort)
		var lines []string
		err := netns.Do(m.a.path, func() error {
			dl := net.Dialer{Timeout: 5 * time.Second, Control: func(_, _ string, c syscall.RawConn) error {
				var serr error
				err := c.Control(func(fd uintptr) { serr = unix.BindToDevice(int(fd), ifName) })
				return errors.Join(err, serr)
			}}
			conn, err := dl.Dial("tcp", target)
			if err != nil {
				return err
			}
			defer conn.Close()
			lines, err = readLines(conn)
			return err
		})
		if err != nil || len(lines) != 2 || lines[0] != "OUT "+target || lines[1] != "IN "+target {
			t.Errorf("bound to %s, %s: %q (%v), want through both proxies", ifName, target, lines, err)
		}
	}
}

// A link-local destination's original destination carries the pod's interface as
// its scope, so the proxy can dial it.
func TestLinkLocalOriginalDstScope(t *testing.T) {
	d, a, b := parallelRig(t)
	var bLL netip.Addr
	b.do(t, func() error {
		addrs, err := netlinksafe.AddrList(nil, netlink.FAMILY_V6)
		for _, ad := range addrs {
			if ip, _ := netip.AddrFromSlice(ad.IP); ip.IsLinkLocalUnicast() {
				bLL = ip
			}
		}
		return err
	})
	if !bLL.IsValid() {
		t.Fatal("b has no link-local address")
	}
	startApp(t, b, appPort)
	// The outbound proxy dials what SO_ORIGINAL_DST says, scope included.
	ln := a.listen(t, "[::]:15001")
	fixtures.Serve(t, ln, func(conn net.Conn) {
		rc, _ := conn.(*net.TCPConn).SyscallConn()
		var (
			sa   *unix.SockaddrInet6
			gerr error
		)
		_ = rc.Control(func(fd uintptr) {
			var buf [28]byte
			n := uint32(len(buf))
			gerr = getsockopt(int(fd), unix.SOL_IPV6, ip6tSoOriginalDst, buf[:], &n)
			sa = &unix.SockaddrInet6{Port: int(buf[2])<<8 | int(buf[3]), Addr: [16]byte(buf[8:24]), ZoneId: uint32(buf[24]) | uint32(buf[25])<<8 | uint32(buf[26])<<16 | uint32(buf[27])<<24}
		})
		if gerr != nil {
			fmt.Fprintf(conn, "OUT ERR %v\n", gerr)
			return
		}
		dst := netip.AddrPortFrom(netip.AddrFrom16(sa.Addr).WithZone(strconv.Itoa(int(sa.ZoneId))), uint16(sa.Port))
		fmt.Fprintf(conn, "OUT %s\n", dst)
		up, err := a.dial(dst.String(), dialOpts{mark: testMark})
		relay(conn, up, err)
	})
	enroll(t, d, a, testSettings())
	var index int
	a.do(t, func() error {
		iface, err := net.InterfaceByName(ifName)
		if err == nil {
			index = iface.Index
		}
		return err
	})
	target := netip.AddrPortFrom(bLL.WithZone(ifName), appPort).String()
	scoped := netip.AddrPortFrom(bLL.WithZone(strconv.Itoa(index)), appPort).String()
	lines, _, err := a.fetch(target, dialOpts{})
	if err != nil || len(lines) != 2 || lines[0] != "OUT "+scoped || !strings.HasPrefix(lines[1], "APP ") {
		t.Errorf("to %s: %q (%v), want the proxy to get %s and dial it", target, lines, err, scoped)
	}
}

// A pod enrolled with BypassInbound keeps its outbound redirection while its
// inbound connections reach the application directly.
func TestBypassInbound(t *testing.T) {
	t.Parallel()
	sb := testSettings()
	sb.BypassInbound = true
	m := newMeshPair(t, testSettings(), sb)
	startApp(t, m.b, appPort)
	startApp(t, m.a, appPort)
	target := hostPort(m.b.addr4, appPort)
	expectLines(t, m.a, target, dialOpts{}, "OUT "+target, "APP "+target)
	back := hostPort(m.a.addr4, appPort)
	expectLines(t, m.b, back, dialOpts{}, "OUT "+back, "IN "+back)
}

// Where /proc/sys is read-only (every container that is not privileged), the
// agent writes a pod's net sysctls through a procfs of its own, mounted detached:
// the value lands in the namespace of the thread that writes it.
func TestSysctlThroughDetachedProcfs(t *testing.T) {
	t.Parallel()
	requireRoot(t)
	a := newNetns(t, "a")
	fd, err := detachedProcfs()
	if err != nil {
		t.Fatal(err)
	}
	p := &procfs{fd: fd}
	p.once.Do(func() {})
	defer p.close()
	a.do(t, func() error { return p.writeSysctl(fwmarkAcceptSysctl, "1") })
	var got []byte
	a.do(t, func() error {
		var err error
		got, err = os.ReadFile("/proc/" + fwmarkAcceptSysctl)
		return err
	})
	if strings.TrimSpace(string(got)) != "1" {
		t.Errorf("tcp_fwmark_accept in the pod: %q, want 1", got)
	}
}
