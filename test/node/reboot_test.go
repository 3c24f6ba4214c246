package node

import (
	"net"
	"path/filepath"
	"slices"
	"strconv"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/intstr"

	"github.com/mesh-cni/mesh-cni/test/fixtures"
	"github.com/mesh-cni/mesh-cni/test/node/nodeenv"
	"github.com/mesh-cni/mesh-cni/test/proxy"
)

// TestReboot reboots a node with meshed pods talking, as far as one machine
// allows (nodeenv.Reboot: every process gone, a fresh /run and bpffs, the
// pods' cgroups and network namespaces gone; the disk kept), and checks what
// an operator relies on when the node comes back: every pod the kubelet
// brings back is meshed before its first connection (the server never
// accepts a connection but from its proxy, every round trip of the meshed
// client goes through its proxy), and no pod's sandbox fails while the agent
// starts: each waits at the gate, for no longer than the agent takes.
func TestReboot(t *testing.T) {
	ctx := fixtures.Context(t, 12*time.Minute)
	s := startScenario(t, ctx, nodeenv.Options{}, currentImages(t), nil)
	n, op, dir := s.n, s.op, s.currentDir
	op.run(ctx, dir, "startup-taint")

	// A client that reaches the server by its Service, so that it finds the
	// server's new address after the reboot as any workload would.
	s.namespace(ctx, "shop", true)
	s.namespace(ctx, "plain", false)
	s.create(ctx, s.server("shop", "server", true))
	if _, err := n.Admin.CoreV1().Services("shop").Create(ctx, &corev1.Service{
		ObjectMeta: metav1.ObjectMeta{Name: "server"},
		Spec: corev1.ServiceSpec{
			Selector: map[string]string{"app": "server"},
			Ports:    []corev1.ServicePort{{Port: serverPort, TargetPort: intstr.FromInt32(serverPort)}},
		},
	}, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	svc, err := n.Admin.CoreV1().Services("shop").Get(ctx, "server", metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	target := net.JoinHostPort(svc.Spec.ClusterIP, strconv.Itoa(serverPort))
	s.create(ctx, s.client("shop", "client", target, true))
	s.create(ctx, s.client("plain", "plain", target, false))
	s.waitConnections(t, ctx, "client", 5)
	s.waitConnections(t, ctx, "plain", 5)

	before := map[string]podBefore{}
	for _, p := range []struct{ ns, name string }{{"shop", "server"}, {"shop", "client"}, {"plain", "plain"}} {
		pod, err := n.Admin.CoreV1().Pods(p.ns).Get(ctx, p.name, metav1.GetOptions{})
		if err != nil {
			t.Fatal(err)
		}
		before[p.name] = podBefore{ns: p.ns, ip: pod.Status.PodIP, sandboxStarted: sandboxReady(pod)}
	}

	links := pinnedLinkIDs(t, n)
	down := n.Reboot(ctx)
	// What the reboot must have taken: every program the agent had attached.
	checkLinksGone(t, links, "the reboot")
	readyCh := make(chan time.Time, 1)
	go func() {
		at, err := s.agentReady(ctx)
		if err != nil {
			t.Error(err)
		}
		readyCh <- at
	}()
	t.Logf("node down at %s; containerd and the kubelet started again %v later", down.Format("15:04:05.000"), time.Since(down).Round(time.Millisecond))

	// Each pod is back in a new sandbox, its containers running.
	back := map[string]time.Time{}
	for name, b := range before {
		_, back[name] = s.until(ctx, b.ns, name, "back in a new sandbox", func(p *corev1.Pod) bool {
			at := sandboxReady(p)
			return running(p) && at.After(b.sandboxStarted) && allRunning(p)
		})
	}
	agentAt := <-readyCh
	serverIP := s.podIP(ctx, "shop", "server")
	s.waitConnections(t, ctx, "client", 10)
	s.waitConnections(t, ctx, "plain", 10)

	// Inbound: the server, before and after, accepted only from its own
	// address (the one it had, the one it has), its proxy's onward connection.
	var bypassed []string
	accepts := fixtures.MustReadJSONL[accepted](t, filepath.Join(s.records(), "server.jsonl"))
	for _, r := range accepts {
		if host, _, err := net.SplitHostPort(r.Client); err != nil || (host != serverIP && host != before["server"].ip) {
			bypassed = append(bypassed, r.Client+" at "+r.Time.Format("15:04:05.000"))
		}
	}
	if len(bypassed) > 0 || len(accepts) == 0 {
		t.Errorf("the server (%s, before the reboot %s) accepted %d connections, %d not from its proxy: %q", serverIP, before["server"].ip, len(accepts), len(bypassed), bypassed)
	}
	// Outbound: every round trip the meshed client made since the reboot went
	// through its proxy. The proxy records a connection when both sides have
	// closed, so wait a little for the last ones.
	cut := time.Now()
	var trips, proxied int
	fixtures.Eventually(ctx, 10*time.Second, 200*time.Millisecond, func() bool {
		trips = 0
		for _, c := range fixtures.MustReadJSONL[connection](t, filepath.Join(s.records(), "client.jsonl")) {
			if c.Error == "" && c.Time.After(down) && c.Time.Before(cut) {
				trips++
			}
		}
		proxied = 0
		for _, r := range s.proxied(t, "client", proxy.Outbound) {
			if r.Time.After(down) {
				proxied++
			}
		}
		return proxied >= trips
	})
	if trips == 0 || proxied < trips {
		t.Errorf("after the reboot the meshed client made %d round trips, its proxy took %d: %d went around it", trips, proxied, trips-proxied)
	}

	// No sandbox failed: each pod waited at the gate for the agent, and was
	// released once it answered, not after a timeout and a retry.
	for name, b := range before {
		for _, e := range s.events(ctx, b.ns, name) {
			at := e.LastTimestamp.Time
			if at.IsZero() {
				at = e.EventTime.Time
			}
			if e.Reason == "FailedCreatePodSandBox" && !at.Before(down.Truncate(time.Second)) {
				t.Errorf("pod %s/%s: %s: %s", b.ns, name, e.Reason, e.Message)
			}
		}
		t.Logf("pod %s/%s: all its containers ran again %v after the node went down (the agent answered ready after %v)",
			b.ns, name, back[name].Sub(down).Round(time.Millisecond), agentAt.Sub(down).Round(time.Millisecond))
	}
	st := s.status(t, ctx)
	if !st.enrolled("shop", "server") || !st.enrolled("shop", "client") || st.enrolled("plain", "plain") {
		t.Errorf("after the reboot mesh-agent status enrolls %+v: want shop/server and shop/client, not plain/plain", st.Pods)
	}
	if _, ok := s.chainEntry(t); !ok {
		t.Error("after the reboot the chain entry is gone")
	}
}

// podBefore is what the test knew of a pod before the reboot.
type podBefore struct {
	ns, ip         string
	sandboxStarted time.Time
}

// sandboxReady is when the kubelet last had the pod's sandbox ready (its
// PodReadyToStartContainers condition).
func sandboxReady(p *corev1.Pod) time.Time {
	i := slices.IndexFunc(p.Status.Conditions, func(c corev1.PodCondition) bool {
		return c.Type == corev1.PodReadyToStartContainers && c.Status == corev1.ConditionTrue
	})
	if i < 0 {
		return time.Time{}
	}
	return p.Status.Conditions[i].LastTransitionTime.Time
}

// allRunning: every container and native sidecar of the pod runs.
func allRunning(p *corev1.Pod) bool {
	for _, cs := range append(p.Status.InitContainerStatuses, p.Status.ContainerStatuses...) {
		if cs.State.Running == nil {
			return false
		}
	}
	return len(p.Status.ContainerStatuses) > 0
}
