package k8s

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"testing"
	"time"

	"go.uber.org/zap/zaptest"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/fields"
	"k8s.io/apimachinery/pkg/util/intstr"

	meshagent "github.com/mesh-cni/mesh-cni/internal/agent"
	"github.com/mesh-cni/mesh-cni/internal/enroll"
	"github.com/mesh-cni/mesh-cni/pkg/gate/gatepb"
	"github.com/mesh-cni/mesh-cni/test/fixtures"
	"github.com/mesh-cni/mesh-cni/test/k8s/kubeenv"
)

// changeLimit is the design's promise: a label change reaches the decision
// within a second.
const changeLimit = time.Second

// startSource runs a KubeSource in-process with the agent's least-privilege
// identity against api, and waits until it has synced.
func startSource(t *testing.T, api *kubeenv.APIServer, node, profile string, apiTimeout time.Duration) *enroll.KubeSource {
	t.Helper()
	sel, err := enroll.ProfileSelectors(profile)
	if err != nil {
		t.Fatal(err)
	}
	src, err := enroll.StartKubeSource(context.Background(), enroll.KubeConfig{
		Client:     api.Client(t, kubeenv.AgentUser),
		NodeName:   node,
		Selectors:  sel,
		APITimeout: apiTimeout,
		Logger:     zaptest.NewLogger(t),
	})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { src.Close() })
	var why string
	if !fixtures.Eventually(t.Context(), time.Minute, fixtures.WaitInterval, func() bool { ok, w := src.Synced(); why = w; return ok }) {
		t.Fatalf("source did not sync: %s", why)
	}
	return src
}

func identity(p *corev1.Pod) *gatepb.PodIdentity {
	return &gatepb.PodIdentity{Namespace: p.Namespace, Name: p.Name, Uid: string(p.UID)}
}

func decide(t *testing.T, src meshagent.Policy, p *corev1.Pod) meshagent.Decision {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	d, err := src.Decide(ctx, identity(p))
	if err != nil {
		t.Fatalf("Decide %s/%s: %v", p.Namespace, p.Name, err)
	}
	return d
}

// expectChange waits for ch (taken before the change) to close and for pod's
// decision to become want. Past changeLimit it reports an error but keeps
// waiting, to tell "slow" from "never".
func expectChange(t *testing.T, src *enroll.KubeSource, ch <-chan struct{}, p *corev1.Pod, want bool, what string) {
	t.Helper()
	expectDecision(t, src, ch, p, what, fmt.Sprintf("enroll=%v", want), func(d meshagent.Decision) bool { return d.Enroll == want })
}

// expectDecision is expectChange for any property of the decision.
func expectDecision(t *testing.T, src *enroll.KubeSource, ch <-chan struct{}, p *corev1.Pod, what, want string, cond func(meshagent.Decision) bool) {
	t.Helper()
	start := time.Now()
	ok := func() bool {
		select {
		case <-ch:
			return cond(decide(t, src, p))
		default:
			return false
		}
	}
	if !fixtures.Eventually(t.Context(), changeLimit, fixtures.WaitInterval, ok) {
		t.Errorf("%s: the decision for %s/%s did not become %s within %s", what, p.Namespace, p.Name, want, changeLimit)
		fixtures.WaitFor(t, 30*time.Second, what, ok)
	}
	t.Logf("%s: decision changed after %s", what, time.Since(start).Round(time.Millisecond))
}

