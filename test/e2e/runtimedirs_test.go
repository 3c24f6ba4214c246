package e2e

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	healthpb "google.golang.org/grpc/health/grpc_health_v1"

	"github.com/mesh-cni/mesh-cni/test/fixtures"
	"github.com/mesh-cni/mesh-cni/test/harness"
)

// hostNS is a PID namespace with its own /proc, whose PID 1 (a sleep the test
// started: the host's root directory and network namespace, a cgroup outside
// any pod's) stands in for the host's init, as PID 1 does for an agent in the
// host's PID namespace; this machine's own init may be out of the test's
// reach. Its mount namespace lays overlays on /etc and /opt, so that an
// agent that falls back to its default CNI directories writes into the
// test's directory, never the machine's.
type hostNS struct {
	mnt, pid string
}

func newHostNS(t *testing.T) hostNS {
	t.Helper()
	dir := t.TempDir()
	var script strings.Builder
	script.WriteString("set -e\n")
	for _, d := range []string{"/etc", "/opt"} {
		upper, work := filepath.Join(dir, d, "upper"), filepath.Join(dir, d, "work")
		fmt.Fprintf(&script, "mkdir -p %s %s\nmount -t overlay overlay -o lowerdir=%s,upperdir=%s,workdir=%s %s\n", upper, work, d, upper, work, d)
	}
	script.WriteString("echo ready\nexec sleep infinity\n")
	holder := harness.StartProcess(t, harness.ProcessOptions{Name: "host-ns", Path: "unshare", Launcher: true,
		Args: []string{"--mount", "--propagation", "private", "--pid", "--fork", "--mount-proc", "--", "sh", "-c", script.String()}})
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if _, err := holder.WaitForLine(ctx, "ready"); err != nil {
		t.Fatal(err)
	}
	return hostNS{mnt: fmt.Sprintf("/proc/%d/ns/mnt", holder.Pid()), pid: fmt.Sprintf("/proc/%d/ns/pid_for_children", holder.Pid())}
}

// wrapper is the command line that runs a program in the namespaces, and in
// network namespace netns unless empty.
func (h hostNS) wrapper(netns string) []string {
	w := []string{"nsenter", "--mount=" + h.mnt, "--pid=" + h.pid}
	if netns != "" {
		w = append(w, "--net="+netns)
	}
	return append(w, "--")
}

// runAgent has a run the agent (and its uninstall) in the namespaces.
func (h hostNS) runAgent(a *agent) {
	a.Wrapper, a.WrapperLaunches = h.wrapper(""), true
}

// fakeContainerd runs a process the agent takes for containerd in h: named
// so, its command line naming a config that puts CNI in binDir and confDir,
// in network namespace netns ("": the host's).
func (h hostNS) fakeContainerd(t *testing.T, binDir, confDir, netns string) {
	t.Helper()
	dir := t.TempDir()
	config := filepath.Join(dir, "config.toml")
	toml := fmt.Sprintf("version = 3\n[plugins.'io.containerd.cri.v1.runtime'.cni]\n  bin_dirs = [%q]\n  conf_dir = %q\n", binDir, confDir)
	if err := os.WriteFile(config, []byte(toml), 0o644); err != nil {
		t.Fatal(err)
	}
	// A script keeps its own name as the process's while the shell runs it.
	exe := filepath.Join(dir, "containerd")
	if err := os.WriteFile(exe, []byte("#!/bin/sh\nsleep 1000\n"), 0o755); err != nil {
		t.Fatal(err)
	}
	w := h.wrapper(netns)
	harness.StartProcess(t, harness.ProcessOptions{Path: w[0], Args: append(w[1:], exe, "-c", config, "--log-level", "info"), Name: "fake-containerd", Launcher: true})
}

