package k8s

import (
	"context"
	"net/netip"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/containernetworking/cni/libcni"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/mesh-cni/mesh-cni/test/fixtures"
	"github.com/mesh-cni/mesh-cni/test/harness"
	"github.com/mesh-cni/mesh-cni/test/proxy"
	"github.com/mesh-cni/mesh-cni/test/ztunnel"
)

// Istio's sidecar mode with istio-cni, side by side: pods rendered by the real
// istiod's injector with pilot.cni.enabled, their istio-validation init
// container the real pilot-agent's check, an Envoy-shaped proxy (the
// reference proxy, echoing, as uid 1337 in its own container), first on the
// real istio-cni (its plugin writes the pod's iptables rules), then on
// mesh-cni, with the same assertions but where the two differ by design: a
// second container running as the proxy's uid passes as the proxy on
// istio-cni and is captured on mesh-cni once the proxy's container is known.
func TestIstioSidecar(t *testing.T) {
	for _, variant := range []struct {
		name string
		mesh bool
	}{{"istio-cni", false}, {"mesh-cni", true}} {
		t.Run(variant.name, func(t *testing.T) {
			t.Parallel()
			testIstioSidecar(t, variant.mesh)
		})
	}
}

// Ports of the test's application and what its pods' annotations exclude or
// leave out of their include lists.
const (
	sidecarAppPort         = 8080
	sidecarInboundExcluded = 8081
	sidecarNotIncluded     = 8082
	sidecarOutExcluded     = 9091
	istioReadinessPort     = 15021
)

