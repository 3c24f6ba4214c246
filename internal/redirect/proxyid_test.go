package redirect

import (
	"bufio"
	"context"
	"fmt"
	"math/rand/v2"
	"net"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/mesh-cni/mesh-cni/test/fixtures"
)

// TestHelperDial is not a test: it is the process TestProxyCgroup starts in a
// cgroup, to connect the way a proxy in another container does. It dials
// MESH_DIAL_ADDR from inside MESH_DIAL_NETNS with SO_MARK MESH_DIAL_MARK and prints
// the lines it reads.
func TestHelperDial(t *testing.T) {
	netnsPath := os.Getenv("MESH_DIAL_NETNS")
	if netnsPath == "" {
		t.Skip("helper process of TestProxyCgroup")
	}
	mark, _ := strconv.ParseUint(os.Getenv("MESH_DIAL_MARK"), 0, 32)
	p := &pod{name: "helper", path: netnsPath}
	lines, _, err := p.fetch(os.Getenv("MESH_DIAL_ADDR"), dialOpts{mark: uint32(mark), local: os.Getenv("MESH_DIAL_LOCAL")})
	if err != nil {
		fmt.Println("ERR", err)
		return
	}
	for _, l := range lines {
		fmt.Println(l)
	}
}

// newCgroup makes a cgroup v2 directory for the test and removes it at the end.
func newCgroup(t *testing.T, parent, name string) string {
	t.Helper()
	dir := filepath.Join(parent, name)
	if err := os.Mkdir(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := os.Remove(dir); err != nil {
			t.Errorf("remove cgroup %s: %v", dir, err)
		}
	})
	return dir
}

// dialFromCgroup runs TestHelperDial in cgroup dir and returns its lines.
func dialFromCgroup(t *testing.T, dir string, p *pod, addr string, mark uint32) []string {
	t.Helper()
	return dialFromCgroupBound(t, dir, p, addr, mark, "")
}

// dialFromCgroupBound is dialFromCgroup with the socket bound to address local
// first ("": not bound).
func dialFromCgroupBound(t *testing.T, dir string, p *pod, addr string, mark uint32, local string) []string {
	t.Helper()
	cg, err := os.Open(dir)
	if err != nil {
		t.Fatal(err)
	}
	defer cg.Close()
	cmd := exec.Command(os.Args[0], "-test.run=^TestHelperDial$", "-test.v=false")
	cmd.Env = append(os.Environ(), "MESH_DIAL_NETNS="+p.path, "MESH_DIAL_ADDR="+addr, fmt.Sprintf("MESH_DIAL_MARK=%#x", mark), "MESH_DIAL_LOCAL="+local)
	cmd.SysProcAttr = &syscall.SysProcAttr{UseCgroupFD: true, CgroupFD: int(cg.Fd())}
	cmd.WaitDelay = 10 * time.Second
	out, err := cmd.Output()
	if err != nil {
		t.Fatalf("helper dial in %s: %v (%s)", dir, err, out)
	}
	var lines []string
	sc := bufio.NewScanner(strings.NewReader(string(out)))
	for sc.Scan() {
		if l := sc.Text(); l != "PASS" && l != "" {
			lines = append(lines, l)
		}
	}
	return lines
}

