package e2e

import (
	"context"
	"os"
	"slices"
	"strings"
	"testing"
	"time"

	types100 "github.com/containernetworking/cni/pkg/types/100"

	"github.com/mesh-cni/mesh-cni/pkg/gate/gatepb"
	"github.com/mesh-cni/mesh-cni/pkg/nethook"
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
// source): it finds the hook through its registration file, runs the primary
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
			t.Fatalf("%s is listed but has no entry in the pinned settings map", p.Name)
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