// testSourceFollowsLabels: the selector logic against real objects, and label
// changes after the start reach the decisions through the informers.
func testSourceFollowsLabels(t *testing.T, c *cluster) {
	node := "node-" + fixtures.RandomHex(4)
	on := c.namespace(t, "on", enabled)
	off := c.namespace(t, "off", nil)
	plain := c.pod(t, on, "plain", node, nil, nil)
	optOut := c.pod(t, on, "opt-out", node, disabled, nil)
	optOutAnn := c.pod(t, on, "opt-out-ann", node, nil, disabled)
	conflict := c.pod(t, on, "conflict", node, enabled, disabled)
	podOn := c.pod(t, off, "pod-on", node, enabled, nil)
	late := c.pod(t, off, "late", node, nil, nil)

	src := startSource(t, c.api, node, enroll.ProfileMeshCNI, 5*time.Second)
	for _, tc := range []struct {
		pod    *corev1.Pod
		enroll bool
	}{
		{plain, true}, {optOut, false}, {optOutAnn, false}, {conflict, false}, {podOn, true}, {late, false},
	} {
		if d := decide(t, src, tc.pod); d.Enroll != tc.enroll {
			t.Errorf("%s/%s: %+v, want enroll=%v", tc.pod.Namespace, tc.pod.Name, d, tc.enroll)
		}
	}

	// The kubelet reaches an enrolled pod past capture only at the ports of
	// its own probes and hooks, as the API server admitted its spec: none
	// for a pod without probes; a probe aimed at another host is not its.
	if d := decide(t, src, plain); d.Capture.KubeletPorts == nil || len(*d.Capture.KubeletPorts) != 0 {
		t.Errorf("pod without probes: kubelet ports %v, want none", d.Capture.KubeletPorts)
	}
	probed := &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Name: "probed", Namespace: on},
		Spec: corev1.PodSpec{NodeName: node, TerminationGracePeriodSeconds: new(int64), Containers: []corev1.Container{{
			Name: "app", Image: "registry.invalid/app:never-pulled",
			Ports:          []corev1.ContainerPort{{Name: "http", ContainerPort: 8080}},
			ReadinessProbe: &corev1.Probe{ProbeHandler: corev1.ProbeHandler{HTTPGet: &corev1.HTTPGetAction{Path: "/ready", Port: intstr.FromString("http")}}},
			LivenessProbe:  &corev1.Probe{ProbeHandler: corev1.ProbeHandler{TCPSocket: &corev1.TCPSocketAction{Host: "10.0.0.9", Port: intstr.FromInt32(5432)}}},
			Lifecycle:      &corev1.Lifecycle{PreStop: &corev1.LifecycleHandler{HTTPGet: &corev1.HTTPGetAction{Path: "/drain", Port: intstr.FromInt32(9901)}}},
		}}},
	}
	if _, err := c.admin.CoreV1().Pods(on).Create(apiContext(t), probed, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	if d := decide(t, src, probed); d.Capture.KubeletPorts == nil || !slices.Equal(*d.Capture.KubeletPorts, []uint16{8080, 9901}) {
		t.Errorf("probed pod: kubelet ports %v, want [8080 9901]", d.Capture.KubeletPorts)
	}
	if d := decide(t, src, optOut); d.Capture.KubeletPorts != nil {
		t.Errorf("a pod not enrolled has kubelet ports %v", *d.Capture.KubeletPorts)
	}

	// Labelling the namespace after its pods started enrolls them.
	ch := src.Changed()
	c.setLabel(t, off, "", "mesh-cni.io/dataplane-mode", "enabled")
	expectChange(t, src, ch, late, true, "namespace labelled")

	// A pod opting out later is released; removing the opt-out brings it back.
	ch = src.Changed()
	c.setLabel(t, off, late.Name, "mesh-cni.io/dataplane-mode", "disabled")
	expectChange(t, src, ch, late, false, "pod opted out")
	ch = src.Changed()
	c.setLabel(t, off, late.Name, "mesh-cni.io/dataplane-mode", "")
	expectChange(t, src, ch, late, true, "opt-out removed")

	// Unlabelling the namespace releases its pods, except one labelled itself.
	ch = src.Changed()
	c.setLabel(t, off, "", "mesh-cni.io/dataplane-mode", "")
	expectChange(t, src, ch, late, false, "namespace unlabelled")
	if d := decide(t, src, podOn); !d.Enroll {
		t.Errorf("pod with its own label released with its namespace: %+v", d)
	}
}

