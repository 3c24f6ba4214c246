package e2e

import (
	"context"
	"errors"
	"fmt"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/mesh-cni/mesh-cni/internal/nethook"
	"github.com/mesh-cni/mesh-cni/pkg/gate/gatepb"
	"github.com/mesh-cni/mesh-cni/test/containerdhook"
	"github.com/mesh-cni/mesh-cni/test/harness"
)

// The hook's tests play containerd with test/containerdhook's Loader, the
// fork's directory loader (blocking dial of every registered plugin, one
// failed dial failing the load, reload on directory events, NetworkReady from
// every plugin's CheckHealth), in front of a primary that runs the node's real
// bridge conflist and `mesh-agent hook`, the hook's own process, with the
// real agent behind its gate socket.

// hookEnv is a node with a primary registered in containerd's plugin
// directory, the agent and the hook.
type hookEnv struct {
	node      *harness.Node
	primary   *containerdhook.Primary
	agent     *agent
	hook      *containerdhook.Hook
	pluginDir string
}

// newHookEnv starts the primary, the agent (with agentArgs) and the hook (with
// hookArgs, as root with no capability, as the chart runs it); the runtime's
// loader is the test's to start.
func newHookEnv(t *testing.T, ctx context.Context, agentArgs, hookArgs []string) *hookEnv {
	t.Helper()
	e := &hookEnv{node: harness.NewNode(t, harness.NodeOptions{})}
	e.agent = newAgent(t, agentArgs...)
	e.pluginDir = e.agent.agentPath("containerd", "net.d")
	e.primary = containerdhook.StartPrimary(t, e.node, e.node.Conflist(t, "hooknet"), e.pluginDir)
	e.agent.start(ctx)
	e.hook = containerdhook.StartHookWithoutCapabilities(t, e.agent.Socket, e.pluginDir, hookArgs...)
	status, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", e.hook.Pid()))
	if err != nil || !strings.Contains(string(status), "CapEff:\t0000000000000000") {
		t.Fatalf("the hook runs with capabilities (%v):\n%s", err, status)
	}
	return e
}

// loader starts containerd's loader on the plugin directory (containerd
// starting), closed in cleanup.
func (e *hookEnv) loader(t *testing.T) *containerdhook.Loader {
	t.Helper()
	l, err := containerdhook.NewLoader(e.pluginDir)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { l.Close() })
	return l
}

func hookPod(p *harness.Pod) containerdhook.Pod {
	return containerdhook.Pod{
		SandboxID:    p.ContainerID,
		NetnsPath:    p.NetNSPath,
		Name:         p.Name,
		Namespace:    p.Namespace,
		UID:          p.UID,
		Labels:       map[string]string{"app": p.Name},
		CgroupParent: "/kubepods/besteffort/pod" + p.UID,
	}
}

// primaryResult is the primary network's result as the runtime holds it.
func primaryResult(t *testing.T, p *harness.Pod) *containerdhook.Result {
	t.Helper()
	r, err := containerdhook.FromCNI(p.Result())
	if err != nil {
		t.Fatal(err)
	}
	return r
}

// resultAddrs are the addresses of a result's interfaces.
func resultAddrs(t *testing.T, r *containerdhook.Result) []netip.Addr {
	t.Helper()
	var out []netip.Addr
	for _, i := range r.Interfaces {
		for _, a := range i.Addresses {
			p, err := netip.ParsePrefix(a)
			if err != nil {
				t.Fatalf("address %q: %v", a, err)
			}
			out = append(out, p.Addr())
		}
	}
	return out
}

// checkPodIPs: the sandbox IPs the runtime derives from the merged result are
// the addresses the primary gave the pod, each once.
func checkPodIPs(t *testing.T, name string, primary, merged *containerdhook.Result) {
	t.Helper()
	ip, more, err := containerdhook.PodIPs(merged)
	if err != nil {
		t.Fatalf("pod IPs of %s: %v", name, err)
	}
	got := append([]string{ip}, more...)
	var want []string
	for _, a := range resultAddrs(t, primary) {
		want = append(want, a.String())
	}
	slices.Sort(got)
	slices.Sort(want)
	if len(want) == 0 || !slices.Equal(got, want) {
		t.Fatalf("the runtime would give %s the IPs %v, want the primary's addresses %v, each once", name, got, want)
	}
}

// waitChain waits until the loader's chain is names (nil: none).
func waitChain(t *testing.T, ctx context.Context, l *containerdhook.Loader, names ...string) {
	t.Helper()
	waitCtx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	if err := l.WaitChain(waitCtx, names...); err != nil {
		t.Fatal(err)
	}
}

