package cniinstall

import (
	"context"
	"encoding/json"
	"errors"
	"flag"
	"os"
	"path/filepath"
	"sort"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/containernetworking/cni/libcni"
	"go.uber.org/zap/zaptest"

	"github.com/mesh-cni/mesh-cni/internal/atomicfile"
	"github.com/mesh-cni/mesh-cni/internal/cniinstall/cniconf"
	"github.com/mesh-cni/mesh-cni/test/fixtures"
)

var update = flag.Bool("update", false, "rewrite the golden files under testdata/golden")

// waitBound is how long a test waits for something that should happen within
// about a second. Generous: the machine is shared and tests run in parallel.
const waitBound = 30 * time.Second

// meshEntry is the entry the agent passes (its fields are the agent's choice).
type meshEntry struct {
	Type              string   `json:"type"`
	SocketPath        string   `json:"socketPath"`
	GateTimeout       string   `json:"gateTimeout"`
	ExcludeNamespaces []string `json:"excludeNamespaces"`
	LogLevel          string   `json:"logLevel"`
}

func testEntry() meshEntry {
	return meshEntry{
		Type:              "mesh-cni",
		SocketPath:        "/var/run/mesh-cni/gate.sock",
		GateTimeout:       "30s",
		ExcludeNamespaces: []string{"kube-system"},
		LogLevel:          "info",
	}
}

func newInstaller(t *testing.T, cfg Config) *Installer {
	t.Helper()
	if cfg.Entry == nil {
		cfg.Entry = testEntry()
	}
	if cfg.Logger == nil {
		cfg.Logger = zaptest.NewLogger(t)
	}
	in, err := New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	return in
}

// startRun runs in.Run until the test ends and checks that it returned nil;
// it returns the status once the first install is done, where every test
// starts from.
func startRun(t *testing.T, in *Installer) Status {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	var wg sync.WaitGroup
	var runErr error
	wg.Add(1)
	go func() {
		defer wg.Done()
		runErr = in.Run(ctx)
	}()
	t.Cleanup(func() {
		cancel()
		wg.Wait()
		if runErr != nil {
			t.Errorf("Run: %v", runErr)
		}
	})
	return waitFor(t, in, "first install", func(s Status) bool { return s.Ready })
}

// waitFor waits for the installer's status to satisfy cond, woken by status
// changes; it fails only when that does not happen within waitBound.
func waitFor(t *testing.T, in *Installer, what string, cond func(Status) bool) Status {
	t.Helper()
	deadline := time.After(waitBound)
	for {
		ch := in.Changed()
		if st := in.Status(); cond(st) {
			return st
		}
		select {
		case <-ch:
		case <-deadline:
			t.Fatalf("timed out waiting for %s; status %+v", what, in.Status())
		}
	}
}

// restartUnchanged is a new installer for cfg, as after the agent's restart:
// its Install must change nothing, the file at path keeping inode ino.
func restartUnchanged(t *testing.T, ctx context.Context, cfg Config, path string, ino uint64) *Installer {
	t.Helper()
	in := newInstaller(t, cfg)
	if changed, err := in.Install(ctx); err != nil || changed {
		t.Errorf("Install after restart = %v, %v", changed, err)
	}
	if inode(t, path) != ino {
		t.Errorf("%s rewritten after restart", path)
	}
	return in
}

// copyCase copies testdata/cases/<name> into a fresh directory.
func copyCase(t *testing.T, name string) string {
	t.Helper()
	dir := t.TempDir()
	for file, data := range fixtures.ReadFiles(t, filepath.Join("testdata", "cases", name)) {
		writeFile(t, filepath.Join(dir, file), data)
	}
	return dir
}

func writeFile(t *testing.T, path string, data []byte) {
	t.Helper()
	if err := os.WriteFile(path, data, 0o644); err != nil {
		t.Fatal(err)
	}
}

// writeAtomic replaces a file the careful way, as well-behaved agents do.
func writeAtomic(t *testing.T, path string, data []byte) {
	t.Helper()
	tmp := filepath.Join(filepath.Dir(path), "writer-"+filepath.Base(path)+".tmp")
	if err := os.WriteFile(tmp, data, 0o644); err != nil {
		t.Fatal(err)
	}
	if err := os.Rename(tmp, path); err != nil {
		t.Fatal(err)
	}
}

func readFile(t *testing.T, path string) []byte {
	t.Helper()
	data, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	return data
}

// snapshot is the content and mode of every file in a directory.
type fileState struct {
	data string
	mode os.FileMode
}

func snapshot(t *testing.T, dir string) map[string]fileState {
	t.Helper()
	ents, err := os.ReadDir(dir)
	if err != nil {
		t.Fatal(err)
	}
	m := map[string]fileState{}
	for _, e := range ents {
		if e.IsDir() {
			continue
		}
		fi, err := os.Lstat(filepath.Join(dir, e.Name()))
		if err != nil {
			t.Fatal(err)
		}
		m[e.Name()] = fileState{data: string(readFile(t, filepath.Join(dir, e.Name()))), mode: fi.Mode()}
	}
	return m
}

func diffSnapshots(t *testing.T, got, want map[string]fileState) {
	t.Helper()
	for n, w := range want {
		g, ok := got[n]
		switch {
		case !ok:
			t.Errorf("%s is gone", n)
		case g.data != w.data:
			t.Errorf("%s changed:\n%s\nwant:\n%s", n, g.data, w.data)
		case g.mode != w.mode:
			t.Errorf("%s mode %v, want %v", n, g.mode, w.mode)
		}
	}
	for n := range got {
		if _, ok := want[n]; !ok {
			t.Errorf("unexpected file %s", n)
		}
	}
}

