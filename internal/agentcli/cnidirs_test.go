package agentcli

import (
	"context"
	"io"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"go.uber.org/zap"

	"github.com/mesh-cni/mesh-cni/internal/agent"
	"github.com/mesh-cni/mesh-cni/internal/hostproc/hostproctest"
)

// The k3s layout: its containerd's config and CNI directories.
const (
	k3sContainerdConfig = "/var/lib/rancher/k3s/agent/etc/containerd/config.toml"
	k3sBinDir           = "/var/lib/rancher/k3s/data/cni"
	k3sConfDir          = "/var/lib/rancher/k3s/agent/etc/cni/net.d"
	bridgeConflist      = `{"cniVersion": "1.0.0", "name": "pods", "plugins": [{"type": "bridge", "bridge": "cni0"}]}`
)

// k3sHost is a node whose runtime is k3s' containerd, its primary CNI
// config in place, and the default layout's directories, which a DaemonSet
// rendered without a platform mounts, empty.
func k3sHost(t *testing.T) *hostproctest.Node {
	t.Helper()
	n := hostproctest.New(t)
	n.Files(n.Root, map[string]string{
		k3sContainerdConfig:                      "version = 3\n[plugins.'io.containerd.cri.v1.runtime'.cni]\n  bin_dir = '" + k3sBinDir + "'\n  conf_dir = '" + k3sConfDir + "'\n",
		k3sConfDir + "/10-flannel.conflist":      bridgeConflist,
		k3sBinDir + "/bridge":                    "",
		"/etc/cni/net.d/":                        "",
		"/opt/cni/bin/":                          "",
		"/var/run/mesh-cni/install/":             "",
		"/usr/local/bin/mesh-cni":                "the plugin",
		"/var/lib/rancher/k3s/agent/containerd/": "",
	})
	n.Process(4242, "containerd", []string{"containerd", "-c", k3sContainerdConfig}, n.Root, n.Netns, "0::/system.slice/k3s.service\n")
	return n
}

// agentOptions parses args as `mesh-agent run` does, on node n: the agent's
// mounts of the default layout are n's /opt/cni/bin and /etc/cni/net.d (the
// flags' defaults, not set), unless args name others.
func agentOptions(t *testing.T, n *hostproctest.Node, args ...string) options {
	t.Helper()
	var opts options
	fs := flagSet("mesh-agent run", &opts, io.Discard)
	if err := parseFlags(fs, args, func(string) (string, bool) { return "", false }); err != nil {
		t.Fatal(err)
	}
	opts.markExplicit(fs)
	if !opts.explicit["cni-bin-dir"] {
		opts.cniBinDirs = stringList{n.Mount("/opt/cni/bin")}
	}
	if !opts.explicit["cni-conf-dir"] {
		opts.cniConfDir = n.Mount("/etc/cni/net.d")
	}
	opts.procRoot = n.Proc
	opts.installStateDir = n.Mount("/var/run/mesh-cni/install")
	opts.pluginBinary = n.Mount("/usr/local/bin/mesh-cni")
	opts.reconcileInterval = 50 * time.Millisecond
	opts.placed = &cniPlaced{}
	return opts
}

// The CNI directories are the operator's only when named on the command
// line or in the environment: the DaemonSet's defaults are not.
func TestCNIDirsNamed(t *testing.T) {
	for _, tc := range []struct {
		args      []string
		env       map[string]string
		bin, conf bool
	}{
		{},
		{args: []string{"--cni-conf-dir=/etc/cni/net.d"}, conf: true},
		{args: []string{"--cni-bin-dir", "/opt/cni/bin"}, bin: true},
		{env: map[string]string{EnvName("cni-bin-dir"): "/x", EnvName("cni-conf-dir"): "/y"}, bin: true, conf: true},
	} {
		var opts options
		fs := flagSet("mesh-agent run", &opts, io.Discard)
		lookup := func(k string) (string, bool) { v, ok := tc.env[k]; return v, ok }
		if err := parseFlags(fs, tc.args, lookup); err != nil {
			t.Fatal(err)
		}
		opts.markExplicit(fs)
		if w := opts.cniWant(); w.ExplicitBin != tc.bin || w.ExplicitConf != tc.conf || w.Check {
			t.Errorf("args %q env %v: %+v, want named bin %v conf %v", tc.args, tc.env, w, tc.bin, tc.conf)
		}
	}
}

