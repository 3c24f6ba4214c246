package cniinstall

import (
	"context"
	"encoding/json"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/containernetworking/cni/libcni"

	"github.com/mesh-cni/mesh-cni/internal/cniinstall/cniconf"
)

func TestChainInstall(t *testing.T) {
	for _, tc := range []struct {
		name    string
		primary string      // the primary's file
		target  string      // the file carrying the entry afterwards
		mode    os.FileMode // mode given to the primary before installing
		// pristine: the primary has no mesh-cni entry, so Remove gives back
		// its exact bytes.
		pristine bool
	}{
		{name: "bridge-conflist", primary: "10-bridge.conflist", target: "10-bridge.conflist", mode: 0o644, pristine: true},
		{name: "single-conf", primary: "10-bridge.conf", target: "10-bridge.conflist", mode: 0o600, pristine: true},
		{name: "json-conf", primary: "05-ptp.json", target: "05-ptp.conflist", mode: 0o640, pristine: true},
		{name: "portmap-tuning", primary: "10-calico.conflist", target: "10-calico.conflist", mode: 0o640, pristine: true},
		{name: "unknown-fields", primary: "10-vendor.conflist", target: "10-vendor.conflist", mode: 0o644, pristine: true},
		{name: "sorts-oddly", primary: "10-bridge.conflist", target: "10-bridge.conflist", mode: 0o644, pristine: true},
		{name: "invalid-first", primary: "10-bridge.conflist", target: "10-bridge.conflist", mode: 0o644, pristine: true},
		{name: "existing-entry", primary: "10-cilium.conflist", target: "10-cilium.conflist", mode: 0o644},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			ctx := context.Background()
			dir := copyCase(t, tc.name)
			primaryPath := filepath.Join(dir, tc.primary)
			if err := os.Chmod(primaryPath, tc.mode); err != nil {
				t.Fatal(err)
			}
			before := snapshot(t, dir)
			stateDir := t.TempDir()

			in := newInstaller(t, Config{ConfDir: dir, StateDir: stateDir})
			changed, err := in.Install(ctx)
			if err != nil || !changed {
				t.Fatalf("Install = %v, %v", changed, err)
			}
			st := in.Status()
			if !st.Ready || st.File != tc.target || st.Primary != tc.primary {
				t.Errorf("status %+v", st)
			}
			targetPath := filepath.Join(dir, tc.target)
			got := readFile(t, targetPath)
			golden(t, tc.name, got)
			// The network name the runtime passes for pods of that list.
			var list struct{ Name string }
			if err := json.Unmarshal(got, &list); err != nil || list.Name == "" || st.Network != list.Name {
				t.Errorf("status network %q, the list's name %q (%v)", st.Network, list.Name, err)
			}
			checkMerged(t, tc.primary, []byte(before[tc.primary].data), got)

			// The runtime now picks the merged list.
			if name, _, err := runtimePick(dir); err != nil || name != tc.target {
				t.Errorf("runtime picks %q (%v), want %q", name, err, tc.target)
			}
			fi, err := os.Stat(targetPath)
			if err != nil {
				t.Fatal(err)
			}
			if fi.Mode().Perm() != tc.mode {
				t.Errorf("mode %v, want %v", fi.Mode().Perm(), tc.mode)
			}
			after := snapshot(t, dir)
			for n, s := range before {
				if n == tc.primary {
					continue
				}
				if after[n] != s {
					t.Errorf("%s was touched", n)
				}
			}
			if tc.primary != tc.target {
				if _, err := os.Stat(primaryPath); !errors.Is(err, os.ErrNotExist) {
					t.Errorf("%s still there after conversion: %v", tc.primary, err)
				}
			}
			noTempFiles(t, dir)

			// Idempotent: a second pass, and a restarted installer, write
			// nothing.
			ino := inode(t, targetPath)
			if changed, err := in.Install(ctx); err != nil || changed {
				t.Errorf("second Install = %v, %v", changed, err)
			}
			restarted := restartUnchanged(t, ctx, Config{ConfDir: dir, StateDir: stateDir}, targetPath, ino)

			// Remove, from the restarted installer (so through the
			// record), gives back the original directory.
			if err := restarted.Remove(ctx); err != nil {
				t.Fatal(err)
			}
			if restarted.Ready() {
				t.Error("ready after Remove")
			}
			if tc.pristine {
				diffSnapshots(t, snapshot(t, dir), before)
			} else {
				got := readFile(t, targetPath)
				if strings.Contains(string(got), "mesh-cni") {
					t.Errorf("entry left after Remove:\n%s", got)
				}
				if _, err := libcni.ConfListFromBytes(got); err != nil {
					t.Error(err)
				}
			}
			if _, err := os.Stat(filepath.Join(stateDir, stateFileName)); !errors.Is(err, os.ErrNotExist) {
				t.Errorf("record left after Remove: %v", err)
			}
			// A second Remove finds nothing to do.
			snap := snapshot(t, dir)
			if err := restarted.Remove(ctx); err != nil {
				t.Fatal(err)
			}
			diffSnapshots(t, snapshot(t, dir), snap)
		})
	}
}