func testSourceIstioProfile(t *testing.T, c *cluster) {
	node := "node-" + fixtures.RandomHex(4)
	ambient := map[string]string{enroll.IstioLabelDataplaneMode: enroll.IstioValueAmbient}
	none := map[string]string{enroll.IstioLabelDataplaneMode: enroll.IstioValueNone}
	amb := c.namespace(t, "ambient", ambient)
	ours := c.namespace(t, "ours", enabled)
	cases := []struct {
		pod    *corev1.Pod
		enroll bool
	}{
		{c.pod(t, amb, "plain", node, nil, nil), true},
		{c.pod(t, amb, "none", node, none, nil), false},
		{c.pod(t, amb, "sidecar", node, nil, map[string]string{enroll.IstioAnnotationSidecar: `{"containers":["istio-proxy"]}`}), false},
		{c.pod(t, ours, "ours", node, nil, nil), false},
		{c.pod(t, ours, "pod-ambient", node, ambient, nil), true},
	}
	// In a namespace that enforces the mesh, neither opting out nor leaving
	// inbound uncaptured holds; elsewhere the bypass does.
	bypass := map[string]string{enroll.IstioAnnotationBypassInbound: "true", enroll.IstioAnnotationDNSCapture: "False"}
	enforced := c.namespace(t, "ambient-enforced", map[string]string{enroll.IstioLabelDataplaneMode: enroll.IstioValueAmbient, enroll.LabelEnforce: enroll.ValueEnforce})
	enforcedBypass := c.pod(t, enforced, "bypass", node, none, bypass)
	openBypass := c.pod(t, amb, "bypass", node, nil, bypass)
	src := startSource(t, c.api, node, enroll.ProfileIstio, 5*time.Second)
	for _, tc := range cases {
		if d := decide(t, src, tc.pod); d.Enroll != tc.enroll {
			t.Errorf("%s/%s: %+v, want enroll=%v", tc.pod.Namespace, tc.pod.Name, d, tc.enroll)
		}
	}
	d := decide(t, src, enforcedBypass)
	if !d.Enroll || d.Capture.BypassInbound || d.Capture.DNS != nil || !strings.Contains(d.Reason, `"istio.io/dataplane-mode=none" (profile istio), ignored`) ||
		!strings.Contains(d.Reason, enroll.IstioAnnotationBypassInbound+"=true, ignored: namespace "+enforced+" enforces the mesh") ||
		!strings.Contains(d.Reason, enroll.IstioAnnotationDNSCapture+"=False, ignored: namespace "+enforced+" enforces the mesh") {
		t.Errorf("opted out, inbound bypassed, DNS not captured, in an enforcing namespace: %+v; want enrolled with inbound and DNS as the node captures them, saying all three were ignored", d)
	}
	if d := decide(t, src, openBypass); !d.Enroll || !d.Capture.BypassInbound || d.Capture.DNS == nil || *d.Capture.DNS {
		t.Errorf("inbound bypassed, DNS not captured, in a namespace that does not enforce: %+v; want enrolled with both", d)
	}
	// Changing the annotation on a running pod is a change the agent applies.
	ch := src.Changed()
	c.setMeta(t, amb, openBypass.Name, "annotations", enroll.IstioAnnotationBypassInbound, "false")
	expectDecision(t, src, ch, openBypass, "bypass annotation turned off", "inbound captured",
		func(d meshagent.Decision) bool { return d.Enroll && !d.Capture.BypassInbound })

	// A pod Istio injected with a sidecar is captured for it, in any
	// namespace but one that enforces the mesh, where a pod cannot make
	// itself its own proxy: there it is the node proxy's.
	plain := c.namespace(t, "plain", nil)
	for _, tc := range []struct {
		namespace string
		sidecar   bool
	}{{plain, true}, {amb, true}, {enforced, false}} {
		p, err := c.admin.CoreV1().Pods(tc.namespace).Create(apiContext(t), injectedPod(tc.namespace, "injected", node), metav1.CreateOptions{})
		if err != nil {
			t.Fatal(err)
		}
		d := decide(t, src, p)
		if !d.Enroll || (d.Capture.Sidecar != nil) != tc.sidecar {
			t.Errorf("injected pod in %s: %+v, want enrolled, in sidecar mode %v", tc.namespace, d, tc.sidecar)
		}
	}
}

// injectedPod is a pod as Istio's injector leaves it for istio-cni: its
// istio-proxy as a native sidecar running as 1337, an application container,
// and the injector's status.
func injectedPod(namespace, name, node string) *corev1.Pod {
	uid := int64(enroll.IstioProxyUID)
	always := corev1.ContainerRestartPolicyAlways
	return &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: namespace,
			Annotations: map[string]string{enroll.IstioAnnotationSidecar: `{"initContainers":["istio-validation","istio-proxy"]}`}},
		Spec: corev1.PodSpec{
			NodeName: node,
			InitContainers: []corev1.Container{{Name: enroll.IstioProxyContainer, Image: "registry.invalid/proxyv2:never-pulled", Args: []string{"proxy", "sidecar"},
				RestartPolicy: &always, SecurityContext: &corev1.SecurityContext{RunAsUser: &uid}}},
			Containers:                    []corev1.Container{{Name: "app", Image: "registry.invalid/app:never-pulled"}},
			TerminationGracePeriodSeconds: new(int64),
		},
	}
}

