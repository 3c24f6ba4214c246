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

	"github.com/mesh-cni/mesh-cni/test/harness"
)

// fakeContainerd runs a process the agent takes for containerd: named so, its
// command line naming a config that puts CNI in binDir and confDir.
func fakeContainerd(t *testing.T, binDir, confDir string) {
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
	harness.StartProcess(t, harness.ProcessOptions{Path: exe, Args: []string{"-c", config, "--log-level", "info"}, Name: "fake-containerd"})
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
	fakeContainerd(t, node.BinDir, elsewhere)

	a := newInstallAgent(t, node, "--runtime-cni-check", "--reconcile-interval=1s")
	a.launch()
	waitCtx, cancel := context.WithTimeout(ctx, 30*time.Second)
	line, err := a.Proc.WaitForLine(waitCtx, "the container runtime loads CNI elsewhere")
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

	fakeContainerd(t, node.BinDir, node.ConfDir)
	if _, err := waitEntry(path, 0, time.Now(), 30*time.Second); err != nil {
		t.Fatal(err)
	}
	if err := harness.WaitForHealthy(ctx, a.Socket); err != nil {
		t.Fatal(err)
	}
}