func testIstioSidecar(t *testing.T, mesh bool) {
	n := newAmbientNodeWith(t, true)
	pods, cgroupArgs := n.podCgroups(t)
	var (
		list *libcni.NetworkConfigList
		a    *agent
	)
	if mesh {
		a = n.runMeshAgent(t, cgroupArgs...)
		list = n.node.Conflist(t, n.listName, a.meshEntry())
	} else {
		list = n.startIstioCNI(t)
	}
	zt := n.startZtunnel(t)
	ctx := apiContext(t)

	// The destinations, outside the mesh, answering "FROM <peer>": a server
	// on two ports, and a second one beyond a narrowed include list.
	server := n.addPod(t, list, n.plain, "server")
	server.app.serve(t, server.cni, sidecarOutExcluded)
	serverV4, serverV6 := server.cni.IPv4(t), server.cni.IPv6(t)
	other := n.addPod(t, list, n.plain, "other")
	to := func(a netip.Addr, port uint16) string { return netip.AddrPortFrom(a, port).String() }

	// The application's pod as its author writes it, annotated with
	// exclusions, with a second container running as the proxy's uid.
	worker := int64(1337)
	sp := n.startSidecarPod(t, list, pods, a, &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Name: "app", Namespace: n.plain, Labels: map[string]string{"app": "app"},
			Annotations: map[string]string{
				"traffic.sidecar.istio.io/excludeInboundPorts":     "8081",
				"traffic.sidecar.istio.io/excludeOutboundPorts":    "9091",
				"traffic.sidecar.istio.io/excludeOutboundIPRanges": netip.PrefixFrom(serverV6, 128).String(),
			}},
		Spec: corev1.PodSpec{
			NodeName:           n.name,
			ServiceAccountName: "app-sa",
			Containers: []corev1.Container{
				{Name: "app", Image: "registry.invalid/app:never-pulled", Ports: []corev1.ContainerPort{{ContainerPort: sidecarAppPort}}},
				{Name: "worker", Image: "registry.invalid/worker:never-pulled", SecurityContext: &corev1.SecurityContext{RunAsUser: &worker}},
			},
			TerminationGracePeriodSeconds: new(int64),
		},
	}, sidecarAppPort, sidecarInboundExcluded, istioReadinessPort)
	// Where inbound connections come from: the server's pod, and the node
	// (a process of its own there, not the kubelet).
	from := containerProc{netns: server.cni.NetNSPath, cgroup: harness.NewCgroup(t, "client")}
	fromNode := containerProc{netns: n.node.NetNSPath, cgroup: harness.NewCgroup(t, "node-client")}

	// Outbound.
	appProc := sp.containers["app"]
	sp.captured(t, ctx, "the application", appProc, to(serverV4, 8080))
	reachesServer(t, ctx, "the application, excluded port", appProc, to(serverV4, sidecarOutExcluded))
	reachesServer(t, ctx, "the application, excluded range", appProc, to(serverV6, 8080))
	reachesServer(t, ctx, "the proxy itself", sp.containers["istio-proxy"], to(serverV4, 8080))
	if mesh {
		sp.captured(t, ctx, "another container as uid 1337", sp.containers["worker"], to(serverV4, 8080))
	} else {
		// istio-cni exempts every process of the proxy's uid.
		reachesServer(t, ctx, "another container as uid 1337", sp.containers["worker"], to(serverV4, 8080))
	}
	// Inbound. The node reaches pods over IPv6 once its addresses are past
	// duplicate address detection.
	n.node.WaitAddressesUsable(ctx, t)
	for _, dst := range []netip.Addr{sp.cni.IPv4(t), sp.cni.IPv6(t)} {
		sp.capturedIn(t, ctx, "inbound from a pod", from, to(dst, sidecarAppPort))
		sp.capturedIn(t, ctx, "inbound from the node", fromNode, to(dst, sidecarAppPort))
		reachesServer(t, ctx, "inbound, excluded port", from, to(dst, sidecarInboundExcluded))
		reachesServer(t, ctx, "inbound, the proxy's readiness port", from, to(dst, istioReadinessPort))
		// Within the pod: the application reaches itself directly; the
		// proxy's connect to its own pod's address goes to its inbound
		// port (how a call to the pod's own service goes through both of
		// its listeners, and what validation checks through 127.0.0.6).
		reachesServer(t, ctx, "the application to its own pod's address", appProc, to(dst, sidecarAppPort))
		sp.capturedIn(t, ctx, "the proxy to its own pod's address", sp.containers["istio-proxy"], to(dst, sidecarAppPort))
		if mesh {
			reachesServer(t, ctx, "another container as uid 1337 to its own pod's address", sp.containers["worker"], to(dst, sidecarAppPort))
		} else {
			sp.capturedIn(t, ctx, "another container as uid 1337 to its own pod's address", sp.containers["worker"], to(dst, sidecarAppPort))
		}
	}

	// A pod whose include lists are narrower than everything: inbound, one
	// of the two ports its application declares; outbound, the server's
	// IPv4 address alone (no IPv6 range, so none of that family).
	narrow := n.startSidecarPod(t, list, pods, a, &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Name: "narrow", Namespace: n.plain, Labels: map[string]string{"app": "narrow"},
			Annotations: map[string]string{
				"traffic.sidecar.istio.io/includeInboundPorts":     "8080",
				"traffic.sidecar.istio.io/includeOutboundIPRanges": netip.PrefixFrom(serverV4, 32).String(),
			}},
		Spec: corev1.PodSpec{
			NodeName:           n.name,
			ServiceAccountName: "narrow-sa",
			Containers: []corev1.Container{{Name: "app", Image: "registry.invalid/app:never-pulled",
				Ports: []corev1.ContainerPort{{ContainerPort: sidecarAppPort}, {ContainerPort: sidecarNotIncluded}}}},
			TerminationGracePeriodSeconds: new(int64),
		},
	}, sidecarAppPort, sidecarNotIncluded)
	narrowApp := narrow.containers["app"]
	narrow.captured(t, ctx, "the narrowed pod, an included range", narrowApp, to(serverV4, 8080))
	reachesServer(t, ctx, "the narrowed pod, outside its included ranges", narrowApp, to(other.cni.IPv4(t), 8080))
	reachesServer(t, ctx, "the narrowed pod, a family its included ranges do not name", narrowApp, to(serverV6, 8080))
	for _, dst := range []netip.Addr{narrow.cni.IPv4(t), narrow.cni.IPv6(t)} {
		narrow.capturedIn(t, ctx, "inbound to the narrowed pod, an included port", from, to(dst, sidecarAppPort))
		reachesServer(t, ctx, "inbound to the narrowed pod, a port not included", from, to(dst, sidecarNotIncluded))
	}

	// An ambient pod of the same node, through the same node agent, keeps
	// going through ztunnel, which never had the sidecar pods.
	amb := n.addPod(t, list, n.ambient, "ambient")
	n.node.WaitAddressesUsable(ctx, t)
	serverApp := netip.AddrPortFrom(serverV4, 8080)
	if got, err := ask(t, amb.cni, serverApp); err != nil || got != amb.cni.IPv4(t) {
		t.Errorf("ambient pod -> server: the server saw %s (%v), want the ambient pod's address", got, err)
	}
	n.waitRecord(t, "the ambient pod's outbound through ztunnel", func(r ztunnel.Record) bool {
		return r.Pod == n.ambient+"/ambient" && r.Dir == "outbound" && r.Dst == serverApp && r.Err == ""
	})
	recs, err := ztunnel.ReadRecords(n.records)
	if err != nil {
		t.Fatal(err)
	}
	for _, r := range recs {
		if r.Pod == n.plain+"/"+sp.api.Name || r.Pod == n.plain+"/"+narrow.api.Name {
			t.Errorf("ztunnel served a sidecar pod: %+v", r)
		}
	}
	select {
	case <-zt.Done():
		t.Errorf("ztunnel stopped:\n%s", zt.Output())
	default:
	}
}

