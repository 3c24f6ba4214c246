package redirect

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/link"
	"go.uber.org/zap/zaptest"

	"github.com/mesh-cni/mesh-cni/internal/netns"
	"github.com/mesh-cni/mesh-cni/test/fixtures"
)

// testdata/tcx-layout.o is the data path's object as an earlier release built it
// (per-interface TCX ingress programs, cookie-keyed CIDR tries, one port list):
// installTCXLayout pins it the way that release did, so Open meets a node that
// runs it.
func installTCXLayout(t *testing.T, cfg Config, cgroup string, pods ...*pod) {
	t.Helper()
	spec, err := ebpf.LoadCollectionSpec("testdata/tcx-layout.o")
	if err != nil {
		t.Fatal(err)
	}
	pins := layout(cfg.PinRoot)
	for _, dir := range []string{pins.maps(), pins.links(), pins.pods()} {
		if err := os.MkdirAll(dir, 0o700); err != nil {
			t.Fatal(err)
		}
	}
	for _, m := range spec.Maps {
		m.Pinning = ebpf.PinByName
	}
	coll, err := ebpf.NewCollectionWithOptions(spec, ebpf.CollectionOptions{Maps: ebpf.MapOptions{PinPath: pins.maps()}})
	if errors.Is(err, ebpf.ErrNotSupported) {
		fixtures.RequireFeature(t, tcxFeature(), fmt.Errorf("the earlier release's objects: %w", err))
	}
	if err != nil {
		t.Fatalf("load the earlier release's objects: %v", err)
	}
	defer coll.Close()
	for _, h := range []struct {
		name, prog string
		attach     ebpf.AttachType
	}{
		{"sockops", "mesh_sockops", ebpf.AttachCGroupSockOps},
		{"getsockopt", "mesh_getsockopt", ebpf.AttachCGroupGetsockopt},
		{"getpeername4", "mesh_getpeername4", ebpf.AttachCgroupInet4GetPeername},
		{"getpeername6", "mesh_getpeername6", ebpf.AttachCgroupInet6GetPeername},
		{"connect4", "mesh_connect4", ebpf.AttachCGroupInet4Connect},
		{"connect6", "mesh_connect6", ebpf.AttachCGroupInet6Connect},
	} {
		l, err := link.AttachCgroup(link.CgroupOptions{Path: cgroup, Attach: h.attach, Program: coll.Programs[h.prog]})
		if err != nil {
			t.Fatal(err)
		}
		if err := l.Pin(filepath.Join(pins.links(), h.name)); err != nil {
			t.Fatal(err)
		}
		l.Close()
	}
	for _, p := range pods {
		v := legacyPodSettings{OutboundPort: 15001, InboundPort: 15006, ProxyMark: testMark, ProxyMarkMask: 0xfff}
		ports := earlierProxyPorts
		v.NrExcludedPorts = uint32(copy(v.ExcludedPorts[:], ports))
		if err := coll.Maps["settings"].Put(p.cookie, v); err != nil {
			t.Fatal(err)
		}
		dir := pins.pod(p.cookie)
		if err := os.MkdirAll(dir, 0o700); err != nil {
			t.Fatal(err)
		}
		p.do(t, func() error {
			iface, err := net.InterfaceByName(ifName)
			if err != nil {
				return err
			}
			l, err := link.AttachTCX(link.TCXOptions{Interface: iface.Index, Program: coll.Programs["mesh_ingress"], Attach: ebpf.AttachTCXIngress})
			if err != nil {
				return err
			}
			defer l.Close()
			return l.Pin(filepath.Join(dir, fmt.Sprintf("tcx_%d_%s", iface.Index, ifName)))
		})
	}
}

// earlierProxyPorts are the inbound exclusions of the earlier releases.
var earlierProxyPorts = []uint16{15001, 15006, 15008, 15020, 15021, 15053, 15090}

