package k8s

import (
	"fmt"
	"io"
	"net"
	"net/netip"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/containernetworking/cni/libcni"
	corev1 "k8s.io/api/core/v1"

	"github.com/mesh-cni/mesh-cni/internal/enroll"
	"github.com/mesh-cni/mesh-cni/internal/redirect"
	"github.com/mesh-cni/mesh-cni/pkg/gate/gatepb"
	"github.com/mesh-cni/mesh-cni/test/fixtures"
	"github.com/mesh-cni/mesh-cni/test/harness"
	"github.com/mesh-cni/mesh-cni/test/proxy"
)

// runningPod is a pod that started before the agent was installed: set up by
// the primary alone, marked Running in the API server as the kubelet would,
// with a container process in the cgroup the kubelet names after the pod
// (pods/pod<uid>/<container>, pods being a QoS class's cgroup) and in the pod's
// network namespace. It returns the pod and its container's cgroup.
func (c *cluster) runningPod(t *testing.T, node *harness.Node, primary *libcni.NetworkConfigList, pods, namespace, name, kubeNode string, labels map[string]string, container func(*harness.Pod) string) (*harness.Pod, string) {
	t.Helper()
	ctx := apiContext(t)
	hp := cniPod(t, node, c.pod(t, namespace, name, kubeNode, labels, nil))
	add(ctx, t, node, primary, hp)
	updatePodStatus(ctx, t, c.admin, namespace, name, func(st *corev1.PodStatus) {
		st.Phase = corev1.PodRunning
		st.PodIPs = []corev1.PodIP{{IP: hp.IPv4(t).String()}, {IP: hp.IPv6(t).String()}}
		st.PodIP = st.PodIPs[0].IP
	})
	dir := harness.MkCgroup(t, filepath.Join(pods, "pod"+hp.UID))
	dir = harness.MkCgroup(t, filepath.Join(dir, container(hp)))
	sleep, err := exec.LookPath("sleep")
	if err != nil {
		t.Fatal(err)
	}
	harness.StartProcess(t, harness.ProcessOptions{Path: sleep, Args: []string{"1000"}, Cgroup: dir, NetNSPath: hp.NetNSPath, Name: "container-" + name})
	return hp, dir
}

// enrolledNetns is the network namespace the agent enrolled the pod in, or ""
// when it did not.
func (a *agent) enrolledNetns(uid string) string {
	a.t.Helper()
	for _, e := range a.enrollments() {
		if e.GetPod().GetUid() == uid {
			return e.GetNetnsPath()
		}
	}
	return ""
}

// enrolledUID reports whether the agent lists an enrollment of the pod by uid
// (an adopted pod's attachment is the agent's reading of the host).
func (a *agent) enrolledUID(uid string) bool {
	a.t.Helper()
	return slices.ContainsFunc(a.enrollments(), func(e *gatepb.Enrollment) bool { return e.GetPod().GetUid() == uid })
}

