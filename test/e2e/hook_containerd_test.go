package e2e

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/mesh-cni/mesh-cni/test/fixtures"
	"github.com/mesh-cni/mesh-cni/test/harness"
)

// envHookContainerd names a directory holding containerd, its runc shim and
// ctr of a build that loads PodNetworkLifecycle plugins from a directory (the
// fork the hook is written for, or a later containerd that carries its
// loader). No such build is published as a Go module or Debian package, so
// without it TestHookRealContainerd is skipped; the loader double
// (test/containerdhook) plays it everywhere else.
const envHookContainerd = "MESH_CNI_HOOK_CONTAINERD_BIN_DIR"

// realContainerd is containerd with the network-plugin loader, its CRI served
// on a socket of its own, run by crictl.
type realContainerd struct {
	t                 *testing.T
	dir, bins, crictl string
	socket, config    string
	// cgroupParent holds the sandboxes' cgroups (runc makes one per
	// hierarchy), removed in cleanup.
	cgroupParent string
	proc         *harness.Process
}

func startRealContainerd(t *testing.T, ctx context.Context, bins, pluginDir string) *realContainerd {
	t.Helper()
	crictlDir := os.Getenv("MESH_CNI_CONTAINERD_BIN_DIR")
	if crictlDir == "" {
		t.Skip("MESH_CNI_CONTAINERD_BIN_DIR (crictl) is not set")
	}
	dir, err := os.MkdirTemp("", "hookctrd-")
	if err != nil {
		t.Fatal(err)
	}
	c := &realContainerd{t: t, dir: dir, bins: bins, crictl: filepath.Join(crictlDir, "crictl"), socket: filepath.Join(dir, "c.sock"),
		config: filepath.Join(dir, "config.toml"), cgroupParent: "/" + filepath.Base(dir)}
	runc, err := exec.LookPath("runc")
	if err != nil {
		t.Skip("no runc")
	}
	cfg := fmt.Sprintf(`version = 3
root = %q
state = %q
disabled_plugins = ['io.containerd.nri.v1.nri', 'io.containerd.snapshotter.v1.btrfs', 'io.containerd.snapshotter.v1.zfs',
  'io.containerd.snapshotter.v1.devmapper', 'io.containerd.snapshotter.v1.blockfile', 'io.containerd.snapshotter.v1.erofs',
  'io.containerd.differ.v1.erofs', 'io.containerd.tracing.processor.v1.otlp', 'io.containerd.internal.v1.tracing']
[grpc]
  address = %q
[ttrpc]
  address = %q
[plugins.'io.containerd.cri.v1.images'.pinned_images]
  sandbox = 'mesh-cni.test/pause:dev'
[plugins.'io.containerd.cri.v1.runtime']
  restrict_oom_score_adj = true
[plugins.'io.containerd.cri.v1.runtime'.cni]
  disable_cni = true
  grpc_network_plugin_conf_dir = %q
  # Nothing in the chain runs CNI's loopback plugin; the agent's reply route
  # needs the pod's lo up.
  use_internal_loopback = true
[plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.runc.options]
  BinaryName = %q
  SystemdCgroup = false
[plugins.'io.containerd.grpc.v1.cri']
  stream_server_address = '127.0.0.1'
  stream_server_port = '0'
`, filepath.Join(dir, "root"), filepath.Join(dir, "state"), c.socket, c.socket+".ttrpc", pluginDir, runc)
	if err := os.WriteFile(c.config, []byte(cfg), 0o600); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
		defer cancel()
		if c.proc != nil {
			select {
			case <-c.proc.Done():
				c.start(t, ctx) // the pods' shims outlive it: remove them through a containerd
			default:
			}
			if _, err := c.run(ctx, c.crictl, "--runtime-endpoint", "unix://"+c.socket, "rmp", "-a", "-f"); err != nil {
				t.Errorf("remove the pods: %v", err)
			}
			_ = c.proc.Stop(ctx)
		}
		exec.CommandContext(ctx, "umount", "-R", filepath.Join(dir, "root")).Run() //nolint:errcheck // best effort
		os.RemoveAll(dir)
		parents, _ := filepath.Glob(filepath.Join("/sys/fs/cgroup", "*", c.cgroupParent))
		for _, p := range parents {
			if err := os.Remove(p); err != nil {
				t.Errorf("remove the pods' cgroup: %v", err)
			}
		}
	})
	c.start(t, ctx)
	tar := os.Getenv("MESH_CNI_PAUSE_IMAGE")
	if tar == "" {
		tar = buildPause(t, ctx)
	}
	if out, err := c.run(ctx, filepath.Join(bins, "ctr"), "--address", c.socket, "-n", "k8s.io", "images", "import", tar); err != nil {
		t.Fatalf("import the pause image: %v\n%s", err, out)
	}
	return c
}

