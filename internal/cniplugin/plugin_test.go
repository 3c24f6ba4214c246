package cniplugin

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/containernetworking/cni/pkg/skel"
	"github.com/containernetworking/cni/pkg/types"
	types100 "github.com/containernetworking/cni/pkg/types/100"
	"github.com/containernetworking/plugins/pkg/testutils"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/health"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"

	"github.com/mesh-cni/mesh-cni/pkg/gate/gatepb"
)

// fakeGate is a gate server on a real Unix socket: it records what the plugin
// sends and answers as told.
type fakeGate struct {
	gatepb.UnimplementedGateServer
	socket string
	health *health.Server

	mu    sync.Mutex
	calls []proto.Message
	err   error // returned by every verb when set
}

func startFakeGate(t *testing.T) *fakeGate {
	t.Helper()
	g := &fakeGate{socket: filepath.Join(t.TempDir(), "gate.sock"), health: health.NewServer()}
	l, err := net.Listen("unix", g.socket)
	if err != nil {
		t.Fatal(err)
	}
	srv := grpc.NewServer()
	gatepb.RegisterGateServer(srv, g)
	healthpb.RegisterHealthServer(srv, g.health)
	go srv.Serve(l)
	t.Cleanup(srv.Stop)
	return g
}

func (g *fakeGate) record(m proto.Message) error {
	g.mu.Lock()
	defer g.mu.Unlock()
	g.calls = append(g.calls, m)
	return g.err
}

func (g *fakeGate) fail(err error) {
	g.mu.Lock()
	g.err = err
	g.mu.Unlock()
}

func (g *fakeGate) last(t *testing.T) proto.Message {
	t.Helper()
	g.mu.Lock()
	defer g.mu.Unlock()
	if len(g.calls) == 0 {
		t.Fatal("the gate was never called")
	}
	return g.calls[len(g.calls)-1]
}

func (g *fakeGate) count() int {
	g.mu.Lock()
	defer g.mu.Unlock()
	return len(g.calls)
}

func (g *fakeGate) Add(_ context.Context, r *gatepb.AddRequest) (*gatepb.AddResponse, error) {
	if err := g.record(r); err != nil {
		return nil, err
	}
	return &gatepb.AddResponse{Decision: gatepb.Decision_DECISION_ENROLLED, Reason: "test", NetnsCookie: 42}, nil
}

func (g *fakeGate) Del(_ context.Context, r *gatepb.DelRequest) (*gatepb.DelResponse, error) {
	if err := g.record(r); err != nil {
		return nil, err
	}
	return &gatepb.DelResponse{Released: true}, nil
}

func (g *fakeGate) Check(_ context.Context, r *gatepb.CheckRequest) (*gatepb.CheckResponse, error) {
	if err := g.record(r); err != nil {
		return nil, err
	}
	return &gatepb.CheckResponse{Decision: gatepb.Decision_DECISION_ENROLLED}, nil
}

func (g *fakeGate) GC(_ context.Context, r *gatepb.GCRequest) (*gatepb.GCResponse, error) {
	if err := g.record(r); err != nil {
		return nil, err
	}
	return &gatepb.GCResponse{}, nil
}

// primaryResult is a primary plugin's result (bridge-like: host veth, pod eth0
// with one address of each family) in the given spec version's shape.
func primaryResult(t *testing.T, cniVersion, netnsPath string) map[string]any {
	t.Helper()
	r := &types100.Result{
		CNIVersion: "1.1.0",
		Interfaces: []*types100.Interface{{Name: "veth1", Mac: "0a:00:00:00:00:01"}, {Name: "eth0", Mac: "0a:00:00:00:00:02", Sandbox: netnsPath}},
	}
	one := 1
	for _, a := range []string{"10.1.0.5/24", "fd00::5/64"} {
		ip, n, _ := net.ParseCIDR(a)
		n.IP = ip
		r.IPs = append(r.IPs, &types100.IPConfig{Interface: &one, Address: *n})
	}
	conv, err := r.GetAsVersion(cniVersion)
	if err != nil {
		t.Fatal(err)
	}
	data, err := json.Marshal(conv)
	if err != nil {
		t.Fatal(err)
	}
	var m map[string]any
	if err := json.Unmarshal(data, &m); err != nil {
		t.Fatal(err)
	}
	return m
}

