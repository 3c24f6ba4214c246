package redirect

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/btf"
	"github.com/cilium/ebpf/link"

	"github.com/mesh-cni/mesh-cni/install/kubernetes"
)

// releaseObject is the data path's object of the release the manifests pin
// (kubernetes.ReleaseCommit): releaseSkLookupV2's.
const releaseObject = "testdata/sklookup-v2.o"

// droppedSinceRelease are the release's maps this build no longer has, and
// why a rollback does not need them to hold anything: the release makes them
// again, empty, and fills them at its start.
var droppedSinceRelease = map[string]string{
	"listen_ports": "the release fills it at start with its inbound port (--inbound-port, every pod's)",
}

// The release's object in testdata is the one its commit built: when the pin
// moves, the test below must compare with the new release. It reads the
// repository's history, as test/node does to build the release.
func TestReleaseObjectIsPinned(t *testing.T) {
	if err := exec.Command("git", "rev-parse", "--git-dir").Run(); err != nil {
		t.Skipf("not in a git checkout: %v", err)
	}
	commit := kubernetes.ReleaseCommit
	if err := exec.Command("git", "cat-file", "-e", commit+"^{commit}").Run(); err != nil {
		t.Fatalf("release commit %s is not in this checkout (a shallow clone lacks it: fetch the history): %v", commit, err)
	}
	want, err := os.ReadFile(releaseObject)
	if err != nil {
		t.Fatal(err)
	}
	// The object's path at that commit (packages moved since).
	var tried []string
	for _, path := range []string{"internal/redirect/redirect_bpfel.o", "pkg/redirect/redirect_bpfel.o"} {
		got, err := exec.Command("git", "show", commit+":"+path).Output()
		if err != nil {
			tried = append(tried, path)
			continue
		}
		if !bytes.Equal(got, want) {
			t.Fatalf("%s is not the data path object of the pinned release %s (%s): copy that in", releaseObject, commit, path)
		}
		return
	}
	t.Fatalf("release commit %s has no data path object at %v", commit, tried)
}

// Every map the pinned release has, this build pins with exactly its spec and
// value layout, so that the release, started on this build's pins (a rollback),
// keeps each of them with its entries: it sets aside every pinned map whose
// spec differs from its own, and refuses a pods map it cannot read (the agent
// then restarts until rolled forward). New fields go into new maps, which the
// release does not know and sets aside (docs/design.md, Upgrades).
func TestReleaseReadsThisBuildsMaps(t *testing.T) {
	rel, err := ebpf.LoadCollectionSpec(releaseObject)
	if err != nil {
		t.Fatal(err)
	}
	cur, err := loadRedirect()
	if err != nil {
		t.Fatal(err)
	}
	for name, rm := range rel.Maps {
		if strings.HasPrefix(name, ".") {
			continue // sections of globals, not pinned
		}
		cm := cur.Maps[name]
		if cm == nil {
			if _, ok := droppedSinceRelease[name]; !ok {
				t.Errorf("map %s: the release has it, this build does not: say in droppedSinceRelease why a rollback does not need its entries", name)
			}
			continue
		}
		if got, want := mapShape(cm), mapShape(rm); got != want {
			t.Errorf("map %s changed since the release (%s): %s, the release's %s; a rollback would set it aside with its entries: put new fields into a new map", name, kubernetes.ReleaseCommit, got, want)
			continue
		}
		for _, kv := range []struct {
			what     string
			cur, rel btf.Type
		}{{"key", cm.Key, rm.Key}, {"value", cm.Value, rm.Value}} {
			if kv.cur == nil || kv.rel == nil {
				continue // no BTF (socket storage keys are plain ints)
			}
			var problems []string
			at := btf.UnderlyingType(kv.rel).TypeName()
			if at == "" {
				at = kv.what
			}
			compareLayout(kv.cur, kv.rel, at, &problems)
			for _, p := range problems {
				t.Errorf("map %s %s: %s: the release would read this build's entries differently", name, kv.what, p)
			}
		}
	}
}

func mapShape(m *ebpf.MapSpec) string {
	return fmt.Sprintf("%v key %d value %d entries %d flags %#x", m.Type, m.KeySize, m.ValueSize, m.MaxEntries, m.Flags)
}

