package redirect

import (
	"bufio"
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"net"
	"net/netip"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"
	"unsafe"

	"go.uber.org/zap/zaptest"
	"golang.org/x/sys/unix"

	"github.com/mesh-cni/mesh-cni/internal/netns"
	"github.com/mesh-cni/mesh-cni/test/fixtures"
)

const (
	testMark = ZtunnelMark
	ifName   = "eth0"
)

func requireRoot(t testing.TB) {
	t.Helper()
	fixtures.RequireRoot(t, "BPF, network namespaces, bpffs")
}

// pod is a test network namespace (test/fixtures), with the fields the tests
// here read.
type pod struct {
	name   string
	path   string
	cookie uint64
	addr4  netip.Addr
	addr6  netip.Addr
}

func newNetns(t testing.TB, name string) *pod {
	t.Helper()
	n := fixtures.NewNetns(t, filepath.Join(t.TempDir(), name))
	return &pod{name: name, path: n.Path, cookie: n.Cookie}
}

// newPodPair makes pods a and b with eth0 <-> eth0 and addresses 10.77.0.1/.2 and
// fd00:77::1/::2 (fixtures.NewPodPair).
func newPodPair(t testing.TB) (a, b *pod) {
	t.Helper()
	fa, fb := fixtures.NewPodPair(t)
	wrap := func(name string, p *fixtures.Pod) *pod {
		return &pod{name: name, path: p.Path, cookie: p.Cookie, addr4: p.IPv4, addr6: p.IPv6}
	}
	return wrap("a", fa), wrap("b", fb)
}

func (p *pod) do(t testing.TB, fn func() error) {
	t.Helper()
	if err := netns.Do(p.path, fn); err != nil {
		t.Fatalf("in netns %s: %v", p.name, err)
	}
}

// listen opens a TCP listener inside the pod, MPTCP off (fixtures.Netns.Listen).
func (p *pod) listen(t testing.TB, addr string) net.Listener {
	t.Helper()
	return (&fixtures.Netns{Path: p.path}).Listen(t, "tcp", addr)
}

// dialOpts tune a test connect.
type dialOpts struct {
	mark    uint32
	timeout time.Duration
	mptcp   bool
	local   string // an address (no port) to bind before connecting
}

// dial connects from inside the pod. The socket belongs to the pod netns; the
// connect runs on the same pod thread.
func (p *pod) dial(addr string, o dialOpts) (net.Conn, error) {
	var conn net.Conn
	timeout := o.timeout
	if timeout == 0 {
		timeout = 5 * time.Second
	}
	err := netns.Do(p.path, func() error {
		d := net.Dialer{Timeout: timeout, Control: fixtures.MarkControl(int(o.mark))}
		if o.local != "" {
			a, err := netip.ParseAddr(o.local)
			if err != nil {
				return err
			}
			d.LocalAddr = net.TCPAddrFromAddrPort(netip.AddrPortFrom(a, 0))
		}
		d.SetMultipathTCP(o.mptcp)
		var err error
		conn, err = d.Dial("tcp", addr)
		return err
	})
	return conn, err
}

// fetch connects from the pod and reads every line the other end sends.
func (p *pod) fetch(addr string, o dialOpts) ([]string, net.Addr, error) {
	conn, err := p.dial(addr, o)
	if err != nil {
		return nil, nil, err
	}
	defer conn.Close()
	lines, err := readLines(conn)
	return lines, conn.RemoteAddr(), err
}

func readLines(conn net.Conn) ([]string, error) {
	if err := conn.SetDeadline(time.Now().Add(10 * time.Second)); err != nil {
		return nil, err
	}
	var lines []string
	sc := bufio.NewScanner(conn)
	for sc.Scan() {
		lines = append(lines, sc.Text())
	}
	return lines, sc.Err()
}