// sidecarPod is an injected pod running on the node: where each of its
// containers runs, by name (istio-proxy included), and the records of its
// sidecar.
type sidecarPod struct {
	api        *corev1.Pod
	cni        *harness.Pod
	containers map[string]containerProc
	records    string
}

// startSidecarPod does what the API server, the kubelet and the runtime do
// with written: istiod's injector makes it what it runs (istio-cni's variant,
// checked), it is created and ADDed, its application serves ports, and its
// containers start in the kubelet's order, each in its cgroup under pods with
// the uid its spec gives: the real istio-validation check (which must pass),
// the sidecar, the rest. Their status goes to the API as the kubelet reports
// it; with a (mesh-cni's agent), it returns once the agent knows the
// sidecar by its container's cgroup.
func (n *ambientNode) startSidecarPod(t *testing.T, list *libcni.NetworkConfigList, pods string, a *agent, written *corev1.Pod, serve ...int) *sidecarPod {
	t.Helper()
	ctx := apiContext(t)
	injected := n.inject(t, written)
	validation, sidecarSpec := container(injected, "istio-validation"), container(injected, "istio-proxy")
	if validation == nil || sidecarSpec == nil || container(injected, "istio-init") != nil {
		t.Fatalf("istiod did not inject %s for istio-cni: init containers %v", written.Name, names(injected.Spec.InitContainers))
	}
	p, err := n.admin.CoreV1().Pods(written.Namespace).Create(ctx, injected, metav1.CreateOptions{})
	if err != nil {
		t.Fatal(err)
	}
	hp := cniPod(t, n.node, p)
	addAsKubelet(ctx, t, n.node, list, hp)
	app := &peerServer{}
	for _, port := range serve {
		app.serve(t, hp, port)
	}

	podDir := harness.MkCgroup(t, filepath.Join(pods, "pod"+string(p.UID)))
	proc := func(c *corev1.Container) (containerProc, string) {
		id := fixtures.RandomHex(32)
		uid := uint32(0)
		if sc := c.SecurityContext; sc != nil && sc.RunAsUser != nil {
			uid = uint32(*sc.RunAsUser)
		}
		return containerProc{netns: hp.NetNSPath, cgroup: harness.MkCgroup(t, filepath.Join(podDir, id)), uid: uid}, id
	}
	validator, validatorID := proc(validation)
	check := harness.StartProcess(t, harness.ProcessOptions{Path: filepath.Join(istioBins(t), "pilot-agent"), Args: validation.Args,
		Env: literalEnv(validation), NetNSPath: validator.netns, Cgroup: validator.cgroup, Dir: "/",
		Credential: validator.credential(), Name: "istio-validation"})
	vctx, cancel := context.WithTimeout(ctx, 2*time.Minute)
	defer cancel()
	if err := check.Wait(vctx); err != nil {
		t.Fatalf("%s: istio-validation failed (%v): the pod would not start\n%s", p.Name, err, check.Output())
	}

	sp := &sidecarPod{api: p, cni: hp, containers: map[string]containerProc{}}
	ids := map[string]string{}
	sidecar, sidecarID := proc(sidecarSpec)
	sp.containers[sidecarSpec.Name], ids[sidecarSpec.Name] = sidecar, sidecarID
	sp.records = echoProxy(t, sidecar)
	for i := range injected.Spec.Containers {
		c := &injected.Spec.Containers[i]
		if c.Name != sidecarSpec.Name {
			sp.containers[c.Name], ids[c.Name] = proc(c)
		}
	}
	updatePodStatus(ctx, t, n.admin, p.Namespace, p.Name, func(st *corev1.PodStatus) {
		st.Phase = corev1.PodRunning
		st.PodIPs = []corev1.PodIP{{IP: hp.IPv4(t).String()}, {IP: hp.IPv6(t).String()}}
		st.PodIP = st.PodIPs[0].IP
		running := corev1.ContainerState{Running: &corev1.ContainerStateRunning{StartedAt: metav1.Now()}}
		status := func(name string) corev1.ContainerStatus {
			return corev1.ContainerStatus{Name: name, ContainerID: "containerd://" + ids[name], State: running}
		}
		st.InitContainerStatuses = []corev1.ContainerStatus{{Name: validation.Name, ContainerID: "containerd://" + validatorID,
			State: corev1.ContainerState{Terminated: &corev1.ContainerStateTerminated{Reason: "Completed", ContainerID: "containerd://" + validatorID}}}}
		// A native sidecar (Kubernetes 1.29 and later) is an init container.
		if slices.ContainsFunc(injected.Spec.InitContainers, func(c corev1.Container) bool { return c.Name == sidecarSpec.Name }) {
			st.InitContainerStatuses = append(st.InitContainerStatuses, status(sidecarSpec.Name))
		}
		for _, c := range injected.Spec.Containers {
			st.ContainerStatuses = append(st.ContainerStatuses, status(c.Name))
		}
	})
	if a != nil {
		fixtures.WaitFor(t, 10*time.Second, p.Name+"'s proxy known by its container's cgroup", func() bool {
			return strings.HasPrefix(sidecarRule(t, a, p.UID), "sidecar container's cgroup")
		})
	}
	return sp
}

// captured checks that c's connect to target reaches the pod's sidecar on
// its outbound port, with target as the original destination.
func (sp *sidecarPod) captured(t *testing.T, ctx context.Context, what string, c containerProc, target string) {
	t.Helper()
	reachesSidecar(t, ctx, sp.records, what, c, proxy.Outbound, target)
}

// capturedIn checks that c's connect to target, one of the pod's addresses,
// reaches the pod's sidecar on its inbound port with target as the original
// destination.
func (sp *sidecarPod) capturedIn(t *testing.T, ctx context.Context, what string, c containerProc, target string) {
	t.Helper()
	reachesSidecar(t, ctx, sp.records, what, c, proxy.Inbound, target)
}

func names(cs []corev1.Container) []string {
	out := make([]string, len(cs))
	for i, c := range cs {
		out[i] = c.Name
	}
	return out
}