// compareLayout appends to problems where cur lays its bytes out unlike rel:
// member names, offsets and sizes, integer sizes, array lengths, recursively
// (a field renamed in place is taken for one that changed meaning). For enums
// (flags), a value the release names must not mean something else here: this
// build may add values (the release ignores the bits it does not know) and
// retire some (never reusing them).
func compareLayout(cur, rel btf.Type, at string, problems *[]string) {
	cur, rel = btf.UnderlyingType(cur), btf.UnderlyingType(rel)
	cs, err1 := btf.Sizeof(cur)
	rs, err2 := btf.Sizeof(rel)
	if err := errors.Join(err1, err2); err != nil {
		*problems = append(*problems, fmt.Sprintf("%s: %v", at, err))
		return
	}
	if cs != rs {
		*problems = append(*problems, fmt.Sprintf("%s: %d bytes, the release's %d", at, cs, rs))
		return
	}
	switch r := rel.(type) {
	case *btf.Struct:
		c, ok := cur.(*btf.Struct)
		if !ok || len(c.Members) != len(r.Members) {
			*problems = append(*problems, fmt.Sprintf("%s: %v, the release's %v", at, cur, rel))
			return
		}
		for i, rm := range r.Members {
			cm := c.Members[i]
			field := at + "." + rm.Name
			if cm.Name != rm.Name || cm.Offset != rm.Offset || cm.BitfieldSize != rm.BitfieldSize {
				*problems = append(*problems, fmt.Sprintf("%s: %s at bit %d, the release's %s at bit %d", field, cm.Name, cm.Offset, rm.Name, rm.Offset))
				continue
			}
			compareLayout(cm.Type, rm.Type, field, problems)
		}
	case *btf.Array:
		c, ok := cur.(*btf.Array)
		if !ok || c.Nelems != r.Nelems {
			*problems = append(*problems, fmt.Sprintf("%s: %v, the release's %v", at, cur, rel))
			return
		}
		compareLayout(c.Type, r.Type, at+"[]", problems)
	case *btf.Enum:
		c, ok := cur.(*btf.Enum)
		if !ok {
			*problems = append(*problems, fmt.Sprintf("%s: %v, the release's enum %s", at, cur, r.Name))
			return
		}
		names := map[uint64]string{}
		for _, v := range c.Values {
			names[v.Value] = v.Name
		}
		for _, v := range r.Values {
			if name, ok := names[v.Value]; ok && name != v.Name {
				*problems = append(*problems, fmt.Sprintf("%s: %#x is %s here, the release's %s", at, v.Value, name, v.Name))
			}
		}
	case *btf.Int:
		c, ok := cur.(*btf.Int)
		if !ok || c.Encoding != r.Encoding {
			*problems = append(*problems, fmt.Sprintf("%s: %v, the release's %v", at, cur, rel))
		}
	default:
		if fmt.Sprintf("%T", cur) != fmt.Sprintf("%T", rel) {
			*problems = append(*problems, fmt.Sprintf("%s: %v, the release's %v", at, cur, rel))
		}
	}
}

// releaseFlags are the pods flags the pinned release knows: bits 0 to 9.
const releaseFlags = 1<<10 - 1

// rollBackToRelease does to the pins under cfg.PinRoot what the pinned release's
// agent does when it starts there (its Open, from its datapath.go): pinned
// maps it does not know are set aside and unpinned, those it knows kept (one
// whose spec differs fails the test: the release would set it aside and lose
// its entries); its programs are loaded on them, its shared sk_lookup program
// put in place, its inbound port put into listen_ports, the pinned cgroup
// links it has switched to its programs and each enrolled pod's sk_lookup link
// to its per-pod program. It returns the release's collection and per-pod
// program, for enrolling pods as it does.
func rollBackToRelease(t *testing.T, rel release, cfg Config) (*ebpf.Collection, *ebpf.ProgramSpec) {
	t.Helper()
	spec := releaseSpec(t, rel)
	pins := layout(cfg.PinRoot)
	unknown, changed := releaseSetsAside(t, spec, pins)
	if len(changed) > 0 {
		t.Fatalf("the release would set aside pinned maps %q with their entries", changed)
	}
	for _, name := range unknown {
		if err := os.Remove(filepath.Join(pins.maps(), name)); err != nil {
			t.Fatal(err)
		}
	}
	coll, perPod := loadRelease(t, rel, spec, pins)
	t.Cleanup(func() { coll.Close() })
	if err := coll.Maps["listen_ports"].Put(uint16(15006), uint8(1)); err != nil {
		t.Fatal(err)
	}
	for _, h := range rel.hooks {
		l, err := link.LoadPinnedLink(filepath.Join(pins.links(), h), nil)
		if err != nil {
			t.Fatal(err)
		}
		err = l.Update(coll.Programs["mesh_"+h])
		l.Close()
		if err != nil {
			t.Fatalf("switch the %s link to the release's program: %v", h, err)
		}
	}
	pods, err := os.ReadDir(pins.pods())
	if err != nil {
		t.Fatal(err)
	}
	for _, e := range pods {
		cookie, ok := parseCookie(e.Name())
		if !ok {
			continue
		}
		var v redirectPodSettings
		if coll.Maps["pods"].Lookup(cookie, &v) != nil {
			continue
		}
		pp, err := readPodPins(pins.pod(cookie))
		if err != nil || pp.lookup == nil {
			t.Fatalf("pins of pod %d: %+v, %v", cookie, pp, err)
		}
		l, err := link.LoadPinnedLink(pp.lookup.path, nil)
		if err != nil {
			t.Fatal(err)
		}
		prog := releasePodProgram(t, perPod, coll, cookie)
		err = l.Update(prog)
		prog.Close()
		l.Close()
		if err != nil {
			t.Fatalf("switch pod %d's link to the release's program: %v", cookie, err)
		}
	}
	return coll, perPod
}