// A node running the earlier release (TCX inbound capture) is upgraded: the pinned
// maps are migrated, the cgroup programs switched, each pod re-enrolled onto socket
// lookup, and the earlier per-interface links removed, while a client keeps
// connecting through both proxies the whole time: no connection fails or bypasses
// them.
func TestMigrateFromTCXLayout(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	cgroup, cfg, a, b := migrationRig(t)
	startProxies(t, a, b)
	installTCXLayout(t, cfg, cgroup, a, b)
	target := hostPort(b.addr4, appPort)
	expectLines(t, a, target, dialOpts{}, "OUT "+target, "IN "+target)

	loop := startClientLoop(t, a, target)
	d, err := Open(ctx, cfg)
	if err != nil {
		loop.stop()
		t.Fatalf("open over the earlier layout: %v", err)
	}
	t.Cleanup(func() { d.Close() })
	for _, p := range []*pod{a, b} {
		if err := d.Check(ctx, p.cookie); !errors.Is(err, ErrLinkBroken) {
			t.Errorf("check %s before it is enrolled again: %v, want ErrLinkBroken (earlier links)", p.name, err)
		}
	}
	loop.more(t) // traffic through the switched cgroup programs
	for _, p := range []*pod{a, b} {
		enroll(t, d, p, testSettings())
		if err := d.Check(ctx, p.cookie); err != nil {
			t.Errorf("check %s after it is enrolled again: %v", p.name, err)
		}
		pp, err := readPodPins(d.pins.pod(p.cookie))
		if err != nil || len(pp.legacy) != 0 || pp.lookup == nil {
			t.Errorf("pins of %s after migration: %+v, %v", p.name, pp, err)
		}
	}
	loop.more(t)
	if good, bad := loop.stop(); good == 0 || bad != 0 {
		t.Errorf("during the upgrade %d connections went through both proxies, %d did not", good, bad)
	}
	if _, err := os.Stat(d.pins.legacy()); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("legacy maps still pinned after the migration: %v", err)
	}
}

// An earlier socket-lookup release, as installRelease pins it.
type release struct {
	// object is its data path's object in testdata.
	object string
	// hooks are the cgroup programs it attached, by pin name.
	hooks []string
	// podValue is a pod's settings entry as it wrote it.
	podValue func(*pod) any
	// nodeAddrs: it kept the node's addresses in probe_srcs.
	nodeAddrs bool
	// whole: its pods entries hold everything this build's do, so a pod
	// migrated from it needs no enrolling again.
	whole bool
}

// releaseSkLookupV1 is the first socket-lookup release: a whole decision program
// per pod, pods without a DNS port.
func releaseSkLookupV1() release {
	return release{
		object: "testdata/sklookup-v1.o",
		hooks:  []string{"getsockopt", "getpeername4", "getpeername6", "sockops", "connect4", "connect6"},
		podValue: func(*pod) any {
			return podSettingsV2{OutboundPort: 15001, InboundPort: 15006, ProxyMark: testMark, ProxyMarkMask: 0xfff,
				Flags: uint32(redirectSettingFlagsSETTING_PROXY_MARK | redirectSettingFlagsSETTING_INBOUND_PORTS), InboundPortSet: 1}
		},
	}
}

// releaseSkLookupV2 is the release the manifests pinned before pods' addresses
// and the reply mark: a small per-pod program tail-calling the shared decision,
// DNS capture, the node's addresses as every pod's probe sources.
func releaseSkLookupV2() release {
	return release{
		object: "testdata/sklookup-v2.o",
		hooks: []string{"getsockopt", "getpeername4", "getpeername6", "recvmsg4", "recvmsg6", "sockops",
			"sendmsg4", "sendmsg6", "connect4", "connect6"},
		podValue: func(*pod) any {
			return redirectPodSettings{OutboundPort: 15001, InboundPort: 15006, ProxyMark: testMark, ProxyMarkMask: 0xfff,
				Flags:          redirectSettingFlagsSETTING_PROXY_MARK | redirectSettingFlagsSETTING_INBOUND_PORTS | earlierProbeNode,
				InboundPortSet: 1, DnsPort: 15053}
		},
		nodeAddrs: true,
	}
}

// releaseSkLookupV3 is the layout of the builds after that release which held
// the pod's addresses and reply mark in its pods entry (never a pinned
// release; the release cannot read it), as the last of them built it.
func releaseSkLookupV3() release {
	return release{
		object: spliceLayoutObject,
		hooks: []string{"getsockopt", "getpeername4", "getpeername6", "recvmsg4", "recvmsg6", "sockops",
			"sendmsg4", "sendmsg6", "sock_create", "connect4", "connect6"},
		podValue: func(p *pod) any {
			s := testSettings().normalized()
			n := podAddrs{all: []netip.Addr{p.addr4, p.addr6}, src4: p.addr4, src6: p.addr6}.toBPF(s)
			return podSettingsWithNet{
				redirectPodSettings: s.toBPF(podSets{inPorts: 1}),
				podNetV1: podNetV1{ReplyMark: n.ReplyMark, ReplyMarkMask: n.ReplyMarkMask, ScopeID: n.ScopeId,
					Src4: n.Src4, Src6: n.Src6, NrAddrs: n.NrAddrs, Addrs: n.Addrs},
			}
		},
		whole: true,
	}
}

