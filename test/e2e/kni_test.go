package e2e

import (
	"bytes"
	"context"
	"errors"
	"net/netip"
	"os"
	"path/filepath"
	"slices"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"

	"github.com/mesh-cni/mesh-cni/internal/kni"
	"github.com/mesh-cni/mesh-cni/internal/kni/knipb"
	"github.com/mesh-cni/mesh-cni/pkg/gate/gatepb"
	"github.com/mesh-cni/mesh-cni/test/harness"
	"github.com/mesh-cni/mesh-cni/test/kniruntime"
	"github.com/mesh-cni/mesh-cni/test/proxy"
)

// agentPath is a path next to the agent's gate socket directory, in the agent's
// own short-named temporary directory (removed in its cleanup).
func (a *agent) agentPath(elem ...string) string {
	return filepath.Join(append([]string{filepath.Dir(filepath.Dir(a.Socket))}, elem...)...)
}

// dialUnixGRPC is a client connection to a gRPC server on a Unix socket, closed
// in cleanup. Calls fail fast when nobody listens (no wait-for-ready).
func dialUnixGRPC(t *testing.T, socket string) *grpc.ClientConn {
	t.Helper()
	conn, err := grpc.NewClient("unix://"+socket, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatalf("client for %s: %v", socket, err)
	}
	t.Cleanup(func() { conn.Close() })
	return conn
}

// enrollmentOf is the agent's enrollment of the sandbox, nil if there is none.
func enrollmentOf(ctx context.Context, a *agent, containerID string) *gatepb.Enrollment {
	for _, e := range a.list(ctx).GetEnrollments() {
		if e.GetAttachment().GetContainerId() == containerID {
			return e
		}
	}
	return nil
}

// checkThroughSidecars runs the reference proxy as a sidecar in both pods, serves
// an echo application on b:8080 and proves that a connection from a to each of
// b's addresses went out through a's proxy and in through b's, both of which
// recovered the original destination, and that b's application never saw a.
func checkThroughSidecars(ctx context.Context, t *testing.T, a, b *meshPod, aAddrs, bAddrs []netip.Addr) {
	t.Helper()
	a.startProxy(ctx, t)
	b.startProxy(ctx, t)
	app := b.ServeEcho(t, 8080)
	payload := bytes.Repeat([]byte("entry point "), 4<<10)
	if len(bAddrs) == 0 {
		t.Fatalf("pod %s has no addresses", b.Name)
	}
	for i, dst := range bAddrs {
		target := netip.AddrPortFrom(dst, 8080)
		if err := a.EchoRoundTrip(ctx, target, payload); err != nil {
			t.Fatalf("%s -> %s: %v", a.Name, target, err)
		}
		out := proxy.AwaitRecords(ctx, t, a.records, i+1)[i]
		if out.Direction != "outbound" || !sameAddrPort(out.OriginalDst, target) || out.DstSource != "getsockopt" || out.Error != "" {
			t.Fatalf("%s's proxy recorded %+v, want outbound to %s via getsockopt", a.Name, out, target)
		}
		in := proxy.AwaitRecords(ctx, t, b.records, i+1)[i]
		if in.Direction != "inbound" || !sameAddrPort(in.OriginalDst, target) || in.DstSource != "getsockopt" || in.Error != "" {
			t.Fatalf("%s's proxy recorded %+v, want inbound to %s via getsockopt", b.Name, in, target)
		}
		if int(in.BytesToDst) != len(payload) {
			t.Fatalf("%s's proxy forwarded %d bytes, want %d", b.Name, in.BytesToDst, len(payload))
		}
	}
	for _, c := range app.Clients() {
		if slices.Contains(aAddrs, c) {
			t.Fatalf("%s's application saw %s directly: its inbound proxy was bypassed", b.Name, c)
		}
	}
}

// kniRequest is the attach kubelet sends for a pod sandbox.
func kniRequest(p *harness.Pod) *knipb.AttachInterfaceRequest {
	return &knipb.AttachInterfaceRequest{
		Id:        p.ContainerID,
		Name:      p.Name,
		Namespace: p.Namespace,
		Isolation: &knipb.Isolation{Path: p.NetNSPath, Type: "namespace"},
		Labels: map[string]string{
			kni.LabelPodUID:       p.UID,
			kni.LabelPodName:      p.Name,
			kni.LabelPodNamespace: p.Namespace,
		},
	}
}

func kniDetachRequest(p *harness.Pod) *knipb.DetachInterfaceRequest {
	req := kniRequest(p)
	return &knipb.DetachInterfaceRequest{Id: req.Id, Name: req.Name, Namespace: req.Namespace, Isolation: req.Isolation, Labels: req.Labels}
}

// kniAddrs are the pod addresses of an attach response's eth0, as kubelet reads
// them.
func kniAddrs(t *testing.T, resp *knipb.AttachInterfaceResponse) []netip.Addr {
	t.Helper()
	var out []netip.Addr
	for _, s := range resp.GetIpconfigs()[kni.DefaultIfname].GetIp() {
		a, err := netip.ParseAddr(s)
		if err != nil {
			t.Fatalf("attach response address %q: %v", s, err)
		}
		out = append(out, a)
	}
	return out
}

