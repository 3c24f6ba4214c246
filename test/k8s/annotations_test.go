package k8s

import (
	"context"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	rbacv1 "k8s.io/api/rbac/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/fields"
	"k8s.io/client-go/kubernetes"

	"github.com/containernetworking/cni/libcni"
	"github.com/mesh-cni/mesh-cni/internal/enroll"
	"github.com/mesh-cni/mesh-cni/test/fixtures"
	"github.com/mesh-cni/mesh-cni/test/harness"
)

// The policies of install/kubernetes/podpolicy.yaml.
const (
	redirectionPolicy = "mesh-redirection-annotations"
	enforcePolicy     = "mesh-enforced-namespaces"
)

// grantPodEditor gives podEditor every write to pods in every namespace, and
// returns its client.
func (pc *policyCluster) grantPodEditor(ctx context.Context, t *testing.T) kubernetes.Interface {
	t.Helper()
	role := &rbacv1.ClusterRole{
		ObjectMeta: metav1.ObjectMeta{Name: podEditor},
		Rules: []rbacv1.PolicyRule{{APIGroups: []string{""}, Resources: []string{"pods"},
			Verbs: []string{"get", "list", "watch", "create", "update", "patch", "delete"}}},
	}
	if _, err := pc.admin.RbacV1().ClusterRoles().Create(ctx, role, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	binding := &rbacv1.ClusterRoleBinding{
		ObjectMeta: metav1.ObjectMeta{Name: podEditor},
		RoleRef:    rbacv1.RoleRef{APIGroup: rbacv1.GroupName, Kind: "ClusterRole", Name: podEditor},
		Subjects:   []rbacv1.Subject{{Kind: rbacv1.UserKind, APIGroup: rbacv1.GroupName, Name: podEditor}},
	}
	if _, err := pc.admin.RbacV1().ClusterRoleBindings().Create(ctx, binding, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	return pc.api.Client(t, podEditor)
}

// waitForPodPolicies waits until the API server enforces both policies of
// podpolicy.yaml: the editor's change of the istio annotation (a new value
// each time) and its opt-out label in an enforcing namespace (taken off
// again while it is allowed) are refused.
func (pc *policyCluster) waitForPodPolicies(ctx context.Context, t *testing.T) {
	t.Helper()
	p := pc.workload(t, "probe-annotations", pc.nodeA)
	pollPolicy(t, time.Minute, "the "+redirectionPolicy+" policy to be enforced", func() (bool, error) {
		_, err := patchMeta(ctx, pc.editor, p, map[string]any{"annotations": map[string]any{enroll.IstioAnnotationRedirection: "probe-" + fixtures.RandomHex(2)}})
		if err == nil {
			return false, nil
		}
		if isRefusalBy(err, redirectionPolicy) {
			return true, nil
		}
		return false, err
	})
	ns := pc.namespaceWithServiceAccount(t, "probe-enforced", map[string]string{enroll.LabelEnforce: enroll.ValueEnforce})
	q := pc.pod(t, ns, "probe", pc.nodeA, nil, nil)
	pollPolicy(t, time.Minute, "the "+enforcePolicy+" policy to be enforced", func() (bool, error) {
		_, err := patchMeta(ctx, pc.editor, q, map[string]any{"labels": disabledLabel()})
		if err == nil {
			_, err = patchMeta(ctx, pc.editor, q, map[string]any{"labels": map[string]any{enroll.LabelDataplaneMode: nil}})
			return false, err
		}
		if isRefusalBy(err, enforcePolicy) {
			return true, nil
		}
		return false, err
	})
}

func disabledLabel() map[string]any {
	return map[string]any{enroll.LabelDataplaneMode: enroll.ValueDisabled}
}

func annotations(kv ...any) map[string]any {
	m := map[string]any{}
	for i := 0; i+1 < len(kv); i += 2 {
		m[kv[i].(string)] = kv[i+1]
	}
	return map[string]any{"annotations": m}
}

// testPolicyRedirectionAnnotations: a pod editor (every write to pods by
// RBAC), and even the cluster admin, may not set ambient.istio.io/redirection
// or mesh-cni.io/redirection on a pod the agent did not capture, create a pod
// that carries one, or bind a pod with one; nor change or remove the agent's.
// Their other writes to the same pod go through, and the agent sets and
// removes both.
func testPolicyRedirectionAnnotations(t *testing.T, pc *policyCluster) {
	ctx := apiContext(t)
	p := pc.workload(t, "uncaptured", pc.nodeA)
	for _, key := range []string{enroll.IstioAnnotationRedirection, enroll.AnnotationRedirection} {
		says := "only the mesh may set, change or remove " + key + " on a pod"
		_, err := patchMeta(ctx, pc.editor, p, annotations(key, enroll.OutcomeEnabled))
		expectRefusedBy(t, redirectionPolicy, "a pod editor setting "+key+"=enabled on an uncaptured pod", err, says, podEditor+" may not")
		_, err = patchMeta(ctx, pc.admin, p, annotations(key, enroll.OutcomeEnabled))
		expectRefusedBy(t, redirectionPolicy, "the cluster admin setting "+key+"=enabled", err, says)
		_, err = createPod(ctx, pc.editor, pc.apps, "forged-"+fixtures.RandomHex(3), pc.nodeA, nil, map[string]string{key: enroll.OutcomeEnabled})
		expectRefusedBy(t, redirectionPolicy, "a pod editor creating a pod with "+key+"=enabled", err, says)
	}
	pending := pc.workload(t, "unbound", "")
	err := pc.admin.CoreV1().Pods(pending.Namespace).Bind(ctx, &corev1.Binding{
		ObjectMeta: metav1.ObjectMeta{Name: pending.Name, Annotations: map[string]string{enroll.IstioAnnotationRedirection: enroll.OutcomeEnabled}},
		Target:     corev1.ObjectReference{Kind: "Node", Name: pc.nodeA},
	}, metav1.CreateOptions{})
	expectRefusedBy(t, redirectionPolicy, "binding a pod with "+enroll.IstioAnnotationRedirection, err, enroll.IstioAnnotationRedirection)
	// The same through the namespace's bindings resource, which the API
	// server serves as the pod's binding subresource.
	unbound := pc.workload(t, "unbound-ns", "")
	err = pc.admin.CoreV1().RESTClient().Post().Namespace(unbound.Namespace).Resource("bindings").Body(&corev1.Binding{
		ObjectMeta: metav1.ObjectMeta{Name: unbound.Name, Annotations: map[string]string{enroll.AnnotationRedirection: enroll.OutcomeEnabled}},
		Target:     corev1.ObjectReference{Kind: "Node", Name: pc.nodeA},
	}).Do(ctx).Error()
	expectRefusedBy(t, redirectionPolicy, "binding a pod with "+enroll.AnnotationRedirection+" through the bindings resource", err, enroll.AnnotationRedirection)
	pc.unchanged(ctx, t, unbound)
	pc.unchanged(ctx, t, p)

	// The agent marks the pod captured; the editor may not undo or change that.
	both := annotations(enroll.AnnotationRedirection, enroll.OutcomeEnabled, enroll.IstioAnnotationRedirection, enroll.OutcomeEnabled)
	if _, err := patchMeta(ctx, pc.agent, p, both); err != nil {
		t.Fatalf("the agent setting both annotations: %v", err)
	}
	marked := pc.get(ctx, t, p)
	_, err = patchMeta(ctx, pc.editor, p, annotations(enroll.IstioAnnotationRedirection, nil))
	expectRefusedBy(t, redirectionPolicy, "a pod editor removing the agent's "+enroll.IstioAnnotationRedirection, err, enroll.IstioAnnotationRedirection)
	_, err = patchMeta(ctx, pc.editor, p, annotations(enroll.AnnotationRedirection, enroll.OutcomeDisabled))
	expectRefusedBy(t, redirectionPolicy, "a pod editor changing the agent's "+enroll.AnnotationRedirection, err, enroll.AnnotationRedirection)
	_, err = patchMeta(ctx, pc.editor, p, annotations(enroll.AnnotationRedirection, nil, enroll.IstioAnnotationRedirection, nil))
	expectRefusedBy(t, redirectionPolicy, "a pod editor removing both", err, enroll.IstioAnnotationRedirection+" and "+enroll.AnnotationRedirection)
	pc.unchanged(ctx, t, marked)

	// Everything else about the pod is the editor's: a patch, and an update of
	// the whole object (which carries the annotations unchanged).
	got, err := patchMeta(ctx, pc.editor, p, map[string]any{"labels": map[string]any{"tier": "web"}, "annotations": map[string]any{"team": "billing"}})
	if err != nil {
		t.Fatalf("a pod editor's own label and annotation on a marked pod: %v", err)
	}
	got.Labels["tier"] = "api"
	if _, err := pc.editor.CoreV1().Pods(got.Namespace).Update(ctx, got, metav1.UpdateOptions{}); err != nil {
		t.Fatalf("a pod editor's update of the whole pod: %v", err)
	}

	// The agent takes the pod out again: both go.
	got, err = patchMeta(ctx, pc.agent, p, annotations(enroll.AnnotationRedirection, enroll.OutcomeDisabled, enroll.IstioAnnotationRedirection, nil))
	if _, still := got.Annotations[enroll.IstioAnnotationRedirection]; err != nil || still || got.Annotations[enroll.AnnotationRedirection] != enroll.OutcomeDisabled {
		t.Fatalf("the agent removing %s: %v (annotations %v)", enroll.IstioAnnotationRedirection, err, got.Annotations)
	}
}

// testPolicyEnforcedNamespace: in a namespace labelled mesh-cni.io/enforce=true
// a pod may not be created with a pod-level opt-out of either profile, nor
// gain one later; the same pods are created elsewhere, and a pod that opted
// out before its namespace was labelled keeps its other updates.
func testPolicyEnforcedNamespace(t *testing.T, pc *policyCluster) {
	ctx := apiContext(t)
	enforcing := map[string]string{enroll.LabelDataplaneMode: enroll.ValueEnabled, enroll.LabelEnforce: enroll.ValueEnforce}
	enforced := pc.namespaceWithServiceAccount(t, "enforced", enforcing)
	open := pc.namespaceWithServiceAccount(t, "open", enabled)
	for _, tc := range []struct {
		what                string
		labels, annotations map[string]string
		says                string
	}{
		{"the mesh-cni opt-out label", disabled, nil, "label mesh-cni.io/dataplane-mode=disabled"},
		{"the mesh-cni opt-out annotation", nil, disabled, "annotation mesh-cni.io/dataplane-mode=disabled"},
		{"the istio opt-out label", map[string]string{enroll.IstioLabelDataplaneMode: enroll.IstioValueNone}, nil, "label istio.io/dataplane-mode=none"},
		{"the istio opt-out annotation", nil, map[string]string{enroll.IstioLabelDataplaneMode: enroll.IstioValueNone}, "annotation istio.io/dataplane-mode=none"},
		{"a sidecar's status", nil, map[string]string{enroll.IstioAnnotationSidecar: "{}"}, "annotation " + enroll.IstioAnnotationSidecar},
		{"inbound capture bypassed", nil, map[string]string{enroll.IstioAnnotationBypassInbound: "true"}, "annotation " + enroll.IstioAnnotationBypassInbound},
		{"DNS capture turned off", nil, map[string]string{enroll.IstioAnnotationDNSCapture: "F"}, "annotation " + enroll.IstioAnnotationDNSCapture + "=F"},
	} {
		name := "opt-out-" + fixtures.RandomHex(3)
		_, err := createPod(ctx, pc.editor, enforced, name, pc.nodeA, tc.labels, tc.annotations)
		expectRefusedBy(t, enforcePolicy, "a pod created with "+tc.what+" in an enforcing namespace", err,
			"namespace "+enforced+" enforces the mesh", "pods may not opt out, refused "+tc.says)
		if _, err := createPod(ctx, pc.editor, open, name, pc.nodeA, tc.labels, tc.annotations); err != nil {
			t.Errorf("a pod created with %s in a namespace that does not enforce: %v", tc.what, err)
		}
	}

	plain, err := createPod(ctx, pc.editor, enforced, "plain", pc.nodeA, map[string]string{"app": "plain"}, nil)
	if err != nil {
		t.Fatalf("a pod without an opt-out in an enforcing namespace: %v", err)
	}
	_, err = patchMeta(ctx, pc.editor, plain, map[string]any{"labels": disabledLabel()})
	expectRefusedBy(t, enforcePolicy, "an opt-out label added later", err, "refused label mesh-cni.io/dataplane-mode=disabled")
	_, err = patchMeta(ctx, pc.editor, plain, annotations(enroll.IstioAnnotationSidecar, "{}"))
	expectRefusedBy(t, enforcePolicy, "a sidecar's status added later", err, "refused annotation "+enroll.IstioAnnotationSidecar)
	pc.unchanged(ctx, t, plain)
	if _, err := patchMeta(ctx, pc.editor, plain, map[string]any{"labels": map[string]any{"app": "other"}}); err != nil {
		t.Errorf("another label on a pod in an enforcing namespace: %v", err)
	}

	// Opted out before its namespace enforced: the opt-out stays (the agent
	// ignores it, testAgentEnforcedNamespace), its other updates go through.
	later := pc.namespaceWithServiceAccount(t, "later", enabled)
	old, err := createPod(ctx, pc.editor, later, "opted-out", pc.nodeA, map[string]string{enroll.LabelDataplaneMode: enroll.ValueDisabled, "app": "old"}, nil)
	if err != nil {
		t.Fatal(err)
	}
	pc.setLabel(t, later, "", enroll.LabelEnforce, enroll.ValueEnforce)
	pollPolicy(t, 30*time.Second, "namespace "+later+" to be enforced", func() (bool, error) {
		_, err := createPod(ctx, pc.editor, later, "probe-"+fixtures.RandomHex(3), pc.nodeA, disabled, nil)
		if err == nil || isRefusalBy(err, enforcePolicy) {
			return err != nil, nil
		}
		return false, err
	})
	if _, err := patchMeta(ctx, pc.editor, old, map[string]any{"labels": map[string]any{"app": "renamed"}}); err != nil {
		t.Errorf("another label on a pod that opted out before its namespace enforced: %v", err)
	}
}

// redirectionOf is the pod's two redirection annotations ("" for absent).
func (c *cluster) redirectionOf(t *testing.T, namespace, name string) (outcome, istio string, hasIstio bool) {
	t.Helper()
	p, err := c.admin.CoreV1().Pods(namespace).Get(apiContext(t), name, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	istio, hasIstio = p.Annotations[enroll.IstioAnnotationRedirection]
	return p.Annotations[enroll.AnnotationRedirection], istio, hasIstio
}

// waitRedirection waits until the pod carries mesh-cni.io/redirection=outcome
// and, with istio true, ambient.istio.io/redirection=enabled, else none.
func (c *cluster) waitRedirection(t *testing.T, namespace, name, outcome string, istio bool) {
	t.Helper()
	what := namespace + "/" + name + ": " + enroll.AnnotationRedirection + "=" + outcome + ", " + enroll.IstioAnnotationRedirection
	if istio {
		what += "=enabled"
	} else {
		what += " absent"
	}
	fixtures.WaitFor(t, 30*time.Second, what, func() bool {
		o, v, ok := c.redirectionOf(t, namespace, name)
		return o == outcome && ok == istio && (!istio || v == enroll.OutcomeEnabled)
	})
}

// testAgentCorrectsForgedAnnotations: with no admission policy in the way,
// the cluster admin marks an uncaptured pod captured, and a captured pod
// uncaptured, and creates a pod of the node that never reaches the gate
// already marked; the real agent (istio profile) rewrites each to what its
// data path does, and logs it, without changing what it redirects.
func testAgentCorrectsForgedAnnotations(t *testing.T, c *cluster) {
	ctx := apiContext(t)
	kubeNode := "node-" + fixtures.RandomHex(4)
	amb := c.namespace(t, "ambient", map[string]string{enroll.IstioLabelDataplaneMode: enroll.IstioValueAmbient})
	plain := c.namespace(t, "plain", nil)
	meshedPod := c.pod(t, amb, "meshed", kubeNode, nil, nil)
	plainPod := c.pod(t, plain, "plain", kubeNode, nil, nil)
	forged := map[string]string{enroll.AnnotationRedirection: enroll.OutcomeEnabled, enroll.IstioAnnotationRedirection: enroll.OutcomeEnabled}
	c.pod(t, plain, "never-added", kubeNode, nil, forged)

	a, node, list := startIstioAgent(ctx, t, c, kubeNode, "1s")
	meshed, uncaptured := cniPod(t, node, meshedPod), cniPod(t, node, plainPod)
	add(ctx, t, node, list, meshed)
	add(ctx, t, node, list, uncaptured)
	c.waitRedirection(t, amb, "meshed", enroll.OutcomeEnabled, true)
	c.waitRedirection(t, plain, "never-added", enroll.OutcomeDisabled, false)
	// Never in the mesh, never marked: nothing to write.
	c.noRedirection(t, plain, "plain")

	for _, f := range []struct {
		pod  *corev1.Pod
		anno map[string]any
	}{
		{plainPod, annotations(enroll.AnnotationRedirection, enroll.OutcomeEnabled, enroll.IstioAnnotationRedirection, enroll.OutcomeEnabled)},
		{meshedPod, annotations(enroll.AnnotationRedirection, enroll.OutcomeDisabled, enroll.IstioAnnotationRedirection, nil)},
	} {
		if _, err := patchMeta(ctx, c.admin, f.pod, f.anno); err != nil {
			t.Fatalf("forge the annotations of %s/%s as the cluster admin: %v", f.pod.Namespace, f.pod.Name, err)
		}
	}
	c.waitRedirection(t, plain, "plain", enroll.OutcomeDisabled, false)
	c.waitRedirection(t, amb, "meshed", enroll.OutcomeEnabled, true)
	// Each correction is logged before it is written.
	fixtures.WaitFor(t, 10*time.Second, "the agent's log line of each correction", func() bool {
		var corrected []string
		for line := range strings.Lines(a.Proc.Output()) {
			for _, pod := range []string{"meshed", "never-added", "plain"} {
				if strings.Contains(line, "disagree with its data path") && strings.Contains(line, `"pod":"`+pod+`"`) && !slices.Contains(corrected, pod) {
					corrected = append(corrected, pod)
				}
			}
		}
		return len(corrected) == 3
	})
	if !a.enrolled(meshed) || a.enrolled(uncaptured) {
		t.Errorf("the forged annotations changed the data path: meshed enrolled=%v, plain enrolled=%v", a.enrolled(meshed), a.enrolled(uncaptured))
	}
}

// startIstioAgent starts an agent for kubeNode with the istio profile and a
// ZDS socket no node proxy serves (so ADDs do not wait for an ack), auditing
// every reconcile, and a node whose chain reaches it.
func startIstioAgent(ctx context.Context, t *testing.T, c *cluster, kubeNode, reconcile string) (*agent, *harness.Node, *libcni.NetworkConfigList) {
	t.Helper()
	a := newAgent(t, c.api, kubeNode, "--selector-profile", enroll.ProfileIstio, "--zds-wait", "never", "--reconcile-interval", reconcile)
	a.Args = append(a.Args, "--zds-socket", filepath.Join(a.dir, "zds", "ztunnel.sock"))
	a.start(ctx)
	node := harness.NewNode(t, harness.NodeOptions{Plugins: append(harness.ReferencePluginNames(), "mesh-cni")})
	return a, node, node.Conflist(t, "meshnet", a.meshEntry())
}

// testAgentReleasesTerminatedPods: under the istio profile a meshed pod
// whose containers have all exited for good (phase Succeeded or Failed, a
// Job's pod, which stays in the API) leaves the mesh as istio-cni takes it
// out: released from the data path and ambient.istio.io/redirection removed,
// so istiod stops sending it HBONE; mesh-cni.io/redirection says disabled.
// Whether the phase reaches the agent before the sandbox's DEL or after it,
// the annotation goes at once, not at the next audit (the reconcile interval
// is an hour). A running pod next to them keeps its annotations.
func testAgentReleasesTerminatedPods(t *testing.T, c *cluster) {
	ctx := apiContext(t)
	kubeNode := "node-" + fixtures.RandomHex(4)
	amb := c.namespace(t, "ambient", map[string]string{enroll.IstioLabelDataplaneMode: enroll.IstioValueAmbient})
	a, node, list := startIstioAgent(ctx, t, c, kubeNode, "1h")
	pods := map[string]*harness.Pod{}
	for _, name := range []string{"running", "completed", "failed-after-del"} {
		p := cniPod(t, node, c.pod(t, amb, name, kubeNode, nil, nil))
		add(ctx, t, node, list, p)
		updatePodStatus(ctx, t, c.admin, amb, name, func(st *corev1.PodStatus) { st.Phase = corev1.PodRunning })
		c.waitRedirection(t, amb, name, enroll.OutcomeEnabled, true)
		pods[name] = p
	}

	// The phase first, as the kubelet usually reports it before it stops
	// the sandbox.
	updatePodStatus(ctx, t, c.admin, amb, "completed", func(st *corev1.PodStatus) { st.Phase = corev1.PodSucceeded })
	c.waitRedirection(t, amb, "completed", enroll.OutcomeDisabled, false)
	waitEnrolled(t, a, pods["completed"], false, "a completed pod")

	// The sandbox's DEL first: released, but nothing says the pod left
	// until its phase does.
	if err := node.Del(ctx, pods["failed-after-del"], list); err != nil {
		t.Fatalf("DEL: %v", err)
	}
	if o, v, ok := c.redirectionOf(t, amb, "failed-after-del"); o != enroll.OutcomeEnabled || v != enroll.OutcomeEnabled || !ok {
		t.Fatalf("after its DEL the pod carries %s=%q, %s=%q (present %v): want both enabled still, or this case shows nothing",
			enroll.AnnotationRedirection, o, enroll.IstioAnnotationRedirection, v, ok)
	}
	updatePodStatus(ctx, t, c.admin, amb, "failed-after-del", func(st *corev1.PodStatus) { st.Phase = corev1.PodFailed })
	c.waitRedirection(t, amb, "failed-after-del", enroll.OutcomeDisabled, false)

	if !a.enrolled(pods["running"]) {
		t.Error("the running pod was released")
	}
	c.waitRedirection(t, amb, "running", enroll.OutcomeEnabled, true)
}

// testAgentEnforcedNamespace: with no admission policy in the way, a pod
// labelled to opt out in a namespace that enforces the mesh is enrolled by
// the real agent anyway, and the pod says so (annotation enabled, a Warning
// Event MeshOptOutIgnored naming the opt-out); the same pod in a namespace
// that does not enforce stays out until its namespace is labelled enforcing.
func testAgentEnforcedNamespace(t *testing.T, c *cluster) {
	ctx := apiContext(t)
	kubeNode := "node-" + fixtures.RandomHex(4)
	enforced := c.namespace(t, "enforced", map[string]string{enroll.LabelDataplaneMode: enroll.ValueEnabled, enroll.LabelEnforce: enroll.ValueEnforce})
	later := c.namespace(t, "later", enabled)
	enforcedPod := c.pod(t, enforced, "opt-out", kubeNode, disabled, nil)
	laterPod := c.pod(t, later, "opt-out", kubeNode, disabled, nil)

	a := newAgent(t, c.api, kubeNode)
	a.start(ctx)
	node := harness.NewNode(t, harness.NodeOptions{Plugins: append(harness.ReferencePluginNames(), "mesh-cni")})
	list := node.Conflist(t, "meshnet", a.meshEntry())
	inEnforced, inLater := cniPod(t, node, enforcedPod), cniPod(t, node, laterPod)
	add(ctx, t, node, list, inEnforced)
	add(ctx, t, node, list, inLater)
	if !a.enrolled(inEnforced) {
		t.Error("a pod opted out in an enforcing namespace was not enrolled")
	}
	if a.enrolled(inLater) {
		t.Error("a pod opted out in a namespace that does not enforce was enrolled")
	}
	c.waitAnnotation(t, enforced, "opt-out", enroll.OutcomeEnabled)
	c.noRedirection(t, later, "opt-out")
	c.waitOptOutEvent(t, enforcedPod)

	c.setLabel(t, later, "", enroll.LabelEnforce, enroll.ValueEnforce)
	waitEnrolled(t, a, inLater, true, "namespace labelled enforcing")
	c.waitAnnotation(t, later, "opt-out", enroll.OutcomeEnabled)
	c.waitOptOutEvent(t, laterPod)
	waitCtx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	if _, err := a.Proc.WaitForLine(waitCtx, "pod opt-out ignored"); err != nil {
		t.Errorf("the agent did not log the ignored opt-out: %v", err)
	}
}

// waitOptOutEvent waits for the Warning Event MeshOptOutIgnored on the pod,
// naming its opt-out and its namespace.
func (c *cluster) waitOptOutEvent(t *testing.T, p *corev1.Pod) {
	t.Helper()
	want := `"mesh-cni.io/dataplane-mode=disabled" (profile mesh-cni), ignored: namespace ` + p.Namespace + " enforces the mesh (mesh-cni.io/enforce=true)"
	fixtures.WaitFor(t, 30*time.Second, "the Warning Event "+enroll.EventReasonOptOutIgnored+" on "+p.Namespace+"/"+p.Name, func() bool {
		evs, err := c.admin.CoreV1().Events(p.Namespace).List(apiContext(t), metav1.ListOptions{
			FieldSelector: fields.OneTermEqualSelector("involvedObject.name", p.Name).String(),
		})
		if err != nil {
			t.Fatal(err)
		}
		return slices.ContainsFunc(evs.Items, func(e corev1.Event) bool {
			return e.Reason == enroll.EventReasonOptOutIgnored && e.Type == corev1.EventTypeWarning && e.InvolvedObject.UID == p.UID &&
				strings.Contains(e.Message, want)
		})
	})
}
