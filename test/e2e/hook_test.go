package e2e

import (
	"context"
	"os"
	"strings"
	"testing"
	"time"

	types100 "github.com/containernetworking/cni/pkg/types/100"
	"google.golang.org/protobuf/proto"

	"github.com/mesh-cni/mesh-cni/pkg/gate/gatepb"
	"github.com/mesh-cni/mesh-cni/pkg/nethook"
	"github.com/mesh-cni/mesh-cni/pkg/nethook/nethookpb"
	"github.com/mesh-cni/mesh-cni/test/harness"
)

// hookPrevResult is what a runtime hands a non-primary plugin after the primary
// ran: the primary's CNI result in the hook's terms.
func hookPrevResult(t *testing.T, res *types100.Result) *nethookpb.SetupPodNetworkResponse {
	t.Helper()
	if res == nil {
		t.Fatal("the primary ADD left no result")
	}
	out := &nethookpb.SetupPodNetworkResponse{Dns: &nethookpb.DNSConfig{
		Servers: res.DNS.Nameservers, Searches: res.DNS.Search, Options: res.DNS.Options,
	}}
	for _, i := range res.Interfaces {
		out.Interfaces = append(out.Interfaces, &nethookpb.NetworkInterface{
			Name: i.Name, MacAddress: i.Mac, Type: nethookpb.DeviceType_NETDEV, Mtu: uint32(i.Mtu), State: "up",
		})
	}
	for _, ip := range res.IPs {
		if ip.Interface == nil || *ip.Interface < 0 || *ip.Interface >= len(out.Interfaces) {
			t.Fatalf("CNI result IP %v names no interface", ip)
		}
		ni := out.Interfaces[*ip.Interface]
		ni.Addresses = append(ni.Addresses, ip.Address.String())
	}
	for _, r := range res.Routes {
		re := &nethookpb.RouteEntry{Destination: r.Dst.String(), Metric: uint32(r.Priority)}
		if r.GW != nil {
			re.Gateway = r.GW.String()
		}
		out.Routes = append(out.Routes, re)
	}
	return out
}

func hookSetupRequest(p *harness.Pod, prev *nethookpb.SetupPodNetworkResponse) *nethookpb.SetupPodNetworkRequest {
	return &nethookpb.SetupPodNetworkRequest{
		SandboxId:    p.ContainerID,
		NetnsPath:    p.NetNSPath,
		PodName:      p.Name,
		PodNamespace: p.Namespace,
		PodUid:       p.UID,
		Labels:       map[string]string{"app": p.Name},
		CgroupParent: "/kubepods/besteffort/pod" + p.UID,
		PrevResult:   prev,
	}
}

// TestHookEntryPoint plays containerd against the agent's network-plugin hook:
// it finds the hook through its registration file, runs the primary network
// (a real [bridge] ADD) itself, then calls SetupPodNetwork with the primary's
// result, which comes back unchanged with the pod enrolled; traffic between two
// such pods goes through their sidecar proxies; TeardownPodNetwork releases;
// CheckHealth says ready while the agent runs and fails once it is stopped, its
// registration staying in place.
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
	hook := nethookpb.NewPodNetworkLifecycleClient(dialUnixGRPC(t, strings.TrimPrefix(reg.Address, "unix://")))

	health, err := hook.CheckHealth(ctx, &nethookpb.CheckHealthRequest{})
	if err != nil || !health.GetReady() {
		t.Fatalf("CheckHealth with the agent ready = %v, %v; want ready", health, err)
	}

	setup := func(p *harness.Pod) *nethookpb.SetupPodNetworkResponse {
		t.Helper()
		if _, err := node.Add(ctx, p, primary); err != nil {
			t.Fatalf("primary network for %s: %v", p.Name, err)
		}
		prev := hookPrevResult(t, p.Result())
		callCtx, cancel := context.WithTimeout(ctx, 30*time.Second)
		defer cancel()
		resp, err := hook.SetupPodNetwork(callCtx, hookSetupRequest(p, prev))
		if err != nil {
			t.Fatalf("SetupPodNetwork %s: %v", p.Name, err)
		}
		if !proto.Equal(resp, prev) {
			t.Fatalf("SetupPodNetwork answered\n%v\nwant prev_result unchanged\n%v", resp, prev)
		}
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
		return prev
	}

	pa := &meshPod{Pod: node.NewPod(t, "shop", "hook-client")}
	pb := &meshPod{Pod: node.NewPod(t, "shop", "hook-server")}
	prevA, prevB := setup(pa.Pod), setup(pb.Pod)
	checkThroughSidecars(ctx, t, pa, pb, pa.Addrs(), pb.Addrs())

	// Teardown releases, before the runtime tears the primary down.
	var cookies []uint64
	for _, x := range []struct {
		p    *meshPod
		prev *nethookpb.SetupPodNetworkResponse
	}{{pa, prevA}, {pb, prevB}} {
		_, cookie := podPinDir(t, a, x.p.Pod)
		cookies = append(cookies, cookie)
		if _, err := hook.TeardownPodNetwork(ctx, &nethookpb.TeardownPodNetworkRequest{
			SandboxId: x.p.ContainerID, NetnsPath: x.p.NetNSPath, PodName: x.p.Name, PodNamespace: x.p.Namespace,
			PodUid: x.p.UID, PrevResult: x.prev,
		}); err != nil {
			t.Fatalf("TeardownPodNetwork %s: %v", x.p.Name, err)
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
	health, err = hook.CheckHealth(callCtx, &nethookpb.CheckHealthRequest{})
	if err == nil && health.GetReady() {
		t.Fatal("CheckHealth says ready with the agent stopped")
	}
	t.Logf("CheckHealth with the agent stopped: %v, %v", health, err)
	if _, err := os.Stat(regPath); err != nil {
		t.Fatalf("the registration is gone after a plain stop: %v", err)
	}
}