// testSourceDirectGet: a pod the cache does not hold is fetched from the API
// server; a pod the API server has under another uid, or not at all, is an
// error, never a guess.
func testSourceDirectGet(t *testing.T, c *cluster) {
	node := "node-" + fixtures.RandomHex(4)
	ns := c.namespace(t, "get", enabled)
	src := startSource(t, c.api, node, "", 2*time.Second)

	// Bound to another node: never in this node's cache, so only a GET finds it.
	elsewhere := c.pod(t, ns, "elsewhere", "other-"+node, nil, nil)
	if d := decide(t, src, elsewhere); !d.Enroll {
		t.Fatalf("pod found by GET: %+v, want enrolled by its namespace", d)
	}
	// Created just now: in the cache or not yet, the answer is the same.
	fresh := c.pod(t, ns, "fresh", node, disabled, nil)
	if d := decide(t, src, fresh); d.Enroll {
		t.Fatalf("fresh opted-out pod: %+v", d)
	}

	ctx := context.Background()
	stale := identity(elsewhere)
	stale.Uid = "00000000-0000-0000-0000-000000000000"
	_, err := src.Decide(ctx, stale)
	if err == nil || !strings.Contains(err.Error(), "was deleted") {
		t.Fatalf("Decide for a uid the API server does not have: %v, want a 'was deleted' error", err)
	}

	start := time.Now()
	_, err = src.Decide(ctx, &gatepb.PodIdentity{Namespace: ns, Name: "ghost"})
	if err == nil || !strings.Contains(err.Error(), "does not know it") || !strings.Contains(err.Error(), "refusing to start the pod unmeshed") {
		t.Fatalf("Decide for a pod that does not exist: %v", err)
	}
	t.Logf("unknown pod refused after %s: %v", time.Since(start).Round(time.Millisecond), err)

	if _, err := src.Decide(ctx, &gatepb.PodIdentity{Name: "no-namespace"}); err == nil {
		t.Fatal("Decide without a namespace answered")
	}
}

// testSourceReportsOutcome: outcomes land on the pod as the annotation, a
// failure also as a Warning Event, and nothing lands on a re-created pod of the
// same name.
func testSourceReportsOutcome(t *testing.T, c *cluster) {
	node := "node-" + fixtures.RandomHex(4)
	ns := c.namespace(t, "report", enabled)
	a := c.pod(t, ns, "a", node, nil, nil)
	b := c.pod(t, ns, "b", node, nil, nil)
	src := startSource(t, c.api, node, "", 5*time.Second)
	ctx := apiContext(t)

	annotation := func(name string) string {
		p, err := c.admin.CoreV1().Pods(ns).Get(ctx, name, metav1.GetOptions{})
		if err != nil {
			t.Fatal(err)
		}
		return p.Annotations[enroll.AnnotationRedirection]
	}
	src.Report(ctx, identity(a), enroll.OutcomeEnabled, nil)
	fixtures.WaitFor(t, 30*time.Second, "annotation enabled on a", func() bool { return annotation("a") == "enabled" })
	// Quick flips: each lands, although the reporter's cache of the pod may
	// lag behind its own last write.
	for i, outcome := range []string{enroll.OutcomeDisabled, enroll.OutcomeEnabled, enroll.OutcomeDisabled, enroll.OutcomeEnabled, enroll.OutcomeDisabled} {
		src.Report(ctx, identity(a), outcome, nil)
		fixtures.WaitFor(t, 30*time.Second, fmt.Sprintf("flip %d: annotation %s on a", i, outcome), func() bool { return annotation("a") == outcome })
	}

	cause := errors.New("attach inbound program: the test says no")
	src.Report(ctx, identity(b), enroll.OutcomeFailed, cause)
	fixtures.WaitFor(t, 30*time.Second, "annotation failed on b", func() bool { return annotation("b") == "failed" })
	var ev corev1.Event
	fixtures.WaitFor(t, 30*time.Second, "a Warning Event on b", func() bool {
		list, err := c.admin.CoreV1().Events(ns).List(ctx, metav1.ListOptions{
			FieldSelector: fields.OneTermEqualSelector("involvedObject.name", "b").String(),
		})
		if err != nil || len(list.Items) == 0 {
			return false
		}
		ev = list.Items[0]
		return true
	})
	if ev.Type != corev1.EventTypeWarning || ev.Reason != enroll.EventReasonEnrollFailed || !strings.Contains(ev.Message, cause.Error()) ||
		ev.InvolvedObject.UID != b.UID || ev.Source.Host != node {
		t.Fatalf("event %+v: want a Warning %s for b's uid from host %s naming the cause", ev, enroll.EventReasonEnrollFailed, node)
	}

	// a is deleted and re-created under the same name: an outcome for the old
	// uid must not land on the new pod.
	if err := c.admin.CoreV1().Pods(ns).Delete(ctx, "a", metav1.DeleteOptions{GracePeriodSeconds: new(int64)}); err != nil {
		t.Fatal(err)
	}
	a2 := c.pod(t, ns, "a", node, nil, nil)
	src.Report(ctx, identity(a), enroll.OutcomeFailed, cause)
	// The reporter works through its queue in order: once b shows a later
	// outcome, the stale report for a was handled (and refused).
	src.Report(ctx, identity(b), enroll.OutcomeEnabled, nil)
	fixtures.WaitFor(t, 30*time.Second, "annotation enabled on b", func() bool { return annotation("b") == "enabled" })
	if got := annotation("a"); got != "" {
		t.Fatalf("re-created pod a (uid %s) carries %s=%q from its predecessor", a2.UID, enroll.AnnotationRedirection, got)
	}
}