var hookAttach = map[string]ebpf.AttachType{
	"getsockopt": ebpf.AttachCGroupGetsockopt, "getpeername4": ebpf.AttachCgroupInet4GetPeername,
	"getpeername6": ebpf.AttachCgroupInet6GetPeername, "recvmsg4": ebpf.AttachCGroupUDP4Recvmsg,
	"recvmsg6": ebpf.AttachCGroupUDP6Recvmsg, "sockops": ebpf.AttachCGroupSockOps,
	"sendmsg4": ebpf.AttachCGroupUDP4Sendmsg, "sendmsg6": ebpf.AttachCGroupUDP6Sendmsg,
	"connect4": ebpf.AttachCGroupInet4Connect, "connect6": ebpf.AttachCGroupInet6Connect,
	"sock_create": ebpf.AttachCGroupInetSockCreate,
}

// installRelease pins rel's data path the way that release did, with pods
// enrolled.
func installRelease(t *testing.T, rel release, cfg Config, cgroup string, pods ...*pod) {
	t.Helper()
	pins := layout(cfg.PinRoot)
	for _, dir := range []string{pins.maps(), pins.links(), pins.pods()} {
		if err := os.MkdirAll(dir, 0o700); err != nil {
			t.Fatal(err)
		}
	}
	coll, perPod := loadRelease(t, rel, releaseSpec(t, rel), pins)
	defer coll.Close()
	for _, h := range rel.hooks {
		l, err := link.AttachCgroup(link.CgroupOptions{Path: cgroup, Attach: hookAttach[h], Program: coll.Programs["mesh_"+h]})
		if err != nil {
			t.Fatal(err)
		}
		if err := l.Pin(filepath.Join(pins.links(), h)); err != nil {
			t.Fatal(err)
		}
		l.Close()
	}
	// The release's inbound port and the proxy ports as its one port set.
	if m := coll.Maps["listen_ports"]; m != nil {
		if err := m.Put(uint16(15006), uint8(1)); err != nil {
			t.Fatal(err)
		}
	}
	for _, port := range earlierProxyPorts {
		if err := coll.Maps["excluded_ports"].Put(redirectPortKey{Set: 1, Port: port}, uint8(1)); err != nil {
			t.Fatal(err)
		}
	}
	if rel.nodeAddrs {
		if err := coll.Maps["probe_srcs"].Put(lpmKey(legacyNodeSet, netip.MustParsePrefix("192.0.2.1/32")), uint8(1)); err != nil {
			t.Fatal(err)
		}
	}
	for _, p := range pods {
		attachReleasePod(t, perPod, coll, pins, p)
		if err := coll.Maps["pods"].Put(p.cookie, rel.podValue(p)); err != nil {
			t.Fatal(err)
		}
	}
}

// attachReleasePod attaches a release's per-pod program to p's namespace and
// pins the link where that release did.
func attachReleasePod(t *testing.T, perPod *ebpf.ProgramSpec, coll *ebpf.Collection, pins layout, p *pod) {
	t.Helper()
	prog := releasePodProgram(t, perPod, coll, p.cookie)
	defer prog.Close()
	ns, err := os.Open(p.path)
	if err != nil {
		t.Fatal(err)
	}
	defer ns.Close()
	ino, err := netnsInode(ns)
	if err != nil {
		t.Fatal(err)
	}
	l, err := link.AttachNetNs(int(ns.Fd()), prog)
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	dir := pins.pod(p.cookie)
	if err := os.MkdirAll(dir, 0o700); err != nil {
		t.Fatal(err)
	}
	if err := l.Pin(filepath.Join(dir, lookupPinName(ino))); err != nil {
		t.Fatal(err)
	}
}

// A node running an earlier socket-lookup layout (the first one, pods without a
// DNS port; the one the manifests pin, pods without addresses; the builds
// between, which held the addresses in the pods entries) is upgraded to this
// build under a client loop: the pods are migrated before the cgroup programs
// switch, the earlier per-pod programs keep working until the agent enrolls each
// pod again (Check reports those migrated without their addresses), and no
// connection fails or bypasses a proxy. The last layout's node is also upgraded
// after the pinned release failed to start on it (a rollback those builds could
// not make: the release set their maps aside and refused their pods).
func TestMigrateFromSkLookup(t *testing.T) {
	t.Parallel()
	for name, c := range map[string]struct {
		rel            release
		failedRollback bool
	}{
		"v1": {rel: releaseSkLookupV1()}, "v2": {rel: releaseSkLookupV2()}, "v3": {rel: releaseSkLookupV3()},
		"v3-after-failed-rollback": {rel: releaseSkLookupV3(), failedRollback: true},
	} {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			testMigrateFromSkLookup(t, c.rel, c.failedRollback)
		})
	}
}