// The proxy is known by its cgroup, which a pod cannot change, and not by a socket
// mark, which a pod's root sets with CAP_NET_RAW (granted by default): a pod
// process that marks its connects is still redirected, a process of the proxy's
// cgroup (or of a cgroup below it) is not.
func TestProxyCgroup(t *testing.T) {
	d, a, b := parallelRig(t)
	s := DefaultSettings()
	// The proxies answer without connecting onward: their own connects would be
	// this process's, which is not in the proxy cgroup.
	for _, p := range []*pod{a, b} {
		ln := p.listen(t, fmt.Sprintf("[::]:%d", s.OutboundPort))
		fixtures.Serve(t, ln, func(conn net.Conn) {
			orig, err := originalDst(conn)
			fmt.Fprintf(conn, "OUT %s %v\n", orig, err)
		})
		startInboundProxy(t, p, s.InboundPort)
		enroll(t, d, p, s)
	}
	startApp(t, b, 9000)
	s.InboundExcludedPorts = append(s.InboundExcludedPorts, 9000)
	enroll(t, d, b, s)

	proxies := newCgroup(t, d.cgroup, fmt.Sprintf("mesh-test-proxies-%d", os.Getpid()))
	worker := newCgroup(t, proxies, "worker")
	other := newCgroup(t, d.cgroup, fmt.Sprintf("mesh-test-other-%d", os.Getpid()))
	if err := d.SetProxyCgroups([]string{proxies}); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = d.SetProxyCgroups(nil) })

	for _, dst := range []netip.Addr{b.addr4, b.addr6} {
		target := hostPort(dst, 9000)
		redirected := "OUT " + target + " <nil>"
		// The forged mark from this (pod-side, root) process: still redirected.
		expectLines(t, a, target, dialOpts{mark: testMark}, redirected)
		// Another cgroup, same forged mark: redirected.
		if got := dialFromCgroup(t, other, a, target, testMark); len(got) != 1 || got[0] != redirected {
			t.Errorf("from another cgroup with the mark: %q, want redirected", got)
		}
		// The proxy's cgroup and one below it: not redirected.
		for _, cg := range []string{proxies, worker} {
			if got := dialFromCgroup(t, cg, a, target, 0); len(got) != 1 || got[0] != "APP "+target {
				t.Errorf("from proxy cgroup %s: %q, want straight to the application", filepath.Base(cg), got)
			}
		}
	}
	// The same cgroup named from the root of the hierarchy, as --proxy-cgroups
	// takes it without knowing where the hierarchy is mounted.
	if err := d.SetProxyCgroups([]string{"/" + filepath.Base(proxies)}); err != nil {
		t.Fatal(err)
	}
	target9000 := hostPort(b.addr4, 9000)
	if got := dialFromCgroup(t, worker, a, target9000, 0); len(got) != 1 || got[0] != "APP "+target9000 {
		t.Errorf("proxy cgroup named from the hierarchy's root: %q, want straight to the application", got)
	}
	// Cleared, the proxy's cgroup is redirected like any other.
	if err := d.SetProxyCgroups(nil); err != nil {
		t.Fatal(err)
	}
	target := hostPort(b.addr4, 9000)
	if got := dialFromCgroup(t, proxies, a, target, 0); len(got) != 1 || got[0] != "OUT "+target+" <nil>" {
		t.Errorf("from the former proxy cgroup: %q, want redirected", got)
	}
}