// testSourceAPIServerDown: a source started with the API server down is not
// synced (and says why) until it comes up; with the API server stopped later,
// cached pods are still answered, an uncached one waits for the API timeout and
// fails with a clear error, and after a restart the source answers again.
func testSourceAPIServerDown(t *testing.T, c *cluster) {
	api := kubeenv.StartAPIServer(t, c.bins, c.etcd, "down-"+fixtures.RandomHex(3))
	api.GrantAgent(t)
	admin := &cluster{bins: c.bins, etcd: c.etcd, api: api, admin: api.Client(t, kubeenv.AdminUser)}
	node := "node-" + fixtures.RandomHex(4)
	ns := admin.namespace(t, "down", enabled)
	known := admin.pod(t, ns, "known", node, nil, nil)
	const apiTimeout = 2 * time.Second

	// Started while the API server is down: not synced, saying why, and no
	// decisions; synced once the API server is back.
	api.Stop(t)
	sel, err := enroll.ProfileSelectors("")
	if err != nil {
		t.Fatal(err)
	}
	early, err := enroll.StartKubeSource(context.Background(), enroll.KubeConfig{
		Client: api.Client(t, kubeenv.AgentUser), NodeName: node, Selectors: sel, APITimeout: apiTimeout, Logger: zaptest.NewLogger(t),
	})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { early.Close() })
	var why string
	fixtures.WaitFor(t, 60*time.Second, "the list error in the unsynced reason", func() bool {
		var ok bool
		ok, why = early.Synced()
		return !ok && strings.Contains(why, "connection refused")
	})
	t.Logf("not synced with the API server down: %s", why)
	if _, err := early.Decide(context.Background(), identity(known)); err == nil || !strings.Contains(err.Error(), "not synced") {
		t.Fatalf("Decide before the caches synced: %v", err)
	}
	api.Start(t)
	fixtures.WaitFor(t, time.Minute, "the source to sync once the API server is up", func() bool { ok, _ := early.Synced(); return ok })
	if d := decide(t, early, known); !d.Enroll {
		t.Fatalf("after syncing: %+v", d)
	}

	src := startSource(t, api, node, "", apiTimeout)
	api.Stop(t)
	if d := decide(t, src, known); !d.Enroll {
		t.Fatalf("cached pod with the API server down: %+v", d)
	}
	start := time.Now()
	_, err = src.Decide(context.Background(), &gatepb.PodIdentity{Namespace: ns, Name: "unseen", Uid: "1e2b6f4c-0000-4000-8000-000000000001"})
	waited := time.Since(start)
	if err == nil || !strings.Contains(err.Error(), "did not answer") || !strings.Contains(err.Error(), "refusing to start the pod unmeshed") {
		t.Fatalf("Decide for an uncached pod with the API server down: %v", err)
	}
	if waited < apiTimeout {
		t.Fatalf("Decide gave up after %s, before the API timeout %s", waited, apiTimeout)
	}
	t.Logf("uncached pod refused after %s: %v", waited.Round(time.Millisecond), err)
	if ok, why := src.Synced(); !ok {
		t.Fatalf("a source that had synced reports unsynced while the API server is down: %s", why)
	}

	api.Start(t)
	unseen := admin.pod(t, ns, "unseen", node, nil, nil)
	if d := decide(t, src, unseen); !d.Enroll {
		t.Fatalf("pod after the API server came back: %+v", d)
	}
}

// testSourceLeastPrivilege: the source works with exactly AgentRules (the
// other tests use that identity too) and gets nothing more: reading secrets is
// forbidden.
func testSourceLeastPrivilege(t *testing.T, c *cluster) {
	agentClient := c.api.Client(t, kubeenv.AgentUser)
	_, err := agentClient.CoreV1().Secrets("default").List(apiContext(t), metav1.ListOptions{})
	if err == nil || !strings.Contains(err.Error(), "forbidden") {
		t.Fatalf("the agent's identity listed secrets: %v", err)
	}
}