// releaseSetsAside lists the maps pinned under pins that a release whose
// objects are spec sets aside when it starts: those it does not know, and those
// whose spec differs from its own.
func releaseSetsAside(t *testing.T, spec *ebpf.CollectionSpec, pins layout) (unknown, changed []string) {
	t.Helper()
	entries, err := os.ReadDir(pins.maps())
	if err != nil {
		t.Fatal(err)
	}
	for _, e := range entries {
		ms, known := spec.Maps[e.Name()]
		if !known {
			unknown = append(unknown, e.Name())
			continue
		}
		m, err := ebpf.LoadPinnedMap(filepath.Join(pins.maps(), e.Name()), nil)
		if err != nil {
			t.Fatal(err)
		}
		if err := ms.Compatible(m); err != nil {
			t.Logf("pinned map %s: %v", e.Name(), err)
			changed = append(changed, e.Name())
		}
		m.Close()
	}
	return unknown, changed
}

// A node's agent is rolled back from this build to the pinned release and then
// forward again, with pods talking through their proxies the whole time: the
// release's programs keep redirecting the pods this build enrolled, from the
// entries this build wrote (the release does nothing with the flags it does not
// know); pods the release enrolls or releases meanwhile are seen as such by
// this build when it is back, which enrolls every pod again for what the
// release dropped (the pod_net entries: addresses, reply mark). No connection
// of the client loop fails or bypasses a proxy throughout.
func TestRollbackToRelease(t *testing.T) {
	t.Parallel()
	requireRoot(t)
	ctx := context.Background()
	rel := releaseSkLookupV2()
	cfg := pinnedConfig(t)
	// a talks to b through both proxies the whole time; c's and e's outbound
	// proxies answer with the source they see, which says whether the pod's
	// pod_net entry is there (its address) or not (loopback, as the release
	// redirects); e is enrolled by the release, gone released by it.
	a, b := newPodPair(t)
	c, e := newPodPair(t)
	gone := newNetns(t, "gone")
	startProxies(t, a, b)
	for _, p := range []*pod{c, e} {
		startPeerProxy(t, p, 15001)
	}
	peerSaw := func(from, to *pod, src string) {
		t.Helper()
		orig := netip.AddrPortFrom(to.addr4, appPort)
		expectLines(t, from, orig.String(), dialOpts{}, fmt.Sprintf("OUT %s FROM %s <nil>", orig, src))
	}
	const loopback = "127.0.0.1"

	d, err := Open(ctx, cfg)
	if err != nil {
		t.Fatal(err)
	}
	for _, p := range []*pod{a, b, c, gone} {
		enroll(t, d, p, testSettings())
	}
	target := hostPort(b.addr4, appPort)
	expectLines(t, a, target, dialOpts{}, "OUT "+target, "IN "+target)
	peerSaw(c, e, c.addr4.String())

	loop := startClientLoop(t, a, target)

	// Back: this build's agent stops, the release's starts on its pins.
	if err := d.Close(); err != nil {
		t.Fatal(err)
	}
	coll, perPod := rollBackToRelease(t, rel, cfg)
	loop.more(t) // traffic through the release's programs
	peerSaw(c, e, loopback)
	// The release enrolls e with the node's settings, as it writes them
	// (its flags only, the node's addresses as probe sources), and releases gone.
	var v redirectPodSettings
	if err := coll.Maps["pods"].Lookup(c.cookie, &v); err != nil {
		t.Fatal(err)
	}
	v.Flags = v.Flags&releaseFlags | earlierProbeNode
	enrollAsRelease(t, perPod, coll, cfg, e, v)
	if err := coll.Maps["pods"].Delete(gone.cookie); err != nil {
		t.Fatal(err)
	}
	if err := removeLinkDir(layout(cfg.PinRoot).pod(gone.cookie)); err != nil {
		t.Fatal(err)
	}
	peerSaw(e, c, loopback)
	loop.more(t)

	// Forward again: this build's agent starts, finds every pod without the
	// entries the release dropped and enrolls it again (its reconcile at
	// start).
	coll.Close()
	d, err = Open(ctx, cfg)
	if err != nil {
		t.Fatalf("open after the rollback: %v", err)
	}
	t.Cleanup(func() { d.Close() })
	if err := d.Check(ctx, gone.cookie); !errors.Is(err, ErrNotEnrolled) {
		t.Errorf("check the pod the release released: %v, want ErrNotEnrolled", err)
	}
	for _, p := range []*pod{a, b, c, e} {
		if err := d.Check(ctx, p.cookie); !errors.Is(err, ErrLinkBroken) {
			t.Errorf("check %s back from the release: %v, want it reported for enrolling again", p.name, err)
		}
	}
	peerSaw(c, e, loopback) // this build's programs, without c's addresses
	for _, p := range []*pod{a, b, c, e} {
		enroll(t, d, p, testSettings())
		if err := d.Check(ctx, p.cookie); err != nil {
			t.Errorf("check %s enrolled again: %v", p.name, err)
		}
	}
	peerSaw(c, e, c.addr4.String())
	peerSaw(e, c, e.addr4.String())
	list, err := d.List(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if len(list) != 4 {
		t.Errorf("enrolled after the round trip: %+v, want a, b, c and e", list)
	}
	for _, en := range list {
		if len(en.Addresses) == 0 {
			t.Errorf("pod %d has no addresses after it was enrolled again", en.Cookie)
		}
	}
	if n, err := d.podNet(gone.cookie); err != nil || n != nil {
		t.Errorf("pod_net entry of the pod the release released: %+v, %v", n, err)
	}
	loop.more(t)
	good, bad := loop.stop()
	if good == 0 || bad != 0 {
		t.Errorf("through the rollback and forward again %d connections went through both proxies, %d did not", good, bad)
	}
	t.Logf("%d connections through both proxies, %d not", good, bad)
	for _, pin := range []string{filepath.Join(d.pins.maps(), "listen_ports"), d.pins.legacy()} {
		if _, err := os.Stat(pin); !errors.Is(err, os.ErrNotExist) {
			t.Errorf("%s still pinned after the forward start: %v", pin, err)
		}
	}
}

// enrollAsRelease enrolls p as the release does: its per-pod sk_lookup link,
// then its pods entry v.
func enrollAsRelease(t *testing.T, perPod *ebpf.ProgramSpec, coll *ebpf.Collection, cfg Config, p *pod, v redirectPodSettings) {
	t.Helper()
	attachReleasePod(t, perPod, coll, layout(cfg.PinRoot), p)
	if err := coll.Maps["pods"].Put(p.cookie, v); err != nil {
		t.Fatal(err)
	}
}

// failedReleaseStart does what the pinned release's agent does when it starts on
// pins of the builds whose pods entries held the pod's addresses: it moves every
// pinned map it does not know or whose spec differs under legacy/, makes its own
// maps and puts its shared sk_lookup program in place, then stops on the pods
// map it cannot read, unpinning the maps it made.
func failedReleaseStart(t *testing.T, rel release, cfg Config) {
	t.Helper()
	spec := releaseSpec(t, rel)
	pins := layout(cfg.PinRoot)
	unknown, changed := releaseSetsAside(t, spec, pins)
	if err := os.MkdirAll(pins.legacy(), 0o700); err != nil {
		t.Fatal(err)
	}
	for _, name := range append(unknown, changed...) {
		if err := os.Rename(filepath.Join(pins.maps(), name), filepath.Join(pins.legacy(), name)); err != nil {
			t.Fatal(err)
		}
	}
	var made []string
	for name := range spec.Maps {
		if _, err := os.Stat(filepath.Join(pins.maps(), name)); errors.Is(err, os.ErrNotExist) {
			made = append(made, name)
		}
	}
	coll, _ := loadRelease(t, rel, spec, pins)
	coll.Close()
	for _, name := range made {
		if err := os.Remove(filepath.Join(pins.maps(), name)); err != nil && !errors.Is(err, os.ErrNotExist) {
			t.Fatal(err)
		}
	}
}
