package kni_test

import (
	"context"
	"errors"
	"maps"
	"net/netip"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"go.uber.org/zap/zaptest"
	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"

	"github.com/mesh-cni/mesh-cni/internal/agent"
	"github.com/mesh-cni/mesh-cni/internal/agent/agenttest"
	"github.com/mesh-cni/mesh-cni/internal/gaterpc"
	"github.com/mesh-cni/mesh-cni/internal/kni"
	"github.com/mesh-cni/mesh-cni/internal/kni/knipb"
	"github.com/mesh-cni/mesh-cni/pkg/gate/gatepb"
	"github.com/mesh-cni/mesh-cni/test/fixtures"
	"github.com/mesh-cni/mesh-cni/test/harness"
	"github.com/mesh-cni/mesh-cni/test/kniruntime"
)

func TestMain(m *testing.M) {
	harness.Main(m, harness.Options{Packages: harness.ReferencePlugins()})
}

// env is a node with a KNI network runtime running its [bridge] conflist, an
// in-process agent, and the interposer in front of the runtime.
type env struct {
	*agenttest.Gate
	node    *harness.Node
	network string // the conflist's name (host-local keeps its allocations under it)
	runtime *kniruntime.Started
	client  knipb.KNIClient
	conn    *grpc.ClientConn
}

// wantCalls fails t unless the runtime got want calls of method.
func (e *env) wantCalls(t *testing.T, method string, want int) {
	t.Helper()
	if n := len(e.runtime.CallsOf(method)); n != want {
		t.Fatalf("runtime got %d %s calls, want %d", n, method, want)
	}
}

// wantNoEnrollments fails t, with format (taking the enrollments), if the
// agent holds any.
func (e *env) wantNoEnrollments(t *testing.T, format string) {
	t.Helper()
	if enr := e.Enrollments(t); len(enr) != 0 {
		t.Fatalf(format, enr)
	}
}

type envOptions struct {
	notReady    bool // start with an unmet readiness condition
	libkni      bool // the runtime serves only libkni's method names
	cfg         kni.Config
	allowedUIDs []int
}

func newEnv(t *testing.T, opts envOptions) *env {
	t.Helper()
	log := zaptest.NewLogger(t)
	node := harness.NewNode(t, harness.NodeOptions{})
	list := node.Conflist(t, "kninet")
	startRuntime := kniruntime.Start
	if opts.libkni {
		startRuntime = kniruntime.StartLibkni
	}
	e := &env{Gate: agenttest.NewGate(t, log, opts.notReady), node: node, network: list.Name, runtime: startRuntime(t, node, list)}

	dir, err := os.MkdirTemp("", "kni-")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	cfg := opts.cfg
	cfg.SocketPath = filepath.Join(dir, "run", "kni.sock")
	cfg.UpstreamSocket = e.runtime.Socket
	cfg.AllowedUIDs = opts.allowedUIDs
	cfg.Gate = e.Service
	cfg.Ready = e.Ready
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	srv, err := kni.New(ctx, log.Named("kni"), cfg)
	if err != nil {
		t.Fatalf("kni.New: %v", err)
	}
	served := make(chan error, 1)
	go func() { served <- srv.Serve() }()
	t.Cleanup(func() {
		srv.Stop(5 * time.Second)
		if err := <-served; err != nil {
			t.Errorf("serve: %v", err)
		}
	})
	for _, p := range []struct {
		path string
		mode os.FileMode
	}{{filepath.Dir(cfg.SocketPath), 0o700}, {cfg.SocketPath, 0o600}} {
		st, err := os.Stat(p.path)
		if err != nil || st.Mode().Perm() != p.mode {
			t.Fatalf("%s: mode %v, %v; want %v", p.path, st.Mode().Perm(), err, p.mode)
		}
	}
	e.conn, err = grpc.NewClient("unix://"+cfg.SocketPath, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { e.conn.Close() })
	e.client = knipb.NewKNIClient(e.conn)
	return e
}