// TestHookEntryPoint: the runtime finds the hook through its registration and
// runs [primary, hook]; the hook answers empty with the pod enrolled, the pod
// IPs the runtime derives are the pod's addresses, each once, traffic between
// two such pods goes through their sidecar proxies, teardown releases. The
// agent's stop leaves the hook, its registration and NetworkReady in place;
// the hook's own stop (SIGTERM) removes the registration.
func TestHookEntryPoint(t *testing.T) {
	t.Parallel()
	ctx := testContext(t)
	e := newHookEnv(t, ctx, nil, nil)
	reg, err := nethook.ReadRegistration(e.hook.Registration)
	if err != nil {
		t.Fatalf("the hook's registration: %v", err)
	}
	if reg.Name != "mesh-cni" || reg.Primary || reg.Priority != nethook.DefaultPriority || reg.Address != e.hook.Socket {
		t.Fatalf("registration %+v, want mesh-cni, not primary, priority %d, address %s", reg, nethook.DefaultPriority, e.hook.Socket)
	}
	l := e.loader(t)
	waitChain(t, ctx, l, e.primary.Name, "mesh-cni")
	if err := l.SettledNetworkReady(ctx); err != nil {
		t.Fatalf("NetworkReady: %v", err)
	}

	setup := func(p *harness.Pod) *containerdhook.Result {
		t.Helper()
		callCtx, cancel := context.WithTimeout(ctx, 30*time.Second)
		defer cancel()
		merged, err := l.Setup(callCtx, hookPod(p))
		if err != nil {
			t.Fatalf("the runtime's chain for %s: %v", p.Name, err)
		}
		checkPodIPs(t, p.Name, e.primary.Result(p.ContainerID), merged)
		en := enrollmentOf(ctx, e.agent, p.ContainerID)
		if en == nil {
			t.Fatalf("the agent does not list %s after its setup returned", p.Name)
		}
		if en.GetSource() != gatepb.Source_SOURCE_HOOK || en.GetNetnsPath() != p.NetNSPath || en.GetPod().GetUid() != p.UID ||
			en.GetAttachment().GetNetwork() != nethook.DefaultNetwork || en.GetAttachment().GetIfname() != "eth0" {
			t.Fatalf("enrollment of %s = %v, want source HOOK, netns %s, uid %s, network %s, ifname eth0", p.Name, en, p.NetNSPath, p.UID, nethook.DefaultNetwork)
		}
		if !settingsEntryExists(t, e.agent, en.GetNetnsCookie()) {
			t.Fatalf("%s is listed but has no entry in the pinned pods map", p.Name)
		}
		return merged
	}
	pa := &meshPod{Pod: e.node.NewPod(t, "shop", "hook-client")}
	pb := &meshPod{Pod: e.node.NewPod(t, "shop", "hook-server")}
	mergedA, mergedB := setup(pa.Pod), setup(pb.Pod)
	checkThroughSidecars(ctx, t, pa, pb, resultAddrs(t, mergedA), resultAddrs(t, mergedB))

	// Teardown (reverse order: the hook first) releases, then the primary.
	for _, x := range []struct {
		p      *meshPod
		merged *containerdhook.Result
	}{{pa, mergedA}, {pb, mergedB}} {
		_, cookie := podPinDir(t, e.agent, x.p.Pod)
		if err := l.Teardown(ctx, hookPod(x.p.Pod), x.merged); err != nil {
			t.Fatalf("teardown %s: %v", x.p.Name, err)
		}
		if settingsEntryExists(t, e.agent, cookie) {
			t.Fatalf("netns cookie %d of %s is still in the settings map after teardown", cookie, x.p.Name)
		}
	}
	if n := len(e.agent.list(ctx).GetEnrollments()); n != 0 || len(e.primary.SetUp()) != 0 {
		t.Fatalf("after both teardowns the agent lists %d enrollments, the primary %v", n, e.primary.SetUp())
	}

	// The agent stops: the hook keeps answering, the node stays network-ready.
	e.agent.stop(ctx)
	if _, err := os.Stat(e.hook.Registration); err != nil {
		t.Fatalf("the registration after the agent stopped: %v", err)
	}
	if err := l.SettledNetworkReady(ctx); err != nil {
		t.Fatalf("NetworkReady with the agent stopped: %v", err)
	}

	// The hook stops: its registration goes, and the runtime drops it.
	if err := e.hook.Stop(ctx); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(e.hook.Registration); !errors.Is(err, os.ErrNotExist) {
		t.Fatalf("the registration after the hook's SIGTERM: %v, want it removed", err)
	}
	waitChain(t, ctx, l, e.primary.Name)
	if !strings.Contains(e.hook.Output(), "network-plugin hook unregistered") {
		t.Fatalf("the hook did not log its unregistration:\n%s", e.hook.Output())
	}
}