// TestKNIInterposer plays kubelet against the agent's KNI interposer, which sits
// in front of a real network runtime (test/kniruntime running the node's
// [bridge] conflist, with no mesh-cni in it): an attach comes back with the
// runtime's addresses and the pod enrolled in the eBPF data path, traffic
// between two attached pods goes through their sidecar proxies, a detach
// releases the pod, and a runtime failure reaches kubelet unchanged with
// nothing enrolled.
func TestKNIInterposer(t *testing.T) {
	t.Parallel()
	ctx := testContext(t)
	node := harness.NewNode(t, harness.NodeOptions{})
	list := node.Conflist(t, "kninet")
	rt := kniruntime.Start(t, node, list)
	a := newAgent(t)
	kniSocket := a.agentPath("kni", "kni.sock")
	a.Args = append(a.Args, "--kni-socket", kniSocket, "--kni-upstream", rt.Socket, "--kni-enroll-timeout", "20s")
	a.start(ctx)
	kubelet := knipb.NewKNIClient(dialUnixGRPC(t, kniSocket))
	runtime := knipb.NewKNIClient(dialUnixGRPC(t, rt.Socket))

	attach := func(p *harness.Pod) *knipb.AttachInterfaceResponse {
		t.Helper()
		callCtx, cancel := context.WithTimeout(ctx, 30*time.Second)
		defer cancel()
		resp, err := kubelet.AttachInterface(callCtx, kniRequest(p))
		if err != nil {
			t.Fatalf("attach %s through the interposer: %v", p.Name, err)
		}
		// The addresses are the runtime's own, untouched.
		q, err := runtime.QueryPodNetwork(callCtx, &knipb.QueryPodNetworkRequest{Id: p.ContainerID})
		if err != nil {
			t.Fatalf("ask the runtime about %s: %v", p.Name, err)
		}
		if !proto.Equal(&knipb.AttachInterfaceResponse{Ipconfigs: q.GetIpconfigs()}, &knipb.AttachInterfaceResponse{Ipconfigs: resp.GetIpconfigs()}) {
			t.Fatalf("attach answered %v, the runtime attached %v", resp.GetIpconfigs(), q.GetIpconfigs())
		}
		addrs := kniAddrs(t, resp)
		if len(addrs) != 2 {
			t.Fatalf("attach of %s answered addresses %v, want an IPv4 and an IPv6 one", p.Name, addrs)
		}
		for _, ip := range addrs {
			if !node.IPv4Range.Contains(ip) && !node.IPv6Range.Contains(ip) {
				t.Fatalf("attach of %s answered %s, outside the node's ranges", p.Name, ip)
			}
		}
		e := enrollmentOf(ctx, a, p.ContainerID)
		if e == nil {
			t.Fatalf("the agent does not list %s after its attach returned", p.Name)
		}
		if e.GetSource() != gatepb.Source_SOURCE_KNI || e.GetNetnsPath() != p.NetNSPath || e.GetPod().GetUid() != p.UID ||
			e.GetAttachment().GetNetwork() != kni.DefaultNetwork || e.GetAttachment().GetIfname() != "eth0" {
			t.Fatalf("enrollment of %s = %v, want source KNI, netns %s, uid %s, network %s, ifname eth0", p.Name, e, p.NetNSPath, p.UID, kni.DefaultNetwork)
		}
		if !settingsEntryExists(t, a, e.GetNetnsCookie()) {
			t.Fatalf("%s is listed but has no entry in the pinned pods map", p.Name)
		}
		return resp
	}

	pa := &meshPod{Pod: node.NewPod(t, "shop", "kni-client")}
	pb := &meshPod{Pod: node.NewPod(t, "shop", "kni-server")}
	aAddrs := kniAddrs(t, attach(pa.Pod))
	bAddrs := kniAddrs(t, attach(pb.Pod))
	checkThroughSidecars(ctx, t, pa, pb, aAddrs, bAddrs)

	// Detach releases: the records, the settings entries and the link pins go.
	type pinned struct {
		dir    string
		cookie uint64
	}
	var pins []pinned
	for _, p := range []*meshPod{pa, pb} {
		dir, cookie := podPinDir(t, a, p.Pod)
		pins = append(pins, pinned{dir, cookie})
		if _, err := kubelet.DetachInterface(ctx, kniDetachRequest(p.Pod)); err != nil {
			t.Fatalf("detach %s: %v", p.Name, err)
		}
	}
	if n := len(a.list(ctx).GetEnrollments()); n != 0 {
		t.Fatalf("the agent still lists %d enrollments after both detaches", n)
	}
	for _, p := range pins {
		if settingsEntryExists(t, a, p.cookie) {
			t.Fatalf("netns cookie %d is still in the settings map after detach", p.cookie)
		}
		if _, err := os.Stat(p.dir); !errors.Is(err, os.ErrNotExist) {
			t.Fatalf("the pod's link pins %s still exist after detach: %v", p.dir, err)
		}
	}
	if got := rt.Attached(); len(got) != 0 {
		t.Fatalf("the runtime still has %v attached after the detaches went through the interposer", got)
	}

	// A runtime failure reaches kubelet exactly as the runtime said it, and the
	// agent enrolls nothing.
	failing := node.NewPod(t, "shop", "kni-nope")
	rt.Fail("AttachInterface", status.Error(codes.ResourceExhausted, "no addresses left in the pool"))
	_, err := kubelet.AttachInterface(ctx, kniRequest(failing))
	if st := status.Convert(err); st.Code() != codes.ResourceExhausted || st.Message() != "no addresses left in the pool" {
		t.Fatalf("attach with a failing runtime: %v, want the runtime's ResourceExhausted unchanged", err)
	}
	if e := enrollmentOf(ctx, a, failing.ContainerID); e != nil {
		t.Fatalf("a pod whose attach failed is enrolled: %v", e)
	}
	if n := len(a.list(ctx).GetEnrollments()); n != 0 {
		t.Fatalf("the agent lists %d enrollments after a failed attach", n)
	}
	if got := rt.Attached(); len(got) != 0 {
		t.Fatalf("the runtime has %v attached after a failed attach", got)
	}
}