// startOutboundProxy listens on the pod's outbound port (dual-stack wildcard), reads
// SO_ORIGINAL_DST, answers "OUT <orig>" and then relays what the original
// destination says when dialed with the proxy mark from inside the pod.
func startOutboundProxy(t testing.TB, p *pod, port uint16) {
	ln := p.listen(t, fmt.Sprintf("[::]:%d", port))
	fixtures.Serve(t, ln, func(conn net.Conn) {
		if orig, ok := announce(conn, "OUT"); ok {
			up, err := p.dial(orig.String(), dialOpts{mark: testMark})
			relay(conn, up, err)
		}
	})
}

// startInboundProxy listens on the pod's inbound port and answers "IN <orig>".
func startInboundProxy(t testing.TB, p *pod, port uint16) {
	ln := p.listen(t, fmt.Sprintf("[::]:%d", port))
	fixtures.Serve(t, ln, func(conn net.Conn) { announce(conn, "IN") })
}

// startProxies starts each pod's outbound proxy on 15001 and inbound proxy on
// 15006, the ports testSettings names.
func startProxies(t testing.TB, pods ...*pod) {
	t.Helper()
	for _, p := range pods {
		startOutboundProxy(t, p, 15001)
		startInboundProxy(t, p, 15006)
	}
}

// announce writes what a test proxy says first: "<tag> <original
// destination>", or "<tag> ERR <why>" when there is none (ok false).
func announce(conn net.Conn, tag string) (orig netip.AddrPort, ok bool) {
	orig, err := originalDst(conn)
	if err != nil {
		fmt.Fprintf(conn, "%s ERR %v\n", tag, err)
		return orig, false
	}
	fmt.Fprintf(conn, "%s %s\n", tag, orig)
	return orig, true
}

// relay passes on to conn what up, a test proxy's upstream connection, sends,
// for ten seconds at most; when err, up's dial's, is set it says "UPSTREAM
// ERR <why>" instead.
func relay(conn, up net.Conn, err error) {
	if err != nil {
		fmt.Fprintf(conn, "UPSTREAM ERR %v\n", err)
		return
	}
	defer up.Close()
	_ = up.SetDeadline(time.Now().Add(10 * time.Second))
	_, _ = io.Copy(conn, up)
}

// startApp listens on a pod port and answers "APP <local address>".
func startApp(t testing.TB, p *pod, port uint16) {
	ln := p.listen(t, fmt.Sprintf("[::]:%d", port))
	fixtures.Serve(t, ln, func(conn net.Conn) {
		fmt.Fprintf(conn, "APP %s\n", unmapAddrPort(conn.LocalAddr()))
	})
}

func unmapAddrPort(a net.Addr) netip.AddrPort {
	ap, err := netip.ParseAddrPort(a.String())
	if err != nil {
		return netip.AddrPort{}
	}
	return netip.AddrPortFrom(ap.Addr().Unmap(), ap.Port())
}

// originalDst asks the way iptables-era proxies do: SOL_IP/SO_ORIGINAL_DST for an
// IPv4 (or IPv4-mapped) connection, SOL_IPV6/IP6T_SO_ORIGINAL_DST for IPv6.
func originalDst(conn net.Conn) (netip.AddrPort, error) {
	rc, err := conn.(*net.TCPConn).SyscallConn()
	if err != nil {
		return netip.AddrPort{}, err
	}
	local := unmapAddrPort(conn.LocalAddr())
	var (
		out  netip.AddrPort
		gerr error
	)
	err = rc.Control(func(fd uintptr) {
		out, gerr = getOriginalDst(int(fd), local.Addr().Is4())
	})
	if err != nil {
		return netip.AddrPort{}, err
	}
	return out, gerr
}