func attachRequest(pod *harness.Pod) *knipb.AttachInterfaceRequest {
	return &knipb.AttachInterfaceRequest{
		Id:        pod.ContainerID,
		Name:      pod.Name,
		Namespace: pod.Namespace,
		Isolation: &knipb.Isolation{Path: pod.NetNSPath, Type: "namespace"},
		DnsConfig: &knipb.DNSConfig{Servers: []string{"10.96.0.10"}, Searches: []string{pod.Namespace + ".svc.cluster.local"}},
		PortMappings: []*knipb.PortMapping{
			{Protocol: knipb.Protocol_TCP, ContainerPort: 8080},
		},
		Labels: map[string]string{
			"app":                    pod.Name,
			kni.LabelPodUID:          pod.UID,
			kni.LabelPodName:         pod.Name,
			kni.LabelPodNamespace:    pod.Namespace,
			"io.kubernetes.pod.role": "test",
		},
		Annotations: map[string]string{"example.com/note": "kni test"},
	}
}

func detachRequest(pod *harness.Pod) *knipb.DetachInterfaceRequest {
	return &knipb.DetachInterfaceRequest{
		Id:        pod.ContainerID,
		Name:      pod.Name,
		Namespace: pod.Namespace,
		Isolation: &knipb.Isolation{Path: pod.NetNSPath, Type: "namespace"},
	}
}

func (e *env) allocations(t *testing.T) []harness.Allocation {
	t.Helper()
	allocs, err := e.node.Allocations(e.network)
	if err != nil {
		t.Fatal(err)
	}
	return allocs
}

// hostPrefixes turns a runtime's bare IPs into the CIDR form the gate records.
func hostPrefixes(t *testing.T, ips []string) []string {
	t.Helper()
	var out []string
	for _, s := range ips {
		a, err := netip.ParseAddr(s)
		if err != nil {
			t.Fatalf("runtime reported %q: %v", s, err)
		}
		out = append(out, netip.PrefixFrom(a, a.BitLen()).String())
	}
	return out
}

func TestAttachEnrollsAndDetachReleases(t *testing.T) {
	t.Parallel()
	e := newEnv(t, envOptions{})
	pod := e.node.NewPod(t, "shop", "web")
	ctx := fixtures.Context(t, time.Minute)
	ctx = metadata.AppendToOutgoingContext(ctx, "x-request-id", "attach-1")

	var header metadata.MD
	resp, err := e.client.AttachInterface(ctx, attachRequest(pod), grpc.Header(&header))
	if err != nil {
		t.Fatalf("attach: %v", err)
	}
	eth0 := resp.GetIpconfigs()["eth0"]
	if len(eth0.GetIp()) != 2 {
		t.Fatalf("response ipconfigs = %v, want eth0 with the runtime's two addresses", resp.GetIpconfigs())
	}
	if got := header.Get(kniruntime.HeaderRuntime); !slices.Equal(got, []string{"kniruntime"}) {
		t.Errorf("response header %s = %v: the runtime's headers did not come back", kniruntime.HeaderRuntime, got)
	}
	calls := e.runtime.CallsOf("AttachInterface")
	if len(calls) != 1 {
		t.Fatalf("runtime got %d attach calls, want 1", len(calls))
	}
	if got := calls[0].Metadata.Get("x-request-id"); !slices.Equal(got, []string{"attach-1"}) {
		t.Errorf("runtime saw x-request-id %v: metadata not forwarded", got)
	}
	// gRPC sends the deadline as a remaining time, so it arrives shifted by the
	// time in transit, rounded up: compare loosely.
	if dl, _ := ctx.Deadline(); calls[0].Deadline.Before(dl.Add(-30*time.Second)) || calls[0].Deadline.After(dl.Add(time.Second)) {
		t.Errorf("runtime saw deadline %v, want the caller's %v", calls[0].Deadline, dl)
	}

	// The pod is enrolled, from the KNI entry point, in its own netns, with the
	// runtime's interfaces.
	enr := e.Enrollments(t)
	if len(enr) != 1 {
		t.Fatalf("enrollments = %v, want the pod", enr)
	}
	got := enr[0]
	want := &gatepb.Enrollment{
		Pod:        &gatepb.PodIdentity{Namespace: pod.Namespace, Name: pod.Name, Uid: pod.UID},
		Attachment: &gatepb.Attachment{ContainerId: pod.ContainerID, Ifname: "eth0", Network: kni.DefaultNetwork},
		NetnsPath:  pod.NetNSPath,
		Interfaces: []*gatepb.Interface{{Name: "eth0", Mac: eth0.GetMac(), Addresses: hostPrefixes(t, eth0.GetIp())}},
		Source:     gatepb.Source_SOURCE_KNI,
	}
	got.NetnsCookie, got.EnrolledAtUnixNano = 0, 0
	if !proto.Equal(got, want) {
		t.Fatalf("enrollment =\n%v\nwant\n%v", got, want)
	}

	// Labels and annotations reach the agent's policy as kubelet sent them.
	asked := e.Policy.Asked()
	sent := attachRequest(pod)
	if len(asked) != 1 || !maps.Equal(asked[0].GetLabels(), sent.GetLabels()) || !maps.Equal(asked[0].GetAnnotations(), sent.GetAnnotations()) {
		t.Fatalf("policy was asked about %v, want labels %v and annotations %v", asked, sent.GetLabels(), sent.GetAnnotations())
	}

	// Other calls go through as they are.
	q, err := e.client.QueryPodNetwork(ctx, &knipb.QueryPodNetworkRequest{Id: pod.ContainerID, Name: pod.Name, Namespace: pod.Namespace})
	if err != nil || !proto.Equal(q.GetIpconfigs()["eth0"], eth0) {
		t.Fatalf("QueryPodNetwork = %v, %v; want eth0 %v", q, err, eth0)
	}

	if _, err := e.client.DetachInterface(ctx, detachRequest(pod)); err != nil {
		t.Fatalf("detach: %v", err)
	}
	e.wantNoEnrollments(t, "enrollments after detach = %v, want none")
	e.wantCalls(t, "DetachInterface", 1)
	if a := e.allocations(t); len(a) != 0 {
		t.Fatalf("host-local allocations after detach = %v, want none", a)
	}
	// A second detach (kubelet retries) is fine.
	if _, err := e.client.DetachInterface(ctx, detachRequest(pod)); err != nil {
		t.Fatalf("repeated detach: %v", err)
	}
}

