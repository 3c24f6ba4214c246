package node

import (
	"context"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	discoveryv1 "k8s.io/api/discovery/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/util/intstr"
	"k8s.io/utils/ptr"

	"github.com/mesh-cni/mesh-cni/install/kubernetes"
	"github.com/mesh-cni/mesh-cni/test/fixtures"
	"github.com/mesh-cni/mesh-cni/test/node/nodeenv"
	"github.com/mesh-cni/mesh-cni/test/proxy"
)

// agentDownHold is how long agentCrashLoop keeps the agent down: past
// kube-controller-manager's node-monitor grace period (50 s by default) plus
// the test pods' not-ready toleration (notReadyToleration), with room for the
// kubelet's 10 s status updates. A node that turned NotReady in that time
// would have had its pods taken out of their Service and evicted.
const (
	agentDownHold      = 75 * time.Second
	notReadyToleration = 10
)

// agentCrashLoop kills the agent with SIGKILL as soon as it comes back, for
// agentDownHold, as an agent in a crash loop (an OOM kill, a bad config) or
// an image pull stuck in an upgrade would leave it, with the chain entry in
// place and a primary of CNI spec 1.1.0, whose runtime asks mesh-cni's
// STATUS. Throughout: the node stays Ready, the running meshed server stays
// ready in its Service's EndpointSlice and is not evicted (its toleration of
// a not-ready node is 10 s), and a pod created meanwhile waits at the gate.
// Once the agent is back, that pod starts, enrolled, through its proxy.
func (s *scenario) agentCrashLoop(t *testing.T, ctx context.Context, target string) {
	tolerate := []corev1.Toleration{
		{Key: corev1.TaintNodeNotReady, Operator: corev1.TolerationOpExists, Effect: corev1.TaintEffectNoExecute, TolerationSeconds: ptr.To[int64](notReadyToleration)},
		{Key: corev1.TaintNodeUnreachable, Operator: corev1.TolerationOpExists, Effect: corev1.TaintEffectNoExecute, TolerationSeconds: ptr.To[int64](notReadyToleration)},
	}
	steady := s.server("shop2", "steady", true)
	steady.Spec.Tolerations = tolerate
	s.create(ctx, steady)
	readyPod := func(p *corev1.Pod) bool {
		return slices.ContainsFunc(p.Status.Conditions, func(c corev1.PodCondition) bool {
			return c.Type == corev1.PodReady && c.Status == corev1.ConditionTrue
		})
	}
	before, _ := s.until(ctx, "shop2", "steady", "ready", readyPod)
	if _, err := s.n.Admin.CoreV1().Services("shop2").Create(ctx, &corev1.Service{
		ObjectMeta: metav1.ObjectMeta{Name: "steady"},
		Spec: corev1.ServiceSpec{
			Selector: map[string]string{"app": "steady"},
			Ports:    []corev1.ServicePort{{Port: serverPort, TargetPort: intstr.FromInt32(serverPort)}},
		},
	}, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	endpointReady := func() (bool, error) {
		list, err := s.n.Admin.DiscoveryV1().EndpointSlices("shop2").List(ctx, metav1.ListOptions{LabelSelector: discoveryv1.LabelServiceName + "=steady"})
		if err != nil {
			return false, err
		}
		for _, es := range list.Items {
			for _, ep := range es.Endpoints {
				if ep.TargetRef != nil && ep.TargetRef.UID == before.UID && ptr.Deref(ep.Conditions.Ready, false) {
					return true, nil
				}
			}
		}
		return false, nil
	}
	if !fixtures.Eventually(ctx, 5*time.Minute, 200*time.Millisecond, func() bool {
		ok, err := endpointReady()
		if err != nil {
			t.Fatal(err)
		}
		return ok
	}) {
		t.Fatalf("the Service's EndpointSlice never listed steady as ready: %v", ctx.Err())
	}

	// The crash loop: every agent process the kubelet starts again is killed
	// at once, long before it can become ready.
	agent := s.agentPod(t, ctx)
	loopCtx, stopLoop := context.WithCancel(ctx)
	var kills atomic.Int64
	var wg sync.WaitGroup
	wg.Go(func() {
		for loopCtx.Err() == nil {
			for _, pid := range podProcesses(agent.UID, filepath.Base(kubernetes.AgentBinary)) {
				if syscall.Kill(pid, syscall.SIGKILL) == nil {
					kills.Add(1)
				}
			}
			// The loop's pace, not a wait: the kubelet restarts the
			// container within this.
			time.Sleep(20 * time.Millisecond)
		}
	})
	defer func() { stopLoop(); wg.Wait() }()
	fixtures.WaitFor(t, time.Minute, "the first kill of the agent", func() bool { return kills.Load() > 0 })
	down := time.Now()
	s.create(ctx, s.client("shop2", "held", target, true))

	for time.Since(down) < agentDownHold {
		if ctx.Err() != nil {
			t.Fatal(ctx.Err())
		}
		c, err := s.n.ReadyCondition(ctx)
		if err != nil {
			t.Fatal(err)
		}
		if c.Status != corev1.ConditionTrue {
			t.Fatalf("%v after the agent went down the node is Ready=%s: %s", time.Since(down).Round(time.Millisecond), c.Status, c.Message)
		}
		p, err := s.n.Admin.CoreV1().Pods("shop2").Get(ctx, "steady", metav1.GetOptions{})
		if err != nil || p.UID != before.UID || p.DeletionTimestamp != nil || !readyPod(p) {
			t.Fatalf("%v after the agent went down the running server is gone or not ready: %v %s", time.Since(down).Round(time.Millisecond), err, describe(p))
		}
		if ok, err := endpointReady(); err != nil || !ok {
			t.Fatalf("%v after the agent went down the server left its Service's ready endpoints (%v)", time.Since(down).Round(time.Millisecond), err)
		}
		held, err := s.n.Admin.CoreV1().Pods("shop2").Get(ctx, "held", metav1.GetOptions{})
		if err != nil {
			t.Fatal(err)
		}
		if held.Status.Phase != corev1.PodPending {
			t.Fatalf("with the agent down pod held is %s: %s", held.Status.Phase, describe(held))
		}
		// The checks' pace through the hold, which is the scenario: not a
		// wait for a state.
		time.Sleep(time.Second)
	}
	stopLoop()
	wg.Wait()
	taints, err := s.n.Admin.CoreV1().Nodes().Get(ctx, s.n.Name, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	for _, taint := range taints.Spec.Taints {
		if strings.HasPrefix(taint.Key, "node.kubernetes.io/") {
			t.Errorf("the node was tainted %s:%s while the agent was down", taint.Key, taint.Effect)
		}
	}
	t.Logf("agent killed %d times over %v: the node stayed Ready, the server in its endpoints, the new pod held", kills.Load(), time.Since(down).Round(time.Second))
	s.bench.note("With the agent in a crash loop for " + agentDownHold.String() + " (SIGKILL at each restart), the chain entry in place and a primary of CNI spec 1.1.0, the node stayed Ready and the running server stayed in its Service's ready endpoints; a pod created meanwhile waited at the gate.")

	// Back without the kubelet's crash back-off: the DaemonSet makes a new pod.
	s.kubectl(t, ctx, "-n", kubernetes.Namespace, "delete", "pod", agent.Name, "--wait")
	s.kubectl(t, ctx, "-n", kubernetes.Namespace, "rollout", "status", "ds/mesh-agent", "--timeout=3m")
	s.until(ctx, "shop2", "held", "running", running)
	s.until(ctx, "shop2", "held", redirectionAnn+"=enabled", func(p *corev1.Pod) bool { return p.Annotations[redirectionAnn] == "enabled" })
	s.waitConnections(t, ctx, "held", 5)
	if len(s.proxied(t, "held", proxy.Outbound)) == 0 {
		t.Error("the pod that waited through the crash loop reaches the server, but not through its proxy")
	}
}

// podProcesses lists the host's processes named comm in the cgroup of the pod
// with uid (the kubelet names pod cgroups after the uid, with dashes under the
// cgroupfs driver and underscores under systemd's); other tests' agents on
// the same host are left alone.
func podProcesses(uid types.UID, comm string) []int {
	forms := []string{"pod" + string(uid), "pod" + strings.ReplaceAll(string(uid), "-", "_")}
	return nodeenv.HostProcesses(comm, func(dir string) bool {
		cg, err := os.ReadFile(filepath.Join(dir, "cgroup"))
		return err == nil && slices.ContainsFunc(forms, func(f string) bool { return strings.Contains(string(cg), f) })
	})
}