func getOriginalDst(fd int, v4 bool) (netip.AddrPort, error) {
	if v4 {
		var buf [16]byte
		n := uint32(len(buf))
		if err := getsockopt(fd, unix.SOL_IP, unix.SO_ORIGINAL_DST, buf[:], &n); err != nil {
			return netip.AddrPort{}, fmt.Errorf("SO_ORIGINAL_DST: %w", err)
		}
		if n != 16 || binary.NativeEndian.Uint16(buf[0:]) != unix.AF_INET {
			return netip.AddrPort{}, fmt.Errorf("SO_ORIGINAL_DST: bad sockaddr_in (len %d)", n)
		}
		return netip.AddrPortFrom(netip.AddrFrom4([4]byte(buf[4:8])), binary.BigEndian.Uint16(buf[2:])), nil
	}
	var buf [28]byte
	n := uint32(len(buf))
	if err := getsockopt(fd, unix.SOL_IPV6, ip6tSoOriginalDst, buf[:], &n); err != nil {
		return netip.AddrPort{}, fmt.Errorf("IP6T_SO_ORIGINAL_DST: %w", err)
	}
	if n != 28 || binary.NativeEndian.Uint16(buf[0:]) != unix.AF_INET6 {
		return netip.AddrPort{}, fmt.Errorf("IP6T_SO_ORIGINAL_DST: bad sockaddr_in6 (len %d)", n)
	}
	return netip.AddrPortFrom(netip.AddrFrom16([16]byte(buf[8:24])), binary.BigEndian.Uint16(buf[2:])), nil
}

func getsockopt(fd, level, name int, buf []byte, n *uint32) error {
	_, _, errno := unix.Syscall6(unix.SYS_GETSOCKOPT, uintptr(fd), uintptr(level), uintptr(name),
		uintptr(unsafe.Pointer(&buf[0])), uintptr(unsafe.Pointer(n)), 0)
	if errno != 0 {
		return errno
	}
	return nil
}

// parallelRig runs t in parallel with a data path of its own and a pod pair:
// how most tests here start.
func parallelRig(t *testing.T) (d *Datapath, a, b *pod) {
	t.Helper()
	t.Parallel()
	requireRoot(t)
	d, _ = testDatapath(t)
	a, b = newPodPair(t)
	return d, a, b
}

// testDatapath opens a Datapath on its own bpffs in a temporary directory and
// uninstalls it (unmounting the bpffs) when the test ends.
func testDatapath(t testing.TB) (*Datapath, Config) {
	t.Helper()
	cfg := Config{PinRoot: filepath.Join(t.TempDir(), "bpf"), Logger: zaptest.NewLogger(t)}
	d, err := Open(context.Background(), cfg)
	if err != nil {
		t.Fatalf("open: %v", err)
	}
	t.Cleanup(func() {
		if err := d.Close(); err != nil {
			t.Errorf("close: %v", err)
		}
		if err := Uninstall(context.Background(), cfg); err != nil {
			t.Errorf("uninstall: %v", err)
		}
		if _, err := os.Stat(cfg.PinRoot); !errors.Is(err, os.ErrNotExist) {
			t.Errorf("pin root %s still there after uninstall (%v)", cfg.PinRoot, err)
			_ = unix.Unmount(cfg.PinRoot, unix.MNT_DETACH)
		}
	})
	return d, cfg
}

func enroll(t testing.TB, d *Datapath, p *pod, s Settings) Enrollment {
	t.Helper()
	e, err := d.Enroll(context.Background(), Target{NetnsPath: p.path, Settings: s})
	if err != nil {
		t.Fatalf("enroll %s: %v", p.name, err)
	}
	return e
}

func hostPort(a netip.Addr, port uint16) string {
	return netip.AddrPortFrom(a, port).String()
}

func joinLines(lines []string) string { return strings.Join(lines, " | ") }

// ip6tSoOriginalDst is IP6T_SO_ORIGINAL_DST (linux/netfilter_ipv6/ip6_tables.h).
const ip6tSoOriginalDst = 80

// testSettings are the defaults with the proxy known by its mark (an opt-in): the
// tests' proxies run in the test process, in its cgroup, and mark their connects.
func testSettings() Settings {
	s := DefaultSettings()
	s.ProxyMark, s.ProxyMarkMask = ZtunnelMark, ZtunnelMarkMask
	return s
}
