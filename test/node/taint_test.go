package node

import (
	"net"
	"slices"
	"strconv"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/mesh-cni/mesh-cni/internal/agentcli"
	"github.com/mesh-cni/mesh-cni/test/fixtures"
	"github.com/mesh-cni/mesh-cni/test/node/nodeenv"
	"github.com/mesh-cni/mesh-cni/test/proxy"
)

// TestStartupTaint registers a node with the startup taint, as a node pool
// would, creates pods of a meshed namespace before the agent exists, and
// installs the chart with startupTaint.enabled as docs/install.md says: no
// pod of the namespace is scheduled there before the agent answers ready,
// the agent then removes the taint, and the pods' first connections go
// through their proxies (the server never sees another client).
func TestStartupTaint(t *testing.T) {
	ctx := fixtures.Context(t, 10*time.Minute)
	taint := agentcli.DefaultStartupTaint + "=true:NoSchedule"
	s := startScenario(t, ctx, nodeenv.Options{RegisterWithTaints: []string{taint}}, currentImages(t), nil)
	n, op, dir := s.n, s.op, s.currentDir
	before := snapshotNode(t, n)

	node, err := n.Admin.CoreV1().Nodes().Get(ctx, n.Name, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if !slices.ContainsFunc(node.Spec.Taints, func(tt corev1.Taint) bool { return tt.Key == agentcli.DefaultStartupTaint }) {
		t.Fatalf("the node registered with taints %v, want %s", node.Spec.Taints, taint)
	}

	// Before the agent: the scheduler keeps the meshed server off the node.
	s.namespace(ctx, "shop", true)
	s.create(ctx, s.server("shop", "server", true))
	s.until(ctx, "shop", "server", "unschedulable", func(p *corev1.Pod) bool {
		return slices.ContainsFunc(p.Status.Conditions, func(c corev1.PodCondition) bool {
			return c.Type == corev1.PodScheduled && c.Status == corev1.ConditionFalse && c.Reason == corev1.PodReasonUnschedulable
		})
	})

	agentReady := s.agentReadyLater(ctx)
	op.run(ctx, dir, "startup-taint")
	ready, err := agentReady()
	if err != nil {
		t.Fatal(err)
	}
	_, scheduled := s.until(ctx, "shop", "server", "scheduled", func(p *corev1.Pod) bool { return p.Spec.NodeName == n.Name })
	if scheduled.Before(ready) {
		t.Errorf("the meshed server was scheduled %v before the agent answered ready", ready.Sub(scheduled))
	}
	ip := s.podIP(ctx, "shop", "server")
	target := net.JoinHostPort(ip, strconv.Itoa(serverPort))
	s.create(ctx, s.client("shop", "client", target, true))
	s.podIP(ctx, "shop", "client")
	s.waitConnections(t, ctx, "client", 5)
	if len(s.proxied(t, "client", proxy.Outbound)) == 0 || len(s.proxied(t, "server", proxy.Inbound)) == 0 {
		t.Error("on the node that started tainted, the client's traffic does not go through both proxies")
	}
	// From the first connection on: any other client at the server fails.
	checkOnlyProxy(t, s.cluster, "server", ip, time.Time{}, time.Time{})
	node, err = n.Admin.CoreV1().Nodes().Get(ctx, n.Name, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if slices.ContainsFunc(node.Spec.Taints, func(tt corev1.Taint) bool { return tt.Key == agentcli.DefaultStartupTaint }) {
		t.Errorf("the agent is ready and the node still carries its startup taint: %v", node.Spec.Taints)
	}
	t.Logf("agent ready, then the meshed server scheduled %v later", scheduled.Sub(ready).Round(time.Millisecond))

	if err := s.deleteNamespace(ctx, "shop"); err != nil {
		t.Fatal(err)
	}
	// helm uninstall alone leaves the node as it was (no Job: its image,
	// the release's, is not on this node).
	op.run(ctx, dir, "helm-uninstall", 0)
	snapshotNode(t, n).mustEqual(t, before)
	op.run(ctx, dir, "helm-uninstall", 3)
	if left := op.unused("startup-taint"); len(left) > 0 {
		t.Errorf("docs/install.md commands the test never ran: %q", left)
	}
}