// Without a state directory Remove restores the bytes within the same
// process, and after a restart takes the entry out (the original bytes are
// gone with the process).
func TestRemoveWithoutStateDir(t *testing.T) {
	ctx := context.Background()
	dir := copyCase(t, "portmap-tuning")
	before := snapshot(t, dir)
	in := newInstaller(t, Config{ConfDir: dir})
	if _, err := in.Install(ctx); err != nil {
		t.Fatal(err)
	}
	if err := in.Remove(ctx); err != nil {
		t.Fatal(err)
	}
	diffSnapshots(t, snapshot(t, dir), before)

	if _, err := in.Install(ctx); err != nil {
		t.Fatal(err)
	}
	fresh := newInstaller(t, Config{ConfDir: dir})
	if err := fresh.Remove(ctx); err != nil {
		t.Fatal(err)
	}
	path := filepath.Join(dir, "10-calico.conflist")
	got := readFile(t, path)
	if strings.Contains(string(got), "mesh-cni") {
		t.Errorf("entry left:\n%s", got)
	}
	if !cniconf.Equal(got, []byte(before["10-calico.conflist"].data)) {
		t.Errorf("reconstructed config differs from the original:\n%s", got)
	}
}

// When the primary rewrote its file after the entry went in, Remove takes the
// entry out and keeps the primary's change.
func TestRemoveKeepsPrimaryChanges(t *testing.T) {
	ctx := context.Background()
	dir := copyCase(t, "bridge-conflist")
	path := filepath.Join(dir, "10-bridge.conflist")
	in := newInstaller(t, Config{ConfDir: dir, StateDir: t.TempDir()})
	if _, err := in.Install(ctx); err != nil {
		t.Fatal(err)
	}
	edited := strings.Replace(string(readFile(t, path)), `"cni0"`, `"cni9"`, 1)
	writeAtomic(t, path, []byte(edited))
	if err := in.Remove(ctx); err != nil {
		t.Fatal(err)
	}
	got := string(readFile(t, path))
	if strings.Contains(got, "mesh-cni") || !strings.Contains(got, `"cni9"`) {
		t.Errorf("after Remove:\n%s", got)
	}
}

func TestExplicitPrimaryFile(t *testing.T) {
	ctx := context.Background()
	dir := t.TempDir()
	writeFile(t, filepath.Join(dir, "05-a.conflist"), []byte(`{"cniVersion":"1.0.0","name":"a","plugins":[{"type":"ptp"}]}`))
	conf := []byte(`{"cniVersion":"1.0.0","name":"b","type":"bridge"}`)
	writeFile(t, filepath.Join(dir, "10-b.conf"), conf)
	before := snapshot(t, dir)
	in := newInstaller(t, Config{ConfDir: dir, PrimaryFile: "10-b.conf", StateDir: t.TempDir()})
	if _, err := in.Install(ctx); err != nil {
		t.Fatal(err)
	}
	if got := readFile(t, filepath.Join(dir, "05-a.conflist")); string(got) != before["05-a.conflist"].data {
		t.Error("05-a.conflist was touched")
	}
	checkMerged(t, "10-b.conf", conf, readFile(t, filepath.Join(dir, "10-b.conflist")))
	// The configured .conf is gone now; its .conflist stands in for it.
	if changed, err := in.Install(ctx); err != nil || changed {
		t.Errorf("second Install = %v, %v", changed, err)
	}
	if err := in.Remove(ctx); err != nil {
		t.Fatal(err)
	}
	diffSnapshots(t, snapshot(t, dir), before)
}

