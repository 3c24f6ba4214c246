package k8s

import (
	"errors"
	"net/netip"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/mesh-cni/mesh-cni/internal/enroll"
	"github.com/mesh-cni/mesh-cni/test/fixtures"
	"github.com/mesh-cni/mesh-cni/test/harness"
	"github.com/mesh-cni/mesh-cni/test/proxy"
)

// The agent's side of Istio's sidecar mode, through the real API server: a pod
// shaped as the injector leaves it for istio-cni is enrolled for its own proxy,
// never handed to the node proxy nor marked for istiod's HBONE; until its
// istio-proxy container runs, that container's uid is the proxy (any container
// running as it passes), and once the kubelet reports the container running
// its cgroup is, found at the node's pod cgroup layout: another container of
// the pod running as the same uid is then captured, and mesh-agent status
// says which rule holds.
func TestSidecarProxyByContainer(t *testing.T) {
	n := newAmbientNode(t)
	pods, cgroupArgs := n.podCgroups(t)
	a := n.runMeshAgent(t, cgroupArgs...)
	list := n.node.Conflist(t, n.listName, a.meshEntry())
	ctx := apiContext(t)

	// The destination, outside the mesh: it answers with the peer it saw.
	server := n.addPod(t, list, n.plain, "sc-server")
	target := netip.AddrPortFrom(server.cni.IPv4(t), 8080).String()

	p, err := n.admin.CoreV1().Pods(n.plain).Create(ctx, injectedPod(n.plain, "sc-sidecar", n.name), metav1.CreateOptions{})
	if err != nil {
		t.Fatal(err)
	}
	hp := cniPod(t, n.node, p)
	addAsKubelet(ctx, t, n.node, list, hp)
	if !a.enrolledUID(string(p.UID)) {
		t.Fatal("the sidecar pod is not enrolled")
	}

	// The pod's containers: each its own cgroup at the kubelet's layout.
	podDir := harness.MkCgroup(t, filepath.Join(pods, "pod"+string(p.UID)))
	proxyID, appID := fixtures.RandomHex(32), fixtures.RandomHex(32)
	sidecar := containerProc{netns: hp.NetNSPath, cgroup: harness.MkCgroup(t, filepath.Join(podDir, proxyID)), uid: enroll.IstioProxyUID}
	app := containerProc{netns: hp.NetNSPath, cgroup: harness.MkCgroup(t, filepath.Join(podDir, appID)), uid: enroll.IstioProxyUID}
	records := echoProxy(t, sidecar)

	// Before the kubelet reports the proxy running: the uid rule.
	if rule := sidecarRule(t, a, p.UID); !strings.HasPrefix(rule, "uid 1337") {
		t.Errorf("status before the proxy runs: %q, want the uid rule", rule)
	}
	reachesServer(t, ctx, "another container as uid 1337, under the uid rule (the proxy)", app, target)

	// The kubelet reports the native sidecar running, with its container id.
	updatePodStatus(ctx, t, n.admin, n.plain, p.Name, func(st *corev1.PodStatus) {
		st.Phase = corev1.PodRunning
		st.PodIPs = []corev1.PodIP{{IP: hp.IPv4(t).String()}, {IP: hp.IPv6(t).String()}}
		st.PodIP = st.PodIPs[0].IP
		running := corev1.ContainerState{Running: &corev1.ContainerStateRunning{StartedAt: metav1.Now()}}
		st.InitContainerStatuses = []corev1.ContainerStatus{{Name: enroll.IstioProxyContainer, ContainerID: "containerd://" + proxyID, State: running}}
		st.ContainerStatuses = []corev1.ContainerStatus{{Name: "app", ContainerID: "containerd://" + appID, State: running}}
	})
	fixtures.WaitFor(t, 10*time.Second, "the proxy known by its container's cgroup", func() bool {
		return strings.HasPrefix(sidecarRule(t, a, p.UID), "sidecar container's cgroup")
	})
	reachesSidecar(t, ctx, records, "another container running as uid 1337", app, proxy.Outbound, target)
	reachesServer(t, ctx, "the istio-proxy container's own connect", sidecar, target)

	// istiod must not take it for an ambient pod.
	fixtures.WaitFor(t, 10*time.Second, "the pod's outcome written", func() bool {
		cur, err := n.admin.CoreV1().Pods(n.plain).Get(ctx, p.Name, metav1.GetOptions{})
		return err == nil && cur.Annotations[enroll.AnnotationRedirection] == enroll.OutcomeEnabled
	})
	cur, err := n.admin.CoreV1().Pods(n.plain).Get(ctx, p.Name, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if v, ok := cur.Annotations[enroll.IstioAnnotationRedirection]; ok {
		t.Errorf("the sidecar pod has %s=%s: istiod would send it HBONE", enroll.IstioAnnotationRedirection, v)
	}
}

// readRecords reads a JSON-lines file, none when it does not exist yet.
func readRecords[T any](t *testing.T, path string) []T {
	t.Helper()
	recs, err := fixtures.ReadJSONL[T](path)
	if err != nil && !errors.Is(err, os.ErrNotExist) {
		t.Fatal(err)
	}
	return recs
}

// A pod with Istio's sidecar already running when the agent starts (on a node
// switched from istio-cni, istio-cni's rules in the pod's namespace) is
// recorded and left to those rules, not taken over in place: the two captures
// side by side would give its sidecar another original destination for inbound
// connections. A later re-decision leaves it too; its next sandbox is
// enrolled through the ADD.
func TestSidecarPodRunningBeforeAgent(t *testing.T) {
	n := newAmbientNode(t)
	pods, cgroupArgs := n.podCgroups(t)
	primary := n.node.Conflist(t, n.listName)
	ctx := apiContext(t)
	server := n.addPod(t, primary, n.plain, "sc-server")
	// Once its namespace joins the mesh below, ztunnel delivers to it.
	target := netip.AddrPortFrom(server.cni.IPv4(t), 8080).String()
	n.runContainer(t, pods, server)

	p, err := n.admin.CoreV1().Pods(n.plain).Create(ctx, injectedPod(n.plain, "sc-running", n.name), metav1.CreateOptions{})
	if err != nil {
		t.Fatal(err)
	}
	hp := cniPod(t, n.node, p)
	addAsKubelet(ctx, t, n.node, primary, hp)
	updatePodStatus(ctx, t, n.admin, n.plain, p.Name, func(st *corev1.PodStatus) {
		st.Phase = corev1.PodRunning
		st.PodIPs = []corev1.PodIP{{IP: hp.IPv4(t).String()}, {IP: hp.IPv6(t).String()}}
		st.PodIP = st.PodIPs[0].IP
	})
	n.runContainer(t, pods, &ambientPod{api: p, cni: hp})
	app := containerProc{netns: hp.NetNSPath, cgroup: harness.NewCgroup(t, "sc-app")}

	a := n.runMeshAgent(t, cgroupArgs...)
	// The server's namespace joins the mesh below: ztunnel takes it then.
	n.startZtunnel(t)
	line, err := a.Proc.WaitForLine(ctx, `"pod":"`+n.plain+`/`+p.Name+`"`)
	if err != nil {
		t.Fatalf("the running sidecar pod was not recorded: %v", err)
	}
	if !strings.Contains(line, "running pod recorded, not enrolled") || !strings.Contains(line, "sidecar") {
		t.Errorf("recorded as %s, want the sidecar pod left to its rules", line)
	}
	reachesServer(t, ctx, "the running sidecar pod's connect", app, target)
	// A change that makes the agent decide every pod again (the namespace
	// joins the mesh: the server is enrolled) leaves it.
	ch := a.Proc.Output()
	ns, err := n.admin.CoreV1().Namespaces().Get(ctx, n.plain, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	ns.Labels = map[string]string{enroll.IstioLabelDataplaneMode: enroll.IstioValueAmbient}
	if _, err := n.admin.CoreV1().Namespaces().Update(ctx, ns, metav1.UpdateOptions{}); err != nil {
		t.Fatal(err)
	}
	if _, err := a.Proc.WaitForLine(ctx, "pod enrolled after a policy change"); err != nil {
		t.Fatal(err)
	}
	if strings.Contains(strings.TrimPrefix(a.Proc.Output(), ch), "/"+p.Name+`"`) {
		t.Errorf("the running sidecar pod was enrolled on a re-decision:\n%s", strings.TrimPrefix(a.Proc.Output(), ch))
	}
	reachesServer(t, ctx, "after a re-decision, the running sidecar pod's connect", app, target)
}
