package kniruntime_test

import (
	"net/netip"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/status"

	"github.com/mesh-cni/mesh-cni/internal/kni/knipb"
	"github.com/mesh-cni/mesh-cni/test/fixtures"
	"github.com/mesh-cni/mesh-cni/test/harness"
	"github.com/mesh-cni/mesh-cni/test/kniruntime"
)

func TestMain(m *testing.M) {
	harness.Main(m, harness.Options{Packages: harness.ReferencePlugins()})
}

func dial(t *testing.T, sock string) knipb.KNIClient {
	t.Helper()
	conn, err := grpc.NewClient("unix://"+sock, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close() })
	return knipb.NewKNIClient(conn)
}

func TestAttachRunsTheConflist(t *testing.T) {
	t.Parallel()
	ctx := fixtures.Context(t, time.Minute)
	node := harness.NewNode(t, harness.NodeOptions{})
	list := node.Conflist(t, "kninet")
	rt := kniruntime.Start(t, node, list)
	client := dial(t, rt.Socket)
	pod := node.NewPod(t, "default", "web")

	resp, err := client.AttachInterface(ctx, &knipb.AttachInterfaceRequest{
		Id: pod.ContainerID, Name: pod.Name, Namespace: pod.Namespace,
		Isolation: &knipb.Isolation{Path: pod.NetNSPath, Type: "namespace"},
	})
	if err != nil {
		t.Fatalf("attach: %v", err)
	}
	eth0 := resp.GetIpconfigs()["eth0"]
	if eth0 == nil || len(eth0.GetIp()) != 2 || eth0.GetMac() == "" {
		t.Fatalf("ipconfigs = %v, want eth0 with an IPv4 and an IPv6 address and a MAC", resp.GetIpconfigs())
	}
	for _, s := range eth0.GetIp() {
		a, err := netip.ParseAddr(s)
		if err != nil {
			t.Fatalf("ip %q is not a bare address: %v", s, err)
		}
		if !node.IPv4Range.Contains(a) && !node.IPv6Range.Contains(a) {
			t.Errorf("ip %s is outside the node's ranges %s, %s", a, node.IPv4Range, node.IPv6Range)
		}
	}
	allocs, err := node.Allocations(list.Name)
	if err != nil || len(allocs) != 2 {
		t.Fatalf("host-local allocations = %v, %v; want 2", allocs, err)
	}
	q, err := client.QueryPodNetwork(ctx, &knipb.QueryPodNetworkRequest{Id: pod.ContainerID})
	if err != nil || len(q.GetIpconfigs()["eth0"].GetIp()) != 2 {
		t.Fatalf("query = %v, %v", q, err)
	}

	if _, err := client.DetachInterface(ctx, &knipb.DetachInterfaceRequest{
		Id: pod.ContainerID, Name: pod.Name, Namespace: pod.Namespace,
		Isolation: &knipb.Isolation{Path: pod.NetNSPath, Type: "namespace"},
	}); err != nil {
		t.Fatalf("detach: %v", err)
	}
	if allocs, err := node.Allocations(list.Name); err != nil || len(allocs) != 0 {
		t.Fatalf("host-local allocations after detach = %v, %v; want none", allocs, err)
	}
	if got := rt.Attached(); len(got) != 0 {
		t.Fatalf("attached after detach: %v", got)
	}
}

func TestFailInjection(t *testing.T) {
	t.Parallel()
	ctx := fixtures.Context(t, time.Minute)
	node := harness.NewNode(t, harness.NodeOptions{})
	rt := kniruntime.Start(t, node, node.Conflist(t, "kninet"))
	client := dial(t, rt.Socket)
	pod := node.NewPod(t, "default", "web")

	rt.Fail("AttachInterface", status.Error(codes.ResourceExhausted, "no addresses left"))
	_, err := client.AttachInterface(ctx, &knipb.AttachInterfaceRequest{
		Id: pod.ContainerID, Name: pod.Name, Namespace: pod.Namespace,
		Isolation: &knipb.Isolation{Path: pod.NetNSPath},
	})
	if st := status.Convert(err); st.Code() != codes.ResourceExhausted || st.Message() != "no addresses left" {
		t.Fatalf("attach error = %v, want the injected one", err)
	}
	if got := rt.Attached(); len(got) != 0 {
		t.Fatalf("a failed attach attached %v", got)
	}
	rt.Fail("AttachInterface", nil)
	if _, err := client.AttachInterface(ctx, &knipb.AttachInterfaceRequest{
		Id: pod.ContainerID, Name: pod.Name, Namespace: pod.Namespace,
		Extradata: map[string]string{"netns": pod.NetNSPath},
	}); err != nil {
		t.Fatalf("attach after clearing the failure (netns in extradata): %v", err)
	}
	if got := len(rt.CallsOf("AttachInterface")); got != 2 {
		t.Fatalf("recorded %d attach calls, want 2", got)
	}
	// Left attached on purpose: Start's cleanup detaches it.
}
