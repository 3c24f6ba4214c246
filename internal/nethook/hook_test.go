package nethook_test

import (
	"context"
	"encoding/json"
	"maps"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	types100 "github.com/containernetworking/cni/pkg/types/100"
	"go.uber.org/zap/zaptest"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/connectivity"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"

	"github.com/mesh-cni/mesh-cni/internal/agent/agenttest"
	"github.com/mesh-cni/mesh-cni/internal/gaterpc"
	"github.com/mesh-cni/mesh-cni/internal/nethook"
	"github.com/mesh-cni/mesh-cni/internal/nethook/nethookpb"
	"github.com/mesh-cni/mesh-cni/pkg/gate/gatepb"
	"github.com/mesh-cni/mesh-cni/test/fixtures"
	"github.com/mesh-cni/mesh-cni/test/harness"
)

func TestMain(m *testing.M) {
	harness.Main(m, harness.Options{Packages: harness.ReferencePlugins()})
}

// env is a node whose primary network is the [bridge] conflist, an in-process
// agent, and the hook registered in a plugin directory.
type env struct {
	*agenttest.Gate
	node      *harness.Node
	pluginDir string
	client    nethookpb.PodNetworkLifecycleClient
}

func newEnv(t *testing.T, notReady bool, cfg nethook.Config) *env {
	t.Helper()
	log := zaptest.NewLogger(t)
	e := &env{Gate: agenttest.NewGate(t, log, notReady), node: harness.NewNode(t, harness.NodeOptions{})}
	dir, err := os.MkdirTemp("", "nethook-")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	cfg.SocketPath = filepath.Join(dir, "run", "hook.sock")
	cfg.Gate = e.Service
	cfg.Ready = e.Ready
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	srv, err := nethook.New(ctx, log.Named("nethook"), cfg)
	if err != nil {
		t.Fatalf("nethook.New: %v", err)
	}
	served := make(chan error, 1)
	go func() { served <- srv.Serve() }()
	t.Cleanup(func() {
		srv.Stop(5 * time.Second)
		if err := <-served; err != nil {
			t.Errorf("serve: %v", err)
		}
	})

	// Register, then reach the hook the way the runtime does: from the file.
	e.pluginDir = filepath.Join(dir, "net.d")
	path, err := nethook.WriteRegistration(e.pluginDir, nethook.Registration{Name: "mesh-cni", Address: srv.Addr()})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := nethook.RemoveRegistration(e.pluginDir, "mesh-cni"); err != nil {
			t.Error(err)
		}
	})
	raw, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	var reg struct {
		Name        string `json:"name"`
		Address     string `json:"address"`
		Primary     bool   `json:"primary"`
		Priority    int    `json:"priority"`
		DialTimeout int    `json:"dial_timeout"`
	}
	if err := json.Unmarshal(raw, &reg); err != nil {
		t.Fatalf("registration %s: %v\n%s", path, err, raw)
	}
	if reg.Primary || reg.Priority <= 100 || reg.DialTimeout <= 0 || reg.Name != "mesh-cni" {
		t.Fatalf("registration %+v: want a non-primary plugin after the default priority", reg)
	}
	dialCtx, cancel := context.WithTimeout(context.Background(), time.Duration(reg.DialTimeout)*time.Second)
	defer cancel()
	conn, err := grpc.NewClient("unix://"+reg.Address, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close() })
	conn.Connect()
	if err := waitConnected(dialCtx, conn); err != nil {
		t.Fatalf("dial %s: %v", reg.Address, err)
	}
	e.client = nethookpb.NewPodNetworkLifecycleClient(conn)
	return e
}

func waitConnected(ctx context.Context, conn *grpc.ClientConn) error {
	for {
		s := conn.GetState()
		if s == connectivity.Ready {
			return nil
		}
		if !conn.WaitForStateChange(ctx, s) {
			return ctx.Err()
		}
	}
}