// installTill runs the agent's CNI installer on opts until its report says
// done, and returns the reports.
func installTill(t *testing.T, opts options, done func(agent.CNIStatus) bool) []agent.CNIStatus {
	t.Helper()
	run, err := newCNIInstaller(opts, zap.NewNop())
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(t.Context())
	var mu sync.Mutex
	var reports []agent.CNIStatus
	finished := make(chan error, 1)
	go func() {
		finished <- run(ctx, func(st agent.CNIStatus) {
			mu.Lock()
			defer mu.Unlock()
			reports = append(reports, st)
			if done(st) {
				cancel()
			}
		})
	}()
	select {
	case err := <-finished:
		if err != nil {
			t.Fatal(err)
		}
	case <-time.After(20 * time.Second):
		cancel()
		<-finished
		t.Fatalf("the installer never reported done: %+v", reports)
	}
	cancel()
	mu.Lock()
	defer mu.Unlock()
	return reports
}

// On k3s, with the DaemonSet rendered without a platform (the default
// layout's directories mounted), the agent installs the plugin and the entry
// where k3s' containerd loads them, through the host's root, and none into
// its mounts; the uninstall removes them from there.
func TestInstallIntoRuntimeDirs(t *testing.T) {
	n := k3sHost(t)
	opts := agentOptions(t, n)
	reports := installTill(t, opts, func(st agent.CNIStatus) bool { return st.InPlace })
	last := reports[len(reports)-1]
	if !strings.Contains(last.Dirs, "(host root)") || !strings.Contains(last.Dirs, k3sConfDir) {
		t.Errorf("the status says the directories are %q", last.Dirs)
	}
	if data, err := os.ReadFile(n.Mount(k3sBinDir + "/mesh-cni")); err != nil || string(data) != "the plugin" {
		t.Errorf("the plugin in k3s' bin dir: %q, %v", data, err)
	}
	entries, err := os.ReadDir(n.Mount(k3sConfDir))
	if err != nil {
		t.Fatal(err)
	}
	var chained bool
	for _, e := range entries {
		data, err := os.ReadFile(n.Mount(filepath.Join(k3sConfDir, e.Name())))
		if err == nil && e.Name() < "10-flannel.conflist" && strings.Contains(string(data), `"mesh-cni"`) {
			chained = true
		}
	}
	if !chained {
		t.Errorf("no config chaining mesh-cni sorts before k3s' primary in %s: %v", k3sConfDir, entries)
	}
	for _, d := range []string{"/opt/cni/bin", "/etc/cni/net.d"} {
		if entries, _ := os.ReadDir(n.Mount(d)); len(entries) != 0 {
			t.Errorf("the agent wrote into its mount %s, which k3s does not read: %v", d, entries)
		}
	}

	// A later agent's uninstall (the Job's: nothing held) finds the same
	// directories; one installed by an agent that did not look for the
	// runtime (the default layout's) is removed too.
	if err := os.WriteFile(n.Mount("/opt/cni/bin/mesh-cni"), []byte("an earlier build"), 0o755); err != nil {
		t.Fatal(err)
	}
	opts.placed = nil
	if err := uninstallNode(t.Context(), withDatapath(opts, "none", filepath.Join(t.TempDir(), "gate.sock")), zap.NewNop()); err != nil {
		t.Fatal(err)
	}
	for _, p := range []string{k3sBinDir + "/mesh-cni", "/opt/cni/bin/mesh-cni"} {
		if _, err := os.Stat(n.Mount(p)); err == nil {
			t.Errorf("%s is still there after the uninstall", p)
		}
	}
	entries, _ = os.ReadDir(n.Mount(k3sConfDir))
	if len(entries) != 1 || entries[0].Name() != "10-flannel.conflist" {
		t.Errorf("after the uninstall k3s' conf dir holds %v, want its primary alone", entries)
	}
	if data, _ := os.ReadFile(n.Mount(k3sConfDir + "/10-flannel.conflist")); string(data) != bridgeConflist {
		t.Errorf("k3s' primary config changed: %s", data)
	}
}