func TestOtherMethodsAreForwarded(t *testing.T) {
	t.Parallel()
	e := newEnv(t, envOptions{})
	ctx := fixtures.Context(t, time.Minute)

	nets, err := e.client.QueryNodeNetworks(ctx, &knipb.QueryNodeNetworksRequest{})
	if err != nil || len(nets.GetNetworks()) != 1 || nets.GetNetworks()[0].GetName() != e.network || !nets.GetNetworks()[0].GetReady() {
		t.Fatalf("QueryNodeNetworks = %v, %v", nets, err)
	}
	if _, err := e.client.SetupNodeNetwork(ctx, &knipb.SetupNodeNetworkRequest{}); err != nil {
		t.Fatalf("SetupNodeNetwork: %v", err)
	}
	// The test runtime does not implement CreateNetwork: its answer comes back.
	_, err = e.client.CreateNetwork(ctx, &knipb.CreateNetworkRequest{Name: "p", Namespace: "default"})
	if status.Code(err) != codes.Unimplemented || len(e.runtime.CallsOf("CreateNetwork")) != 1 {
		t.Fatalf("CreateNetwork = %v (runtime calls %d), want the runtime's Unimplemented", err, len(e.runtime.CallsOf("CreateNetwork")))
	}
	// A service the interposer does not know is forwarded byte for byte.
	h, err := healthpb.NewHealthClient(e.conn).Check(ctx, &healthpb.HealthCheckRequest{})
	if err != nil || h.GetStatus() != healthpb.HealthCheckResponse_SERVING {
		t.Fatalf("health check through the interposer = %v, %v; want the runtime's SERVING", h, err)
	}
	// A method neither knows: the runtime's own answer comes back.
	err = e.conn.Invoke(ctx, "/kni.KNI/SomeFutureMethod", &knipb.QueryNodeNetworksRequest{}, &knipb.QueryNodeNetworksResponse{})
	if st := status.Convert(err); st.Code() != codes.Unimplemented || !strings.Contains(st.Message(), "SomeFutureMethod") {
		t.Fatalf("unknown method = %v, want the runtime's Unimplemented", err)
	}
}

