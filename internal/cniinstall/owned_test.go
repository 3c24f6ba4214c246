package cniinstall

import (
	"context"
	"errors"
	"math/rand/v2"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/containernetworking/cni/libcni"
)

func TestOwnedNameBefore(t *testing.T) {
	c := Config{OwnedName: DefaultOwnedName}
	for first, want := range map[string]string{
		"":                     "00-mesh-cni.conflist",
		"10-bridge.conflist":   "00-mesh-cni.conflist",
		"00-multus.conf":       "00-mesh-cni.conflist",
		"00-mesh.conflist":     "00-mesh-cni.conflist",
		"00-calico.conflist":   "00-0-mesh-cni.conflist",
		"0-a.conflist":         "0-0-mesh-cni.conflist",
		"00-0-x.conflist":      "00-0-0-mesh-cni.conflist",
		"0.conf":               "0.0-mesh-cni.conflist",
		"!first.json":          "!0-mesh-cni.conflist",
		"00-mesh-cni.conflist": "00-0-mesh-cni.conflist", // not ours: no entry
	} {
		got := c.ownedNameBefore(first)
		if got != want {
			t.Errorf("ownedNameBefore(%q) = %q, want %q", first, got, want)
		}
		if first != "" && got >= first {
			t.Errorf("ownedNameBefore(%q) = %q does not sort first", first, got)
		}
	}
	// Property: any name a config file can have.
	const alphabet = " !#+,-.0123456789=@ABCZ_abcz~"
	exts := []string{".conf", ".conflist", ".json"}
	r := rand.New(rand.NewPCG(1, 2))
	for range 10000 {
		b := make([]byte, r.IntN(8))
		for i := range b {
			b[i] = alphabet[r.IntN(len(alphabet))]
		}
		first := string(b) + exts[r.IntN(len(exts))]
		got := c.ownedNameBefore(first)
		if got >= first || !c.isOwned(got) || strings.Contains(got, "/") {
			t.Fatalf("ownedNameBefore(%q) = %q", first, got)
		}
	}
}

func TestOwnedInstall(t *testing.T) {
	ctx := context.Background()
	dir := copyCase(t, "bridge-conflist")
	before := snapshot(t, dir)
	stateDir := t.TempDir()
	in := newInstaller(t, Config{ConfDir: dir, Mode: ModeOwned, StateDir: stateDir})
	if changed, err := in.Install(ctx); err != nil || !changed {
		t.Fatalf("Install = %v, %v", changed, err)
	}
	owned := filepath.Join(dir, "00-mesh-cni.conflist")
	got := readFile(t, owned)
	// The same merge as chain mode, in another file.
	golden(t, "bridge-conflist", got)
	checkMerged(t, "10-bridge.conflist", []byte(before["10-bridge.conflist"].data), got)
	if name, _, err := runtimePick(dir); err != nil || name != "00-mesh-cni.conflist" {
		t.Errorf("runtime picks %q (%v)", name, err)
	}
	if st := in.Status(); !st.Ready || st.File != "00-mesh-cni.conflist" || st.Primary != "10-bridge.conflist" {
		t.Errorf("status %+v", st)
	}
	now := snapshot(t, dir)
	if now["10-bridge.conflist"] != before["10-bridge.conflist"] {
		t.Error("primary touched in owned mode")
	}
	ino := inode(t, owned)
	restarted := restartUnchanged(t, ctx, Config{ConfDir: dir, Mode: ModeOwned, StateDir: stateDir}, owned, ino)
	if err := restarted.Remove(ctx); err != nil {
		t.Fatal(err)
	}
	diffSnapshots(t, snapshot(t, dir), before)
}

// A primary whose name sorts before "00-mesh-cni.conflist" gets an owned
// name computed to sort before it.
func TestOwnedNameSortsFirst(t *testing.T) {
	dir := t.TempDir()
	writeFile(t, filepath.Join(dir, "00-calico.conflist"), []byte(`{"cniVersion":"0.3.1","name":"k8s","plugins":[{"type":"calico"}]}`))
	in := newInstaller(t, Config{ConfDir: dir, Mode: ModeOwned})
	if _, err := in.Install(context.Background()); err != nil {
		t.Fatal(err)
	}
	name, list, err := runtimePick(dir)
	if err != nil || name != "00-0-mesh-cni.conflist" || list.Plugins[len(list.Plugins)-1].Network.Type != "mesh-cni" {
		t.Errorf("runtime picks %q (%v)", name, err)
	}
}