// TestHookRuntimeRestartWhileAgentDown: containerd (its loader) starts while
// the agent is down. The chain loads whole and NetworkReady holds, so the
// primary's pods get their network: an excluded namespace's pod is set up at
// once; a meshed pod's setup fails after the hook's gate timeout with an error
// naming the agent, the primary torn down again (never started unmeshed).
// Once the agent is back the same pod is set up enrolled.
func TestHookRuntimeRestartWhileAgentDown(t *testing.T) {
	t.Parallel()
	ctx := testContext(t)
	e := newHookEnv(t, ctx, nil, []string{"--gate-timeout", "2s"})
	e.agent.kill()

	l := e.loader(t)
	waitChain(t, ctx, l, e.primary.Name, "mesh-cni")
	if err := l.SettledNetworkReady(ctx); err != nil {
		t.Fatalf("NetworkReady after containerd restarted with the agent down: %v", err)
	}
	hook, err := containerdhook.Dial(e.hook.Socket)
	if err != nil {
		t.Fatal(err)
	}
	defer hook.Close()
	if ready, msg, err := hook.Health(ctx); err != nil || !ready || !strings.Contains(msg, "does not answer") {
		t.Fatalf("CheckHealth with the agent down = %v %q %v; want ready, saying the agent does not answer", ready, msg, err)
	}

	sys := e.node.NewPod(t, "kube-system", "coredns")
	merged, err := l.Setup(ctx, hookPod(sys))
	if err != nil {
		t.Fatalf("setup of a kube-system pod with the agent down: %v", err)
	}
	checkPodIPs(t, sys.Name, e.primary.Result(sys.ContainerID), merged)

	p := e.node.NewPod(t, "shop", "while-down")
	_, err = l.Setup(ctx, hookPod(p))
	if err == nil || !strings.Contains(err.Error(), "mesh-agent did not answer") || !strings.Contains(err.Error(), e.agent.Socket) {
		t.Fatalf("setup of a meshed pod with the agent down = %v; want a failure naming the agent's socket", err)
	}
	if slices.Contains(e.primary.SetUp(), p.ContainerID) {
		t.Fatal("the failed setup left the primary's network in place")
	}

	e.agent.start(ctx)
	merged, err = l.Setup(ctx, hookPod(p))
	if err != nil {
		t.Fatalf("setup once the agent is back: %v", err)
	}
	checkPodIPs(t, p.Name, e.primary.Result(p.ContainerID), merged)
	if enrollmentOf(ctx, e.agent, p.ContainerID) == nil {
		t.Fatal("the pod set up once the agent was back is not enrolled")
	}
	if enrollmentOf(ctx, e.agent, sys.ContainerID) != nil {
		t.Fatal("the kube-system pod is enrolled")
	}
}

// TestHookAgentKilled: the agent is SIGKILLed; a meshed pod's setup issued
// then waits at the gate (it does not return, and the pod has no network
// from the runtime yet), and completes enrolled once the agent restarts: no
// pod starts unmeshed.
func TestHookAgentKilled(t *testing.T) {
	t.Parallel()
	ctx := testContext(t)
	e := newHookEnv(t, ctx, nil, []string{"--gate-timeout", "2m"})
	l := e.loader(t)
	waitChain(t, ctx, l, e.primary.Name, "mesh-cni")
	e.agent.kill()

	p := e.node.NewPod(t, "shop", "after-kill")
	type result struct {
		merged *containerdhook.Result
		err    error
	}
	done := make(chan result, 1)
	go func() {
		m, err := l.Setup(ctx, hookPod(p))
		done <- result{m, err}
	}()
	// The setup reached the hook, which waits for the agent.
	lineCtx, cancel := context.WithTimeout(ctx, 30*time.Second)
	_, err := e.hook.WaitForLine(lineCtx, "the setup waits for it")
	cancel()
	if err != nil {
		t.Fatalf("the setup did not wait at the gate: %v\n%s", err, e.hook.Output())
	}
	select {
	case r := <-done:
		t.Fatalf("the setup returned (%v) with the agent down", r.err)
	default:
	}
	if err := l.SettledNetworkReady(ctx); err != nil {
		t.Fatalf("NetworkReady with the agent killed: %v", err)
	}

	e.agent.start(ctx)
	r := <-done
	if r.err != nil {
		t.Fatalf("the waiting setup after the agent restarted: %v", r.err)
	}
	checkPodIPs(t, p.Name, e.primary.Result(p.ContainerID), r.merged)
	if enrollmentOf(ctx, e.agent, p.ContainerID) == nil {
		t.Fatal("the setup returned but the pod is not enrolled")
	}
}