func netconf(t *testing.T, g *fakeGate, cniVersion string, extra map[string]any) []byte {
	t.Helper()
	c := map[string]any{"cniVersion": cniVersion, "name": "meshnet", "type": "mesh-cni", "socketPath": g.socket, "gateTimeout": "2s", "delTimeout": "2s"}
	for k, v := range extra {
		c[k] = v
	}
	data, err := json.Marshal(c)
	if err != nil {
		t.Fatal(err)
	}
	return data
}

// The plugin's netns check needs a network namespace file: its own process's
// is one a test without privileges may open.
const ownNetns = "/proc/self/ns/net"

func podArgs(namespace string) string {
	return "IgnoreUnknown=1;K8S_POD_NAMESPACE=" + namespace + ";K8S_POD_NAME=web-0;K8S_POD_UID=0f1e2d3c-aaaa-bbbb-cccc-123456789abc"
}

func cmdArgs(stdin []byte, args string) *skel.CmdArgs {
	return &skel.CmdArgs{ContainerID: "c0ffee", Netns: ownNetns, IfName: "eth0", Args: args, Path: "/opt/cni/bin", StdinData: stdin}
}

func cniCode(t *testing.T, err error) uint {
	t.Helper()
	var e *types.Error
	if !errors.As(err, &e) {
		t.Fatalf("error %v (%T) is not a CNI error", err, err)
	}
	return e.Code
}

// ADD of every supported spec version, in-process against a gate socket: the
// request names the pod, its attachment and the interfaces the primary put in
// the pod, and the primary's result comes back unchanged in the same version.
func TestAddEveryVersion(t *testing.T) {
	g := startFakeGate(t)
	p := Plugin{Stdout: os.Stdout, Stderr: new(strings.Builder)}
	for _, v := range supportedVersions.SupportedVersions() {
		t.Run(v, func(t *testing.T) {
			prev := primaryResult(t, v, ownNetns)
			stdin := netconf(t, g, v, map[string]any{"prevResult": prev})
			res, out, err := testutils.CmdAddWithArgs(cmdArgs(stdin, podArgs("shop")), func() error { return p.Add(cmdArgs(stdin, podArgs("shop"))) })
			if err != nil {
				t.Fatal(err)
			}
			if res.Version() != v {
				t.Errorf("result in version %s, want %s", res.Version(), v)
			}
			var got, want map[string]any
			if err := json.Unmarshal(out, &got); err != nil {
				t.Fatal(err)
			}
			wantJSON, _ := json.Marshal(prev)
			_ = json.Unmarshal(wantJSON, &want)
			want["cniVersion"] = v
			if g, w := fmt.Sprint(got), fmt.Sprint(want); g != w {
				t.Errorf("result %s, want the prevResult %s", g, w)
			}
			req, ok := g.last(t).(*gatepb.AddRequest)
			if !ok {
				t.Fatalf("last call %T, want an Add", g.last(t))
			}
			if req.GetPod().GetNamespace() != "shop" || req.GetPod().GetName() != "web-0" || req.GetPod().GetUid() == "" ||
				req.GetAttachment().GetContainerId() != "c0ffee" || req.GetAttachment().GetIfname() != "eth0" || req.GetAttachment().GetNetwork() != "meshnet" ||
				req.GetNetnsPath() != ownNetns || req.GetSource() != gatepb.Source_SOURCE_CNI {
				t.Errorf("add request %v", req)
			}
			if ifs := req.GetInterfaces(); len(ifs) != 1 || ifs[0].GetName() != "eth0" || strings.Join(ifs[0].GetAddresses(), ",") != "10.1.0.5/24,fd00::5/64" {
				t.Errorf("interfaces %v, want eth0 with the pod's two addresses", ifs)
			}
		})
	}
}

