package redirect

import (
	"context"
	"errors"
	"net/netip"
	"os"
	"path/filepath"
	"reflect"
	"testing"

	"github.com/cilium/ebpf/link"
	"go.uber.org/zap/zaptest"
	"golang.org/x/sys/unix"
)

func tcxLinkIDs(t *testing.T, d *Datapath, cookie uint64) []link.ID {
	t.Helper()
	pins, err := readPodPins(d.pins.pod(cookie))
	if err != nil {
		t.Fatal(err)
	}
	var ids []link.ID
	for _, p := range pins {
		l, err := link.LoadPinnedLink(p.path, nil)
		if err != nil {
			t.Fatal(err)
		}
		info, err := l.Info()
		l.Close()
		if err != nil {
			t.Fatal(err)
		}
		ids = append(ids, info.ID)
	}
	return ids
}

func TestEnrollIdempotentAndUpdate(t *testing.T) {
	t.Parallel()
	requireRoot(t)
	ctx := context.Background()
	d, _ := testDatapath(t)
	a, _ := newPodPair(t)

	s := DefaultSettings()
	s.ExcludedCIDRs = []netip.Prefix{netip.MustParsePrefix("10.0.0.0/8"), netip.MustParsePrefix("fd00::/8")}
	first := enroll(t, d, a, s, ifName)
	ids := tcxLinkIDs(t, d, a.cookie)
	if first.Cookie != a.cookie || len(first.Interfaces) != 1 || first.Interfaces[0].Name != ifName || first.Interfaces[0].Index == 0 {
		t.Fatalf("enrollment %+v", first)
	}

	again := enroll(t, d, a, s, ifName)
	if !reflect.DeepEqual(first, again) {
		t.Errorf("second enroll:\n%+v\nwant\n%+v", again, first)
	}
	if got := tcxLinkIDs(t, d, a.cookie); !reflect.DeepEqual(got, ids) {
		t.Errorf("second enroll replaced the links: %v, was %v", got, ids)
	}

	// New settings replace the old, CIDRs included; the interface list can shrink.
	s2 := DefaultSettings()
	s2.FailOpen = true
	s2.ExcludedCIDRs = []netip.Prefix{netip.MustParsePrefix("192.168.0.0/16")}
	updated := enroll(t, d, a, s2)
	list, err := d.List(ctx)
	if err != nil {
		t.Fatal(err)
	}
	want := []Enrollment{{Cookie: a.cookie, Settings: s2.normalized()}}
	if !reflect.DeepEqual(list, want) || !reflect.DeepEqual(updated, want[0]) {
		t.Errorf("after update: list %+v, enroll %+v, want %+v", list, updated, want[0])
	}
	excluded, _, err := d.podCIDRs(a.cookie)
	if err != nil || len(excluded) != 1 {
		t.Errorf("trie holds %v (%v), want only the new prefix", excluded, err)
	}
}

func TestEnrollFailureLeavesNothing(t *testing.T) {
	t.Parallel()
	requireRoot(t)
	ctx := context.Background()
	d, _ := testDatapath(t)
	a, _ := newPodPair(t)

	// The second interface does not exist: the first one's link is rolled back.
	_, err := d.Enroll(ctx, Target{NetnsPath: a.path, Interfaces: []string{ifName, "nope0"}, Settings: DefaultSettings()})
	if err == nil {
		t.Fatal("enroll with a missing interface succeeded")
	}
	if err := d.Check(ctx, a.cookie, nil); !errors.Is(err, ErrNotEnrolled) {
		t.Errorf("check after failed enroll: %v", err)
	}
	if _, err := os.Stat(d.pins.pod(a.cookie)); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("pins left after a failed enroll: %v", err)
	}

	for name, target := range map[string]Target{
		"not a netns":      {NetnsPath: t.TempDir(), Settings: DefaultSettings()},
		"missing netns":    {NetnsPath: filepath.Join(t.TempDir(), "gone"), Settings: DefaultSettings()},
		"invalid settings": {NetnsPath: a.path},
		"bad interface":    {NetnsPath: a.path, Interfaces: []string{"../x"}, Settings: DefaultSettings()},
	} {
		if _, err := d.Enroll(ctx, target); err == nil {
			t.Errorf("%s: enroll succeeded", name)
		}
	}
	if list, err := d.List(ctx); err != nil || len(list) != 0 {
		t.Errorf("list %+v, %v; want empty", list, err)
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
	for _, p := range []*pod{a, b} {
		startOutboundProxy(t, p, 15001)
		startInboundProxy(t, p, 15006)
	}
	enroll(t, d1, a, DefaultSettings(), ifName)
	enroll(t, d2, b, DefaultSettings(), ifName)

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
		enroll(t, d, a, DefaultSettings(), "lo")
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