// TestHookHandOver: a second hook started before the first stops takes the
// socket over; the first one's SIGTERM then leaves the registration, which is
// the second's, and the runtime's chain keeps the hook throughout. The second
// one's SIGTERM removes it.
func TestHookHandOver(t *testing.T) {
	t.Parallel()
	ctx := testContext(t)
	e := newHookEnv(t, ctx, nil, nil)
	l := e.loader(t)
	waitChain(t, ctx, l, e.primary.Name, "mesh-cni")
	// The readiness probe passes in the hook's PID namespace, and fails in
	// another one (the pod of the hook being replaced, before its successor
	// took the socket over), where the kernel reports the server's PID as 0.
	probe := func(wrap ...string) error {
		args := append(wrap, harness.Bins(t).Path("mesh-agent"), "hook", "--probe", "--hook-socket", e.hook.Socket)
		out, err := exec.CommandContext(ctx, args[0], args[1:]...).CombinedOutput()
		if err != nil {
			return fmt.Errorf("%w: %s", err, out)
		}
		return nil
	}
	if err := probe(); err != nil {
		t.Fatalf("readiness probe next to the hook: %v", err)
	}
	if err := probe("unshare", "--pid", "--fork"); err == nil || !strings.Contains(err.Error(), "another PID namespace") {
		t.Fatalf("readiness probe from another PID namespace = %v, want a failure saying so", err)
	}

	first := e.hook.Process
	second := e.hook.Restart(t)
	if err := first.Stop(ctx); err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(first.Output(), "a newer hook serves the socket") {
		t.Fatalf("the first hook did not see its successor:\n%s", first.Output())
	}
	if _, err := os.Stat(e.hook.Registration); err != nil {
		t.Fatalf("the registration after the first hook stopped: %v", err)
	}
	if got := l.Names(); !slices.Equal(got, []string{e.primary.Name, "mesh-cni"}) {
		t.Fatalf("the chain after the hand-over is %v (last load %v)", got, l.LastStatus())
	}
	if err := l.SettledNetworkReady(ctx); err != nil {
		t.Fatalf("NetworkReady after the hand-over: %v", err)
	}
	p := e.node.NewPod(t, "shop", "handed-over")
	if _, err := l.Setup(ctx, hookPod(p)); err != nil {
		t.Fatalf("setup through the second hook: %v", err)
	}
	if enrollmentOf(ctx, e.agent, p.ContainerID) == nil {
		t.Fatal("the pod is not enrolled")
	}
	if err := second.Stop(ctx); err != nil {
		t.Fatal(err)
	}
	waitChain(t, ctx, l, e.primary.Name)
}

// TestHookCrash: a hook that crashed (SIGKILL) leaves its registration, and a
// containerd that starts then loads no chain at all: that is the runtime's
// rule (one failed dial fails the load), the window the hook's own process
// keeps to its crashes. The hook restarting rewrites its registration, and
// the runtime loads the whole chain again without a restart of its own.
// `mesh-agent hook --unregister` removes a crashed hook's registration, and
// refuses while one serves.
func TestHookCrash(t *testing.T) {
	t.Parallel()
	ctx := testContext(t)
	e := newHookEnv(t, ctx, nil, nil)
	if err := e.hook.Kill(); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(e.hook.Registration); err != nil {
		t.Fatalf("the registration after a crash: %v, want it left", err)
	}
	l := e.loader(t)
	if l.Chain() != nil || l.LastStatus() == nil {
		t.Fatalf("containerd started with the hook crashed: chain %v, status %v; want none, as the runtime does", l.Names(), l.LastStatus())
	}
	e.hook.Restart(t)
	waitChain(t, ctx, l, e.primary.Name, "mesh-cni")
	if err := l.SettledNetworkReady(ctx); err != nil {
		t.Fatalf("NetworkReady after the hook restarted: %v", err)
	}

	// --unregister refuses while a hook serves, and removes a crashed one's
	// registration.
	unregister := func() error {
		return exec.CommandContext(ctx, harness.Bins(t).Path("mesh-agent"), "hook", "--unregister",
			"--hook-socket", e.hook.Socket, "--hook-plugin-dir", e.pluginDir).Run()
	}
	if err := unregister(); err == nil {
		t.Fatal("--unregister succeeded while the hook serves")
	}
	if _, err := os.Stat(e.hook.Registration); err != nil {
		t.Fatalf("the refused --unregister removed the registration: %v", err)
	}
	if err := e.hook.Kill(); err != nil {
		t.Fatal(err)
	}
	if err := unregister(); err != nil {
		t.Fatalf("--unregister after a crash: %v", err)
	}
	if _, err := os.Stat(e.hook.Registration); !errors.Is(err, os.ErrNotExist) {
		t.Fatalf("the registration after --unregister: %v", err)
	}
	waitChain(t, ctx, l, e.primary.Name)
}

