package node

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/containernetworking/plugins/pkg/netlinksafe"
	"github.com/vishvananda/netlink"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/intstr"

	"github.com/mesh-cni/mesh-cni/install/kubernetes"
	"github.com/mesh-cni/mesh-cni/internal/agentcli"
	"github.com/mesh-cni/mesh-cni/internal/netns"
	"github.com/mesh-cni/mesh-cni/test/fixtures"
	"github.com/mesh-cni/mesh-cni/test/node/nodeenv"
	"github.com/mesh-cni/mesh-cni/test/proxy"
)

// scenarioTimeout bounds the whole scenario on a busy two-core machine.
const scenarioTimeout = 25 * time.Minute

// gateEvent is what the plugin's ADD says when the agent does not answer in
// gateTimeout, as kubelet puts it in the pod's FailedCreatePodSandBox event.
const gateEvent = "mesh-agent is not ready: no answer on gate socket /var/run/mesh-cni/gate.sock"

// accepted is a line of the echo server's record; connection a line of the
// echo client's.
type accepted struct {
	Time   time.Time `json:"time"`
	Client string    `json:"client"`
}

type connection struct {
	Time  time.Time `json:"time"`
	Local string    `json:"local,omitempty"`
	Error string    `json:"error,omitempty"`
}

// TestNode installs mesh-cni on a real node as an operator does, with the
// commands of docs/install.md: containerd with the CRI and runc, kubelet, kube-proxy
// and the control plane, all built from modules (nodeenv). With kustomize: the
// pinned release, meshed pods talking through their proxies, pods created
// while the agent is away, containerd restarted, the agent pod replaced, the
// DaemonSet rolled to this tree's build, uninstall. With Helm: the same build
// over a primary CNI of spec 1.1.0, the CNI verbs containerd sends, the agent
// in a crash loop for longer than the node-monitor grace period with the
// node staying Ready, uninstall. Each uninstall leaves the node's CNI config as it was
// and no pins.
func TestNode(t *testing.T) {
	current, release := readImages(t)
	ctx, cancel := context.WithTimeout(context.Background(), scenarioTimeout)
	defer cancel()

	s := startScenario(t, ctx, nodeenv.Options{PrimaryCNIVersion: "1.0.0"}, current, release)
	n, op, bench := s.n, s.op, newNodeBench()
	s.bench = bench
	before := snapshotNode(t, n)
	steps := []struct {
		name string
		fn   func(*testing.T, context.Context)
	}{
		{"1-install-release", s.installRelease},
		{"3-meshed-pods-talk", s.meshedPodsTalk},
		{"4c-rollout-to-this-build", s.rolloutOwnBuild},
		{"4d-nodeport-captured-probes-pass", s.nodePortAndProbes},
		{"4e-probe-aimed-elsewhere-captured", s.probeAimedElsewhere},
		{"4f-completed-pod-leaves-mesh", s.completedPodLeavesMesh},
		{"2-pod-waits-for-agent", s.podWaitsForAgent},
		{"4a-containerd-restart", s.containerdRestart},
		{"4b-agent-pod-replaced", s.agentPodReplaced},
		{"pod-start-times", s.podStartTimes},
		{"4-no-bypass", s.noBypass},
		{"5-del-on-pod-delete", s.delOnPodDelete},
		{"6-uninstall", func(t *testing.T, ctx context.Context) { s.uninstall(t, ctx, before) }},
		{"helm-5-verbs-and-status", s.helm},
	}
	// -run TestNode/... picks steps (each needs the ones before it that set
	// up its state); only a whole run checks that every command of docs/install.md ran.
	ran := 0
	for _, st := range steps {
		if !t.Run(st.name, func(t *testing.T) { ran++; st.fn(t, ctx) }) {
			t.FailNow()
		}
	}
	if ran < len(steps) {
		return
	}
	if left := op.unused("release", "own-build", "uninstall", "helm", "helm-upgrade", "helm-uninstall"); len(left) > 0 {
		t.Errorf("docs/install.md commands the test never ran: %q", left)
	}
	bench.write(t)
}

// scenario is the state the steps hand on.
type scenario struct {
	*cluster
	op                     *operator
	releaseDir, currentDir string
	bench                  *nodeBench

	serverIP, clientIP, plainIP string
	// enrolled are the long-lived pods of namespace shop, each of which must
	// stay enrolled through every disruption.
	enrolled []string
	// upgrade is when the DaemonSet rolled from the release to this tree's
	// build (see rolloutOwnBuild).
	upgrade struct{ from, to time.Time }
}

// agentPod is the DaemonSet's pod on the node.
func (s *scenario) agentPod(t *testing.T, ctx context.Context) corev1.Pod {
	t.Helper()
	list, err := s.n.Admin.CoreV1().Pods(kubernetes.Namespace).List(ctx, metav1.ListOptions{LabelSelector: "app.kubernetes.io/name=mesh-agent"})
	if err != nil || len(list.Items) != 1 {
		t.Fatalf("agent pods: %v (%d)", err, len(list.Items))
	}
	return list.Items[0]
}