// TestInstallWaitsForRuntimeDirs: with --runtime-cni-check, an agent told to
// install where the node's runtime does not load CNI from (a wrong platform)
// installs nothing and stays not ready, saying which directories the runtime
// uses; once a runtime loads from the agent's, it installs and is ready.
func TestInstallWaitsForRuntimeDirs(t *testing.T) {
	t.Parallel()
	ctx := testContext(t)
	node := installNode(t)
	path := node.WriteConf(t, primaryFile, primaryConflist(t, node, 0))
	elsewhere := t.TempDir()
	h := newHostNS(t)
	h.fakeContainerd(t, node.BinDir, elsewhere, "")

	a := newInstallAgent(t, node, "--runtime-cni-check", "--reconcile-interval=1s", "--datapath=none")
	h.runAgent(a)
	a.launch()
	waitCtx, cancel := context.WithTimeout(ctx, 30*time.Second)
	line, err := a.Proc.WaitForLine(waitCtx, "chain entry not installed")
	cancel()
	if err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{"configs from " + elsewhere, "pods would start without the mesh"} {
		if !strings.Contains(line, want) {
			t.Errorf("the agent's reason %q does not say %q", line, want)
		}
	}
	a.wantHealth(ctx, healthpb.HealthCheckResponse_NOT_SERVING)
	if st, _ := readConf(path); slices.Contains(st.plugins, "mesh-cni") {
		t.Fatal("the chain entry was installed where the runtime does not look")
	}

	h.fakeContainerd(t, node.BinDir, node.ConfDir, "")
	if _, err := waitEntry(path, 0, time.Now(), 30*time.Second); err != nil {
		t.Fatal(err)
	}
	if err := harness.WaitForHealthy(ctx, a.Socket); err != nil {
		t.Fatal(err)
	}
}

// TestInstallIntoRuntimeDirs: an agent given no CNI directories installs the
// plugin and the chain entry where the node's containerd loads them, through
// the host's root, and not where a process named containerd in another
// network namespace (a pod's) says with a config of its own; uninstall finds
// them there and takes them out.
func TestInstallIntoRuntimeDirs(t *testing.T) {
	t.Parallel()
	ctx := testContext(t)
	node := installNode(t)
	path := node.WriteConf(t, primaryFile, primaryConflist(t, node, 0))
	decoy := installNode(t)
	decoyPath := decoy.WriteConf(t, primaryFile, primaryConflist(t, decoy, 0))
	h := newHostNS(t)
	h.fakeContainerd(t, decoy.BinDir, decoy.ConfDir, fixtures.NewNetns(t, filepath.Join(t.TempDir(), "pod")).Path)
	h.fakeContainerd(t, node.BinDir, node.ConfDir, "")

	a := newAgent(t, "--cni-install=true", "--owned-config=false", "--datapath=none",
		"--install-state-dir", filepath.Join(t.TempDir(), "install"), "--plugin-binary", harness.Bins(t).Path("mesh-cni"))
	h.runAgent(a)
	a.launch()
	a.waitReady(ctx)
	if _, err := waitEntry(path, 0, time.Now(), 30*time.Second); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(filepath.Join(node.BinDir, "mesh-cni")); err != nil {
		t.Errorf("the plugin is not in the runtime's bin dir: %v", err)
	}
	if st, _ := readConf(decoyPath); slices.Contains(st.plugins, "mesh-cni") {
		t.Error("the chain entry went where the pod's process named containerd said")
	}
	if _, err := os.Stat(filepath.Join(decoy.BinDir, "mesh-cni")); err == nil {
		t.Error("the plugin went where the pod's process named containerd said")
	}
	waitCtx, cancel := context.WithTimeout(ctx, 10*time.Second)
	line, err := a.Proc.WaitForLine(waitCtx, "CNI directories decided")
	cancel()
	if err != nil || !strings.Contains(line, "(host root)") || !strings.Contains(line, node.ConfDir) {
		t.Errorf("the agent's decision %q (%v) does not say it reaches %s through the host's root", line, err, node.ConfDir)
	}

	a.stop(ctx)
	a.uninstall(ctx)
	if st, _ := readConf(path); slices.Contains(st.plugins, "mesh-cni") {
		t.Error("uninstall left the chain entry in the runtime's conf dir")
	}
	if _, err := os.Stat(filepath.Join(node.BinDir, "mesh-cni")); err == nil {
		t.Error("uninstall left the plugin in the runtime's bin dir")
	}
}
