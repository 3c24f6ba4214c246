package e2e

import (
	"context"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	types100 "github.com/containernetworking/cni/pkg/types/100"

	"github.com/mesh-cni/mesh-cni/internal/nethook"
	"github.com/mesh-cni/mesh-cni/pkg/gate/gatepb"
	"github.com/mesh-cni/mesh-cni/test/containerdhook"
	"github.com/mesh-cni/mesh-cni/test/harness"
)

// primaryResult is the primary network's result as the runtime holds it.
func primaryResult(t *testing.T, res *types100.Result) *containerdhook.Result {
	t.Helper()
	r, err := containerdhook.FromCNI(res)
	if err != nil {
		t.Fatal(err)
	}
	return r
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

// checkPodIPs: the sandbox IPs the runtime derives from the merged result are
// the pod's addresses, each once.
func checkPodIPs(t *testing.T, p *harness.Pod, merged *containerdhook.Result) {
	t.Helper()
	ip, more, err := containerdhook.PodIPs(merged)
	if err != nil {
		t.Fatalf("pod IPs of %s: %v", p.Name, err)
	}
	got := append([]string{ip}, more...)
	var want []string
	for _, a := range p.Addrs() {
		want = append(want, a.String())
	}
	slices.Sort(got)
	slices.Sort(want)
	if !slices.Equal(got, want) {
		t.Fatalf("the runtime would give %s the IPs %v, want its addresses %v, each once", p.Name, got, want)
	}
}

// TestHookEntryPoint plays containerd against the agent's network-plugin hook,
// through test/containerdhook (the runtime's chain written from the fork's
// source, github.com/MikeZappa87/containerd branch mzappa/podapi at commit
// b5dc60445dc9537d5e473bec6b1aef9b3c487be1): it finds the hook through its registration file, runs the primary
// network (a real [bridge] ADD) itself, then runs the chain [primary, hook];
// the hook answers empty with the pod enrolled, and the pod IPs the runtime
// derives from the merged result are the pod's addresses, each once; traffic
// between two such pods goes through their sidecar proxies; teardown
// releases; the runtime's NetworkReady holds while the agent runs and fails
// once it is stopped, the registration staying in place.
func TestHookEntryPoint(t *testing.T) {
	t.Parallel()
	ctx := testContext(t)
	node := harness.NewNode(t, harness.NodeOptions{})
	primary := node.Conflist(t, "hooknet")
	a := newAgent(t)
	pluginDir := a.agentPath("containerd", "net.d")
	a.Args = append(a.Args, "--hook-socket", a.agentPath("hook", "hook.sock"), "--hook-plugin-dir", pluginDir)
	a.start(ctx)

	// The runtime's view: the registration file in its plugin directory.
	regPath := nethook.RegistrationPath(pluginDir, "mesh-cni")
	reg, err := nethook.ReadRegistration(regPath)
	if err != nil {
		t.Fatalf("the agent's hook registration: %v", err)
	}
	if reg.Name != "mesh-cni" || reg.Primary || reg.Priority != nethook.DefaultPriority || reg.Address != a.agentPath("hook", "hook.sock") {
		t.Fatalf("registration %+v, want mesh-cni, not primary, priority %d, address the hook socket", reg, nethook.DefaultPriority)
	}
	hook, err := containerdhook.Dial(strings.TrimPrefix(reg.Address, "unix://"))
	if err != nil {
		t.Fatal(err)
	}
	defer hook.Close()
	chainFor := func(p *harness.Pod) *containerdhook.Chain {
		return &containerdhook.Chain{
			Plugins: []containerdhook.Plugin{containerdhook.Done{Result: primaryResult(t, p.Result())}, hook},
			Names:   []string{"bridge", reg.Name},
		}
	}
	if err := (&containerdhook.Chain{Plugins: []containerdhook.Plugin{hook}, Names: []string{reg.Name}}).NetworkReady(ctx); err != nil {
		t.Fatalf("NetworkReady with the agent ready: %v", err)
	}

	setup := func(p *harness.Pod) *containerdhook.Result {
		t.Helper()
		if _, err := node.Add(ctx, p, primary); err != nil {
			t.Fatalf("primary network for %s: %v", p.Name, err)
		}
		callCtx, cancel := context.WithTimeout(ctx, 30*time.Second)
		defer cancel()
		own, err := hook.Setup(callCtx, hookPod(p), primaryResult(t, p.Result()))
		if err != nil {
			t.Fatalf("SetupPodNetwork %s: %v", p.Name, err)
		}
		if len(own.Interfaces) != 0 || len(own.Routes) != 0 || own.DNS != nil {
			t.Fatalf("the hook answered %+v for %s, want an empty response (the mesh adds no interface)", own, p.Name)
		}
		merged, err := chainFor(p).Setup(callCtx, hookPod(p))
		if err != nil {
			t.Fatalf("the runtime's chain for %s: %v", p.Name, err)
		}
		checkPodIPs(t, p, merged)
		e := enrollmentOf(ctx, a, p.ContainerID)
		if e == nil {
			t.Fatalf("the agent does not list %s after its setup returned", p.Name)
		}
		if e.GetSource() != gatepb.Source_SOURCE_HOOK || e.GetNetnsPath() != p.NetNSPath || e.GetPod().GetUid() != p.UID ||
			e.GetAttachment().GetNetwork() != nethook.DefaultNetwork || e.GetAttachment().GetIfname() != p.IfName {
			t.Fatalf("enrollment of %s = %v, want source HOOK, netns %s, uid %s, network %s, ifname %s", p.Name, e, p.NetNSPath, p.UID, nethook.DefaultNetwork, p.IfName)
		}
		if !settingsEntryExists(t, a, e.GetNetnsCookie()) {
			t.Fatalf("%s is listed but has no entry in the pinned pods map", p.Name)
		}
		return merged
	}

	pa := &meshPod{Pod: node.NewPod(t, "shop", "hook-client")}
	pb := &meshPod{Pod: node.NewPod(t, "shop", "hook-server")}
	prevA, prevB := setup(pa.Pod), setup(pb.Pod)
	checkThroughSidecars(ctx, t, pa, pb, pa.Addrs(), pb.Addrs())

	// Teardown (reverse order: the hook first) releases, before the runtime
	// tears the primary down.
	var cookies []uint64
	for _, x := range []struct {
		p      *meshPod
		merged *containerdhook.Result
	}{{pa, prevA}, {pb, prevB}} {
		_, cookie := podPinDir(t, a, x.p.Pod)
		cookies = append(cookies, cookie)
		if err := chainFor(x.p.Pod).Teardown(ctx, hookPod(x.p.Pod), x.merged); err != nil {
			t.Fatalf("teardown %s: %v", x.p.Name, err)
		}
		if err := node.Del(ctx, x.p.Pod, primary); err != nil {
			t.Fatal(err)
		}
	}
	if n := len(a.list(ctx).GetEnrollments()); n != 0 {
		t.Fatalf("the agent still lists %d enrollments after both teardowns", n)
	}
	for _, c := range cookies {
		if settingsEntryExists(t, a, c) {
			t.Fatalf("netns cookie %d is still in the settings map after teardown", c)
		}
	}

	// A stopped agent is not healthy, and its registration stays: the runtime
	// keeps pods waiting for the mesh instead of starting them unmeshed.
	a.stop(ctx)
	callCtx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	err = (&containerdhook.Chain{Plugins: []containerdhook.Plugin{hook}, Names: []string{reg.Name}}).NetworkReady(callCtx)
	if err == nil {
		t.Fatal("NetworkReady holds with the agent stopped")
	}
	t.Logf("NetworkReady with the agent stopped: %v", err)
	if _, err := os.Stat(regPath); err != nil {
		t.Fatalf("the registration is gone after a plain stop: %v", err)
	}
}

// TestHookHealthWhileAgentStarts (containerd's health rule from the fork at
// commit b5dc60445dc9537d5e473bec6b1aef9b3c487be1, internal/cri/server/status.go):
// the real agent, its hook serving but the agent
// not ready (its policy file does not exist yet, so the enrollment source has
// not synced). containerd's NetworkReady holds, the hook's answer says what the
// agent waits for, and a pod's setup issued then waits at the gate and
// completes, enrolled, once the agent is ready: the node is never made
// NotReady by a starting agent.
func TestHookHealthWhileAgentStarts(t *testing.T) {
	t.Parallel()
	ctx := testContext(t)
	node := harness.NewNode(t, harness.NodeOptions{})
	primary := node.Conflist(t, "hooknet")
	a := newAgent(t)
	policy := a.agentPath("policy", "enrollment.yaml")
	if err := os.MkdirAll(filepath.Dir(policy), 0o700); err != nil {
		t.Fatal(err)
	}
	pluginDir := a.agentPath("containerd", "net.d")
	a.Args = append(a.Args, "--enrollment=file", "--policy-file", policy,
		"--hook-socket", a.agentPath("hook", "hook.sock"), "--hook-plugin-dir", pluginDir)
	a.Proc = harness.StartProcess(t, harness.ProcessOptions{Path: harness.Bins(t).Path("mesh-agent"), Args: a.Args, Name: "mesh-agent"})

	// The registration is written once the hook serves.
	regPath := nethook.RegistrationPath(pluginDir, "mesh-cni")
	lineCtx, cancel := context.WithTimeout(ctx, 30*time.Second)
	_, err := a.Proc.WaitForLine(lineCtx, "network-plugin hook serving")
	cancel()
	if err != nil {
		t.Fatalf("the hook never served: %v\n%s", err, a.Proc.Output())
	}
	var reg nethook.Registration
	harness.WaitFor(t, 30*time.Second, "the hook's registration", func() bool {
		r, err := nethook.ReadRegistration(regPath)
		if err == nil {
			reg = r
		}
		return err == nil
	})
	hook, err := containerdhook.Dial(strings.TrimPrefix(reg.Address, "unix://"))
	if err != nil {
		t.Fatal(err)
	}
	defer hook.Close()
	if a.list(ctx).GetReady() {
		t.Fatal("the agent is ready without its policy file")
	}
	chain := &containerdhook.Chain{Plugins: []containerdhook.Plugin{hook}, Names: []string{reg.Name}}
	if err := chain.NetworkReady(ctx); err != nil {
		t.Fatalf("NetworkReady while the agent starts: %v (a not-ready hook makes kubelet mark the node NotReady)", err)
	}
	if ready, msg, err := hook.Health(ctx); err != nil || !ready || !strings.Contains(msg, "starting") || !strings.Contains(msg, "enrollment") {
		t.Fatalf("CheckHealth while the agent starts = %v %q %v; want ready, saying what it waits for", ready, msg, err)
	}

	p := node.NewPod(t, "shop", "early")
	if _, err := node.Add(ctx, p, primary); err != nil {
		t.Fatal(err)
	}
	full := &containerdhook.Chain{
		Plugins: []containerdhook.Plugin{containerdhook.Done{Result: primaryResult(t, p.Result())}, hook},
		Names:   []string{"bridge", reg.Name},
	}
	type result struct {
		merged *containerdhook.Result
		err    error
	}
	done := make(chan result, 1)
	go func() {
		callCtx, cancel := context.WithTimeout(ctx, time.Minute)
		defer cancel()
		m, err := full.Setup(callCtx, hookPod(p))
		done <- result{m, err}
	}()
	// The setup reached the hook and waits for the agent.
	lineCtx, cancel = context.WithTimeout(ctx, 30*time.Second)
	_, err = a.Proc.WaitForLine(lineCtx, "the setup waits for it")
	cancel()
	if err != nil {
		t.Fatalf("the setup did not wait at the gate: %v\n%s", err, a.Proc.Output())
	}
	if err := os.WriteFile(policy, []byte("namespaces: [shop]\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	r := <-done
	if r.err != nil {
		t.Fatalf("setup issued while the agent started: %v", r.err)
	}
	checkPodIPs(t, p, r.merged)
	if e := enrollmentOf(ctx, a, p.ContainerID); e == nil {
		t.Fatal("the pod whose setup waited is not enrolled")
	}
	if err := full.Teardown(ctx, hookPod(p), r.merged); err != nil {
		t.Fatal(err)
	}
	if err := node.Del(ctx, p, primary); err != nil {
		t.Fatal(err)
	}
}
