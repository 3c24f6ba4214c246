package redirect

import (
	"context"
	"errors"
	"fmt"
	"net/netip"
	"os"
	"path/filepath"
	"reflect"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/link"
	"go.uber.org/zap/zaptest"
	"golang.org/x/sys/unix"

	"github.com/mesh-cni/mesh-cni/test/fixtures"
)

// lookupLinkID is the ID of the pod's pinned sk_lookup link.
func lookupLinkID(t *testing.T, d *Datapath, cookie uint64) link.ID {
	t.Helper()
	return lookupLinkInfo(t, d, cookie).ID
}

// lookupLinkInfo is the info of the pod's pinned sk_lookup link, which must be
// its only link.
func lookupLinkInfo(t *testing.T, d *Datapath, cookie uint64) *link.Info {
	t.Helper()
	pp, err := readPodPins(d.pins.pod(cookie))
	if err != nil {
		t.Fatal(err)
	}
	if pp.lookup == nil || len(pp.legacy) != 0 {
		t.Fatalf("pod pins %+v, want exactly one lookup link", pp)
	}
	l, err := link.LoadPinnedLink(pp.lookup.path, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	info, err := l.Info()
	if err != nil {
		t.Fatal(err)
	}
	return info
}

func TestEnrollIdempotentAndUpdate(t *testing.T) {
	t.Parallel()
	requireRoot(t)
	ctx := context.Background()
	d, _ := testDatapath(t)
	a, _ := newPodPair(t)

	s := testSettings()
	s.ExcludedCIDRs = []netip.Prefix{netip.MustParsePrefix("10.0.0.0/8"), netip.MustParsePrefix("fd00::/8")}
	first := enroll(t, d, a, s)
	id := lookupLinkID(t, d, a.cookie)
	if first.Cookie != a.cookie || first.NetnsInode == 0 {
		t.Fatalf("enrollment %+v", first)
	}

	again := enroll(t, d, a, s)
	if !reflect.DeepEqual(first, again) {
		t.Errorf("second enroll:\n%+v\nwant\n%+v", again, first)
	}
	if got := lookupLinkID(t, d, a.cookie); got != id {
		t.Errorf("second enroll replaced the link: %v, was %v", got, id)
	}

	// New settings replace the old, lists included; the old lists leave the maps.
	s2 := testSettings()
	s2.FailOpen = true
	s2.ExcludedCIDRs = []netip.Prefix{netip.MustParsePrefix("192.168.0.0/16")}
	s2.OutboundExcludedPorts = []uint16{22}
	updated := enroll(t, d, a, s2)
	list, err := d.List(ctx)
	if err != nil {
		t.Fatal(err)
	}
	want := []Enrollment{{Cookie: a.cookie, NetnsInode: first.NetnsInode, Settings: s2.normalized(), Addresses: first.Addresses}}
	if !slices.Contains(first.Addresses, a.addr4) || !slices.Contains(first.Addresses, a.addr6) {
		t.Errorf("enrolled with addresses %v, want %s and %s among them", first.Addresses, a.addr4, a.addr6)
	}
	if !reflect.DeepEqual(list, want) || !reflect.DeepEqual(updated, want[0]) {
		t.Errorf("after update: list %+v, enroll %+v, want %+v", list, updated, want[0])
	}
	if n := mapLen(t, d.objs.ExcludedDsts); n != 1 {
		t.Errorf("excluded_dsts holds %d entries, want only the new prefix", n)
	}
	if got := lookupLinkID(t, d, a.cookie); got != id {
		t.Errorf("a settings update replaced the link: %v, was %v", got, id)
	}
}

// Pods with the same lists share one copy of them: the maps' size bounds the number
// of distinct lists, not of pods (a node's pods usually all have the same).
func TestPodsShareLists(t *testing.T) {
	t.Parallel()
	requireRoot(t)
	ctx := context.Background()
	d, _ := testDatapath(t)
	s := testSettings()
	for i := range MaxCIDRs {
		s.ExcludedCIDRs = append(s.ExcludedCIDRs, netip.PrefixFrom(netip.AddrFrom4([4]byte{10, byte(i), 0, 0}), 16))
	}
	s.ProbeSources = []netip.Prefix{netip.MustParsePrefix("192.168.1.1/32")}
	var pods []*pod
	for range 80 {
		pods = append(pods, newNetns(t, "p"))
	}
	for _, p := range pods {
		enroll(t, d, p, s)
	}
	if n := mapLen(t, d.objs.ExcludedDsts); n != MaxCIDRs {
		t.Errorf("excluded_dsts holds %d entries for 80 pods with one list of %d", n, MaxCIDRs)
	}
	if n := mapLen(t, d.objs.ExcludedPorts); n != len(s.InboundExcludedPorts) {
		t.Errorf("excluded_ports holds %d entries for 80 pods with one list of %d", n, len(s.InboundExcludedPorts))
	}
	for _, p := range pods {
		if err := d.Release(ctx, p.cookie); err != nil {
			t.Fatal(err)
		}
	}
	for name, m := range map[string]*ebpf.Map{"excluded_dsts": d.objs.ExcludedDsts, "probe_srcs": d.objs.ProbeSrcs, "excluded_ports": d.objs.ExcludedPorts} {
		if n := mapLen(t, m); n != 0 {
			t.Errorf("%s holds %d entries after every pod was released", name, n)
		}
	}
}

func mapLen(t *testing.T, m *ebpf.Map) int {
	t.Helper()
	n := 0
	it := m.Iterate()
	k := make([]byte, m.KeySize())
	v := make([]byte, m.ValueSize())
	for it.Next(&k, &v) {
		n++
	}
	if err := it.Err(); err != nil {
		t.Fatal(err)
	}
	return n
}

func TestEnrollRefusesBadTargets(t *testing.T) {
	t.Parallel()
	requireRoot(t)
	ctx := context.Background()
	d, _ := testDatapath(t)
	a, _ := newPodPair(t)

	for name, target := range map[string]Target{
		"not a netns":       {NetnsPath: t.TempDir(), Settings: testSettings()},
		"missing netns":     {NetnsPath: filepath.Join(t.TempDir(), "gone"), Settings: testSettings()},
		"invalid settings":  {NetnsPath: a.path},
		"a mount namespace": {NetnsPath: "/proc/self/ns/mnt", Settings: testSettings()},
		// Enrolling the node's namespace would redirect every connect on the node.
		"the agent's own netns": {NetnsPath: ownNetnsPath(t), Settings: testSettings()},
	} {
		_, err := d.Enroll(ctx, target)
		if err == nil {
			t.Errorf("%s: enroll succeeded", name)
		}
		if strings.HasPrefix(name, "the ") {
			if !errors.Is(err, ErrNodeNamespace) {
				t.Errorf("%s: %v, want ErrNodeNamespace", name, err)
			}
		}
	}
	if list, err := d.List(ctx); err != nil || len(list) != 0 {
		t.Errorf("list %+v, %v; want empty", list, err)
	}
	if entries, err := os.ReadDir(d.pins.pods()); err != nil || len(entries) != 0 {
		t.Errorf("pod pins left after refused enrollments: %v (%v)", entries, err)
	}
}

// Two data paths on one host, each with its own bpffs: both attach at the cgroup
// root and each redirects only its own pods.
func TestTwoDatapaths(t *testing.T) {
	t.Parallel()
	requireRoot(t)
	d1, _ := testDatapath(t)
	d2, _ := testDatapath(t)
	a, b := newPodPair(t)
	startProxies(t, a, b)
	enroll(t, d1, a, testSettings())
	enroll(t, d2, b, testSettings())

	for _, target := range []string{hostPort(b.addr4, appPort), hostPort(b.addr6, appPort)} {
		expectLines(t, a, target, dialOpts{}, "OUT "+target, "IN "+target)
	}
	c1, err := d1.Counters()
	if err != nil {
		t.Fatal(err)
	}
	c2, err := d2.Counters()
	if err != nil {
		t.Fatal(err)
	}
	if c1.Outbound.Redirected != 2 || c1.Inbound.Redirected != 0 || c2.Outbound.Redirected != 0 || c2.Inbound.Redirected != 2 {
		t.Errorf("each data path should count its own pod only: d1 %+v, d2 %+v", c1, c2)
	}
}

func TestUninstall(t *testing.T) {
	t.Parallel()
	requireRoot(t)
	ctx := context.Background()

	t.Run("nothing there", func(t *testing.T) {
		if err := Uninstall(ctx, Config{PinRoot: filepath.Join(t.TempDir(), "none")}); err != nil {
			t.Fatal(err)
		}
	})

	t.Run("inside a shared bpffs", func(t *testing.T) {
		shared := filepath.Join(t.TempDir(), "bpffs")
		if err := os.Mkdir(shared, 0o700); err != nil {
			t.Fatal(err)
		}
		if err := unix.Mount("bpf", shared, "bpf", 0, ""); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() {
			if err := unix.Unmount(shared, 0); err != nil {
				t.Errorf("unmount: %v", err)
			}
		})
		cfg := Config{PinRoot: filepath.Join(shared, "mesh-cni"), Logger: zaptest.NewLogger(t)}
		d, err := Open(ctx, cfg)
		if err != nil {
			t.Fatal(err)
		}
		a := newNetns(t, "a")
		enroll(t, d, a, testSettings())
		if err := d.Close(); err != nil {
			t.Fatal(err)
		}
		if err := Uninstall(ctx, cfg); err != nil {
			t.Fatal(err)
		}
		if _, err := os.Stat(cfg.PinRoot); !errors.Is(err, os.ErrNotExist) {
			t.Errorf("pin root still there: %v", err)
		}
		if onBPFFS, err := isBPFFS(shared); err != nil || !onBPFFS {
			t.Errorf("the shared bpffs was unmounted (%v)", err)
		}
		// A second uninstall finds nothing to do.
		if err := Uninstall(ctx, cfg); err != nil {
			t.Errorf("second uninstall: %v", err)
		}
	})
}