func TestUpstreamErrorPassesThroughUnchanged(t *testing.T) {
	t.Parallel()
	e := newEnv(t, envOptions{})
	pod := e.node.NewPod(t, "shop", "web")
	ctx := fixtures.Context(t, time.Minute)

	injected, err := status.New(codes.ResourceExhausted, "no addresses left in 10.0.0.0/24").
		WithDetails(&errdetails.ErrorInfo{Reason: "POOL_EXHAUSTED", Domain: "kniruntime.test"})
	if err != nil {
		t.Fatal(err)
	}
	e.runtime.Fail("AttachInterface", injected.Err())
	_, err = e.client.AttachInterface(ctx, attachRequest(pod))
	if got := status.Convert(err); !proto.Equal(got.Proto(), injected.Proto()) {
		t.Fatalf("attach error = %v, want the runtime's %v unchanged (code, message, details)", got.Proto(), injected.Proto())
	}
	e.wantNoEnrollments(t, "a failed attach enrolled %v")
	e.wantCalls(t, "DetachInterface", 0)

	// Detach errors pass through too, after the release.
	e.runtime.Fail("DetachInterface", status.Error(codes.Unavailable, "runtime busy"))
	_, err = e.client.DetachInterface(ctx, detachRequest(pod))
	if st := status.Convert(err); st.Code() != codes.Unavailable || st.Message() != "runtime busy" {
		t.Fatalf("detach error = %v, want the runtime's", err)
	}
}

func TestAttachNetworkOldNames(t *testing.T) {
	t.Parallel()
	e := newEnv(t, envOptions{})
	pod := e.node.NewPod(t, "shop", "legacy")
	ctx := fixtures.Context(t, time.Minute)

	// The netns in extradata instead of isolation, as some runtimes send it.
	req := attachRequest(pod)
	req.Isolation = nil
	req.Extradata = map[string]string{kni.ExtradataNetns: pod.NetNSPath}
	resp, err := e.client.AttachNetwork(ctx, req)
	if err != nil || len(resp.GetIpconfigs()["eth0"].GetIp()) != 2 {
		t.Fatalf("AttachNetwork = %v, %v", resp, err)
	}
	e.wantCalls(t, "AttachNetwork", 1)
	enr := e.Enrollments(t)
	if len(enr) != 1 || enr[0].GetNetnsPath() != pod.NetNSPath || enr[0].GetSource() != gatepb.Source_SOURCE_KNI {
		t.Fatalf("enrollments = %v, want the pod from KNI in %s", enr, pod.NetNSPath)
	}
	if _, err := e.client.DetachNetwork(ctx, detachRequest(pod)); err != nil {
		t.Fatalf("DetachNetwork: %v", err)
	}
	e.wantCalls(t, "DetachNetwork", 1)
	e.wantNoEnrollments(t, "enrollments after DetachNetwork = %v")
}