// buildPause builds the pause image as `make image` does.
func buildPause(t *testing.T, ctx context.Context) string {
	t.Helper()
	dir := t.TempDir()
	root, err := filepath.Abs("../..")
	if err != nil {
		t.Fatal(err)
	}
	build := exec.CommandContext(ctx, "go", "build", "-trimpath", "-o", dir+"/", "./test/cmd/pause")
	build.Dir, build.Env = root, append(os.Environ(), "CGO_ENABLED=0")
	if out, err := build.CombinedOutput(); err != nil {
		t.Fatalf("build pause: %v\n%s", err, out)
	}
	img := exec.CommandContext(ctx, "go", "run", ".", "-out", filepath.Join(dir, "pause.tar"), "-ref", "mesh-cni.test/pause:dev",
		"-entrypoint", "/usr/local/bin/pause", "-add", filepath.Join(dir, "pause")+"=/usr/local/bin/pause")
	img.Dir = filepath.Join(root, "hack", "image")
	if out, err := img.CombinedOutput(); err != nil {
		t.Fatalf("pause image: %v\n%s", err, out)
	}
	return filepath.Join(dir, "pause.tar")
}

// run runs a command and returns its standard output; an error carries its
// standard error.
func (c *realContainerd) run(ctx context.Context, name string, args ...string) (string, error) {
	var stderr strings.Builder
	cmd := exec.CommandContext(ctx, name, args...)
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	if err != nil {
		return string(out), fmt.Errorf("%s %s: %w: %s", filepath.Base(name), strings.Join(args, " "), err, stderr.String())
	}
	return string(out), nil
}

// start runs containerd (again) and waits for its CRI.
func (c *realContainerd) start(t *testing.T, ctx context.Context) {
	t.Helper()
	c.proc = harness.StartProcess(t, harness.ProcessOptions{
		Path: filepath.Join(c.bins, "containerd"), Args: []string{"--config", c.config},
		Env: []string{"PATH=" + c.bins + ":/usr/sbin:/usr/bin:/sbin:/bin"}, Name: "containerd",
	})
	fixtures.WaitFor(t, time.Minute, "containerd's CRI", func() bool {
		_, err := c.info(ctx)
		return err == nil
	})
}

func (c *realContainerd) stop(t *testing.T, ctx context.Context) {
	t.Helper()
	if err := c.proc.Stop(ctx); err != nil {
		t.Fatal(err)
	}
}

// info is crictl info's NetworkReady condition and plugin load status.
type criInfo struct {
	NetworkReady bool
	Message      string
	LoadStatus   string
}

func (c *realContainerd) info(ctx context.Context) (criInfo, error) {
	out, err := exec.CommandContext(ctx, c.crictl, "--runtime-endpoint", "unix://"+c.socket, "info", "-o", "json").Output()
	if err != nil {
		return criInfo{}, err
	}
	var raw struct {
		Status struct {
			Conditions []struct {
				Type    string `json:"type"`
				Status  bool   `json:"status"`
				Message string `json:"message"`
			} `json:"conditions"`
		} `json:"status"`
		LoadStatus string `json:"lastGRPCPluginLoadStatus"`
	}
	if err := json.Unmarshal(out, &raw); err != nil {
		return criInfo{}, fmt.Errorf("crictl info: %w\n%s", err, out)
	}
	inf := criInfo{LoadStatus: raw.LoadStatus}
	for _, cond := range raw.Status.Conditions {
		if cond.Type == "NetworkReady" {
			inf.NetworkReady, inf.Message = cond.Status, cond.Message
		}
	}
	return inf, nil
}