func withDatapath(o options, datapath, socket string) options {
	o.datapath, o.socketPath = datapath, socket
	return o
}

// Named directories win: the agent installs where the operator said, even
// where the runtime does not load from; with --runtime-cni-check it waits
// instead, saying where the runtime loads from, and installs once the
// directories are the runtime's.
func TestNamedCNIDirs(t *testing.T) {
	t.Run("named", func(t *testing.T) {
		n := k3sHost(t)
		n.Files(n.Root, map[string]string{"/etc/cni/net.d/10-flannel.conflist": bridgeConflist})
		opts := agentOptions(t, n, "--cni-conf-dir="+n.Mount("/etc/cni/net.d"), "--cni-bin-dir="+n.Mount("/opt/cni/bin"))
		reports := installTill(t, opts, func(st agent.CNIStatus) bool { return st.InPlace })
		if d := reports[len(reports)-1].Dirs; !strings.Contains(d, "(flag)") {
			t.Errorf("the status says the directories are %q", d)
		}
		if _, err := os.Stat(n.Mount("/opt/cni/bin/mesh-cni")); err != nil {
			t.Errorf("the plugin is not in the named directory: %v", err)
		}
		if _, err := os.Stat(n.Mount(k3sBinDir + "/mesh-cni")); err == nil {
			t.Error("the plugin went into k3s' directory, not the named one")
		}
	})
	t.Run("checked", func(t *testing.T) {
		n := k3sHost(t)
		opts := agentOptions(t, n, "--runtime-cni-check")
		var once sync.Once
		reports := installTill(t, opts, func(st agent.CNIStatus) bool {
			if strings.Contains(st.Reason, "pods would start without the mesh") {
				// What a platform value does: mount k3s' directories where
				// the agent's flags point.
				once.Do(func() {
					for mount, dir := range map[string]string{"/opt/cni/bin": k3sBinDir, "/etc/cni/net.d": k3sConfDir} {
						if err := os.Remove(n.Mount(mount)); err != nil {
							t.Error(err)
						}
						if err := os.Symlink(n.Mount(dir), n.Mount(mount)); err != nil {
							t.Error(err)
						}
					}
				})
			}
			return st.InPlace
		})
		waited := slices.ContainsFunc(reports, func(st agent.CNIStatus) bool {
			return strings.Contains(st.Reason, "loads CNI plugins from "+k3sBinDir+" and configs from "+k3sConfDir)
		})
		if !waited {
			t.Errorf("the agent did not wait naming k3s' directories: %+v", reports)
		}
		if _, err := os.Stat(n.Mount(k3sBinDir + "/mesh-cni")); err != nil {
			t.Errorf("the plugin is not where k3s loads it once the mounts are k3s': %v", err)
		}
	})
}

// While the runtime's directory does not exist (k3s writes its conf dir with
// its primary config), the agent makes none of it: it stays not ready,
// saying which, and installs once it exists.
func TestWaitsForRuntimeDirs(t *testing.T) {
	n := k3sHost(t)
	if err := os.RemoveAll(n.Mount(k3sConfDir)); err != nil {
		t.Fatal(err)
	}
	opts := agentOptions(t, n)
	var once sync.Once
	reports := installTill(t, opts, func(st agent.CNIStatus) bool {
		if strings.Contains(st.Reason, k3sConfDir+" does not exist") {
			once.Do(func() { n.Files(n.Root, map[string]string{k3sConfDir + "/10-flannel.conflist": bridgeConflist}) })
		}
		return st.InPlace
	})
	if !strings.Contains(reports[0].Reason, "loads CNI configs from "+k3sConfDir+", which the agent cannot reach") || reports[0].InPlace {
		t.Errorf("first report %+v, want not ready naming k3s' conf dir", reports[0])
	}
	if _, err := os.Stat(n.Mount(k3sBinDir + "/mesh-cni")); err != nil {
		t.Errorf("the plugin is not in k3s' bin dir: %v", err)
	}
}
