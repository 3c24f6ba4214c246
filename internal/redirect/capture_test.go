package redirect

import (
	"context"
	"fmt"
	"net"
	"net/netip"
	"os"
	"reflect"
	"strings"
	"testing"

	"github.com/mesh-cni/mesh-cni/test/fixtures"
)

// sidecarSettings are the settings of a pod in Istio's sidecar mode with c: the
// proxy's ports as Istio's sidecar has them, and its own ports excluded inbound.
func sidecarSettings(c Capture) Settings {
	s := DefaultSettings()
	s.InboundExcludedPorts = []uint16{15008, 15020, 15021, 15090}
	s.Capture = c
	return s
}

// Istio's sidecar mode: the proxy is the pod's own container, known by its
// cgroup; another process of the pod, whatever it runs as, is captured. The
// proxy's connects to the pod's local addresses but 127.0.0.1 go to its inbound
// port (how Istio's validation and a call to the pod's own service through the
// proxy work), but from the inbound passthrough source 127.0.0.6 and to the
// tunnel port. The include lists narrow capture both ways.
func TestSidecarCapture(t *testing.T) {
	d, a, b := parallelRig(t)
	// a's sidecar answers on both ports without connecting onward.
	outLn := a.listen(t, "[::]:15001")
	fixtures.Serve(t, outLn, func(conn net.Conn) { announce(conn, "OUT") })
	startInboundProxy(t, a, 15006)
	for _, port := range []uint16{9100, 9200, 15008} {
		startApp(t, a, port)
	}
	for _, port := range []uint16{9000, 9001} {
		startApp(t, b, port)
	}
	proxy := newCgroup(t, d.cgroup, fmt.Sprintf("mesh-test-sidecar-%d", os.Getpid()))
	other := newCgroup(t, d.cgroup, fmt.Sprintf("mesh-test-app-%d", os.Getpid()))
	ref, err := d.CgroupRef(proxy)
	if err != nil {
		t.Fatal(err)
	}
	enroll(t, d, a, sidecarSettings(Capture{ProxyCgroup: ref, LocalToInbound: true}))

	fromProxy := func(addr, local string) string {
		return joinLines(dialFromCgroupBound(t, proxy, a, addr, 0, local))
	}
	expect := func(what, got, want string) {
		t.Helper()
		if got != want {
			t.Errorf("%s: got %q, want %q", what, got, want)
		}
	}
	for _, dst := range []netip.Addr{b.addr4, b.addr6} {
		target := hostPort(dst, 9000)
		expect("the application's connect", joinLines(mustFetch(t, a, target)), "OUT "+target)
		expect("the proxy's connect", fromProxy(target, ""), "APP "+target)
		// Another container of the pod, as the proxy's uid or not: the cgroup
		// decides, and it is not the proxy's.
		expect("another cgroup's connect", joinLines(dialFromCgroup(t, other, a, target, 0)), "OUT "+target)
	}
	// The proxy to its pod's local addresses.
	for _, c := range []struct {
		what, addr, local, want string
	}{
		{"validation's 127.0.0.6", "127.0.0.6:15002", "", "IN 127.0.0.6:15002"},
		{"the pod's own address", hostPort(a.addr4, 9100), "", "IN " + hostPort(a.addr4, 9100)},
		{"the pod's own IPv6 address", hostPort(a.addr6, 9100), "", "IN " + hostPort(a.addr6, 9100)},
		{"127.0.0.1", "127.0.0.1:9100", "", "APP 127.0.0.1:9100"},
		{"the inbound passthrough", hostPort(a.addr4, 9100), "127.0.0.6", "APP " + hostPort(a.addr4, 9100)},
		{"the tunnel port", hostPort(a.addr4, 15008), "", "APP " + hostPort(a.addr4, 15008)},
	} {
		expect("proxy to "+c.what, fromProxy(c.addr, c.local), c.want)
	}
	// The application to 127.0.0.6 stays in the pod, as any loopback connect.
	expect("the application to 127.0.0.6", joinLines(mustFetch(t, a, "127.0.0.6:9100")), "APP 127.0.0.6:9100")

	// mesh-agent status says by what the proxy is known.
	proxyState := func() string {
		t.Helper()
		snap, err := Inspect(context.Background(), string(d.pins))
		if err != nil {
			t.Fatal(err)
		}
		for _, p := range snap.Pods {
			if p.Cookie == a.cookie {
				return p.Proxy
			}
		}
		t.Fatalf("pod a not in the snapshot")
		return ""
	}
	if got := proxyState(); !strings.HasPrefix(got, "sidecar container's cgroup") {
		t.Errorf("status of the proxy by its cgroup: %q", got)
	}

	// Under the uid rule (the container's cgroup not yet known) every process of
	// that uid is the proxy: this test runs as it.
	uid := uint32(os.Geteuid())
	s := sidecarSettings(Capture{LocalToInbound: true})
	s.ProxyUID = &uid
	enroll(t, d, a, s)
	if got := proxyState(); !strings.HasPrefix(got, fmt.Sprintf("uid %d: the sidecar container's cgroup is not known yet", uid)) {
		t.Errorf("status of the proxy by its uid: %q", got)
	}
	target := hostPort(b.addr4, 9000)
	expect("another cgroup under the uid rule", joinLines(dialFromCgroup(t, other, a, target, 0)), "APP "+target)
	expect("validation under the uid rule", joinLines(dialFromCgroup(t, other, a, "127.0.0.6:15002", 0)), "IN 127.0.0.6:15002")

	// Include lists: only b's IPv4 address and, anywhere, port 9001 outbound;
	// only 9100 inbound.
	inc := Capture{
		ProxyCgroup:       ref,
		LocalToInbound:    true,
		OutboundCIDRsOnly: true, IncludedCIDRs: []netip.Prefix{netip.PrefixFrom(b.addr4, 32)},
		OutboundIncludedPorts: []uint16{9001},
		InboundPortsOnly:      true, InboundIncludedPorts: []uint16{9100},
	}
	e := enroll(t, d, a, sidecarSettings(inc))
	for _, c := range []struct{ addr, want string }{
		{hostPort(b.addr4, 9000), "OUT " + hostPort(b.addr4, 9000)},
		{hostPort(b.addr6, 9000), "APP " + hostPort(b.addr6, 9000)},
		{hostPort(b.addr6, 9001), "OUT " + hostPort(b.addr6, 9001)},
	} {
		expect("included outbound "+c.addr, joinLines(mustFetch(t, a, c.addr)), c.want)
	}
	for _, c := range []struct{ addr, want string }{
		{hostPort(a.addr4, 9100), "IN " + hostPort(a.addr4, 9100)},
		{hostPort(a.addr4, 9200), "APP " + hostPort(a.addr4, 9200)},
	} {
		expect("included inbound "+c.addr, joinLines(mustFetch(t, b, c.addr)), c.want)
	}
	list, err := d.List(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	for _, got := range list {
		if got.Cookie == e.Cookie && !reflect.DeepEqual(got.Settings.Capture, inc.normalized()) {
			t.Errorf("listed capture %+v, want %+v", got.Settings.Capture, inc.normalized())
		}
	}
	// No capture: the pod's entry goes, and the former proxy cgroup is redirected.
	enroll(t, d, a, sidecarSettings(Capture{}))
	if c, err := d.podCapture(e.Cookie); err != nil || c != nil {
		t.Errorf("pod_capture entry after a plain enrollment: %+v, %v", c, err)
	}
	expect("the former proxy cgroup", fromProxy(target, ""), "OUT "+target)
	// Released, it goes too, with its sets.
	enroll(t, d, a, sidecarSettings(inc))
	if err := d.Release(context.Background(), e.Cookie); err != nil {
		t.Fatal(err)
	}
	if c, err := d.podCapture(e.Cookie); err != nil || c != nil {
		t.Errorf("pod_capture entry after the release: %+v, %v", c, err)
	}
	d.mapMu.Lock()
	defer d.mapMu.Unlock()
	if n := len(d.ports.byID) + len(d.excluded.byID); n != 0 {
		t.Errorf("%d sets left after the release", n)
	}
}

func mustFetch(t *testing.T, p *pod, addr string) []string {
	t.Helper()
	lines, _, err := p.fetch(addr, dialOpts{})
	if err != nil {
		t.Fatalf("%s -> %s: %v", p.name, addr, err)
	}
	return lines
}
