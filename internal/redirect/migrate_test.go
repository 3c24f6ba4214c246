package redirect

import (
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/link"
	"go.uber.org/zap/zaptest"

	"github.com/mesh-cni/mesh-cni/internal/netns"
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
		t.Skipf("the earlier release never ran on this kernel: %v", err)
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
		ports := ProxyPorts()
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

// A node running the earlier release (TCX inbound capture) is upgraded: the pinned
// maps are migrated, the cgroup programs switched, each pod re-enrolled onto socket
// lookup, and the earlier per-interface links removed, while a client keeps
// connecting through both proxies the whole time: no connection fails or bypasses
// them.
func TestMigrateFromTCXLayout(t *testing.T) {
	t.Parallel()
	requireRoot(t)
	ctx := context.Background()
	cgroup, err := findCgroup2()
	if err != nil {
		t.Fatal(err)
	}
	cfg := Config{PinRoot: filepath.Join(t.TempDir(), "bpf"), Logger: zaptest.NewLogger(t)}
	if err := os.MkdirAll(cfg.PinRoot, 0o700); err != nil {
		t.Fatal(err)
	}
	var undo undoStack
	if err := ensurePinRoot(cfg.PinRoot, cfg.Logger, &undo); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := Uninstall(ctx, cfg); err != nil {
			t.Errorf("uninstall: %v", err)
		}
	})
	a, b := newPodPair(t)
	for _, p := range []*pod{a, b} {
		startOutboundProxy(t, p, 15001)
		startInboundProxy(t, p, 15006)
	}
	installTCXLayout(t, cfg, cgroup, a, b)
	target := hostPort(b.addr4, appPort)
	expectLines(t, a, target, dialOpts{}, "OUT "+target, "IN "+target)

	var (
		stop          atomic.Bool
		wg            sync.WaitGroup
		good, bad     atomic.Int64
		firstProblems sync.Once
	)
	wg.Go(func() {
		for !stop.Load() {
			lines, _, err := a.fetch(target, dialOpts{timeout: 2 * time.Second})
			if err != nil || len(lines) != 2 || lines[0] != "OUT "+target || lines[1] != "IN "+target {
				bad.Add(1)
				firstProblems.Do(func() { t.Logf("during the upgrade: %q, %v", joinLines(lines), err) })
				continue
			}
			good.Add(1)
		}
	})

	d, err := Open(ctx, cfg)
	if err != nil {
		stop.Store(true)
		wg.Wait()
		t.Fatalf("open over the earlier layout: %v", err)
	}
	t.Cleanup(func() { d.Close() })
	for _, p := range []*pod{a, b} {
		if err := d.Check(ctx, p.cookie); !errors.Is(err, ErrLinkBroken) {
			t.Errorf("check %s before it is enrolled again: %v, want ErrLinkBroken (earlier links)", p.name, err)
		}
	}
	time.Sleep(200 * time.Millisecond) // traffic through the switched cgroup programs
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
	time.Sleep(200 * time.Millisecond)
	stop.Store(true)
	wg.Wait()
	if good.Load() == 0 || bad.Load() != 0 {
		t.Errorf("during the upgrade %d connections went through both proxies, %d did not", good.Load(), bad.Load())
	}
	if _, err := os.Stat(d.pins.legacy()); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("legacy maps still pinned after the migration: %v", err)
	}
}