// What ADD does without the agent's yes: a pod of an excluded namespace passes
// without asking; an agent that cannot admit the pod, or none at all, fails it
// with "try again later" (the runtime retries); a refusal gets its own code.
func TestAddRefusals(t *testing.T) {
	g := startFakeGate(t)
	p := Plugin{Stdout: os.Stdout, Stderr: new(strings.Builder)}
	const v = "1.0.0"
	stdin := netconf(t, g, v, map[string]any{"prevResult": primaryResult(t, v, ownNetns), "excludeNamespaces": []string{"kube-system"}})
	add := func(args string) error {
		_, _, err := testutils.CmdAddWithArgs(cmdArgs(stdin, args), func() error { return p.Add(cmdArgs(stdin, args)) })
		return err
	}
	if err := add(podArgs("kube-system")); err != nil || g.count() != 0 {
		t.Errorf("excluded namespace: %v, %d gate calls; want a pass without asking", err, g.count())
	}
	for _, c := range []struct {
		err  error
		code uint
	}{
		{status.Error(codes.Aborted, "enrollment source unreachable"), types.ErrTryAgainLater},
		{status.Error(codes.Unavailable, "not ready"), types.ErrTryAgainLater},
		{status.Error(codes.InvalidArgument, "bad uid"), ErrRequestRejected},
		{status.Error(codes.PermissionDenied, "uid 65534"), ErrGateRefused},
		{status.Error(codes.Internal, "datapath"), ErrEnrollFailed},
	} {
		g.fail(c.err)
		if got := cniCode(t, add(podArgs("shop"))); got != c.code {
			t.Errorf("agent answering %v: code %d, want %d", c.err, got, c.code)
		}
	}
	g.fail(nil)
	if got := cniCode(t, add("K8S_POD_NAME=web-0")); got == 0 {
		t.Error("ADD without the pod's namespace passed")
	}
	noPrev := netconf(t, g, v, nil)
	_, _, err := testutils.CmdAddWithArgs(cmdArgs(noPrev, podArgs("shop")), func() error { return p.Add(cmdArgs(noPrev, podArgs("shop"))) })
	if got := cniCode(t, err); got != types.ErrInvalidNetworkConfig {
		t.Errorf("ADD with no prevResult: code %d, want %d", got, types.ErrInvalidNetworkConfig)
	}
	notNetns := cmdArgs(stdin, podArgs("shop"))
	notNetns.Netns = "/proc/self/ns/mnt"
	_, _, err = testutils.CmdAddWithArgs(notNetns, func() error { return p.Add(notNetns) })
	if got := cniCode(t, err); got != types.ErrInvalidNetNS {
		t.Errorf("ADD with a mount namespace for CNI_NETNS: code %d, want %d", got, types.ErrInvalidNetNS)
	}

	gone := netconf(t, &fakeGate{socket: filepath.Join(t.TempDir(), "none.sock")}, v, map[string]any{"prevResult": primaryResult(t, v, ownNetns), "gateTimeout": "300ms"})
	start := time.Now()
	_, _, err = testutils.CmdAddWithArgs(cmdArgs(gone, podArgs("shop")), func() error { return p.Add(cmdArgs(gone, podArgs("shop"))) })
	if got := cniCode(t, err); got != types.ErrTryAgainLater || time.Since(start) > 10*time.Second {
		t.Errorf("no agent: code %d after %v, want %d within the gate timeout", got, time.Since(start), types.ErrTryAgainLater)
	}
}

// DEL is best effort: it passes the attachment on, and succeeds whatever the
// agent answers or when there is none; only a config it cannot read fails it.
func TestDelBestEffortInProcess(t *testing.T) {
	g := startFakeGate(t)
	p := Plugin{Stdout: os.Stdout, Stderr: new(strings.Builder)}
	for _, v := range supportedVersions.SupportedVersions() {
		stdin := netconf(t, g, v, nil)
		args := cmdArgs(stdin, podArgs("shop"))
		if err := testutils.CmdDelWithArgs(args, func() error { return p.Del(args) }); err != nil {
			t.Fatalf("%s: %v", v, err)
		}
		req, ok := g.last(t).(*gatepb.DelRequest)
		if !ok || req.GetAttachment().GetContainerId() != "c0ffee" || req.GetPod().GetName() != "web-0" || req.GetNetnsPath() != ownNetns {
			t.Errorf("%s: del request %v", v, g.last(t))
		}
	}
	g.fail(status.Error(codes.Internal, "boom"))
	stdin := netconf(t, g, "1.1.0", nil)
	args := cmdArgs(stdin, podArgs("shop"))
	if err := testutils.CmdDelWithArgs(args, func() error { return p.Del(args) }); err != nil {
		t.Errorf("DEL with the agent failing: %v", err)
	}
	gone := cmdArgs(netconf(t, &fakeGate{socket: filepath.Join(t.TempDir(), "none.sock")}, "1.1.0", map[string]any{"delTimeout": "200ms"}), "")
	gone.Netns = ""
	if err := testutils.CmdDelWithArgs(gone, func() error { return p.Del(gone) }); err != nil {
		t.Errorf("DEL with no agent and no netns: %v", err)
	}
	bad := cmdArgs([]byte("{"), "")
	if err := testutils.CmdDelWithArgs(bad, func() error { return p.Del(bad) }); err == nil {
		t.Error("DEL with a config that does not parse succeeded")
	}
}