// kubectl runs the cluster's kubectl as the admin and returns its output.
func (s *scenario) kubectl(t *testing.T, ctx context.Context, args ...string) string {
	t.Helper()
	cmd := exec.CommandContext(ctx, s.n.Bins.Kubectl(), append([]string{"--kubeconfig", s.n.AdminKubeconfig}, args...)...)
	var out, stderr bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &stderr
	if err := cmd.Run(); err != nil {
		t.Fatalf("kubectl %s: %v\n%s%s", strings.Join(args, " "), err, out.String(), stderr.String())
	}
	return out.String()
}

// agentStatus is `mesh-agent status -o json` in the agent's pod, as an
// operator runs it.
type agentStatus struct {
	Agent struct {
		Ready bool `json:"ready"`
	} `json:"agent"`
	Pods []struct {
		Namespace string `json:"namespace"`
		Name      string `json:"name"`
		State     string `json:"state"`
	} `json:"pods"`
}

func (s *scenario) status(t *testing.T, ctx context.Context) agentStatus {
	t.Helper()
	out := s.kubectl(t, ctx, "-n", kubernetes.Namespace, "exec", "ds/mesh-agent", "--", kubernetes.AgentBinary, "status", "-o", "json")
	var st agentStatus
	if err := json.Unmarshal([]byte(out), &st); err != nil {
		t.Fatalf("mesh-agent status -o json: %v\n%s", err, out)
	}
	return st
}

func (st agentStatus) enrolled(ns, name string) bool {
	return slices.ContainsFunc(st.Pods, func(p struct {
		Namespace string `json:"namespace"`
		Name      string `json:"name"`
		State     string `json:"state"`
	}) bool {
		return p.Namespace == ns && p.Name == name
	})
}

// chainEntry reads the node's CNI conf dir: the file the runtime loads first
// and whether it chains mesh-cni.
func (s *scenario) chainEntry(t *testing.T) (string, bool) {
	t.Helper()
	dir := s.n.Path(s.n.CNIConfDir)
	entries, err := os.ReadDir(dir)
	if err != nil || len(entries) == 0 {
		t.Fatalf("node conf dir: %v (%d files)", err, len(entries))
	}
	first := entries[0].Name()
	data, err := os.ReadFile(filepath.Join(dir, first))
	if err != nil {
		t.Fatal(err)
	}
	return first, strings.Contains(string(data), `"type": "mesh-cni"`)
}

func (s *scenario) installRelease(t *testing.T, ctx context.Context) {
	s.op.run(ctx, s.releaseDir, "release")
	p := s.agentPod(t, ctx)
	if img := p.Spec.Containers[0].Image; img != kubernetes.Image+"@"+kubernetes.ReleaseDigest {
		t.Errorf("the agent runs %s, want the pinned release", img)
	}
	file, meshed := s.chainEntry(t)
	if !meshed {
		t.Fatalf("the runtime loads %s first, which does not chain mesh-cni", file)
	}
	if _, err := os.Stat(s.n.Path("/opt/cni/bin/mesh-cni")); err != nil {
		t.Errorf("the plugin is not in the node's CNI bin dir: %v", err)
	}
	if st := s.status(t, ctx); !st.Agent.Ready {
		t.Errorf("mesh-agent status: not ready")
	}
	t.Logf("agent %s ready; the runtime loads %s", p.Name, file)
}

