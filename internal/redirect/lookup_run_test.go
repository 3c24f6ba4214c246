package redirect

import (
	"errors"
	"fmt"
	"net"
	"net/netip"
	"testing"

	"github.com/cilium/ebpf"
	"golang.org/x/sys/unix"
)

// skLookupCtx is struct bpf_sk_lookup of the UAPI, what BPF_PROG_TEST_RUN
// takes for an sk_lookup program and gives back: addresses and the remote
// port in network byte order, the local port in host order. Cookie comes
// back as the cookie of the socket the program selected, 0 for none.
type skLookupCtx struct {
	Cookie         uint64
	Family         uint32
	Protocol       uint32
	RemoteIP4      [4]byte
	RemoteIP6      [16]byte
	RemotePort     [2]byte
	_              uint16
	LocalIP4       [4]byte
	LocalIP6       [16]byte
	LocalPort      uint32
	IngressIfindex uint32
	// The C struct's tail padding, which the kernel copies out too.
	_ uint32
}

// What an sk_lookup program returns.
const (
	skDrop = 0
	skPass = 1
)

// lookupCtx is the lookup of a new connection from remote to local.
func lookupCtx(protocol uint32, remote, local netip.AddrPort) skLookupCtx {
	c := skLookupCtx{Protocol: protocol, LocalPort: uint32(local.Port())}
	c.RemotePort = [2]byte{byte(remote.Port() >> 8), byte(remote.Port())}
	if remote.Addr().Is4() {
		c.Family = unix.AF_INET
		c.RemoteIP4, c.LocalIP4 = remote.Addr().As4(), local.Addr().As4()
	} else {
		c.Family = unix.AF_INET6
		c.RemoteIP6, c.LocalIP6 = remote.Addr().As16(), local.Addr().As16()
	}
	return c
}

// capturedProxyPorts are the well-known ports of the mesh's proxies other
// than HBONE: an application listening on one is captured like on any port,
// so nobody reaches it past the pod's proxy.
func capturedProxyPorts() []uint16 { return []uint16{15001, 15006, 15020, 15021, 15053, 15090} }

// podLookupProgram is the sk_lookup program the data path attached to the
// enrolled pod's namespace, as its pinned link runs it.
func podLookupProgram(t *testing.T, d *Datapath, cookie uint64) *ebpf.Program {
	t.Helper()
	p, err := ebpf.NewProgramFromID(lookupLinkInfo(t, d, cookie).Program)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { p.Close() })
	return p
}

// socketCookie is SO_COOKIE of ln's socket, what a lookup that selects it
// gives back.
func socketCookie(t *testing.T, ln net.Listener) uint64 {
	t.Helper()
	return listenerSockopt(t, ln, unix.GetsockoptUint64, unix.SO_COOKIE)
}

// listenerSockopt reads the SOL_SOCKET option opt of ln's socket with get.
func listenerSockopt[T any](t *testing.T, ln net.Listener, get func(fd, level, opt int) (T, error), opt int) T {
	t.Helper()
	rc, err := ln.(*net.TCPListener).SyscallConn()
	if err != nil {
		t.Fatal(err)
	}
	var v T
	var gerr error
	if err := rc.Control(func(fd uintptr) { v, gerr = get(int(fd), unix.SOL_SOCKET, opt) }); err != nil || gerr != nil {
		t.Fatal(errors.Join(err, gerr))
	}
	return v
}