// Plugins a conflist loads from <confdir>/<network>/ are inlined into the
// owned copy, which then runs the same chain with mesh-cni last.
func TestOwnedInlinesPluginFiles(t *testing.T) {
	dir := t.TempDir()
	if err := os.Mkdir(filepath.Join(dir, "filenet"), 0o755); err != nil {
		t.Fatal(err)
	}
	writeFile(t, filepath.Join(dir, "10-net.conflist"), []byte(`{"cniVersion":"1.1.0","name":"filenet","plugins":[{"type":"bridge"}]}`))
	writeFile(t, filepath.Join(dir, "filenet", "10-a.conf"), []byte(`{"type":"portmap","capabilities":{"portMappings":true}}`))
	writeFile(t, filepath.Join(dir, "filenet", "20-b.conf"), []byte(`{"type":"tuning"}`))
	in := newInstaller(t, Config{ConfDir: dir, Mode: ModeOwned})
	if _, err := in.Install(context.Background()); err != nil {
		t.Fatal(err)
	}
	list, err := libcni.ConfListFromFile(filepath.Join(dir, "00-mesh-cni.conflist"))
	if err != nil {
		t.Fatal(err)
	}
	var types []string
	for _, p := range list.Plugins {
		types = append(types, p.Network.Type)
	}
	if strings.Join(types, ",") != "bridge,portmap,tuning,mesh-cni" {
		t.Errorf("owned chain = %v", types)
	}
}

// Switching modes with the same state directory moves the entry and leaves
// nothing behind: the primary gets its original bytes back.
func TestModeSwitch(t *testing.T) {
	ctx := context.Background()
	dir := copyCase(t, "single-conf")
	before := snapshot(t, dir)
	stateDir := t.TempDir()

	chain := newInstaller(t, Config{ConfDir: dir, StateDir: stateDir})
	if _, err := chain.Install(ctx); err != nil {
		t.Fatal(err)
	}
	owned := newInstaller(t, Config{ConfDir: dir, Mode: ModeOwned, StateDir: stateDir})
	if _, err := owned.Install(ctx); err != nil {
		t.Fatal(err)
	}
	now := snapshot(t, dir)
	if now["10-bridge.conf"] != before["10-bridge.conf"] {
		t.Error("the primary's .conf is not back")
	}
	if _, ok := now["10-bridge.conflist"]; ok {
		t.Error("the converted .conflist is still there")
	}
	checkMerged(t, "10-bridge.conf", []byte(before["10-bridge.conf"].data), []byte(now["00-mesh-cni.conflist"].data))

	chain = newInstaller(t, Config{ConfDir: dir, StateDir: stateDir})
	if _, err := chain.Install(ctx); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(filepath.Join(dir, "00-mesh-cni.conflist")); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("owned config left in chain mode: %v", err)
	}
	if name, _, _ := runtimePick(dir); name != "10-bridge.conflist" || !hasEntryLast(filepath.Join(dir, name)) {
		t.Errorf("runtime picks %q", name)
	}
	if err := chain.Remove(ctx); err != nil {
		t.Fatal(err)
	}
	diffSnapshots(t, snapshot(t, dir), before)
}

// Run keeps the owned copy in sync with the primary and its name first.
func TestOwnedFollowsPrimary(t *testing.T) {
	dir := copyCase(t, "bridge-conflist")
	primary := filepath.Join(dir, "10-bridge.conflist")
	in := newInstaller(t, Config{ConfDir: dir, Mode: ModeOwned, StateDir: t.TempDir()})
	startRun(t, in)

	// The primary changes its config: the owned copy follows.
	edited := strings.Replace(string(readFile(t, primary)), `"cni0"`, `"cni7"`, 1)
	writeAtomic(t, primary, []byte(edited))
	waitFor(t, in, "owned copy updated", func(s Status) bool {
		return s.Ready && strings.Contains(string(readFile(t, filepath.Join(dir, s.File))), `"cni7"`)
	})
	if got := string(readFile(t, primary)); got != edited {
		t.Error("primary touched")
	}

	// A new config sorting before the owned file: the owned file moves in
	// front of it and follows it (it is now the first, so the primary).
	writeAtomic(t, filepath.Join(dir, "0-a.conflist"), []byte(`{"cniVersion":"1.0.0","name":"a","plugins":[{"type":"ptp"}]}`))
	st := waitFor(t, in, "owned config moved", func(s Status) bool {
		return s.Ready && s.File == "0-0-mesh-cni.conflist" && s.Primary == "0-a.conflist"
	})
	if name, list, err := runtimePick(dir); err != nil || name != st.File || list.Name != "a" {
		t.Errorf("runtime picks %q (%v)", name, err)
	}
	if _, err := os.Stat(filepath.Join(dir, "00-mesh-cni.conflist")); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("old owned config left: %v", err)
	}

	// Every primary gone: the owned copy goes too (no ghost network).
	for _, n := range []string{"0-a.conflist", "10-bridge.conflist"} {
		if err := os.Remove(filepath.Join(dir, n)); err != nil {
			t.Fatal(err)
		}
	}
	waitFor(t, in, "owned config removed", func(s Status) bool {
		_, err := os.Stat(filepath.Join(dir, "0-0-mesh-cni.conflist"))
		return !s.Ready && errors.Is(err, os.ErrNotExist)
	})
	noTempFiles(t, dir)
}