// testdata/sklookup-v1.o is the data path's object as the first socket-lookup release
// built it (socket-lookup capture with a whole decision program per pod, pods
// without a DNS port). installSkLookupV1 pins it the way that release did.
func installSkLookupV1(t *testing.T, cfg Config, cgroup string, pods ...*pod) {
	t.Helper()
	spec, err := ebpf.LoadCollectionSpec("testdata/sklookup-v1.o")
	if err != nil {
		t.Fatal(err)
	}
	pins := layout(cfg.PinRoot)
	for _, dir := range []string{pins.maps(), pins.links(), pins.pods()} {
		if err := os.MkdirAll(dir, 0o700); err != nil {
			t.Fatal(err)
		}
	}
	perPod := spec.Programs["mesh_lookup"]
	delete(spec.Programs, "mesh_lookup")
	for _, m := range spec.Maps {
		m.Pinning = ebpf.PinByName
	}
	coll, err := ebpf.NewCollectionWithOptions(spec, ebpf.CollectionOptions{Maps: ebpf.MapOptions{PinPath: pins.maps()}})
	if err != nil {
		t.Fatalf("load the release's objects: %v", err)
	}
	defer coll.Close()
	for _, h := range []struct {
		name, prog string
		attach     ebpf.AttachType
	}{
		{"getsockopt", "mesh_getsockopt", ebpf.AttachCGroupGetsockopt},
		{"getpeername4", "mesh_getpeername4", ebpf.AttachCgroupInet4GetPeername},
		{"getpeername6", "mesh_getpeername6", ebpf.AttachCgroupInet6GetPeername},
		{"sockops", "mesh_sockops", ebpf.AttachCGroupSockOps},
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
	// The release's inbound port and the proxy ports as its one port set.
	if err := coll.Maps["listen_ports"].Put(uint16(15006), uint8(1)); err != nil {
		t.Fatal(err)
	}
	for _, port := range ProxyPorts() {
		if err := coll.Maps["excluded_ports"].Put(redirectPortKey{Set: 1, Port: port}, uint8(1)); err != nil {
			t.Fatal(err)
		}
	}
	for _, p := range pods {
		v := podSettingsV2{OutboundPort: 15001, InboundPort: 15006, ProxyMark: testMark, ProxyMarkMask: 0xfff,
			Flags: uint32(redirectSettingFlagsSETTING_PROXY_MARK | redirectSettingFlagsSETTING_INBOUND_PORTS), InboundPortSet: 1}
		if err := coll.Maps["pods"].Put(p.cookie, v); err != nil {
			t.Fatal(err)
		}
		// The release's per-pod program: its whole decision, the cookie built in.
		ps := perPod.Copy()
		for i := range ps.Instructions {
			ins := &ps.Instructions[i]
			if ref := ins.Reference(); ref != "" && ins.IsLoadFromMap() {
				if err := ins.AssociateMap(coll.Maps[ref]); err != nil {
					t.Fatal(err)
				}
			}
			if ins.OpCode.IsDWordLoad() && ins.Src == 0 && uint64(ins.Constant) == podCookieMarker {
				ins.Constant = int64(p.cookie)
			}
		}
		prog, err := ebpf.NewProgram(ps)
		if err != nil {
			t.Fatalf("load the release's per-pod program: %v", err)
		}
		ns, err := os.Open(p.path)
		if err != nil {
			t.Fatal(err)
		}
		ino, err := netnsInode(ns)
		if err != nil {
			t.Fatal(err)
		}
		l, err := link.AttachNetNs(int(ns.Fd()), prog)
		ns.Close()
		prog.Close()
		if err != nil {
			t.Fatal(err)
		}
		dir := pins.pod(p.cookie)
		if err := os.MkdirAll(dir, 0o700); err != nil {
			t.Fatal(err)
		}
		if err := l.Pin(filepath.Join(dir, lookupPinName(ino))); err != nil {
			t.Fatal(err)
		}
		l.Close()
	}
}

// A node running the first socket-lookup release (socket-lookup capture, pods without
// a DNS port) is upgraded to this build under a client loop: the pods are migrated
// before the cgroup programs switch, the release's per-pod programs keep working
// until the agent enrolls each pod again, and no connection fails or bypasses a
// proxy.
func TestMigrateFromSkLookupV1(t *testing.T) {
	t.Parallel()
	requireRoot(t)
	ctx := context.Background()
	cgroup, err := findCgroup2()
	if err != nil {
		t.Fatal(err)
	}
	cfg := Config{PinRoot: filepath.Join(t.TempDir(), "bpf"), Logger: zaptest.NewLogger(t)}
	var undo undoStack
	if err := ensurePinRoot(cfg.PinRoot, cfg.Logger, &undo); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := Uninstall(ctx, cfg); err != nil {
			t.Errorf("uninstall: %v", err)
		}
	})
	a, b := newPodPair(t)
	installSkLookupV1(t, cfg, cgroup, a, b)
	// The proxies start once the release runs: its sockops collects their listeners.
	for _, p := range []*pod{a, b} {
		startOutboundProxy(t, p, 15001)
		startInboundProxy(t, p, 15006)
	}
	target := hostPort(b.addr4, appPort)
	expectLines(t, a, target, dialOpts{}, "OUT "+target, "IN "+target)

	var (
		stop      atomic.Bool
		wg        sync.WaitGroup
		good, bad atomic.Int64
		first     sync.Once
	)
	wg.Go(func() {
		for !stop.Load() {
			lines, _, err := a.fetch(target, dialOpts{timeout: 2 * time.Second})
			if err != nil || len(lines) != 2 || lines[0] != "OUT "+target || lines[1] != "IN "+target {
				bad.Add(1)
				first.Do(func() { t.Logf("during the upgrade: %q, %v", joinLines(lines), err) })
				continue
			}
			good.Add(1)
		}
	})
	d, err := Open(ctx, cfg)
	if err != nil {
		stop.Store(true)
		wg.Wait()
		t.Fatalf("open over the release's layout: %v", err)
	}
	t.Cleanup(func() { d.Close() })
	time.Sleep(200 * time.Millisecond) // traffic through the switched cgroup programs
	list, err := d.List(ctx)
	if err != nil || len(list) != 2 {
		t.Errorf("after open: %d pods (%v), want both migrated", len(list), err)
	}
	for _, p := range []*pod{a, b} {
		enroll(t, d, p, testSettings())
		if err := d.Check(ctx, p.cookie); err != nil {
			t.Errorf("check %s after it is enrolled again: %v", p.name, err)
		}
	}
	time.Sleep(200 * time.Millisecond)
	stop.Store(true)
	wg.Wait()
	if good.Load() == 0 || bad.Load() != 0 {
		t.Errorf("during the upgrade %d connections went through both proxies, %d did not", good.Load(), bad.Load())
	}
}

func netnsInode(f *os.File) (uint64, error) { return netns.InodeFd(int(f.Fd())) }