// TestLibkniUpstream: in front of a runtime that serves only libkni's names
// (AttachInterface/DetachInterface, as kni-api v0.0.8 = commit
// b7b61d2d455d1c08c9d712d14a2f2e515b723025 declares them and libkni v0.3.0 =
// commit 81fe78d04cf748697e9cf8adf5461cbea9386d4b serves them; see
// kniruntime.StartLibkni), kubelet's
// AttachNetwork/DetachNetwork work: the runtime's Unimplemented is retried under
// the other name. An attach that cannot be enrolled is undone the same way.
func TestLibkniUpstream(t *testing.T) {
	t.Parallel()
	e := newEnv(t, envOptions{libkni: true})
	pod := e.node.NewPod(t, "shop", "kubelet-fork")
	ctx := fixtures.Context(t, time.Minute)

	// The runtime really knows only the new names.
	up, err := grpc.NewClient("unix://"+e.runtime.Socket, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	defer up.Close()
	if _, err := knipb.NewKNIClient(up).AttachNetwork(ctx, attachRequest(pod)); status.Code(err) != codes.Unimplemented {
		t.Fatalf("AttachNetwork straight to the libkni-named runtime = %v, want Unimplemented", err)
	}

	resp, err := e.client.AttachNetwork(ctx, attachRequest(pod))
	if err != nil || len(resp.GetIpconfigs()["eth0"].GetIp()) != 2 {
		t.Fatalf("AttachNetwork through the interposer = %v, %v", resp, err)
	}
	e.wantCalls(t, "AttachInterface", 1)
	if enr := e.Enrollments(t); len(enr) != 1 || enr[0].GetNetnsPath() != pod.NetNSPath {
		t.Fatalf("enrollments = %v, want the pod", enr)
	}
	if _, err := e.client.DetachNetwork(ctx, detachRequest(pod)); err != nil {
		t.Fatalf("DetachNetwork through the interposer: %v", err)
	}
	e.wantCalls(t, "DetachInterface", 1)
	e.wantNoEnrollments(t, "enrollments after DetachNetwork = %v")
	if a := e.runtime.Attached(); len(a) != 0 {
		t.Fatalf("runtime still holds %v", a)
	}
}

// TestLibkniUpstreamUndo: an AttachNetwork whose pod cannot be enrolled is
// undone with DetachInterface on a libkni-named runtime.
func TestLibkniUpstreamUndo(t *testing.T) {
	t.Parallel()
	e := newEnv(t, envOptions{libkni: true, notReady: true, cfg: kni.Config{EntryConfig: gaterpc.EntryConfig{EnrollTimeout: time.Second}}})
	pod := e.node.NewPod(t, "shop", "undo")
	ctx := fixtures.Context(t, time.Minute)
	if _, err := e.client.AttachNetwork(ctx, attachRequest(pod)); status.Code(err) != codes.Unavailable {
		t.Fatalf("AttachNetwork with the agent never ready = %v, want Unavailable", err)
	}
	e.wantCalls(t, "DetachInterface", 1)
	if a := e.runtime.Attached(); len(a) != 0 {
		t.Fatalf("runtime still holds %v", a)
	}
}

func TestAttachWaitsForReadiness(t *testing.T) {
	t.Parallel()
	e := newEnv(t, envOptions{notReady: true})
	pod := e.node.NewPod(t, "shop", "web")
	ctx := fixtures.Context(t, time.Minute)

	type result struct {
		resp *knipb.AttachInterfaceResponse
		err  error
	}
	done := make(chan result, 1)
	go func() {
		resp, err := e.client.AttachInterface(ctx, attachRequest(pod))
		done <- result{resp, err}
	}()
	select {
	case <-e.ReadyAsked:
	case r := <-done:
		t.Fatalf("attach returned (%v, %v) while the agent was not ready", r.resp, r.err)
	case <-ctx.Done():
		t.Fatal("the interposer never got to waiting for readiness")
	}
	// The runtime has attached the pod; the agent holds it back.
	if err := e.runtime.WaitForCalls(ctx, "AttachInterface", 1); err != nil {
		t.Fatal(err)
	}
	select {
	case r := <-done:
		t.Fatalf("attach returned (%v, %v) before the agent was ready", r.resp, r.err)
	default:
	}
	e.wantNoEnrollments(t, "enrolled before ready: %v")

	e.Readiness.Set(agenttest.CondTest, true, "")
	r := <-done
	if r.err != nil {
		t.Fatalf("attach after readiness: %v", r.err)
	}
	if enr := e.Enrollments(t); len(enr) != 1 || enr[0].GetAttachment().GetContainerId() != pod.ContainerID {
		t.Fatalf("enrollments = %v, want the pod", enr)
	}
}

func TestAttachUndoneWhenNotEnrolled(t *testing.T) {
	t.Parallel()
	e := newEnv(t, envOptions{notReady: true, cfg: kni.Config{EntryConfig: gaterpc.EntryConfig{EnrollTimeout: time.Second}}})
	pod := e.node.NewPod(t, "shop", "web")
	ctx := fixtures.Context(t, time.Minute)

	_, err := e.client.AttachInterface(ctx, attachRequest(pod))
	st := status.Convert(err)
	if st.Code() != codes.Unavailable {
		t.Fatalf("attach with the agent never ready = %v, want Unavailable", err)
	}
	t.Logf("caller sees: %v", err)
	e.wantCalls(t, "DetachInterface", 1)
	if a := e.runtime.Attached(); len(a) != 0 {
		t.Fatalf("runtime still holds %v", a)
	}
	if a := e.allocations(t); len(a) != 0 {
		t.Fatalf("host-local allocations after the undo = %v, want none", a)
	}
	e.wantNoEnrollments(t, "enrollments = %v")
}

func TestCallerDeadlineBoundsTheWait(t *testing.T) {
	t.Parallel()
	e := newEnv(t, envOptions{notReady: true})
	pod := e.node.NewPod(t, "shop", "web")
	ctx := fixtures.Context(t, time.Minute)

	// EnrollTimeout is 30 s by default; kubelet's own deadline is shorter.
	callCtx, callCancel := context.WithTimeout(ctx, 2*time.Second)
	defer callCancel()
	_, err := e.client.AttachInterface(callCtx, attachRequest(pod))
	if code := status.Code(err); code != codes.DeadlineExceeded && code != codes.Unavailable {
		t.Fatalf("attach = %v, want it to end with the caller's deadline", err)
	}
	// The undo runs after the caller has gone; it still happens.
	if err := e.runtime.WaitForCalls(ctx, "DetachInterface", 1); err != nil {
		t.Fatal(err)
	}
	if a := e.allocations(t); len(a) != 0 {
		t.Fatalf("host-local allocations after the undo = %v, want none", a)
	}
}

func TestExcludedNamespacePassesThrough(t *testing.T) {
	t.Parallel()
	e := newEnv(t, envOptions{notReady: true})
	pod := e.node.NewPod(t, "kube-system", "coredns")
	ctx := fixtures.Context(t, time.Minute)

	if _, err := e.client.AttachInterface(ctx, attachRequest(pod)); err != nil {
		t.Fatalf("attach of a kube-system pod with the agent not ready: %v", err)
	}
	e.wantNoEnrollments(t, "excluded pod enrolled: %v")
	if _, err := e.client.DetachInterface(ctx, detachRequest(pod)); err != nil {
		t.Fatalf("detach: %v", err)
	}
}

func TestUnenrollablePodIsRefusedBeforeTheRuntime(t *testing.T) {
	t.Parallel()
	e := newEnv(t, envOptions{})
	pod := e.node.NewPod(t, "shop", "web")
	ctx := fixtures.Context(t, time.Minute)

	req := attachRequest(pod)
	req.Name = "Not_A_Pod_Name"
	delete(req.Labels, kni.LabelPodName)
	_, err := e.client.AttachInterface(ctx, req)
	if status.Code(err) != codes.InvalidArgument {
		t.Fatalf("attach = %v, want InvalidArgument", err)
	}
	e.wantCalls(t, "AttachInterface", 0)
}

func TestPeerNotAllowed(t *testing.T) {
	t.Parallel()
	e := newEnv(t, envOptions{allowedUIDs: []int{64000}})
	ctx := fixtures.Context(t, time.Minute)
	_, err := e.client.QueryNodeNetworks(ctx, &knipb.QueryNodeNetworksRequest{})
	if status.Code(err) != codes.PermissionDenied {
		t.Fatalf("call from uid 0 with only uid 64000 allowed = %v, want PermissionDenied", err)
	}
	_, err = healthpb.NewHealthClient(e.conn).Check(ctx, &healthpb.HealthCheckRequest{})
	if status.Code(err) != codes.PermissionDenied {
		t.Fatalf("forwarded call from a peer not allowed = %v, want PermissionDenied", err)
	}
	if n := len(e.runtime.Calls()); n != 0 {
		t.Fatalf("runtime got %d calls from a peer not allowed", n)
	}
}

func TestNewRejectsBadConfig(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	log := zaptest.NewLogger(t)
	for name, cfg := range map[string]kni.Config{
		"no gate":           {EntryConfig: gaterpc.EntryConfig{SocketPath: "/run/x/kni.sock"}, UpstreamSocket: "/run/y.sock"},
		"relative socket":   {EntryConfig: gaterpc.EntryConfig{SocketPath: "kni.sock", Gate: &agent.Service{}}, UpstreamSocket: "/run/y.sock"},
		"relative upstream": {EntryConfig: gaterpc.EntryConfig{SocketPath: "/run/x/kni.sock", Gate: &agent.Service{}}, UpstreamSocket: "y.sock"},
		"same socket":       {EntryConfig: gaterpc.EntryConfig{SocketPath: "/run/x/kni.sock", Gate: &agent.Service{}}, UpstreamSocket: "/run/x/kni.sock"},
	} {
		if _, err := kni.New(ctx, log, cfg); err == nil {
			t.Errorf("%s: New succeeded", name)
		} else if errors.Is(err, context.Canceled) {
			t.Errorf("%s: %v", name, err)
		}
	}
}