// ownNetns is this process's network namespace, opened before any test runs.
// /proc/self/ns/net is the main thread's, which internal/netns may have moved into a pod
// namespace by the time a test runs (a goroutine that creates a namespace never
// unlocks its thread, and the main thread is never discarded).
var ownNetns, ownNetnsErr = os.Open("/proc/thread-self/ns/net")

func ownNetnsPath(t *testing.T) string {
	t.Helper()
	if ownNetnsErr != nil {
		t.Fatal(ownNetnsErr)
	}
	return fmt.Sprintf("/proc/%d/fd/%d", os.Getpid(), ownNetns.Fd())
}

// TestUninstallAnswersRedirected: a connection the connect hook sent to the
// proxy's port just before the uninstall, which the proxy accepts only once
// the redirecting programs are gone, still gets its original destination.
func TestUninstallAnswersRedirected(t *testing.T) {
	t.Parallel()
	requireRoot(t)
	d, cfg := testDatapath(t)
	a, b := newPodPair(t)
	s := testSettings()
	enroll(t, d, a, s)
	ln := a.listen(t, fmt.Sprintf("[::]:%d", s.OutboundPort))
	want := netip.AddrPortFrom(b.addr4, 8080)
	conn, err := a.dial(want.String(), dialOpts{})
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()

	// A grace longer than any wait here, so the check does not race it; the
	// cancel below ends it, and the uninstall must still finish.
	cfg.UninstallGrace = time.Hour
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	done := make(chan error, 1)
	go func() { done <- Uninstall(ctx, cfg) }()
	fixtures.WaitFor(t, 10*time.Second, "the connect hooks detached", func() bool {
		_, err := os.Stat(filepath.Join(layout(cfg.PinRoot).links(), "connect4"))
		return errors.Is(err, os.ErrNotExist)
	})
	accepted, err := ln.Accept()
	if err != nil {
		t.Fatal(err)
	}
	defer accepted.Close()
	if got, err := originalDst(accepted); err != nil || got != want {
		t.Errorf("original destination after the connect hooks went: %v (%v), want %v", got, err, want)
	}
	cancel()
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(cfg.PinRoot); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("the pin root is still there after an uninstall whose wait was cut short: %v", err)
	}
}