// prevResult is what a runtime hands the hook after the primary ran: the CNI
// result of the real bridge ADD in the hook's terms.
func prevResult(t *testing.T, res *types100.Result) *nethookpb.SetupPodNetworkResponse {
	t.Helper()
	out := &nethookpb.SetupPodNetworkResponse{Dns: &nethookpb.DNSConfig{
		Servers: res.DNS.Nameservers, Searches: res.DNS.Search, Options: res.DNS.Options,
	}}
	for _, i := range res.Interfaces {
		out.Interfaces = append(out.Interfaces, &nethookpb.NetworkInterface{Name: i.Name, MacAddress: i.Mac, Type: nethookpb.DeviceType_NETDEV, Mtu: uint32(i.Mtu), State: "up"})
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

// primaryAdd runs the node's primary network for pod and returns its result.
func (e *env) primaryAdd(t *testing.T, ctx context.Context, pod *harness.Pod) *types100.Result {
	t.Helper()
	list := e.node.Conflist(t, "hooknet")
	if _, err := e.node.Add(ctx, pod, list); err != nil {
		t.Fatal(err)
	}
	return pod.Result()
}

func setupRequest(pod *harness.Pod, prev *nethookpb.SetupPodNetworkResponse) *nethookpb.SetupPodNetworkRequest {
	return &nethookpb.SetupPodNetworkRequest{
		SandboxId:    pod.ContainerID,
		NetnsPath:    pod.NetNSPath,
		PodName:      pod.Name,
		PodNamespace: pod.Namespace,
		PodUid:       pod.UID,
		Annotations:  map[string]string{"example.com/note": "hook test"},
		Labels:       map[string]string{"app": pod.Name},
		PortMappings: []*nethookpb.PortMapping{{Protocol: "tcp", ContainerPort: 8080}},
		CgroupParent: "/kubepods/besteffort/pod" + pod.UID,
		PrevResult:   prev,
	}
}

func teardownRequest(pod *harness.Pod, prev *nethookpb.SetupPodNetworkResponse) *nethookpb.TeardownPodNetworkRequest {
	return &nethookpb.TeardownPodNetworkRequest{
		SandboxId: pod.ContainerID, NetnsPath: pod.NetNSPath, PodName: pod.Name, PodNamespace: pod.Namespace, PodUid: pod.UID,
		PrevResult: prev,
	}
}

// TestSetupEnrollsAndAnswersEmpty: the setup enrolls the pod and answers with
// an empty response (the runtime appends it to the primary's result).
func TestSetupEnrollsAndAnswersEmpty(t *testing.T) {
	t.Parallel()
	e := newEnv(t, false, nethook.Config{})
	ctx := fixtures.Context(t, time.Minute)
	pod := e.node.NewPod(t, "shop", "web")
	res := e.primaryAdd(t, ctx, pod)
	prev := prevResult(t, res)
	if len(prev.GetInterfaces()) < 2 {
		t.Fatalf("bridge result has %d interfaces, want the bridge, the host veth and eth0: %v", len(prev.GetInterfaces()), prev)
	}

	resp, err := e.client.SetupPodNetwork(ctx, setupRequest(pod, prev))
	if err != nil {
		t.Fatalf("setup: %v", err)
	}
	if !proto.Equal(resp, &nethookpb.SetupPodNetworkResponse{}) {
		t.Fatalf("setup answered\n%v\nwant an empty response (the mesh adds no interface)", resp)
	}

	var eth0 *nethookpb.NetworkInterface
	for _, i := range prev.GetInterfaces() {
		if i.GetName() == "eth0" {
			eth0 = i
		}
	}
	enr := e.Enrollments(t)
	if len(enr) != 1 {
		t.Fatalf("enrollments = %v, want the pod", enr)
	}
	got := enr[0]
	want := &gatepb.Enrollment{
		Pod:        &gatepb.PodIdentity{Namespace: pod.Namespace, Name: pod.Name, Uid: pod.UID},
		Attachment: &gatepb.Attachment{ContainerId: pod.ContainerID, Ifname: "eth0", Network: nethook.DefaultNetwork},
		NetnsPath:  pod.NetNSPath,
		// Only the pod's own interface: the bridge and the host-side veth carry
		// no address and are not in the pod.
		Interfaces: []*gatepb.Interface{{Name: "eth0", Mac: eth0.GetMacAddress(), Addresses: eth0.GetAddresses()}},
		Source:     gatepb.Source_SOURCE_HOOK,
	}
	got.NetnsCookie, got.EnrolledAtUnixNano = 0, 0
	if !proto.Equal(got, want) {
		t.Fatalf("enrollment =\n%v\nwant\n%v", got, want)
	}

	asked := e.Policy.Asked()
	sent := setupRequest(pod, prev)
	if len(asked) != 1 || !maps.Equal(asked[0].GetLabels(), sent.GetLabels()) || !maps.Equal(asked[0].GetAnnotations(), sent.GetAnnotations()) {
		t.Fatalf("policy was asked about %v, want labels %v and annotations %v", asked, sent.GetLabels(), sent.GetAnnotations())
	}

	if _, err := e.client.TeardownPodNetwork(ctx, teardownRequest(pod, prev)); err != nil {
		t.Fatalf("teardown: %v", err)
	}
	if enr := e.Enrollments(t); len(enr) != 0 {
		t.Fatalf("enrollments after teardown = %v", enr)
	}
	// Teardown again, and with the netns gone: still fine.
	if err := e.node.Del(ctx, pod, e.node.Conflist(t, "hooknet")); err != nil {
		t.Fatal(err)
	}
	if _, err := e.client.TeardownPodNetwork(ctx, teardownRequest(pod, nil)); err != nil {
		t.Fatalf("repeated teardown: %v", err)
	}
}

// TestCheckHealthReadyWhileAgentStarts: the hook answers ready while the agent
// is not ready yet (the message says what it waits for) and after; it never
// answers not-ready, which would make kubelet mark the node NotReady.
func TestCheckHealthReadyWhileAgentStarts(t *testing.T) {
	t.Parallel()
	e := newEnv(t, true, nethook.Config{})
	ctx := fixtures.Context(t, time.Minute)

	h, err := e.client.CheckHealth(ctx, &nethookpb.CheckHealthRequest{})
	if err != nil || !h.GetReady() || !strings.Contains(h.GetMessage(), agenttest.CondTest) {
		t.Fatalf("CheckHealth while the agent starts = %v, %v; want ready, naming %q", h, err, agenttest.CondTest)
	}
	e.Readiness.Set(agenttest.CondTest, true, "")
	h, err = e.client.CheckHealth(ctx, &nethookpb.CheckHealthRequest{})
	if err != nil || !h.GetReady() || !strings.Contains(h.GetMessage(), "ready") {
		t.Fatalf("CheckHealth after ready = %v, %v", h, err)
	}
	e.Readiness.Set(agenttest.CondTest, false, "data path lost")
	h, err = e.client.CheckHealth(ctx, &nethookpb.CheckHealthRequest{})
	if err != nil || !h.GetReady() || !strings.Contains(h.GetMessage(), "data path lost") {
		t.Fatalf("CheckHealth after readiness was lost = %v, %v; want ready, naming what is missing", h, err)
	}
}

func TestSetupWaitsForReadiness(t *testing.T) {
	t.Parallel()
	e := newEnv(t, true, nethook.Config{})
	ctx := fixtures.Context(t, time.Minute)
	pod := e.node.NewPod(t, "shop", "web")
	prev := prevResult(t, e.primaryAdd(t, ctx, pod))

	done := make(chan error, 1)
	go func() {
		_, err := e.client.SetupPodNetwork(ctx, setupRequest(pod, prev))
		done <- err
	}()
	select {
	case <-e.ReadyAsked:
	case err := <-done:
		t.Fatalf("setup returned (%v) while the agent was not ready", err)
	case <-ctx.Done():
		t.Fatal("the hook never got to waiting for readiness")
	}
	select {
	case err := <-done:
		t.Fatalf("setup returned (%v) before the agent was ready", err)
	default:
	}
	if enr := e.Enrollments(t); len(enr) != 0 {
		t.Fatalf("enrolled before ready: %v", enr)
	}
	e.Readiness.Set(agenttest.CondTest, true, "")
	if err := <-done; err != nil {
		t.Fatalf("setup: %v", err)
	}
	if enr := e.Enrollments(t); len(enr) != 1 {
		t.Fatalf("enrollments = %v", enr)
	}
}

func TestSetupFailsWhenNotEnrolled(t *testing.T) {
	t.Parallel()
	e := newEnv(t, true, nethook.Config{EntryConfig: gaterpc.EntryConfig{EnrollTimeout: time.Second}})
	ctx := fixtures.Context(t, time.Minute)
	pod := e.node.NewPod(t, "shop", "web")
	prev := prevResult(t, e.primaryAdd(t, ctx, pod))

	_, err := e.client.SetupPodNetwork(ctx, setupRequest(pod, prev))
	if st := status.Convert(err); st.Code() != codes.Unavailable || !strings.Contains(st.Message(), agenttest.CondTest) {
		t.Fatalf("setup with the agent never ready = %v, want Unavailable naming %q", err, agenttest.CondTest)
	}
	if enr := e.Enrollments(t); len(enr) != 0 {
		t.Fatalf("enrollments = %v", enr)
	}

	req := setupRequest(pod, prev)
	req.NetnsPath = ""
	if _, err := e.client.SetupPodNetwork(ctx, req); status.Code(err) != codes.InvalidArgument {
		t.Fatalf("setup without netns = %v, want InvalidArgument", err)
	}
}

func TestExcludedNamespacePassesThrough(t *testing.T) {
	t.Parallel()
	e := newEnv(t, true, nethook.Config{})
	ctx := fixtures.Context(t, time.Minute)
	pod := e.node.NewPod(t, "kube-system", "coredns")

	resp, err := e.client.SetupPodNetwork(ctx, setupRequest(pod, nil))
	if err != nil || !proto.Equal(resp, &nethookpb.SetupPodNetworkResponse{}) {
		t.Fatalf("setup of a kube-system pod with the agent not ready = %v, %v; want an empty pass-through", resp, err)
	}
	if enr := e.Enrollments(t); len(enr) != 0 {
		t.Fatalf("excluded pod enrolled: %v", enr)
	}
}

func TestPeerNotAllowed(t *testing.T) {
	t.Parallel()
	e := newEnv(t, false, nethook.Config{EntryConfig: gaterpc.EntryConfig{AllowedUIDs: []int{64000}}})
	ctx := fixtures.Context(t, time.Minute)
	if _, err := e.client.CheckHealth(ctx, &nethookpb.CheckHealthRequest{}); status.Code(err) != codes.PermissionDenied {
		t.Fatalf("CheckHealth from uid 0 with only uid 64000 allowed = %v, want PermissionDenied", err)
	}
}