// Kubelet probes are let through by the socket that sends them, never by an
// address: connects of the kubelet's cgroup in the node's namespace reach the
// application while its proxy is down; the same node address used by any other
// process (a masquerading node, another host-network process), the kubelet's
// cgroup in another namespace, and a SYN forged from the node's address with a
// raw socket are captured, and fail closed. a stands for the node here.
func TestKubeletProbes(t *testing.T) {
	d, a, b := parallelRig(t)
	c := newNetns(t, "c")
	startApp(t, b, appPort)
	enroll(t, d, b, testSettings())

	kubelet := newCgroup(t, d.cgroup, fmt.Sprintf("mesh-test-kubelet-%d", os.Getpid()))
	other := newCgroup(t, d.cgroup, fmt.Sprintf("mesh-test-host-%d", os.Getpid()))
	if err := d.SetProbeCgroups(a.cookie, []string{kubelet}); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = d.SetProbeCgroups(0, nil) })
	if err := d.SetProbeCgroups(a.cookie, []string{d.cgroup}); err == nil {
		t.Error("the root cgroup was taken as the kubelet's: every process would probe past capture")
	}

	refused := func(got []string) bool { return len(got) == 1 && strings.HasPrefix(got[0], "ERR") }
	for _, dst := range []netip.Addr{b.addr4, b.addr6} {
		target := hostPort(dst, appPort)
		if got := dialFromCgroup(t, kubelet, a, target, 0); len(got) != 1 || got[0] != "APP "+target {
			t.Errorf("kubelet probe to %s: %q, want the application with no proxy running", target, got)
		}
		if got := dialFromCgroup(t, other, a, target, 0); !refused(got) {
			t.Errorf("another node process to %s: %q, want captured (reset, no proxy)", target, got)
		}
		if got := dialFromCgroup(t, kubelet, c, target, 0); !refused(got) {
			t.Errorf("the kubelet's cgroup in another namespace to %s: %q, want captured", target, got)
		}
	}
	for _, fam := range []struct{ src, dst netip.Addr }{{a.addr4, b.addr4}, {a.addr6, b.addr6}} {
		sport := uint16(20000 + rand.IntN(20000))
		flags, ok := rawExchange(t, a, fam.src, fam.dst, sport, appPort, plainSYN(fam.src, fam.dst, sport, appPort))
		if !ok || flags&tcpRST == 0 || flags&tcpSYN != 0 {
			t.Errorf("raw SYN from the node's address %s: reply flags %#x (seen %v), want a reset", fam.src, flags, ok)
		}
	}
	// Every handshake is over: nothing of the kubelet's is left in the map.
	if n := mapLen(t, d.objs.ProbeConns); n != 0 {
		t.Errorf("probe_conns holds %d entries after the probes finished", n)
	}
	if err := d.SetProbeCgroups(0, nil); err != nil {
		t.Fatal(err)
	}
	target := hostPort(b.addr4, appPort)
	if got := dialFromCgroup(t, kubelet, a, target, 0); !refused(got) {
		t.Errorf("kubelet cgroup cleared: %q, want captured", got)
	}
}

// With the pod's probe ports known, the kubelet passes the inbound capture only
// to them: a probe another pod's author aims at this pod (its host field) on
// any other port is captured like any connection, and with no proxy running
// it is reset. An empty list captures all of the kubelet's connections; off,
// the kubelet reaches every port again. Enroll applies each in place.
func TestKubeletProbesOwnPortsOnly(t *testing.T) {
	d, a, b := parallelRig(t)
	const otherPort = appPort + 1
	startApp(t, b, appPort)
	startApp(t, b, otherPort)
	s := testSettings()
	s.KubeletPortsOnly, s.KubeletPorts = true, []uint16{appPort}
	if e := enroll(t, d, b, s); !e.Settings.KubeletPortsOnly || !slices.Equal(e.Settings.KubeletPorts, []uint16{appPort}) {
		t.Fatalf("enrolled with %+v", e.Settings)
	}
	kubelet := newCgroup(t, d.cgroup, fmt.Sprintf("mesh-test-kubelet-ports-%d", os.Getpid()))
	if err := d.SetProbeCgroups(a.cookie, []string{kubelet}); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = d.SetProbeCgroups(0, nil) })

	refused := func(got []string) bool { return len(got) == 1 && strings.HasPrefix(got[0], "ERR") }
	probe := func(dst netip.Addr, port uint16) (string, []string) {
		target := hostPort(dst, port)
		return target, dialFromCgroup(t, kubelet, a, target, 0)
	}
	for _, dst := range []netip.Addr{b.addr4, b.addr6} {
		if target, got := probe(dst, appPort); len(got) != 1 || got[0] != "APP "+target {
			t.Errorf("kubelet to the pod's probe port %s: %q, want the application", target, got)
		}
		if target, got := probe(dst, otherPort); !refused(got) {
			t.Errorf("kubelet to %s, a port no probe of the pod names: %q, want captured (reset, no proxy)", target, got)
		}
	}
	listed, err := d.List(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	for _, e := range listed {
		if e.Cookie == b.cookie && !slices.Equal(e.Settings.KubeletPorts, []uint16{appPort}) {
			t.Errorf("List reads the ports back as %v", e.Settings.KubeletPorts)
		}
	}

	s.KubeletPorts = nil // a pod with no probes
	enroll(t, d, b, s)
	if target, got := probe(b.addr4, appPort); !refused(got) {
		t.Errorf("kubelet to %s of a pod without probes: %q, want captured", target, got)
	}
	s.KubeletPortsOnly = false // a source that does not know the pod's spec
	enroll(t, d, b, s)
	if target, got := probe(b.addr6, otherPort); len(got) != 1 || got[0] != "APP "+target {
		t.Errorf("kubelet to %s with every port open to it: %q, want the application", target, got)
	}
}