func (s *scenario) meshedPodsTalk(t *testing.T, ctx context.Context) {
	s.namespace(ctx, "shop", true)
	s.namespace(ctx, "plain", false)
	s.create(ctx, s.server("shop", "server", true))
	s.serverIP = s.podIP(ctx, "shop", "server")
	target := net.JoinHostPort(s.serverIP, strconv.Itoa(serverPort))
	s.create(ctx, s.client("shop", "client", target, true))
	s.create(ctx, s.client("plain", "plain", target, false))
	s.clientIP = s.podIP(ctx, "shop", "client")
	s.enrolled = append(s.enrolled, "server", "client")
	s.plainIP = s.podIP(ctx, "plain", "plain")
	s.waitConnections(t, ctx, "client", 20)
	s.waitConnections(t, ctx, "plain", 10)

	for _, p := range []struct{ ns, name string }{{"shop", "server"}, {"shop", "client"}} {
		s.until(ctx, p.ns, p.name, redirectionAnn+"=enabled", func(pod *corev1.Pod) bool { return pod.Annotations[redirectionAnn] == "enabled" })
	}
	// This step runs the pinned release, which still writes "disabled" on a
	// pod outside the mesh; this tree's agent writes nothing there.
	plain, err := s.n.Admin.CoreV1().Pods("plain").Get(ctx, "plain", metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if v := plain.Annotations[redirectionAnn]; v != "" && v != "disabled" {
		t.Errorf("the plain pod carries %s=%s, want none or disabled", redirectionAnn, v)
	}
	st := s.status(t, ctx)
	if !st.enrolled("shop", "server") || !st.enrolled("shop", "client") || st.enrolled("plain", "plain") {
		t.Errorf("mesh-agent status enrolls %+v: want shop/server and shop/client, not plain/plain", st.Pods)
	}

	// Through both proxies, each with the exact original destination.
	want := netip.MustParseAddrPort(target)
	out := s.proxied(t, "client", proxy.Outbound)
	in := s.proxied(t, "server", proxy.Inbound)
	for _, r := range out {
		if r.OriginalDst != want || r.DstSource != proxy.SourceGetsockopt {
			t.Fatalf("the client's proxy took a connection to %s (%s), want %s from SO_ORIGINAL_DST", r.OriginalDst, r.DstSource, want)
		}
	}
	fromClient, fromPlain := 0, 0
	for _, r := range in {
		if r.OriginalDst != want {
			t.Fatalf("the server's proxy took a connection to %s, want %s", r.OriginalDst, want)
		}
		switch r.Client.Addr().String() {
		case s.clientIP:
			fromClient++
		case s.plainIP:
			fromPlain++
		}
	}
	if len(out) == 0 || fromClient == 0 || fromPlain == 0 {
		t.Fatalf("proxied: %d outbound by the client's proxy, inbound by the server's %d from the client and %d from the plain pod", len(out), fromClient, fromPlain)
	}
	s.checkServerSawOnlyItsProxy(t)
	t.Logf("client %s → server %s:%d through both proxies (%d outbound, %d inbound from it); plain pod %s untouched (no proxy, %d connections reached the server's proxy directly)",
		s.clientIP, s.serverIP, serverPort, len(out), fromClient, s.plainIP, fromPlain)
}

// proxied returns the records of pod's proxy in one direction, for the
// server's port (kubelet's startup probe of the proxy's own port aside).
func (s *scenario) proxied(t *testing.T, pod string, dir proxy.Direction) []proxy.Record {
	t.Helper()
	var out []proxy.Record
	for _, r := range readLines[proxy.Record](t, filepath.Join(s.records(), pod+"-proxy.jsonl")) {
		if r.Direction == dir && r.OriginalDst.Port() == serverPort && r.Error == "" {
			out = append(out, r)
		}
	}
	return out
}

// connections counts a client's round trips: succeeded and failed.
func (s *scenario) connections(t *testing.T, pod string) (ok, failed int) {
	ok, failed, _ = s.connectionsLastError(t, pod)
	return ok, failed
}

// connectionsLastError is connections with the last failure's error.
func (s *scenario) connectionsLastError(t *testing.T, pod string) (ok, failed int, last string) {
	t.Helper()
	for _, c := range readLines[connection](t, filepath.Join(s.records(), pod+".jsonl")) {
		if c.Error == "" {
			ok++
		} else {
			failed++
			last = c.Error
		}
	}
	return ok, failed, last
}

// waitConnections waits until pod's client has made at least n more
// successful round trips than it had.
func (s *scenario) waitConnections(t *testing.T, ctx context.Context, pod string, n int) {
	t.Helper()
	start, _ := s.connections(t, pod)
	var (
		ok, failed int
		last       string
	)
	if !fixtures.Eventually(ctx, time.Minute, 200*time.Millisecond, func() bool {
		ok, failed, last = s.connectionsLastError(t, pod)
		return ok >= start+n
	}) {
		t.Fatalf("client %s: %d round trips succeeded (%d before), %d failed (the last: %s); want %d more", pod, ok, start, failed, last, n)
	}
}

// checkServerSawOnlyItsProxy: every connection the server accepted came from
// its own pod's address, its inbound proxy's onward connection. Any other
// client address is a connection that bypassed the mesh.
func (s *scenario) checkServerSawOnlyItsProxy(t *testing.T) int {
	t.Helper()
	total, _ := checkOnlyProxy(t, s.cluster, "server", s.serverIP, s.upgrade.from, s.upgrade.to)
	return total
}

// checkOnlyProxy is checkServerSawOnlyItsProxy for any server pod: it fails
// the test for every connection not from ip, the server pod's own address,
// except those accepted between from and to, which it returns.
func checkOnlyProxy(t *testing.T, c *cluster, server, ip string, from, to time.Time) (int, []string) {
	t.Helper()
	recs := readLines[accepted](t, filepath.Join(c.records(), server+".jsonl"))
	var bypassed, inWindow []string
	for _, r := range recs {
		host, _, err := net.SplitHostPort(r.Client)
		if err == nil && host == ip {
			continue
		}
		desc := fmt.Sprintf("%s at %s", r.Client, r.Time.Format("15:04:05.000"))
		if !r.Time.Before(from) && !r.Time.After(to) {
			inWindow = append(inWindow, desc)
		} else {
			bypassed = append(bypassed, desc)
		}
	}
	if len(bypassed) > 0 || len(recs) == 0 {
		t.Errorf("the server accepted %d connections, %d of them not from its proxy (%s): %q", len(recs), len(bypassed), ip, bypassed)
	}
	return len(recs), inWindow
}

func (s *scenario) podWaitsForAgent(t *testing.T, ctx context.Context) {
	// The agent away while its DaemonSet stays (an eviction, a node
	// selector that no longer matches, an image that cannot be pulled): the
	// chain entry stays, so new pods wait for an agent instead of starting
	// unmeshed.
	s.kubectl(t, ctx, "-n", kubernetes.Namespace, "patch", "ds/mesh-agent", "--type=merge",
		"-p", `{"spec":{"template":{"spec":{"nodeSelector":{"mesh-cni.test/away":"true"}}}}}`)
	gone := s.agentPod(t, ctx)
	s.untilGone(ctx, kubernetes.Namespace, gone.Name)
	if file, meshed := s.chainEntry(t); !meshed {
		t.Fatalf("with the agent away the runtime loads %s, without mesh-cni", file)
	}
	// Two pods of the enrolled namespace: a client with its proxy (to show
	// its traffic redirected once it runs) and a one-container pod (whose
	// status kubectl shows as ContainerCreating).
	target := net.JoinHostPort(s.serverIP, strconv.Itoa(serverPort))
	created := s.create(ctx, s.client("shop", "late", target, true))
	s.create(ctx, s.server("shop", "late-app", false))
	late := []string{"late", "late-app"}

	// Held: no container starts, and kubelet reports the gate's reason when
	// the plugin's ADD gives up after gateTimeout (and tries again).
	const held = 2 * time.Minute
	heldFrom := time.Now()
	events := map[string]corev1.Event{}
	var pending *corev1.Pod
	if !fixtures.Eventually(ctx, held, time.Second, func() bool {
		for _, name := range late {
			for _, e := range s.events(ctx, "shop", name) {
				if e.Reason == "FailedCreatePodSandBox" && strings.Contains(e.Message, gateEvent) {
					events[name] = e
				}
			}
			p, err := s.n.Admin.CoreV1().Pods("shop").Get(ctx, name, metav1.GetOptions{})
			if err != nil {
				t.Fatal(err)
			}
			if p.Status.Phase != corev1.PodPending {
				t.Fatalf("with no agent pod %s is %s: %s", name, p.Status.Phase, describe(p))
			}
			if _, ok := events[name]; !ok {
				pending = p
			}
		}
		return len(events) == len(late)
	}) {
		t.Fatalf("no FailedCreatePodSandBox event with the gate's reason for %s after %v: %s", pending.Name, time.Since(created).Round(time.Second), describe(pending))
	}
	kubectlSays := strings.TrimSpace(s.kubectl(t, ctx, "-n", "shop", "get", "pods", "late", "late-app", "--no-headers"))
	t.Logf("%v after creation:\n%s\nevent %s: %s", time.Since(created).Round(time.Second), kubectlSays, events["late-app"].Reason, events["late-app"].Message)
	s.bench.note(fmt.Sprintf("Pods created with the agent away, %v later (`kubectl get pods`):\n\n```\n%s\n```\n\nand kubelet's event: `%s`",
		time.Since(created).Round(time.Second), kubectlSays, events["late-app"].Message))

	// kubelet retries a failed sandbox after its pod worker's back-off (10 s
	// and jitter), each ADD held up to gateTimeout: bring the agent back
	// while both pods' ADDs are held at the gate (a mesh-cni process for
	// each), the case the gate is for.
	if !fixtures.Eventually(ctx, time.Until(heldFrom.Add(held+time.Minute)), 50*time.Millisecond, func() bool {
		return len(s.n.Processes("mesh-cni")) >= len(late)
	}) {
		t.Fatalf("the pods' ADDs are not both held at the gate (%d mesh-cni processes)", len(s.n.Processes("mesh-cni")))
	}
	agentReady := s.agentReadyLater(ctx)
	s.kubectl(t, ctx, "-n", kubernetes.Namespace, "patch", "ds/mesh-agent", "--type=json",
		"-p", `[{"op":"remove","path":"/spec/template/spec/nodeSelector/mesh-cni.test~1away"}]`)
	s.kubectl(t, ctx, "-n", kubernetes.Namespace, "rollout", "status", "ds/mesh-agent", "--timeout=3m")
	ready, err := agentReady()
	if err != nil {
		t.Fatal(err)
	}
	for _, name := range late {
		_, runningAt := s.until(ctx, "shop", name, "running", running)
		wait := runningAt.Sub(ready)
		if runningAt.Before(ready) {
			t.Errorf("pod %s ran %v before the agent answered ready", name, -wait)
		}
		s.bench.sample("gate-release", "ADD held at the gate", wait)
		t.Logf("agent ready → waiting pod %s Running: %v", name, wait.Round(time.Millisecond))
	}
	s.enrolled = append(s.enrolled, late...)
	s.until(ctx, "shop", "late", redirectionAnn+"=enabled", func(p *corev1.Pod) bool { return p.Annotations[redirectionAnn] == "enabled" })
	s.waitConnections(t, ctx, "late", 5)
	if len(s.proxied(t, "late", proxy.Outbound)) == 0 {
		t.Error("the pod that waited reaches the server, but not through its proxy")
	}
}

// noLoss checks that the meshed client kept going through a disruption: more
// round trips through its proxy, none failed, no bypass at the server.
func (s *scenario) noLoss(t *testing.T, ctx context.Context, what string, disrupt func()) {
	t.Helper()
	okBefore, failedBefore := s.connections(t, "client")
	proxiedBefore := len(s.proxied(t, "client", proxy.Outbound))
	disrupt()
	s.waitConnections(t, ctx, "client", 20)
	ok, failed := s.connections(t, "client")
	proxied := len(s.proxied(t, "client", proxy.Outbound))
	if failed != failedBefore {
		t.Errorf("%s: %d of the client's round trips failed", what, failed-failedBefore)
	}
	if proxied <= proxiedBefore {
		t.Errorf("%s: the client's round trips no longer go through its proxy (%d proxied before, %d after)", what, proxiedBefore, proxied)
	}
	s.checkServerSawOnlyItsProxy(t)
	st := s.status(t, ctx)
	for _, p := range s.enrolled {
		if !st.enrolled("shop", p) {
			t.Errorf("%s: shop/%s is no longer enrolled: %+v", what, p, st.Pods)
		}
	}
	t.Logf("%s: the client made %d more round trips, all through its proxy, none failed", what, ok-okBefore)
}

func (s *scenario) containerdRestart(t *testing.T, ctx context.Context) {
	s.noLoss(t, ctx, "containerd restarted", func() {
		s.n.RestartContainerd()
		if err := s.n.WaitReady(ctx, true); err != nil {
			t.Fatal(err)
		}
	})
}

func (s *scenario) agentPodReplaced(t *testing.T, ctx context.Context) {
	old := s.agentPod(t, ctx)
	s.noLoss(t, ctx, "agent pod deleted and recreated", func() {
		s.kubectl(t, ctx, "-n", kubernetes.Namespace, "delete", "pod", old.Name, "--wait")
		s.kubectl(t, ctx, "-n", kubernetes.Namespace, "rollout", "status", "ds/mesh-agent", "--timeout=3m")
		if p := s.agentPod(t, ctx); p.Name == old.Name {
			t.Fatalf("agent pod %s not replaced", old.Name)
		}
	})
}

// nodePortAndProbes: a meshed server behind a NodePort Service whose traffic
// kube-proxy masquerades (externalTrafficPolicy Cluster) to the node's own
// address on the pods' network, and with a readiness probe on the same port,
// which the kubelet makes from that same address. Connections from off the
// node to the node port reach the application only through its proxy; the
// kubelet's probes reach it directly, past the proxy, and the pod turns Ready.
func (s *scenario) nodePortAndProbes(t *testing.T, ctx context.Context) {
	p := s.server("shop", "probed", true)
	p.Spec.Containers[0].ReadinessProbe = &corev1.Probe{
		ProbeHandler:  corev1.ProbeHandler{TCPSocket: &corev1.TCPSocketAction{Port: intstr.FromInt32(serverPort)}},
		PeriodSeconds: 1,
	}
	s.create(ctx, p)
	pod, _ := s.until(ctx, "shop", "probed", "ready", func(p *corev1.Pod) bool {
		for _, c := range p.Status.Conditions {
			if c.Type == corev1.PodReady && c.Status == corev1.ConditionTrue {
				return true
			}
		}
		return false
	})
	svc, err := s.n.Admin.CoreV1().Services("shop").Create(ctx, &corev1.Service{
		ObjectMeta: metav1.ObjectMeta{Name: "probed"},
		Spec: corev1.ServiceSpec{
			Type:                  corev1.ServiceTypeNodePort,
			ExternalTrafficPolicy: corev1.ServiceExternalTrafficPolicyCluster,
			Selector:              map[string]string{"app": "probed"},
			Ports:                 []corev1.ServicePort{{Port: serverPort, TargetPort: intstr.FromInt32(serverPort)}},
		},
	}, metav1.CreateOptions{})
	if err != nil {
		t.Fatal(err)
	}
	nodePort := netip.AddrPortFrom(s.n.NodeIP, uint16(svc.Spec.Ports[0].NodePort))
	// From the host, off the node: kube-proxy DNATs to the pod and masquerades.
	const through = 3
	for i := 0; i < through; {
		if err := echoFromHost(ctx, nodePort); err != nil {
			if ctx.Err() != nil {
				t.Fatalf("node port %s: %v", nodePort, err)
			}
			time.Sleep(200 * time.Millisecond) // kube-proxy's rules are not in place yet
			continue
		}
		i++
	}
	podAddr := netip.MustParseAddr(pod.Status.PodIP)
	nodeAddrs := s.nodeAddresses(t)
	// The node port's connections carry a line; the kubelet's TCP probes of
	// the application connect and close. (The kubelet's startup probe of the
	// proxy's own port reaches the proxy as it should, and is not counted.)
	// The proxy writes its record once both sides have closed, which can be
	// after the client has its echo: wait for the last one a little.
	var viaProxy int
	fixtures.Eventually(ctx, 10*time.Second, 200*time.Millisecond, func() bool {
		viaProxy = 0
		for _, r := range readLines[proxy.Record](t, filepath.Join(s.records(), "probed-proxy.jsonl")) {
			if r.Direction != proxy.Inbound || !slices.Contains(nodeAddrs, r.Client.Addr()) || r.OriginalDst.Port() != serverPort {
				continue
			}
			if r.BytesToDst == 0 {
				t.Errorf("the proxy took a connection from %s that carried nothing (a kubelet probe?): %+v", r.Client, r)
				continue
			}
			viaProxy++
		}
		return viaProxy >= through || t.Failed()
	})
	var probes int
	for _, r := range readLines[accepted](t, filepath.Join(s.records(), "probed.jsonl")) {
		client := netip.MustParseAddrPort(r.Client).Addr()
		switch {
		case client == podAddr: // its proxy
		case slices.Contains(nodeAddrs, client):
			probes++
		default:
			t.Errorf("the application accepted a connection from %s, neither its proxy nor the kubelet", r.Client)
		}
	}
	if viaProxy < through {
		t.Errorf("the proxy took %d connections through the node port from the node's addresses %v, want the %d made", viaProxy, nodeAddrs, through)
	}
	if probes == 0 {
		t.Errorf("no kubelet probe reached the application directly, though the pod is Ready")
	}
	t.Logf("node port %s: %d connections masqueraded to the node's address, all through the proxy; %d kubelet probes from the same address reached the application directly", nodePort, viaProxy, probes)

	// The kubelet restarted in place (its cgroup made again at the same
	// path, with another id): once the agent's watch finds it, within its
	// reconcile interval, its probes reach the application directly again.
	restarted := time.Now()
	s.n.RestartKubeletInPlace()
	if err := s.n.WaitReady(ctx, true); err != nil {
		t.Fatal(err)
	}
	var direct time.Time
	if !fixtures.Eventually(ctx, time.Until(restarted.Add(2*time.Minute)), 500*time.Millisecond, func() bool {
		for _, r := range readLines[accepted](t, filepath.Join(s.records(), "probed.jsonl")) {
			if r.Time.After(restarted) && slices.Contains(nodeAddrs, netip.MustParseAddrPort(r.Client).Addr()) {
				direct = r.Time
				return true
			}
		}
		return false
	}) {
		t.Fatalf("%v after the kubelet restarted in place, none of its probes reached the application directly", time.Since(restarted).Round(time.Second))
	}
	s.until(ctx, "shop", "probed", "ready after the kubelet restarted", func(p *corev1.Pod) bool {
		return slices.ContainsFunc(p.Status.Conditions, func(c corev1.PodCondition) bool {
			return c.Type == corev1.PodReady && c.Status == corev1.ConditionTrue
		})
	})
	t.Logf("kubelet restarted in place: its probes reach the application directly again %v later", direct.Sub(restarted).Round(time.Millisecond))
}

// probeAimedElsewhere: a pod's author aims its readiness probe at another
// team's meshed pod (the probe's host field), at a port that pod's own probes
// do not name. The kubelet makes the connection, but it reaches the target
// only through the target's proxy, like any connection; the target's own
// probes still reach it directly (4d).
func (s *scenario) probeAimedElsewhere(t *testing.T, ctx context.Context) {
	s.create(ctx, s.server("shop", "aimed-at", true))
	targetIP := s.podIP(ctx, "shop", "aimed-at")
	aimer := s.server("plain", "aimer", false)
	aimer.Spec.Containers[0].ReadinessProbe = &corev1.Probe{
		ProbeHandler:  corev1.ProbeHandler{TCPSocket: &corev1.TCPSocketAction{Host: targetIP, Port: intstr.FromInt32(serverPort)}},
		PeriodSeconds: 1,
	}
	s.create(ctx, aimer)
	// The proxy forwards the probe's connection, so the probe succeeds: the
	// point is the path it took.
	s.until(ctx, "plain", "aimer", "ready", func(p *corev1.Pod) bool {
		return slices.ContainsFunc(p.Status.Conditions, func(c corev1.PodCondition) bool {
			return c.Type == corev1.PodReady && c.Status == corev1.ConditionTrue
		})
	})
	nodeAddrs := s.nodeAddresses(t)
	var viaProxy int
	fixtures.Eventually(ctx, 10*time.Second, 200*time.Millisecond, func() bool {
		for _, r := range readLines[proxy.Record](t, filepath.Join(s.records(), "aimed-at-proxy.jsonl")) {
			if r.Direction == proxy.Inbound && slices.Contains(nodeAddrs, r.Client.Addr()) && r.OriginalDst.Port() == serverPort {
				viaProxy++
			}
		}
		return viaProxy > 0
	})
	target := netip.MustParseAddr(targetIP)
	var direct int
	for _, r := range readLines[accepted](t, filepath.Join(s.records(), "aimed-at.jsonl")) {
		if client := netip.MustParseAddrPort(r.Client).Addr(); client != target {
			direct++
			t.Errorf("the target's application accepted %s directly, past its proxy", r.Client)
		}
	}
	if viaProxy == 0 {
		t.Errorf("none of the probes aimed at %s:%d went through its proxy", targetIP, serverPort)
	}
	t.Logf("a probe aimed at another pod's port %d: %d connections through that pod's proxy, %d directly", serverPort, viaProxy, direct)
	for _, p := range [][2]string{{"plain", "aimer"}, {"shop", "aimed-at"}} {
		if err := s.n.Admin.CoreV1().Pods(p[0]).Delete(ctx, p[1], metav1.DeleteOptions{}); err != nil {
			t.Errorf("delete pod %s/%s: %v", p[0], p[1], err)
		}
	}
}

// completedPodLeavesMesh: a meshed pod whose containers have all exited for
// good (a Job's: restartPolicy Never, its work done through its proxy) leaves
// the mesh, whichever of the kubelet's phase and its sandbox's DEL reaches the
// agent first: the agent holds it enrolled no longer and its annotation says
// disabled, so istiod would no longer send it HBONE.
func (s *scenario) completedPodLeavesMesh(t *testing.T, ctx context.Context) {
	const trips = 3
	job := s.client("shop", "job", net.JoinHostPort(s.serverIP, strconv.Itoa(serverPort)), true)
	args := job.Spec.Containers[0].Args
	args[slices.Index(args, "-n")+1] = strconv.Itoa(trips)
	job.Spec.RestartPolicy = corev1.RestartPolicyNever
	s.create(ctx, job)
	s.until(ctx, "shop", "job", "phase Succeeded", func(p *corev1.Pod) bool { return p.Status.Phase == corev1.PodSucceeded })
	s.until(ctx, "shop", "job", redirectionAnn+"=disabled", func(p *corev1.Pod) bool { return p.Annotations[redirectionAnn] == "disabled" })
	if ok, failed := s.connections(t, "job"); ok != trips || failed != 0 {
		t.Errorf("the job made %d round trips and %d failed, want %d and none", ok, failed, trips)
	}
	if n := len(s.proxied(t, "job", proxy.Outbound)); n < trips {
		t.Errorf("the job's proxy forwarded %d of its %d connections", n, trips)
	}
	for _, p := range s.status(t, ctx).Pods {
		if p.Namespace == "shop" && p.Name == "job" && p.State == agentcli.StateRedirected {
			t.Errorf("the agent still holds the completed job enrolled: %+v", p)
		}
	}
	if err := s.n.Admin.CoreV1().Pods("shop").Delete(ctx, "job", metav1.DeleteOptions{}); err != nil {
		t.Errorf("delete pod shop/job: %v", err)
	}
}

// echoFromHost has a line echoed by the server at target, from the test's own
// network namespace.
func echoFromHost(ctx context.Context, target netip.AddrPort) error {
	ctx, cancel := context.WithTimeout(ctx, 3*time.Second)
	defer cancel()
	var d net.Dialer
	c, err := d.DialContext(ctx, "tcp", target.String())
	if err != nil {
		return err
	}
	defer c.Close()
	_ = c.SetDeadline(time.Now().Add(3 * time.Second))
	if _, err := c.Write([]byte("node port\n")); err != nil {
		return err
	}
	buf := make([]byte, len("node port\n"))
	if _, err := io.ReadFull(c, buf); err != nil {
		return err
	}
	return nil
}

// nodeAddresses are the addresses of the node's network namespace.
func (s *scenario) nodeAddresses(t *testing.T) []netip.Addr {
	t.Helper()
	var out []netip.Addr
	err := netns.Do(s.n.NetNS, func() error {
		addrs, err := netlinksafe.AddrList(nil, netlink.FAMILY_ALL)
		for _, a := range addrs {
			if ip, ok := netip.AddrFromSlice(a.IP); ok {
				out = append(out, ip.Unmap())
			}
		}
		return err
	})
	if err != nil {
		t.Fatal(err)
	}
	return out
}

// rolloutOwnBuild rolls the DaemonSet from the release to this tree's build: the
// new agent migrates the release's pinned maps and takes over the pods it
// enrolled, and no connection may reach the meshed server directly meanwhile.
func (s *scenario) rolloutOwnBuild(t *testing.T, ctx context.Context) {
	s.noLoss(t, ctx, "DaemonSet rolled to this tree's build", func() {
		s.upgrade.from = time.Now()
		s.op.run(ctx, s.currentDir, "own-build")
		s.upgrade.to = time.Now()
	})
	_, gap := checkOnlyProxy(t, s.cluster, "server", s.serverIP, s.upgrade.from, s.upgrade.to)
	if len(gap) > 0 {
		t.Errorf("while the DaemonSet rolled from the release to this build, %d connections reached the server directly: %q", len(gap), gap)
	}
	if len(gap) == 0 {
		s.bench.note("Rolling the DaemonSet from the release to this tree's build, no connection reached the meshed server directly.")
	} else {
		s.bench.note(fmt.Sprintf("Rolling the DaemonSet from the release to this tree's build, %d connections reached the meshed server directly while the new agent took over (it adopts the pods the old one enrolled): %q.", len(gap), gap))
	}
	if img := s.agentPod(t, ctx).Spec.Containers[0].Image; img != s.im["mesh-agent"].Ref() {
		t.Errorf("after the rollout the agent runs %s, want %s", img, s.im["mesh-agent"].Ref())
	}
}

// podStartTimes samples pod creation → Running for the same one-container pod
// in an enrolled namespace and in one that is not, taking turns.
func (s *scenario) podStartTimes(t *testing.T, ctx context.Context) {
	const rounds = 5
	for i := range rounds {
		for _, v := range []struct {
			ns, variant string
		}{{"plain", "unmeshed"}, {"shop", "meshed"}} {
			name := fmt.Sprintf("start-%s-%d", v.variant, i)
			start := s.create(ctx, s.server(v.ns, name, false))
			_, at := s.until(ctx, v.ns, name, "running", running)
			s.bench.sample("pod-start", v.variant, at.Sub(start))
			if err := s.n.Admin.CoreV1().Pods(v.ns).Delete(ctx, name, metav1.DeleteOptions{}); err != nil {
				t.Fatal(err)
			}
		}
	}
	t.Logf("pod create → Running: %s", s.bench.summary("pod-start"))
}

func (s *scenario) noBypass(t *testing.T, ctx context.Context) {
	total := s.checkServerSawOnlyItsProxy(t)
	_, failed := s.connections(t, "client")
	t.Logf("over every step so far the server accepted %d connections, each from its own proxy; the meshed client had %d failures", total, failed)
}

func (s *scenario) delOnPodDelete(t *testing.T, ctx context.Context) {
	for _, ns := range []string{"shop", "plain"} {
		if err := s.deleteNamespace(ctx, ns); err != nil {
			t.Fatal(err)
		}
	}
	// Every pod deleted: the runtime's DEL reached the agent, which released
	// them (the pods of the timing samples included).
	var st agentStatus
	if !fixtures.Eventually(ctx, time.Minute, 500*time.Millisecond, func() bool {
		st = s.status(t, ctx)
		return len(st.Pods) == 0
	}) {
		t.Fatalf("after every pod was deleted the agent still holds %+v", st.Pods)
	}
	pods, err := os.ReadDir(s.n.Path("/sys/fs/bpf/mesh-cni/pods"))
	if err == nil && len(pods) > 0 {
		t.Errorf("pins of %d pods remain after their DEL", len(pods))
	}
}

// uninstall runs docs/install.md's uninstall: deleting the DaemonSet alone
// leaves the node as it was (its agent, told to stop, sees the DaemonSet
// being deleted and uninstalls); the Job after it, for nodes whose agent was
// away, changes nothing here.
func (s *scenario) uninstall(t *testing.T, ctx context.Context, before nodeSnapshot) {
	links := pinnedLinkIDs(t, s.n)
	s.op.run(ctx, s.currentDir, "uninstall", 0)
	snapshotNode(t, s.n).mustEqual(t, before)
	checkLinksGone(t, links, "uninstall")
	s.op.run(ctx, s.currentDir, "uninstall", 1, 2, 3)
	snapshotNode(t, s.n).mustEqual(t, before)
}