// TestHookHealthWhileAgentStarts (containerd's health rule from the fork,
// internal/cri/server/status.go): the agent runs but is not ready (its policy
// file does not exist yet, so the enrollment source has not synced).
// NetworkReady holds, the hook's answer says what the agent waits for, and a
// pod's setup issued then waits at the gate and completes, enrolled, once the
// agent is ready: the node is never made NotReady by a starting agent.
func TestHookHealthWhileAgentStarts(t *testing.T) {
	t.Parallel()
	ctx := testContext(t)
	node := harness.NewNode(t, harness.NodeOptions{})
	a := newAgent(t)
	policy := a.agentPath("policy", "enrollment.yaml")
	if err := os.MkdirAll(filepath.Dir(policy), 0o700); err != nil {
		t.Fatal(err)
	}
	pluginDir := a.agentPath("containerd", "net.d")
	primary := containerdhook.StartPrimary(t, node, node.Conflist(t, "hooknet"), pluginDir)
	a.Args = append(a.Args, "--enrollment=file", "--policy-file", policy)
	a.Proc = harness.StartProcess(t, harness.ProcessOptions{Path: harness.Bins(t).Path("mesh-agent"), Args: a.Args, Name: "mesh-agent"})
	lineCtx, cancel := context.WithTimeout(ctx, 30*time.Second)
	_, err := a.Proc.WaitForLine(lineCtx, "gate serving")
	cancel()
	if err != nil {
		t.Fatalf("the gate never served: %v\n%s", err, a.Proc.Output())
	}
	h := containerdhook.StartHook(t, a.Socket, pluginDir)
	if a.list(ctx).GetReady() {
		t.Fatal("the agent is ready without its policy file")
	}
	l, err := containerdhook.NewLoader(pluginDir)
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	waitChain(t, ctx, l, primary.Name, "mesh-cni")
	if err := l.SettledNetworkReady(ctx); err != nil {
		t.Fatalf("NetworkReady while the agent starts: %v (a not-ready hook makes kubelet mark the node NotReady)", err)
	}
	hook, err := containerdhook.Dial(h.Socket)
	if err != nil {
		t.Fatal(err)
	}
	defer hook.Close()
	if ready, msg, err := hook.Health(ctx); err != nil || !ready || !strings.Contains(msg, "starting") || !strings.Contains(msg, "enrollment") {
		t.Fatalf("CheckHealth while the agent starts = %v %q %v; want ready, saying what it waits for", ready, msg, err)
	}

	p := node.NewPod(t, "shop", "early")
	type result struct {
		merged *containerdhook.Result
		err    error
	}
	done := make(chan result, 1)
	go func() {
		callCtx, cancel := context.WithTimeout(ctx, time.Minute)
		defer cancel()
		m, err := l.Setup(callCtx, hookPod(p))
		done <- result{m, err}
	}()
	lineCtx, cancel = context.WithTimeout(ctx, 30*time.Second)
	_, err = h.WaitForLine(lineCtx, "the setup waits for it")
	cancel()
	if err != nil {
		t.Fatalf("the setup did not wait at the gate: %v\n%s", err, h.Output())
	}
	if err := os.WriteFile(policy, []byte("namespaces: [shop]\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	r := <-done
	if r.err != nil {
		t.Fatalf("setup issued while the agent started: %v", r.err)
	}
	checkPodIPs(t, p.Name, primary.Result(p.ContainerID), r.merged)
	if en := enrollmentOf(ctx, a, p.ContainerID); en == nil {
		t.Fatal("the pod whose setup waited is not enrolled")
	}
	if err := l.Teardown(ctx, hookPod(p), r.merged); err != nil {
		t.Fatal(err)
	}
}