// A cgroup's id is its directory's inode, taken as SetProbeCgroups takes the
// path (absolute or below the data path's root): a cgroup removed and made
// again at the same path has a new one, so whoever follows a process by its
// cgroup path must compare ids.
func TestCgroupIDMadeAgain(t *testing.T) {
	t.Parallel()
	requireRoot(t)
	d, _ := testDatapath(t)
	name := fmt.Sprintf("mesh-test-cgroupid-%d", os.Getpid())
	dir := newCgroup(t, d.cgroup, name)
	first, err := d.CgroupID(dir)
	if err != nil {
		t.Fatal(err)
	}
	if rel, err := d.CgroupID("/" + name); err != nil || rel != first {
		t.Errorf("by the path below the root: %d, %v; want %d", rel, err, first)
	}
	if err := os.Remove(dir); err != nil {
		t.Fatal(err)
	}
	if err := os.Mkdir(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	again, err := d.CgroupID(dir)
	if err != nil || again == first {
		t.Errorf("made again: id %d, %v; want a new id (was %d)", again, err, first)
	}
}

// An agent that starts keeps the node proxy's cgroup the agent before it
// pinned, after its own configured ones, until the proxy connects to it and
// the list is replaced: the proxy's connections stay exempt meanwhile.
func TestKeepProxyCgroups(t *testing.T) {
	t.Parallel()
	requireRoot(t)
	d, cfg := testDatapath(t)
	learned := newCgroup(t, d.cgroup, fmt.Sprintf("mesh-test-learned-%d", os.Getpid()))
	configured := newCgroup(t, d.cgroup, fmt.Sprintf("mesh-test-configured-%d", os.Getpid()))
	if err := d.SetProxyCgroups([]string{configured, learned}); err != nil {
		t.Fatal(err)
	}
	ids := func(d *Datapath) []uint64 {
		t.Helper()
		var c redirectNodeConfig
		if err := d.objs.Node.Lookup(uint32(0), &c); err != nil {
			t.Fatal(err)
		}
		var out []uint64
		for _, p := range c.ProxyCgroups[:c.NrProxyCgroups] {
			out = append(out, p.Id)
		}
		return out
	}
	id := func(path string) uint64 {
		t.Helper()
		id, err := d.CgroupID(path)
		if err != nil {
			t.Fatal(err)
		}
		return id
	}
	// The next agent, on the same pins.
	next, err := Open(context.Background(), cfg)
	if err != nil {
		t.Fatal(err)
	}
	defer next.Close()
	if err := next.KeepProxyCgroups([]string{configured}); err != nil {
		t.Fatal(err)
	}
	if got, want := ids(next), []uint64{id(configured), id(learned)}; !slices.Equal(got, want) {
		t.Errorf("proxy cgroups after the start %v, want the configured one, then the learned one kept %v", got, want)
	}
	// Kept once only, however often the agent starts.
	if err := next.KeepProxyCgroups([]string{configured}); err != nil {
		t.Fatal(err)
	}
	if got := ids(next); len(got) != 2 {
		t.Errorf("proxy cgroups after a second start %v, want two", got)
	}
	// The proxy connected: its report replaces the list.
	if err := next.SetProxyCgroups([]string{configured}); err != nil {
		t.Fatal(err)
	}
	if got, want := ids(next), []uint64{id(configured)}; !slices.Equal(got, want) {
		t.Errorf("proxy cgroups after the proxy's report %v, want %v", got, want)
	}
}