// runPod runs a pod sandbox and returns its id and IP, or crictl's error.
func (c *realContainerd) runPod(t *testing.T, ctx context.Context, namespace, name string) (id, ip string, err error) {
	t.Helper()
	cfg := filepath.Join(c.dir, namespace+"-"+name+".json")
	data := fmt.Sprintf(`{"metadata": {"name": %q, "namespace": %q, "uid": "uid-%s-%s", "attempt": 0}, "log_directory": %q, "linux": {"cgroup_parent": %q}}`,
		name, namespace, namespace, name, c.dir, c.cgroupParent)
	if err := os.WriteFile(cfg, []byte(data), 0o600); err != nil {
		t.Fatal(err)
	}
	callCtx, cancel := context.WithTimeout(ctx, 2*time.Minute)
	defer cancel()
	out, err := c.run(callCtx, c.crictl, "--runtime-endpoint", "unix://"+c.socket, "--timeout", "90s", "runp", cfg)
	if err != nil {
		return "", "", fmt.Errorf("pod %s/%s: %w", namespace, name, err)
	}
	id = strings.TrimSpace(out)
	inspect, err := c.run(ctx, c.crictl, "--runtime-endpoint", "unix://"+c.socket, "inspectp", "-o", "json", id)
	if err != nil {
		t.Fatalf("crictl inspectp %s: %v\n%s", id, err, inspect)
	}
	var st struct {
		Status struct {
			Network struct {
				IP string `json:"ip"`
			} `json:"network"`
		} `json:"status"`
	}
	if err := json.Unmarshal([]byte(inspect), &st); err != nil {
		t.Fatalf("crictl inspectp: %v\n%s", err, inspect)
	}
	return id, st.Status.Network.IP, nil
}

// TestHookRealContainerd runs the cases of TestHookRuntimeRestartWhileAgentDown
// against containerd itself: its loader, its CRI, real sandboxes (crictl
// runp), the primary and the hook registered in its plugin directory. It
// runs where envHookContainerd names such a build.
func TestHookRealContainerd(t *testing.T) {
	bins := os.Getenv(envHookContainerd)
	if bins == "" {
		t.Skipf("%s is not set: no containerd with the network-plugin loader", envHookContainerd)
	}
	ctx := testContext(t)
	e := newHookEnv(t, ctx, nil, []string{"--gate-timeout", "3s"})
	c := startRealContainerd(t, ctx, bins, e.pluginDir)

	inf, err := c.info(ctx)
	if err != nil || !inf.NetworkReady || inf.LoadStatus != "OK" {
		t.Fatalf("containerd with the primary and the hook: %+v %v", inf, err)
	}
	id, ip, err := c.runPod(t, ctx, "shop", "web")
	if err != nil || ip == "" {
		t.Fatalf("a meshed pod with the agent up: %q %q %v", id, ip, err)
	}
	if enrollmentOf(ctx, e.agent, id) == nil {
		t.Fatalf("sandbox %s is not enrolled", id)
	}

	// The agent is killed and containerd restarts meanwhile.
	e.agent.kill()
	c.stop(t, ctx)
	c.start(t, ctx)
	inf, err = c.info(ctx)
	if err != nil || !inf.NetworkReady || inf.LoadStatus != "OK" {
		t.Fatalf("containerd restarted with the agent down: %+v %v; want the whole chain loaded and NetworkReady", inf, err)
	}
	if _, ip, err := c.runPod(t, ctx, "kube-system", "coredns"); err != nil || ip == "" {
		t.Fatalf("an excluded pod with the agent down: %q %v", ip, err)
	}
	if _, _, err := c.runPod(t, ctx, "shop", "while-down"); err == nil || !strings.Contains(err.Error(), "mesh-agent did not answer") {
		t.Fatalf("a meshed pod with the agent down = %v, want containerd's error naming the agent", err)
	}
	e.agent.start(ctx)
	id, ip, err = c.runPod(t, ctx, "shop", "while-down")
	if err != nil || ip == "" || enrollmentOf(ctx, e.agent, id) == nil {
		t.Fatalf("the meshed pod once the agent is back: %q %q %v (enrolled: %v)", id, ip, err, enrollmentOf(ctx, e.agent, id) != nil)
	}

	// A crashed hook: containerd starting then loads no chain; the hook's
	// restart loads it again.
	if err := e.hook.Kill(); err != nil {
		t.Fatal(err)
	}
	c.stop(t, ctx)
	c.start(t, ctx)
	if inf, err := c.info(ctx); err != nil || inf.NetworkReady {
		t.Fatalf("containerd started with the hook crashed: %+v %v; want NetworkReady false (containerd's rule)", inf, err)
	}
	e.hook.Restart(t)
	fixtures.WaitFor(t, time.Minute, "containerd loading the chain again", func() bool {
		inf, err := c.info(ctx)
		return err == nil && inf.NetworkReady && inf.LoadStatus == "OK"
	})

	// The hook's SIGTERM: unregistered, the primary alone.
	if err := e.hook.Stop(ctx); err != nil {
		t.Fatal(err)
	}
	fixtures.WaitFor(t, time.Minute, "the primary alone", func() bool {
		_, ip, err := c.runPod(t, ctx, "shop", "unhooked")
		return err == nil && ip != ""
	})
}