func TestInstallRefuses(t *testing.T) {
	for name, tc := range map[string]struct {
		mode  Mode
		files map[string]string
		link  bool // 10-net.conflist is a symlink to ../real.conflist
		want  string
	}{
		"old cniVersion": {
			files: map[string]string{"10-net.conf": `{"cniVersion":"0.2.0","name":"n","type":"bridge"}`},
			want:  "outside the range",
		},
		"future cniVersion": {
			files: map[string]string{"10-net.conflist": `{"cniVersion":"1.2.0","name":"n","plugins":[{"type":"bridge"}]}`},
			want:  "outside the range",
		},
		"conversion would lose first place": {
			files: map[string]string{
				"10-net.conf":      `{"cniVersion":"1.0.0","name":"n","type":"bridge"}`,
				"10-net.conf.json": `{"cniVersion":"1.0.0","name":"other","type":"ptp"}`,
			},
			want: "would then sort first",
		},
		"conversion target is someone else's": {
			files: map[string]string{
				"10-net.conf":     `{"cniVersion":"1.0.0","name":"n","type":"bridge"}`,
				"10-net.conflist": `{"cniVersion":"1.0.0","name":"other","plugins":[{"type":"ptp"}]}`,
			},
			want: "is not ours",
		},
		"plugins from files": {
			files: map[string]string{
				"10-net.conflist":   `{"cniVersion":"1.1.0","name":"filenet"}`,
				"filenet/10-a.conf": `{"type":"bridge"}`,
			},
			want: "use the owned-config mode",
		},
		"symlinked primary": {
			link: true,
			want: "symbolic link",
		},
	} {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			root := t.TempDir()
			dir := filepath.Join(root, "net.d")
			if err := os.MkdirAll(filepath.Join(dir, "filenet"), 0o755); err != nil {
				t.Fatal(err)
			}
			for n, data := range tc.files {
				writeFile(t, filepath.Join(dir, n), []byte(data))
			}
			if tc.link {
				writeFile(t, filepath.Join(root, "real.conflist"), []byte(`{"cniVersion":"1.0.0","name":"n","plugins":[{"type":"bridge"}]}`))
				if err := os.Symlink("../real.conflist", filepath.Join(dir, "10-net.conflist")); err != nil {
					t.Fatal(err)
				}
			}
			before := snapshot(t, dir)
			in := newInstaller(t, Config{ConfDir: dir, Mode: tc.mode})
			_, err := in.Install(context.Background())
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("Install error %v, want one containing %q", err, tc.want)
			}
			if st := in.Status(); st.Ready || !strings.Contains(st.Reason, tc.want) {
				t.Errorf("status %+v", st)
			}
			diffSnapshots(t, snapshot(t, dir), before)
		})
	}
}

func TestNoPrimary(t *testing.T) {
	dir := t.TempDir()
	writeFile(t, filepath.Join(dir, "00-broken.conflist"), []byte(`{`))
	in := newInstaller(t, Config{ConfDir: dir})
	_, err := in.Install(context.Background())
	if !errors.Is(err, ErrNoPrimary) {
		t.Fatalf("Install = %v, want ErrNoPrimary", err)
	}
	if in.Ready() {
		t.Error("ready without a primary")
	}
}

func TestNewValidates(t *testing.T) {
	for name, cfg := range map[string]Config{
		"no dir":          {Entry: testEntry()},
		"no entry":        {ConfDir: "/x"},
		"entry no type":   {ConfDir: "/x", Entry: map[string]string{"socketPath": "/s"}},
		"primary path":    {ConfDir: "/x", Entry: testEntry(), PrimaryFile: "../10-x.conflist"},
		"primary ext":     {ConfDir: "/x", Entry: testEntry(), PrimaryFile: "10-x.yaml"},
		"primary owned":   {ConfDir: "/x", Entry: testEntry(), PrimaryFile: "00-mesh-cni.conflist"},
		"bad versions":    {ConfDir: "/x", Entry: testEntry(), MinCNIVersion: "1.1.0", MaxCNIVersion: "0.3.0"},
		"unknown mode":    {ConfDir: "/x", Entry: testEntry(), Mode: Mode(7)},
		"owned name path": {ConfDir: "/x", Entry: testEntry(), OwnedName: "a/b"},
	} {
		if _, err := New(cfg); err == nil {
			t.Errorf("%s: New accepted %+v", name, cfg)
		}
	}
}
