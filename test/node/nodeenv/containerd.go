package nodeenv

import (
	"bytes"
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/mesh-cni/mesh-cni/test/harness"
)

// Where containerd keeps its socket on the node: the default, so ctr and
// crictl run on the node find it as on any node.
const (
	ContainerdSocket = "/run/containerd/containerd.sock"
	// ContainerdConfig is containerd's default config path.
	ContainerdConfig = "/etc/containerd/config.toml"
	// SandboxImage is the pause image the CRI starts every pod with (the test
	// imports it; the node has no registry).
	SandboxImage = "mesh-cni.test/pause:dev"
)

// containerdConfig is the node's /etc/containerd/config.toml: the defaults of
// containerd 2.x with the CNI dirs a kubelet node uses, runc from Debian, and
// what this machine needs.
func containerdConfig(bins Binaries, cniBinDir, cniConfDir string) string {
	return fmt.Sprintf(`version = 4
root = '/var/lib/containerd'
state = '/run/containerd'
# Plugins this node has nothing for; each only logs why it cannot load.
disabled_plugins = ['io.containerd.nri.v1.nri', 'io.containerd.snapshotter.v1.btrfs', 'io.containerd.snapshotter.v1.zfs',
  'io.containerd.snapshotter.v1.devmapper', 'io.containerd.snapshotter.v1.blockfile', 'io.containerd.snapshotter.v1.erofs',
  'io.containerd.differ.v1.erofs', 'io.containerd.tracing.processor.v1.otlp', 'io.containerd.internal.v1.tracing']

[plugins]
  [plugins.'io.containerd.server.v1.grpc']
    address = '%s'
  [plugins.'io.containerd.cri.v1.images'.pinned_images]
    sandbox = '%s'
  [plugins.'io.containerd.cri.v1.runtime']
    # Root on this machine has no CAP_SYS_RESOURCE, so no process may lower
    # its oom_score_adj: the CRI's -998 for sandboxes would fail every pod.
    # Restricted, containerd clamps every value at its own.
    restrict_oom_score_adj = true
  [plugins.'io.containerd.cri.v1.runtime'.cni]
    bin_dirs = ['%s']
    conf_dir = '%s'
    max_conf_num = 1
  [plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.runc.options]
    BinaryName = '%s'
    SystemdCgroup = false
`, ContainerdSocket, SandboxImage, cniBinDir, cniConfDir, bins.Runc)
}

// Containerd is containerd running on the node.
type Containerd struct {
	Proc *harness.Process
	m    *Machine
	bins Binaries
}

// startContainerd writes the node's config and starts containerd.
func startContainerd(tb testing.TB, m *Machine, bins Binaries, cniBinDir, cniConfDir string) *Containerd {
	tb.Helper()
	path := m.Path(ContainerdConfig)
	if err := os.MkdirAll(filepath.Dir(path), 0o755); err != nil {
		tb.Fatal(err)
	}
	if err := os.WriteFile(path, []byte(containerdConfig(bins, cniBinDir, cniConfDir)), 0o644); err != nil {
		tb.Fatal(err)
	}
	c := &Containerd{m: m, bins: bins}
	c.Start(tb)
	return c
}

// Start runs containerd (again) and waits until it serves its socket.
func (c *Containerd) Start(tb testing.TB) {
	tb.Helper()
	// The shim is found on PATH, next to containerd.
	c.Proc = c.m.Start(tb, "containerd", "/usr/bin/env", "PATH="+c.bins.Containerd+":/usr/sbin:/usr/bin:/sbin:/bin",
		c.bins.containerd("containerd"), "--log-level", "info")
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	if _, err := c.Proc.WaitForLine(ctx, "containerd successfully booted"); err != nil {
		tb.Fatalf("containerd: %v", err)
	}
}

// Stop ends containerd with SIGTERM, as `systemctl stop containerd` does: the
// shims and the containers keep running.
func (c *Containerd) Stop(ctx context.Context) error {
	return c.Proc.Stop(ctx)
}

// Ctr runs ctr on the node with args and returns its standard output.
func (c *Containerd) Ctr(ctx context.Context, args ...string) (string, error) {
	return c.run(ctx, c.bins.Ctr(), append([]string{"--address", ContainerdSocket}, args...)...)
}

// Crictl runs crictl on the node with args and returns its standard output.
func (c *Containerd) Crictl(ctx context.Context, args ...string) (string, error) {
	return c.run(ctx, c.bins.Crictl(), append([]string{"--runtime-endpoint", "unix://" + ContainerdSocket}, args...)...)
}

func (c *Containerd) run(ctx context.Context, path string, args ...string) (string, error) {
	var stdout, stderr bytes.Buffer
	cmd := c.m.Command(ctx, nil, path, args...)
	cmd.Stdout = &stdout
	cmd.Stderr = &stderr
	if err := cmd.Run(); err != nil {
		return stdout.String(), fmt.Errorf("%s %s: %w\n%s%s", filepath.Base(path), strings.Join(args, " "), err, stdout.String(), stderr.String())
	}
	return stdout.String(), nil
}

// Import loads OCI layout tars into the CRI's image store (namespace k8s.io).
func (c *Containerd) Import(ctx context.Context, tars ...string) error {
	for _, t := range tars {
		if _, err := c.Ctr(ctx, "--namespace", "k8s.io", "images", "import", t); err != nil {
			return err
		}
	}
	return nil
}

// removePods stops and removes every pod sandbox (the runtime calls CNI DEL
// for each), for the node's cleanup while containerd still runs.
func (c *Containerd) removePods(ctx context.Context) error {
	_, err := c.Crictl(ctx, "rmp", "--all", "--force")
	return err
}