func testMigrateFromSkLookup(t *testing.T, rel release, failedRollback bool) {
	ctx := context.Background()
	cgroup, cfg, a, b := migrationRig(t)
	installRelease(t, rel, cfg, cgroup, a, b)
	// The proxies start once the release runs: its sockops collects their listeners.
	startProxies(t, a, b)
	target := hostPort(b.addr4, appPort)
	expectLines(t, a, target, dialOpts{}, "OUT "+target, "IN "+target)

	var loop *clientLoop
	if failedRollback {
		// Left so, the pods' inbound connections pass their proxies (as
		// docs/install.md warns): the release's shared sk_lookup program, now
		// every pod's, finds none of them in its own pods map. Traffic is
		// counted from the upgrade on.
		failedReleaseStart(t, releaseSkLookupV2(), cfg)
		lines, _, err := a.fetch(target, dialOpts{timeout: 2 * time.Second})
		if slices.Contains(lines, "IN "+target) {
			t.Errorf("after the release's failed start b's inbound proxy still takes a's connection (%q, %v): docs/install.md says it does not", joinLines(lines), err)
		}
	} else {
		loop = startClientLoop(t, a, target)
	}
	d, err := Open(ctx, cfg)
	if err != nil {
		if loop != nil {
			loop.stop()
		}
		t.Fatalf("open over the release's layout: %v", err)
	}
	t.Cleanup(func() { d.Close() })
	if failedRollback {
		loop = startClientLoop(t, a, target)
	}
	loop.more(t) // traffic through the switched cgroup programs
	list, err := d.List(ctx)
	if err != nil || len(list) != 2 {
		t.Errorf("after open: %d pods (%v), want both migrated", len(list), err)
	}
	for _, e := range list {
		if rel.whole && len(e.Addresses) != 2 {
			t.Errorf("pod %d migrated with addresses %v, want its two", e.Cookie, e.Addresses)
		}
	}
	for _, p := range []*pod{a, b} {
		switch err := d.Check(ctx, p.cookie); {
		case rel.whole && err != nil:
			t.Errorf("check %s after the migration: %v, want it intact", p.name, err)
		case !rel.whole && err == nil:
			t.Errorf("check %s after the migration: intact, want it reported for enrolling again", p.name)
		}
		enroll(t, d, p, testSettings())
		if err := d.Check(ctx, p.cookie); err != nil {
			t.Errorf("check %s after it is enrolled again: %v", p.name, err)
		}
	}
	loop.more(t)
	if good, bad := loop.stop(); good == 0 || bad != 0 {
		t.Errorf("during the upgrade %d connections went through both proxies, %d did not", good, bad)
	}
	if n := mapLen(t, d.objs.ProbeSrcs); n != 0 {
		t.Errorf("probe_srcs holds %d entries after the migration: the release's node addresses stayed", n)
	}
}

func netnsInode(f *os.File) (uint64, error) { return netns.InodeFd(int(f.Fd())) }

func releaseSpec(t *testing.T, rel release) *ebpf.CollectionSpec {
	t.Helper()
	spec, err := ebpf.LoadCollectionSpec(rel.object)
	if err != nil {
		t.Fatal(err)
	}
	return spec
}

// loadRelease loads rel's programs that it loaded with its maps (its hooks'
// and the shared sk_lookup one; those of optional features, loaded apart, are
// left out) on the maps pinned under pins, pinning the missing ones, and puts
// the shared sk_lookup program in place, as that release's start did. It
// returns the collection, for the caller to close, and the per-pod program.
func loadRelease(t *testing.T, rel release, spec *ebpf.CollectionSpec, pins layout) (*ebpf.Collection, *ebpf.ProgramSpec) {
	t.Helper()
	perPod := spec.Programs["mesh_lookup"]
	for name := range spec.Programs {
		if name != "mesh_lookup_main" && !slices.Contains(rel.hooks, strings.TrimPrefix(name, "mesh_")) {
			delete(spec.Programs, name)
		}
	}
	for _, m := range spec.Maps {
		m.Pinning = ebpf.PinByName
	}
	coll, err := ebpf.NewCollectionWithOptions(spec, ebpf.CollectionOptions{Maps: ebpf.MapOptions{PinPath: pins.maps()}})
	if err != nil {
		t.Fatalf("load the release's objects on the pinned maps: %v", err)
	}
	if main := coll.Programs["mesh_lookup_main"]; main != nil {
		if err := coll.Maps["lookup_main"].Update(uint32(0), main, ebpf.UpdateAny); err != nil {
			coll.Close()
			t.Fatal(err)
		}
	}
	return coll, perPod
}