// testAgentAdoptsRunningPods: installed on a node whose pods already run, the
// agent enrolls the selected ones in place, their next connections go through
// the proxy without a restart; an unselected one is recorded and enrolled when
// its namespace is labelled; a pod whose only process sits in a namespace of
// its own is reported failed, not guessed; pods of excluded namespaces are left
// alone; the runtime's DEL releases an adopted pod whether or not the agent
// read its attachment as the runtime names it. Pods' cgroups are at the
// kubelet's cgroupfs layout under a cgroupRoot of the test's, which the agent
// is given (there is no kubelet to read it from). An unlabelled pod that made
// cgroups inside its container's named after two others', with a process in
// its own network namespace in each, has neither refused nor given its
// namespace: the one with processes of its own is adopted in its own
// namespace, the one without is still reported failed.
func testAgentAdoptsRunningPods(t *testing.T, c *cluster) {
	ctx := apiContext(t)
	kubeNode := "node-" + fixtures.RandomHex(4)
	lab := c.namespace(t, "adopt", enabled)
	plain := c.namespace(t, "adopt-plain", nil)
	node := harness.NewNode(t, harness.NodeOptions{Plugins: append(harness.ReferencePluginNames(), "mesh-cni")})
	primaryJSON, err := node.ConflistJSON("meshnet")
	if err != nil {
		t.Fatal(err)
	}
	node.WriteConf(t, "10-meshnet.conflist", primaryJSON)
	primary := node.Conflist(t, "meshnet")
	mount, err := redirect.FindCgroup2()
	if err != nil {
		t.Fatal(err)
	}
	cgroupRoot := harness.NewCgroup(t, "adopt")
	cgroups := harness.MkCgroup(t, filepath.Join(harness.MkCgroup(t, filepath.Join(cgroupRoot, "kubepods")), "besteffort"))
	asRuntime := func(p *harness.Pod) string { return p.ContainerID }
	misread := func(*harness.Pod) string { return fixtures.RandomHex(32) }

	client, _ := c.runningPod(t, node, primary, cgroups, lab, "client", kubeNode, nil, asRuntime)
	worker, _ := c.runningPod(t, node, primary, cgroups, lab, "worker", kubeNode, nil, misread)
	late, _ := c.runningPod(t, node, primary, cgroups, plain, "late", kubeNode, nil, asRuntime)
	server, _ := c.runningPod(t, node, primary, cgroups, plain, "server", kubeNode, disabled, asRuntime)
	system, _ := c.runningPod(t, node, primary, cgroups, "kube-system", "system-"+fixtures.RandomHex(3), kubeNode, enabled, asRuntime)
	attacker, attackerCg := c.runningPod(t, node, primary, cgroups, plain, "attacker", kubeNode, disabled, asRuntime)
	// Its one process runs in a network namespace it made itself.
	lost := cniPod(t, node, c.pod(t, lab, "lost", kubeNode, nil, nil))
	add(ctx, t, node, primary, lost)
	lostCg := harness.MkCgroup(t, filepath.Join(harness.MkCgroup(t, filepath.Join(cgroups, "pod"+lost.UID)), lost.ContainerID))
	unshare, err := exec.LookPath("unshare")
	if err != nil {
		t.Fatal(err)
	}
	harness.StartProcess(t, harness.ProcessOptions{Path: unshare, Args: []string{"--net", "sleep", "1000"}, Cgroup: lostCg, NetNSPath: lost.NetNSPath, Name: "container-lost"})
	// The attacker's cgroups named after the client's and lost's containers,
	// inside its own container's, as a pod with a writable cgroupfs makes
	// them; their processes in the attacker's network namespace.
	sleep, err := exec.LookPath("sleep")
	if err != nil {
		t.Fatal(err)
	}
	for _, victim := range []*harness.Pod{client, lost} {
		dir := harness.MkCgroup(t, filepath.Join(harness.MkCgroup(t, filepath.Join(attackerCg, "pod"+victim.UID)), victim.ContainerID))
		harness.StartProcess(t, harness.ProcessOptions{Path: sleep, Args: []string{"1000"}, Cgroup: dir, NetNSPath: attacker.NetNSPath, Name: "attacker-as-" + victim.Name})
	}
	updatePodStatus(ctx, t, c.admin, lab, "lost", func(st *corev1.PodStatus) { st.Phase = corev1.PodRunning })

	server.ServeEcho(t, 8080)
	target := netip.AddrPortFrom(server.IPv4(t), 8080)
	_, records := client.StartRefproxy(ctx, t)
	if err := client.EchoRoundTrip(ctx, target, []byte("mesh-cni k8s")); err != nil {
		t.Fatalf("client -> server before the install: %v", err)
	}
	// A connection the client holds open across its adoption.
	held, err := client.Dial(ctx, "tcp", target.String())
	if err != nil {
		t.Fatalf("client -> server, held: %v", err)
	}
	defer held.Close()
	if err := echoOn(held, "before the install"); err != nil {
		t.Fatalf("held connection: %v", err)
	}

	a := newAgent(t, c.api, kubeNode, append(installArgs(t, node), "--owned-config=false", "--netns-dir", harness.NetnsDir,
		"--pod-cgroup-driver=cgroupfs", "--pod-cgroup-root", strings.TrimPrefix(cgroupRoot, mount))...)
	a.start(ctx)

	fixtures.WaitFor(t, 30*time.Second, "the running pods of the labelled namespace adopted", func() bool {
		return a.enrolledUID(client.UID) && a.enrolledUID(worker.UID)
	})
	c.waitAnnotation(t, lab, "client", enroll.OutcomeEnabled)
	c.waitAnnotation(t, lab, "worker", enroll.OutcomeEnabled)
	c.waitAnnotation(t, lab, "lost", enroll.OutcomeFailed)
	c.noRedirection(t, plain, "late")
	c.noRedirection(t, plain, "attacker")
	if got := a.enrolledNetns(client.UID); got != client.NetNSPath {
		t.Errorf("the client is enrolled in %q; want its own namespace %s, never the attacker's %s", got, client.NetNSPath, attacker.NetNSPath)
	}
	if a.enrolledUID(late.UID) || a.enrolledUID(server.UID) || a.enrolledUID(lost.UID) || a.enrolledUID(attacker.UID) {
		t.Error("a running pod the policy does not select, or that could not be placed, is enrolled")
	}
	if a.enrolledUID(system.UID) {
		t.Error("a running pod of an excluded namespace was adopted")
	}
	if got := c.annotation(t, "kube-system", system.Name); got != "" {
		t.Errorf("a pod of an excluded namespace was annotated %q", got)
	}

	// The connection it opened before keeps its path: it still carries
	// data, past the proxy, which has seen nothing yet. Its next connection
	// goes through the proxy.
	if err := echoOn(held, "after the adoption"); err != nil {
		t.Errorf("the connection held across the adoption: %v", err)
	}
	if n := len(proxy.MustReadRecords(t, records)); n != 0 {
		t.Fatalf("the proxy saw %d connections before the adopted pod's first new one", n)
	}
	if err := client.EchoRoundTrip(ctx, target, []byte("mesh-cni k8s")); err != nil {
		t.Fatalf("client -> server once adopted: %v", err)
	}
	recs := proxy.AwaitRecords(ctx, t, records, 1)
	if r := recs[0]; r.Direction != "outbound" || r.OriginalDst.Addr().Unmap() != target.Addr() || r.OriginalDst.Port() != target.Port() || r.Error != "" {
		t.Fatalf("proxy record %+v, want outbound to %s", r, target)
	}

	// Labelling the unselected pod's namespace enrolls it like any pod the
	// agent knows.
	c.setLabel(t, plain, "late", "mesh-cni.io/dataplane-mode", "enabled")
	fixtures.WaitFor(t, 30*time.Second, "the labelled running pod enrolled", func() bool { return a.enrolledUID(late.UID) })

	// The runtime's DEL, through the chain the agent installed, releases
	// adopted pods: the one whose attachment the agent read as the runtime
	// names it, and the one whose sandbox id it could not read.
	meshed := waitChainEntry(t, node, true)
	for _, p := range []*harness.Pod{client, worker} {
		if err := node.Del(ctx, p, meshed); err != nil {
			t.Fatalf("DEL %s: %v", p.Name, err)
		}
		if a.enrolledUID(p.UID) {
			t.Errorf("pod %s still enrolled after its DEL", p.Name)
		}
	}
}

// echoOn sends msg on c, a connection to an echo server, and reads it back,
// leaving c open.
func echoOn(c net.Conn, msg string) error {
	if err := c.SetDeadline(time.Now().Add(5 * time.Second)); err != nil {
		return err
	}
	if _, err := io.WriteString(c, msg); err != nil {
		return fmt.Errorf("write: %w", err)
	}
	got := make([]byte, len(msg))
	if _, err := io.ReadFull(c, got); err != nil {
		return fmt.Errorf("read: %w", err)
	}
	if string(got) != msg {
		return fmt.Errorf("echo %q, want %q", got, msg)
	}
	return nil
}