// TestLookupDecisions runs each enrolled pod's own sk_lookup program, as the
// data path built and attached it, on the lookups the kernel makes for new
// connections into the pod (BPF_PROG_TEST_RUN, no packet sent): which
// listener each one is handed to, or none, and which counter it moves. The
// traffic tests show the same end to end; this shows every decision in well
// under a second, on each kernel of the matrix and in make test-unit.
func TestLookupDecisions(t *testing.T) {
	t.Parallel()
	requireRoot(t)
	d, _ := testDatapath(t)

	probes := netip.MustParsePrefix("192.0.2.0/24")
	s := testSettings()
	s.InboundExcludedPorts = append(s.InboundExcludedPorts, 9090)
	s.ProbeSources = []netip.Prefix{probes}
	p := newNetns(t, "pod")
	enroll(t, d, p, s)
	proxy := p.listen(t, "[::]:15006")
	// Another enrolled pod's proxy, and a namespace nobody enrolled listening
	// on the inbound port: neither may ever get this pod's connections.
	other := newNetns(t, "other")
	enroll(t, d, other, testSettings())
	otherProxy := other.listen(t, "[::]:15006")
	stranger := newNetns(t, "stranger")
	strangerLn := stranger.listen(t, "[::]:15006")
	// A pod whose proxy is not listening, failing open.
	open := newNetns(t, "failopen")
	openSettings := testSettings()
	openSettings.FailOpen = true
	enroll(t, d, open, openSettings)

	proxyCookie := socketCookie(t, proxy)
	notThese := map[uint64]string{socketCookie(t, otherProxy): "another pod's proxy", socketCookie(t, strangerLn): "an unenrolled namespace's listener"}
	prog, otherProg, openProg := podLookupProgram(t, d, p.cookie), podLookupProgram(t, d, other.cookie), podLookupProgram(t, d, open.cookie)

	client4, client6 := netip.MustParseAddrPort("10.9.0.7:40000"), netip.MustParseAddrPort("[fd00:9::7]:40000")
	pod4, pod6 := netip.MustParseAddr("10.77.0.2"), netip.MustParseAddr("fd00:77::2")
	to := func(a netip.Addr, port uint16) netip.AddrPort { return netip.AddrPortFrom(a, port) }
	type want struct {
		verdict uint32
		cookie  uint64 // the listener handed the connection, 0 for the kernel's own lookup
		counter string // redirected, passed, dropped, or "" when none moves
	}
	redirected := want{skPass, proxyCookie, "redirected"}
	passed := want{skPass, 0, "passed"}
	type lookupCase struct {
		name string
		prog *ebpf.Program
		ctx  skLookupCtx
		want want
	}
	var cases []lookupCase
	for _, port := range capturedProxyPorts() {
		cases = append(cases, lookupCase{fmt.Sprintf("port %d of a mesh proxy, captured", port), prog, lookupCtx(unix.IPPROTO_TCP, client4, to(pod4, port)), redirected})
	}
	for _, c := range append(cases, []lookupCase{
		{"inbound IPv4 to the application", prog, lookupCtx(unix.IPPROTO_TCP, client4, to(pod4, 8080)), redirected},
		{"inbound IPv6 to the application", prog, lookupCtx(unix.IPPROTO_TCP, client6, to(pod6, 8080)), redirected},
		// Only the proxy's own port is reachable past it; the other ports
		// of the mesh's proxies are captured like any application's (above).
		{"HBONE port, excluded by default", prog, lookupCtx(unix.IPPROTO_TCP, client4, to(pod4, HBONEPort)), passed},
		{"port the settings exclude", prog, lookupCtx(unix.IPPROTO_TCP, client6, to(pod6, 9090)), passed},
		{"a probe source the settings name", prog, lookupCtx(unix.IPPROTO_TCP, netip.MustParseAddrPort("192.0.2.9:50000"), to(pod4, 8080)), passed},
		{"a source next to the probe range", prog, lookupCtx(unix.IPPROTO_TCP, netip.MustParseAddrPort("192.0.3.9:50000"), to(pod4, 8080)), redirected},
		{"UDP", prog, lookupCtx(unix.IPPROTO_UDP, client4, to(pod4, 8080)), want{skPass, 0, ""}},
		{"within the pod, over loopback", prog, lookupCtx(unix.IPPROTO_TCP, netip.MustParseAddrPort("127.0.0.1:40000"), to(netip.MustParseAddr("127.0.0.1"), 8080)), want{skPass, 0, ""}},
		{"another pod's program picks its own proxy", otherProg, lookupCtx(unix.IPPROTO_TCP, client4, to(pod4, 8080)), want{skPass, socketCookie(t, otherProxy), "redirected"}},
		{"no proxy listening, failing open", openProg, lookupCtx(unix.IPPROTO_TCP, client4, to(pod4, 8080)), passed},
	}...) {
		before, err := d.Counters()
		if err != nil {
			t.Fatal(err)
		}
		out := skLookupCtx{}
		verdict, err := c.prog.Run(&ebpf.RunOptions{Context: c.ctx, ContextOut: &out})
		if err != nil {
			t.Fatalf("%s: run: %v", c.name, err)
		}
		after, err := d.Counters()
		if err != nil {
			t.Fatal(err)
		}
		counter := ""
		for name, delta := range map[string]uint64{
			"redirected": after.Inbound.Redirected - before.Inbound.Redirected,
			"passed":     after.Inbound.Passed - before.Inbound.Passed,
			"dropped":    after.Inbound.Dropped - before.Inbound.Dropped,
		} {
			if delta != 0 {
				counter += name
			}
		}
		if verdict != c.want.verdict || out.Cookie != c.want.cookie || counter != c.want.counter {
			t.Errorf("%s: verdict %d, socket %d, counter %q; want %d, %d (the proxy's is %d), %q",
				c.name, verdict, out.Cookie, counter, c.want.verdict, c.want.cookie, proxyCookie, c.want.counter)
		}
		if why, ok := notThese[out.Cookie]; ok && c.prog == prog {
			t.Errorf("%s: handed to %s", c.name, why)
		}
	}

	// With its proxy gone the pod fails closed: the lookup drops, and the
	// client gets a reset as from a closed port.
	proxy.Close()
	out := skLookupCtx{}
	verdict, err := prog.Run(&ebpf.RunOptions{Context: lookupCtx(unix.IPPROTO_TCP, client4, to(pod4, 8080)), ContextOut: &out})
	if err != nil {
		t.Fatal(err)
	}
	if verdict != skDrop || out.Cookie != 0 {
		t.Errorf("no proxy listening: verdict %d, socket %d; want the drop (%d) and none", verdict, out.Cookie, skDrop)
	}
}