// CHECK (0.4.0 and later), GC and STATUS (1.1.0) ask the gate; CHECK maps a
// broken redirection to its own code, STATUS an agent not serving to "plugin
// not available".
func TestCheckGCStatus(t *testing.T) {
	g := startFakeGate(t)
	p := Plugin{Stdout: os.Stdout, Stderr: new(strings.Builder)}
	for _, v := range []string{"0.4.0", "1.0.0", "1.1.0"} {
		stdin := netconf(t, g, v, map[string]any{"prevResult": primaryResult(t, v, ownNetns)})
		args := cmdArgs(stdin, podArgs("shop"))
		if err := testutils.CmdCheckWithArgs(args, func() error { return p.Check(args) }); err != nil {
			t.Fatalf("CHECK %s: %v", v, err)
		}
		if req, ok := g.last(t).(*gatepb.CheckRequest); !ok || req.GetAttachment().GetContainerId() != "c0ffee" {
			t.Errorf("CHECK %s: request %v", v, g.last(t))
		}
	}
	stdin := netconf(t, g, "1.1.0", map[string]any{"prevResult": primaryResult(t, "1.1.0", ownNetns)})
	args := cmdArgs(stdin, podArgs("shop"))
	g.fail(status.Error(codes.FailedPrecondition, "link detached"))
	if got := cniCode(t, testutils.CmdCheckWithArgs(args, func() error { return p.Check(args) })); got != ErrNotIntact {
		t.Errorf("CHECK of a broken pod: code %d, want %d", got, ErrNotIntact)
	}
	g.fail(nil)

	gcConf := netconf(t, g, "1.1.0", map[string]any{"cni.dev/valid-attachments": []map[string]string{{"containerID": "a1", "ifname": "eth0"}, {"containerID": "b2", "ifname": "net1"}}})
	gcArgs := cmdArgs(gcConf, "")
	if err := p.GC(gcArgs); err != nil {
		t.Fatal(err)
	}
	req, ok := g.last(t).(*gatepb.GCRequest)
	if !ok || req.GetNetwork() != "meshnet" || len(req.GetValid()) != 2 || req.GetValid()[1].GetContainerId() != "b2" || req.GetValid()[1].GetIfname() != "net1" {
		t.Errorf("GC request %v", g.last(t))
	}

	// STATUS holds the node's network readiness: an agent that is not ready
	// (or gone) must not make the kubelet mark the node NotReady.
	statusArgs := cmdArgs(netconf(t, g, "1.1.0", nil), "")
	for _, st := range []healthpb.HealthCheckResponse_ServingStatus{healthpb.HealthCheckResponse_SERVING, healthpb.HealthCheckResponse_NOT_SERVING} {
		g.health.SetServingStatus("", st)
		if err := testutils.CmdStatus(func() error { return p.Status(statusArgs) }); err != nil {
			t.Errorf("STATUS with the agent %s: %v", st, err)
		}
	}
	if got := cniCode(t, testutils.CmdStatus(func() error {
		return p.Status(cmdArgs([]byte(`{"cniVersion":"1.1.0","name":"x","type":"mesh-cni","gateTimeout":"forever"}`), ""))
	})); got != types.ErrDecodingFailure && got != types.ErrInvalidNetworkConfig {
		t.Errorf("STATUS with an unusable entry: code %d, want the config's error", got)
	}
}