// inode returns the inode number of path and keeps the file open until the
// test ends, so the number cannot be reused by a later file: a different
// number afterwards means the file was replaced.
func inode(t *testing.T, path string) uint64 {
	t.Helper()
	f, err := os.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { f.Close() })
	fi, err := f.Stat()
	if err != nil {
		t.Fatal(err)
	}
	return fi.Sys().(*syscall.Stat_t).Ino
}

// runtimePick loads the directory the way containerd and CRI-O do and
// returns the name of the config they use.
func runtimePick(dir string) (string, *libcni.NetworkConfigList, error) {
	files, err := libcni.ConfFiles(dir, []string{".conf", ".conflist", ".json"})
	if err != nil {
		return "", nil, err
	}
	sort.Strings(files)
	for _, f := range files {
		var list *libcni.NetworkConfigList
		if strings.HasSuffix(f, ".conflist") {
			list, err = libcni.ConfListFromFile(f)
		} else {
			//lint:ignore SA1019 what runtimes call for .conf files
			conf, cerr := libcni.ConfFromFile(f)
			if err = cerr; err == nil {
				//lint:ignore SA1019 what runtimes call for .conf files
				list, err = libcni.ConfListFromConf(conf)
			}
		}
		if err == nil {
			return filepath.Base(f), list, nil
		}
	}
	return "", nil, errors.New("no valid CNI config")
}

// checkMerged checks a merged config list against the primary it came from:
// libcni accepts it, every plugin of the primary (other than old mesh-cni
// entries) is there unchanged and in order, the top level keeps its values,
// and the entry is there exactly once, last.
func checkMerged(t *testing.T, primaryName string, primary, merged []byte) {
	t.Helper()
	nc, err := libcni.ConfListFromBytes(merged)
	if err != nil {
		t.Fatalf("libcni rejects the merged config: %v\n%s", err, merged)
	}
	orig, err := cniconf.Parse(cniconf.KindOf(primaryName), primary)
	if err != nil {
		t.Fatal(err)
	}
	got, err := cniconf.ParseList(merged)
	if err != nil {
		t.Fatal(err)
	}
	if nc.Name != orig.Name || nc.CNIVersion != orig.CNIVersion {
		t.Errorf("name/version %q %q, want %q %q", nc.Name, nc.CNIVersion, orig.Name, orig.CNIVersion)
	}
	var want []json.RawMessage
	for _, p := range orig.Plugins {
		if cniconf.PluginType(p) != "mesh-cni" {
			want = append(want, p)
		}
	}
	if len(got.Plugins) != len(want)+1 {
		t.Fatalf("merged has %d plugins, want %d:\n%s", len(got.Plugins), len(want)+1, merged)
	}
	for i, p := range want {
		if !cniconf.Equal(p, got.Plugins[i]) {
			t.Errorf("plugin %d changed: %s -> %s", i, p, got.Plugins[i])
		}
	}
	types := make([]string, len(nc.Plugins))
	for i, p := range nc.Plugins {
		types[i] = p.Network.Type
	}
	if n := strings.Count(strings.Join(types, ","), "mesh-cni"); n != 1 || types[len(types)-1] != "mesh-cni" {
		t.Errorf("mesh-cni not exactly once and last: %v", types)
	}
	entry, _ := json.Marshal(testEntry())
	if !cniconf.Equal(got.Plugins[len(got.Plugins)-1], entry) {
		t.Errorf("entry = %s, want %s", got.Plugins[len(got.Plugins)-1], entry)
	}
	if cniconf.KindOf(primaryName) == cniconf.KindList {
		var a, b map[string]json.RawMessage
		_ = json.Unmarshal(primary, &a)
		_ = json.Unmarshal(merged, &b)
		for k, v := range a {
			if k != "plugins" && !cniconf.Equal(v, b[k]) {
				t.Errorf("top-level %q changed: %s -> %s", k, v, b[k])
			}
		}
		if len(a) != len(b) {
			t.Errorf("top-level keys: %d -> %d", len(a), len(b))
		}
	}
}

// hasEntryLast reports whether the file holds a config list ending in the entry.
func hasEntryLast(path string) bool {
	data, err := os.ReadFile(path)
	if err != nil {
		return false
	}
	l, err := cniconf.ParseList(data)
	if err != nil {
		return false
	}
	e, err := cniconf.NewEntry(testEntry())
	if err != nil {
		return false
	}
	return l.HasEntryLast(e)
}

func noTempFiles(t *testing.T, dir string) {
	t.Helper()
	ents, err := os.ReadDir(dir)
	if err != nil {
		t.Fatal(err)
	}
	for _, e := range ents {
		if strings.HasPrefix(e.Name(), atomicfile.TempPrefix) {
			t.Errorf("temporary file left behind: %s", e.Name())
		}
	}
}

func golden(t *testing.T, name string, got []byte) {
	t.Helper()
	path := filepath.Join("testdata", "golden", name+".golden")
	if *update {
		if err := os.MkdirAll(filepath.Dir(path), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(path, got, 0o644); err != nil {
			t.Fatal(err)
		}
		return
	}
	want, err := os.ReadFile(path)
	if err != nil {
		t.Fatalf("%v (run with -update to create it)", err)
	}
	if string(got) != string(want) {
		t.Errorf("%s differs from %s (run with -update after checking):\n%s", name, path, got)
	}
}