// migrationRig is what a migration test starts from: the cgroup to attach to,
// a Config pinning in a bpffs of its own, and two pods.
func migrationRig(t *testing.T) (cgroup string, cfg Config, a, b *pod) {
	t.Helper()
	requireRoot(t)
	cgroup, err := findCgroup2()
	if err != nil {
		t.Fatal(err)
	}
	cfg = pinnedConfig(t)
	a, b = newPodPair(t)
	return cgroup, cfg, a, b
}

// pinnedConfig is a Config whose PinRoot is a bpffs of its own in a temporary
// directory, with nothing pinned yet, uninstalled when the test ends.
func pinnedConfig(t *testing.T) Config {
	t.Helper()
	cfg := Config{PinRoot: filepath.Join(t.TempDir(), "bpf"), Logger: zaptest.NewLogger(t)}
	var undo undoStack
	if err := ensurePinRoot(cfg.PinRoot, cfg.Logger, &undo); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := Uninstall(context.Background(), cfg); err != nil {
			t.Errorf("uninstall: %v", err)
		}
	})
	return cfg
}

// clientLoop has a connect to target, one after the other, each to be answered
// by its outbound proxy and target's inbound proxy ("OUT target", "IN
// target"), until stop, which returns how many were (good) and how many were
// not (bad; the first is logged).
type clientLoop struct {
	done, good, bad atomic.Int64
	stop            func() (good, bad int64)
}

func startClientLoop(t *testing.T, a *pod, target string) *clientLoop {
	var (
		l     clientLoop
		quit  atomic.Bool
		wg    sync.WaitGroup
		first sync.Once
	)
	wg.Go(func() {
		for !quit.Load() {
			lines, _, err := a.fetch(target, dialOpts{timeout: 2 * time.Second})
			if err != nil || len(lines) != 2 || lines[0] != "OUT "+target || lines[1] != "IN "+target {
				l.bad.Add(1)
				first.Do(func() { t.Logf("a connection not through both proxies: %q, %v", joinLines(lines), err) })
			} else {
				l.good.Add(1)
			}
			l.done.Add(1)
		}
	})
	var once sync.Once
	l.stop = func() (int64, int64) {
		once.Do(func() {
			quit.Store(true)
			wg.Wait()
		})
		return l.good.Load(), l.bad.Load()
	}
	t.Cleanup(func() { l.stop() })
	return &l
}

// loopConns is how many connections clientLoop.more waits for: enough that
// a phase of an upgrade is crossed by traffic, not only bracketed by it.
const loopConns = 5

// more waits until the loop has made loopConns more connections, whatever
// their outcome (stop counts that), so the phase the test is in has carried
// traffic.
func (l *clientLoop) more(t *testing.T) {
	t.Helper()
	from := l.done.Load()
	fixtures.WaitFor(t, 30*time.Second, fmt.Sprintf("%d more connections of the client loop", loopConns), func() bool {
		return l.done.Load() >= from+loopConns
	})
}

// releasePodProgram loads a release's per-pod sk_lookup program (perPod) for
// the pod with this cookie, built in as the release's loader does, on the maps
// of coll. The caller closes it.
func releasePodProgram(t *testing.T, perPod *ebpf.ProgramSpec, coll *ebpf.Collection, cookie uint64) *ebpf.Program {
	t.Helper()
	ps := perPod.Copy()
	for i := range ps.Instructions {
		ins := &ps.Instructions[i]
		if ref := ins.Reference(); ref != "" && ins.IsLoadFromMap() {
			if err := ins.AssociateMap(coll.Maps[ref]); err != nil {
				t.Fatal(err)
			}
		}
		if ins.OpCode.IsDWordLoad() && ins.Src == 0 && uint64(ins.Constant) == podCookieMarker {
			ins.Constant = int64(cookie)
		}
	}
	prog, err := ebpf.NewProgram(ps)
	if err != nil {
		t.Fatalf("load the release's per-pod program: %v", err)
	}
	return prog
}
