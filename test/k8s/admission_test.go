package k8s

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"go.uber.org/zap/zaptest"
	appsv1 "k8s.io/api/apps/v1"
	authenticationv1 "k8s.io/api/authentication/v1"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/fields"
	"k8s.io/apimachinery/pkg/types"
	utilyaml "k8s.io/apimachinery/pkg/util/yaml"
	"k8s.io/client-go/discovery/cached/memory"
	"k8s.io/client-go/dynamic"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/restmapper"
	"k8s.io/client-go/tools/clientcmd"
	clientcmdapi "k8s.io/client-go/tools/clientcmd/api"
	"sigs.k8s.io/yaml"

	meshinstall "github.com/mesh-cni/mesh-cni/install/kubernetes"
	"github.com/mesh-cni/mesh-cni/internal/enroll"
	"github.com/mesh-cni/mesh-cni/test/fixtures"
	"github.com/mesh-cni/mesh-cni/test/harness"
	"github.com/mesh-cni/mesh-cni/test/k8s/kubeenv"
)

// nodeNameExtra is where the API server puts the node a pod-bound
// service-account token names (k8s.io/apiserver's serviceaccount.NodeNameKey).
const nodeNameExtra = "authentication.kubernetes.io/node-name"

// policyCluster is an API server with the manifests of install/kubernetes
// applied, two nodes, the agent's pod on node A and its token as the kubelet
// of node A mints it.
type policyCluster struct {
	*cluster
	nodeA, nodeB string
	agentPod     *corev1.Pod
	// token is the agent pod's service-account token, from node A's kubelet.
	token string
	agent kubernetes.Interface
	// editor is a user allowed every write to pods by RBAC, and nothing
	// else: a workload's owner.
	editor kubernetes.Interface
	apps   string // a namespace for workload pods
}

// podEditor is the user of policyCluster.editor.
const podEditor = "pod-editor"

// TestAgentAdmissionPolicy applies install/kubernetes (every file its
// kustomization lists, as shipped) to a real API server with ServiceAccount
// admission, Node authorization and NodeRestriction, mints the agent's token
// the way node A's kubelet does for the agent's pod there, and shows what the
// ValidatingAdmissionPolicy lets that token change: the mesh-cni.io/redirection
// annotation of node A's pods, and nothing else.
func TestAgentAdmissionPolicy(t *testing.T) {
	bins, err := kubeenv.FromEnv()
	if err != nil {
		t.Fatal(err)
	}
	suffix := fixtures.RandomHex(3)
	nodeA, nodeB := "node-a-"+suffix, "node-b-"+suffix
	kubeletA := "system:node:" + nodeA
	etcd := kubeenv.StartEtcd(t, bins)
	api := kubeenv.StartAPIServerWith(t, bins, etcd, "policy-"+suffix, kubeenv.APIServerOptions{
		Cluster: true,
		Users:   map[string][]string{kubeletA: {"system:nodes"}, podEditor: {"pod-editors"}},
	})
	admin := api.Client(t, kubeenv.AdminUser)
	c := &cluster{bins: bins, etcd: etcd, api: api, admin: admin}
	ctx := apiContext(t)

	applyInstallManifests(ctx, t, api)
	for _, n := range []string{nodeA, nodeB} {
		if _, err := admin.CoreV1().Nodes().Create(ctx, &corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: n}}, metav1.CreateOptions{}); err != nil {
			t.Fatalf("create node %s: %v", n, err)
		}
	}
	pc := &policyCluster{cluster: c, nodeA: nodeA, nodeB: nodeB}
	pc.agentPod = pc.agentPodOn(ctx, t, "mesh-agent-"+suffix, nodeA)
	pc.token = kubeletToken(ctx, t, api.Client(t, kubeletA), pc.agentPod)
	pc.agent = tokenClient(t, api, pc.token)
	if extra := whoAmI(ctx, t, pc.agent); !slices.Equal(extra.Extra[nodeNameExtra], []string{nodeA}) ||
		extra.Username != "system:serviceaccount:"+meshinstall.Namespace+":"+meshinstall.ServiceAccount {
		t.Fatalf("the kubelet-minted token authenticates as %+v, want the agent's service account with %s=[%s]", extra, nodeNameExtra, nodeA)
	}
	pc.editor = pc.grantPodEditor(ctx, t)
	pc.apps = pc.namespaceWithServiceAccount(t, "apps", nil)
	pc.waitForPolicy(ctx, t)
	pc.waitForPodPolicies(ctx, t)

	for _, tc := range []struct {
		name string
		fn   func(*testing.T, *policyCluster)
	}{
		{"AnnotationOnOwnNode", testPolicyAnnotationOnOwnNode},
		{"AnnotationOnOtherNode", testPolicyAnnotationOnOtherNode},
		{"OtherAnnotation", testPolicyOtherAnnotation},
		{"IstioAnnotation", testPolicyIstioAnnotation},
		{"Label", testPolicyLabel},
		{"Spec", testPolicySpec},
		{"TokenWithoutNode", testPolicyTokenWithoutNode},
		{"OthersNotLimited", testPolicyOthersNotLimited},
		{"EnrollmentEvents", testPolicyEnrollmentEvents},
		{"RealAgent", testPolicyRealAgent},
		{"StartupTaint", testPolicyStartupTaint},
		{"RedirectionAnnotations", testPolicyRedirectionAnnotations},
		{"EnforcedNamespace", testPolicyEnforcedNamespace},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			tc.fn(t, pc)
		})
	}
}

// applyInstallManifests creates every object of the files install/kubernetes'
// kustomization lists, as kubectl apply -k would (the kustomization's image
// pin changes nothing here: no kubelet runs the DaemonSet).
func applyInstallManifests(ctx context.Context, t *testing.T, api *kubeenv.APIServer) {
	t.Helper()
	cfg := api.RestConfig(kubeenv.AdminUser)
	disco := api.Client(t, kubeenv.AdminUser).Discovery()
	mapper := restmapper.NewDeferredDiscoveryRESTMapper(memory.NewMemCacheClient(disco))
	dyn, err := dynamic.NewForConfig(cfg)
	if err != nil {
		t.Fatal(err)
	}
	data, err := fs.ReadFile(meshinstall.Manifests(), "kustomization.yaml")
	if err != nil {
		t.Fatal(err)
	}
	var kust struct {
		Resources []string `json:"resources"`
	}
	if err := yaml.Unmarshal(data, &kust); err != nil {
		t.Fatalf("kustomization.yaml: %v", err)
	}
	if !slices.Contains(kust.Resources, "admissionpolicy.yaml") {
		t.Fatalf("the kustomization does not list admissionpolicy.yaml: %v", kust.Resources)
	}
	for _, file := range kust.Resources {
		data, err := fs.ReadFile(meshinstall.Manifests(), file)
		if err != nil {
			t.Fatal(err)
		}
		dec := utilyaml.NewYAMLOrJSONDecoder(bytes.NewReader(data), 4096)
		for {
			var obj unstructured.Unstructured
			if err := dec.Decode(&obj.Object); err != nil {
				if errors.Is(err, io.EOF) {
					break
				}
				t.Fatalf("%s: %v", file, err)
			}
			if len(obj.Object) == 0 {
				continue
			}
			gvk := obj.GroupVersionKind()
			m, err := mapper.RESTMapping(gvk.GroupKind(), gvk.Version)
			if err != nil {
				t.Fatalf("%s: %s: %v", file, gvk, err)
			}
			var ri dynamic.ResourceInterface = dyn.Resource(m.Resource)
			if m.Scope.Name() == meta.RESTScopeNameNamespace {
				ri = dyn.Resource(m.Resource).Namespace(obj.GetNamespace())
			}
			if _, err := ri.Create(ctx, &obj, metav1.CreateOptions{FieldManager: "kubectl"}); err != nil {
				t.Fatalf("%s: create %s %s: %v", file, gvk.Kind, obj.GetName(), err)
			}
		}
	}
}

// agentPodOn creates a pod of the applied DaemonSet's template bound to node
// (nodeName "" leaves it unscheduled), as the DaemonSet controller and the
// scheduler leave it for the kubelet. ServiceAccount admission gives it the
// kube-api-access volume the kubelet fills with the token.
func (pc *policyCluster) agentPodOn(ctx context.Context, t *testing.T, name, node string) *corev1.Pod {
	t.Helper()
	ds, err := pc.admin.AppsV1().DaemonSets(meshinstall.Namespace).Get(ctx, meshinstall.DaemonSet, metav1.GetOptions{})
	if err != nil {
		t.Fatalf("the applied DaemonSet: %v", err)
	}
	tmpl := ds.Spec.Template
	pod := &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{
			Name: name, Namespace: ds.Namespace, Labels: tmpl.Labels, Annotations: tmpl.Annotations,
			OwnerReferences: []metav1.OwnerReference{*metav1.NewControllerRef(ds, appsv1.SchemeGroupVersion.WithKind("DaemonSet"))},
		},
		Spec: *tmpl.Spec.DeepCopy(),
	}
	pod.Spec.NodeName = node
	p, err := pc.admin.CoreV1().Pods(ds.Namespace).Create(ctx, pod, metav1.CreateOptions{})
	if err != nil {
		t.Fatalf("create the agent's pod: %v", err)
	}
	return p
}

// kubeletToken mints the token of the pod's projected service-account token
// volume as the kubelet does (k8s.io/kubernetes pkg/volume/projected): a
// TokenRequest for the pod's service account with the volume's audience and
// expiry, bound to the pod, made with the node's own credential (Node
// authorization and NodeRestriction allow that only for pods on that node).
func kubeletToken(ctx context.Context, t *testing.T, kubelet kubernetes.Interface, pod *corev1.Pod) string {
	t.Helper()
	var source *corev1.ServiceAccountTokenProjection
	for _, v := range pod.Spec.Volumes {
		if v.Projected == nil {
			continue
		}
		for _, s := range v.Projected.Sources {
			if s.ServiceAccountToken != nil {
				source = s.ServiceAccountToken
			}
		}
	}
	if source == nil {
		t.Fatalf("pod %s/%s has no projected service-account token: ServiceAccount admission did not add kube-api-access", pod.Namespace, pod.Name)
	}
	req := &authenticationv1.TokenRequest{Spec: authenticationv1.TokenRequestSpec{
		ExpirationSeconds: source.ExpirationSeconds,
		BoundObjectRef:    &authenticationv1.BoundObjectReference{APIVersion: "v1", Kind: "Pod", Name: pod.Name, UID: pod.UID},
	}}
	if source.Audience != "" {
		req.Spec.Audiences = []string{source.Audience}
	}
	var token string
	// The Node authorizer learns of the pod from its own watch, a moment
	// after the pod was created.
	pollPolicy(t, 30*time.Second, "node A's kubelet to be allowed a token for the agent's pod", func() (bool, error) {
		tr, err := kubelet.CoreV1().ServiceAccounts(pod.Namespace).CreateToken(ctx, pod.Spec.ServiceAccountName, req, metav1.CreateOptions{})
		if apierrors.IsForbidden(err) {
			return false, nil
		}
		if err != nil {
			return false, err
		}
		token = tr.Status.Token
		return true, nil
	})
	return token
}

// tokenClient is a client presenting a bearer token, trusting the cluster's CA.
func tokenClient(t *testing.T, api *kubeenv.APIServer, token string) kubernetes.Interface {
	t.Helper()
	cfg := tokenRestConfig(api, token)
	c, err := kubernetes.NewForConfig(cfg)
	if err != nil {
		t.Fatal(err)
	}
	return c
}

func tokenRestConfig(api *kubeenv.APIServer, token string) *rest.Config {
	cfg := api.RestConfig(kubeenv.AdminUser)
	cfg.BearerToken = token
	cfg.UserAgent = "mesh-cni-e2e/token"
	return cfg
}

// whoAmI is the API server's view of the client's credential.
func whoAmI(ctx context.Context, t *testing.T, c kubernetes.Interface) authenticationv1.UserInfo {
	t.Helper()
	r, err := c.AuthenticationV1().SelfSubjectReviews().Create(ctx, &authenticationv1.SelfSubjectReview{}, metav1.CreateOptions{})
	if err != nil {
		t.Fatalf("SelfSubjectReview: %v", err)
	}
	return r.Status.UserInfo
}

// namespaceWithServiceAccount creates a namespace and its default service
// account (no controller manager runs to make it; ServiceAccount admission
// refuses pods without it).
func (pc *policyCluster) namespaceWithServiceAccount(t *testing.T, prefix string, labels map[string]string) string {
	t.Helper()
	ns := pc.namespace(t, prefix, labels)
	if _, err := pc.admin.CoreV1().ServiceAccounts(ns).Create(apiContext(t), &corev1.ServiceAccount{ObjectMeta: metav1.ObjectMeta{Name: "default"}}, metav1.CreateOptions{}); err != nil {
		t.Fatalf("create service account %s/default: %v", ns, err)
	}
	return ns
}

// workload creates a pod on node with a label and an annotation of its own.
func (pc *policyCluster) workload(t *testing.T, name, node string) *corev1.Pod {
	t.Helper()
	return pc.pod(t, pc.apps, name, node, map[string]string{"app": name}, map[string]string{"team": "shop"})
}

// waitForPolicy waits until the API server enforces the policy: a label
// patch by the agent on a pod of its own node is refused by it.
func (pc *policyCluster) waitForPolicy(ctx context.Context, t *testing.T) {
	t.Helper()
	p := pc.workload(t, "probe", pc.nodeA)
	pollPolicy(t, time.Minute, "the ValidatingAdmissionPolicy to be enforced", func() (bool, error) {
		_, err := patchMeta(ctx, pc.agent, p, map[string]any{"labels": map[string]any{"probe": fixtures.RandomHex(2)}})
		switch {
		case err == nil:
			return false, nil
		case isPolicyRefusal(err):
			return true, nil
		default:
			return false, err
		}
	})
}

// patchMeta sends a merge patch of the pod's metadata carrying its uid, as the
// agent's reporter does (internal/enroll/report.go).
func patchMeta(ctx context.Context, c kubernetes.Interface, p *corev1.Pod, meta map[string]any) (*corev1.Pod, error) {
	meta["uid"] = string(p.UID)
	return patch(ctx, c, p, map[string]any{"metadata": meta})
}

func patch(ctx context.Context, c kubernetes.Interface, p *corev1.Pod, body map[string]any) (*corev1.Pod, error) {
	data, err := json.Marshal(body)
	if err != nil {
		return nil, fmt.Errorf("encode patch: %w", err)
	}
	return c.CoreV1().Pods(p.Namespace).Patch(ctx, p.Name, types.MergePatchType, data, metav1.PatchOptions{FieldManager: "mesh-agent"})
}

func redirection(value any) map[string]any {
	return map[string]any{"annotations": map[string]any{enroll.AnnotationRedirection: value}}
}

// isPolicyRefusal reports a 403 from the mesh-agent policy (not from RBAC,
// and not an evaluation error of the policy).
func isPolicyRefusal(err error) bool { return isRefusalBy(err, "mesh-agent") }

// isRefusalBy reports a 403 from the named policy, through its binding of
// the same name.
func isRefusalBy(err error, policy string) bool {
	return apierrors.IsForbidden(err) &&
		strings.Contains(err.Error(), "ValidatingAdmissionPolicy '"+policy+"' with binding '"+policy+"' denied request: ") &&
		!strings.Contains(err.Error(), "resulted in error")
}

// expectRefused fails unless err is the mesh-agent policy's refusal saying
// each of says.
func expectRefused(t *testing.T, what string, err error, says ...string) {
	t.Helper()
	expectRefusedBy(t, "mesh-agent", what, err, says...)
}

// expectRefusedBy fails unless err is the named policy's refusal saying each
// of says.
func expectRefusedBy(t *testing.T, policy, what string, err error, says ...string) {
	t.Helper()
	if err == nil {
		t.Errorf("%s: allowed", what)
		return
	}
	if !isRefusalBy(err, policy) {
		t.Errorf("%s: %v; want the %s policy's refusal", what, err, policy)
		return
	}
	for _, s := range says {
		if !strings.Contains(err.Error(), s) {
			t.Errorf("%s: refusal %q does not say %q", what, err, s)
		}
	}
	t.Logf("%s: %v", what, err)
}

// unchanged fails unless the pod's labels, annotations and spec are as before.
func (pc *policyCluster) unchanged(ctx context.Context, t *testing.T, before *corev1.Pod) {
	t.Helper()
	now, err := pc.admin.CoreV1().Pods(before.Namespace).Get(ctx, before.Name, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if !equalJSON(t, now.Labels, before.Labels) || !equalJSON(t, now.Annotations, before.Annotations) || !equalJSON(t, now.Spec, before.Spec) {
		t.Errorf("pod %s/%s changed: labels %v annotations %v (before %v %v)", now.Namespace, now.Name, now.Labels, now.Annotations, before.Labels, before.Annotations)
	}
}

func equalJSON(t *testing.T, a, b any) bool {
	t.Helper()
	ja, err := json.Marshal(a)
	if err != nil {
		t.Fatal(err)
	}
	jb, err := json.Marshal(b)
	if err != nil {
		t.Fatal(err)
	}
	return bytes.Equal(ja, jb)
}

// testPolicyAnnotationOnOwnNode: the agent sets each of its outcomes on a pod
// of its node.
func testPolicyAnnotationOnOwnNode(t *testing.T, pc *policyCluster) {
	ctx := apiContext(t)
	p := pc.workload(t, "own", pc.nodeA)
	for _, outcome := range []string{enroll.OutcomeEnabled, enroll.OutcomeDisabled, enroll.OutcomeFailed, enroll.OutcomeEnabled} {
		got, err := patchMeta(ctx, pc.agent, p, redirection(outcome))
		if err != nil {
			t.Fatalf("%s=%s on a pod of node A: %v", enroll.AnnotationRedirection, outcome, err)
		}
		if got.Annotations[enroll.AnnotationRedirection] != outcome || got.Annotations["team"] != "shop" || got.Labels["app"] != "own" {
			t.Fatalf("after setting %s: labels %v annotations %v", outcome, got.Labels, got.Annotations)
		}
	}
	before := pc.get(ctx, t, p)
	_, err := patchMeta(ctx, pc.agent, p, redirection("bogus"))
	expectRefused(t, "a value the agent never writes", err, "only set "+enroll.AnnotationRedirection+" to enabled, disabled or failed")
	_, err = patchMeta(ctx, pc.agent, p, redirection(nil))
	expectRefused(t, "removing the annotation", err, "only set "+enroll.AnnotationRedirection)
	pc.unchanged(ctx, t, before)
}

func (pc *policyCluster) get(ctx context.Context, t *testing.T, p *corev1.Pod) *corev1.Pod {
	t.Helper()
	got, err := pc.admin.CoreV1().Pods(p.Namespace).Get(ctx, p.Name, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	return got
}

// testPolicyAnnotationOnOtherNode: the same patch on a pod of node B, or of
// no node yet, is refused.
func testPolicyAnnotationOnOtherNode(t *testing.T, pc *policyCluster) {
	ctx := apiContext(t)
	b := pc.workload(t, "elsewhere", pc.nodeB)
	_, err := patchMeta(ctx, pc.agent, b, redirection(enroll.OutcomeEnabled))
	expectRefused(t, "the annotation on a pod of node B", err,
		"the mesh-agent of node "+pc.nodeA+" may only change pods on that node", "is on node "+pc.nodeB)
	pc.unchanged(ctx, t, b)

	pending := pc.workload(t, "pending", "")
	_, err = patchMeta(ctx, pc.agent, pending, redirection(enroll.OutcomeEnabled))
	expectRefused(t, "the annotation on a pod not yet scheduled", err, "is on no node")
	pc.unchanged(ctx, t, pending)
}

// testPolicyOtherAnnotation: any other annotation, alone or next to the
// agent's own, added, changed or removed, is refused.
func testPolicyOtherAnnotation(t *testing.T, pc *policyCluster) {
	ctx := apiContext(t)
	p := pc.workload(t, "annotations", pc.nodeA)
	for _, tc := range []struct {
		what  string
		annos map[string]any
	}{
		{"adding another annotation", map[string]any{"example.com/owner": "someone"}},
		{"changing another annotation", map[string]any{"team": "billing"}},
		{"removing another annotation", map[string]any{"team": nil}},
		{"another annotation next to the agent's", map[string]any{enroll.AnnotationRedirection: enroll.OutcomeEnabled, "example.com/owner": "someone"}},
	} {
		_, err := patchMeta(ctx, pc.agent, p, map[string]any{"annotations": tc.annos})
		say := "example.com/owner"
		if _, ok := tc.annos["team"]; ok {
			say = "team"
		}
		expectRefused(t, tc.what, err, "may change only the "+enroll.AnnotationRedirection+" and "+enroll.IstioAnnotationRedirection+" annotations of a pod, not "+say)
	}
	pc.unchanged(ctx, t, p)
}

// testPolicyIstioAnnotation: istiod's ambient.istio.io/redirection may be set to
// enabled, next to the agent's own outcome, and removed; any other value (such
// as istio-cni's pending, which the agent never writes) is refused.
func testPolicyIstioAnnotation(t *testing.T, pc *policyCluster) {
	ctx := apiContext(t)
	p := pc.workload(t, "istio", pc.nodeA)
	both := func(outcome string, istio any) map[string]any {
		return map[string]any{"annotations": map[string]any{enroll.AnnotationRedirection: outcome, enroll.IstioAnnotationRedirection: istio}}
	}
	got, err := patchMeta(ctx, pc.agent, p, both(enroll.OutcomeEnabled, "enabled"))
	if err != nil || got.Annotations[enroll.IstioAnnotationRedirection] != "enabled" {
		t.Fatalf("setting %s=enabled: %v (annotations %v)", enroll.IstioAnnotationRedirection, err, got.Annotations)
	}
	got, err = patchMeta(ctx, pc.agent, p, both(enroll.OutcomeDisabled, nil))
	if _, still := got.Annotations[enroll.IstioAnnotationRedirection]; err != nil || still {
		t.Fatalf("removing %s: %v (annotations %v)", enroll.IstioAnnotationRedirection, err, got.Annotations)
	}
	before := pc.get(ctx, t, p)
	_, err = patchMeta(ctx, pc.agent, p, both(enroll.OutcomeEnabled, "pending"))
	expectRefused(t, "a value the agent never writes", err, "only set "+enroll.IstioAnnotationRedirection+" to enabled, or remove it")
	pc.unchanged(ctx, t, before)
}

// testPolicyLabel: labels and finalizers are refused, with or without the
// agent's annotation.
func testPolicyLabel(t *testing.T, pc *policyCluster) {
	ctx := apiContext(t)
	p := pc.workload(t, "labels", pc.nodeA)
	_, err := patchMeta(ctx, pc.agent, p, map[string]any{"labels": map[string]any{"mesh-cni.io/dataplane-mode": "disabled"}})
	expectRefused(t, "a label", err, "may not change a pod's labels")
	_, err = patchMeta(ctx, pc.agent, p, map[string]any{"labels": map[string]any{"app": nil}, "annotations": map[string]any{enroll.AnnotationRedirection: enroll.OutcomeEnabled}})
	expectRefused(t, "removing a label next to the annotation", err, "may not change a pod's labels")
	_, err = patchMeta(ctx, pc.agent, p, map[string]any{"finalizers": []string{"example.com/hold"}})
	expectRefused(t, "a finalizer", err, "finalizers")
	pc.unchanged(ctx, t, p)
}

// testPolicySpec: a change of the spec is refused, although the API server
// accepts the same change from the admin.
func testPolicySpec(t *testing.T, pc *policyCluster) {
	ctx := apiContext(t)
	p := pc.workload(t, "spec", pc.nodeA)
	change := map[string]any{"spec": map[string]any{"activeDeadlineSeconds": 3600}}
	_, err := patch(ctx, pc.agent, p, change)
	expectRefused(t, "spec.activeDeadlineSeconds", err, "may not change a pod's spec")
	withAnno := map[string]any{"spec": map[string]any{"activeDeadlineSeconds": 3600}, "metadata": redirection(enroll.OutcomeEnabled)}
	_, err = patch(ctx, pc.agent, p, withAnno)
	expectRefused(t, "spec.activeDeadlineSeconds next to the annotation", err, "may not change a pod's spec")
	pc.unchanged(ctx, t, p)

	got, err := patch(ctx, pc.admin, p, change)
	if err != nil {
		t.Fatalf("the same change by the admin: %v", err)
	}
	if got.Spec.ActiveDeadlineSeconds == nil || *got.Spec.ActiveDeadlineSeconds != 3600 {
		t.Fatalf("the admin's change did not land: %v", got.Spec.ActiveDeadlineSeconds)
	}
}

// testPolicyTokenWithoutNode: the agent's service account with a token that
// names no node changes nothing, not even the annotation on node A.
func testPolicyTokenWithoutNode(t *testing.T, pc *policyCluster) {
	ctx := apiContext(t)
	p := pc.workload(t, "claims", pc.nodeA)
	sas := pc.admin.CoreV1().ServiceAccounts(meshinstall.Namespace)

	// As `kubectl create token mesh-agent -n mesh-system` makes it: bound to nothing.
	unbound, err := sas.CreateToken(ctx, meshinstall.ServiceAccount, &authenticationv1.TokenRequest{}, metav1.CreateOptions{})
	if err != nil {
		t.Fatal(err)
	}
	// Bound to an agent pod no scheduler has placed yet.
	unscheduled := pc.agentPodOn(ctx, t, "mesh-agent-unscheduled-"+fixtures.RandomHex(3), "")
	bound, err := sas.CreateToken(ctx, meshinstall.ServiceAccount, &authenticationv1.TokenRequest{Spec: authenticationv1.TokenRequestSpec{
		BoundObjectRef: &authenticationv1.BoundObjectReference{APIVersion: "v1", Kind: "Pod", Name: unscheduled.Name, UID: unscheduled.UID},
	}}, metav1.CreateOptions{})
	if err != nil {
		t.Fatal(err)
	}
	for what, token := range map[string]string{"an unbound token": unbound.Status.Token, "a token bound to an unscheduled pod": bound.Status.Token} {
		c := tokenClient(t, pc.api, token)
		who := whoAmI(ctx, t, c)
		if _, ok := who.Extra[nodeNameExtra]; ok || who.Username != "system:serviceaccount:"+meshinstall.Namespace+":"+meshinstall.ServiceAccount {
			t.Fatalf("%s authenticates as %+v: want the agent's service account without %s", what, who, nodeNameExtra)
		}
		_, err := patchMeta(ctx, c, p, redirection(enroll.OutcomeEnabled))
		expectRefused(t, what, err, "this request's credential names none")
	}
	pc.unchanged(ctx, t, p)
}

// testPolicyOthersNotLimited: the policy binds only the agent: the admin
// labels and annotates the same pods (all but the mesh's own annotations:
// testPolicyRedirectionAnnotations).
func testPolicyOthersNotLimited(t *testing.T, pc *policyCluster) {
	ctx := apiContext(t)
	b := pc.workload(t, "admin", pc.nodeB)
	got, err := patchMeta(ctx, pc.admin, b, map[string]any{
		"labels":      map[string]any{"mesh-cni.io/dataplane-mode": "enabled"},
		"annotations": map[string]any{"team": "billing"},
	})
	if err != nil {
		t.Fatalf("the admin's patch: %v", err)
	}
	if got.Labels["mesh-cni.io/dataplane-mode"] != "enabled" || got.Annotations["team"] != "billing" {
		t.Fatalf("the admin's patch did not land: %v %v", got.Labels, got.Annotations)
	}
}

// testPolicyEnrollmentEvents: the Kubernetes enrollment source, with the
// kubelet-minted token, writes a failure as it does in the agent: a Warning
// Event (a resource the policy does not cover) and the annotation.
func testPolicyEnrollmentEvents(t *testing.T, pc *policyCluster) {
	ctx := apiContext(t)
	p := pc.workload(t, "events", pc.nodeA)
	sel, err := enroll.ProfileSelectors("mesh-cni")
	if err != nil {
		t.Fatal(err)
	}
	src, err := enroll.StartKubeSource(ctx, enroll.KubeConfig{
		Client: pc.agent, NodeName: pc.nodeA, Selectors: sel, APITimeout: 3 * time.Second, Logger: zaptest.NewLogger(t),
	})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { src.Close() })
	pollPolicy(t, time.Minute, "the source to sync", func() (bool, error) { ok, _ := src.Synced(); return ok, nil })
	src.Report(ctx, identity(p), enroll.OutcomeFailed, errors.New("attach inbound program: the test says no"))
	pollPolicy(t, 30*time.Second, "the Warning Event and the annotation failed", func() (bool, error) {
		evs, err := pc.admin.CoreV1().Events(p.Namespace).List(ctx, metav1.ListOptions{
			FieldSelector: fields.OneTermEqualSelector("involvedObject.name", p.Name).String(),
		})
		if err != nil {
			return false, err
		}
		found := slices.ContainsFunc(evs.Items, func(e corev1.Event) bool {
			return e.Reason == enroll.EventReasonEnrollFailed && e.Type == corev1.EventTypeWarning && e.InvolvedObject.UID == p.UID &&
				strings.Contains(e.Message, "the test says no")
		})
		return found && pc.get(ctx, t, p).Annotations[enroll.AnnotationRedirection] == enroll.OutcomeFailed, nil
	})
}

// testPolicyRealAgent: the agent binary, with the kubelet-minted token in its
// kubeconfig, annotates the pods of its node; a CNI ADD on this node for a pod
// the API server places on node B gets its annotation write refused.
func testPolicyRealAgent(t *testing.T, pc *policyCluster) {
	ctx := apiContext(t)
	ns := pc.namespaceWithServiceAccount(t, "meshed", enabled)
	meshed := pc.pod(t, ns, "meshed", pc.nodeA, nil, nil)
	optOut := pc.pod(t, ns, "opt-out", pc.nodeA, disabled, nil)
	elsewhere := pc.pod(t, ns, "elsewhere", pc.nodeB, nil, nil)

	a := prepareAgent(t)
	a.Kubeconfig = writeTokenKubeconfig(t, pc.api, pc.token, a.dir)
	a.Args = append(a.Args, "--enrollment", "kubernetes", "--kubeconfig", a.Kubeconfig, "--node-name", pc.nodeA, "--api-timeout", "3s")
	a.start(ctx)
	node := harness.NewNode(t, harness.NodeOptions{Plugins: append(harness.ReferencePluginNames(), "mesh-cni")})
	list := node.Conflist(t, "meshnet", a.meshEntry())
	for _, p := range []*corev1.Pod{meshed, optOut, elsewhere} {
		add(ctx, t, node, list, cniPod(t, node, p))
	}
	pc.waitAnnotation(t, ns, "meshed", enroll.OutcomeEnabled)
	pc.noRedirection(t, ns, "opt-out")

	waitCtx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	want := "the mesh-agent of node " + pc.nodeA + " may only change pods on that node; pod " + ns + "/elsewhere is on node " + pc.nodeB
	line, err := a.Proc.WaitForLine(waitCtx, want)
	if err != nil {
		t.Fatalf("the agent did not log the refused write for the pod on node B (%q): %v", want, err)
	}
	t.Logf("agent: %s", strings.TrimSpace(line))
	if got := pc.annotation(t, ns, "elsewhere"); got != "" {
		t.Errorf("the pod on node B carries %s=%q", enroll.AnnotationRedirection, got)
	}
}

// writeTokenKubeconfig writes a kubeconfig (mode 0600) that reads the token
// from a file next to it, as the in-cluster client reads the mounted token.
func writeTokenKubeconfig(t *testing.T, api *kubeenv.APIServer, token, dir string) string {
	t.Helper()
	tokenFile := filepath.Join(dir, "token")
	if err := os.WriteFile(tokenFile, []byte(token), 0o600); err != nil {
		t.Fatal(err)
	}
	rc := api.RestConfig(kubeenv.AdminUser)
	cfg := clientcmdapi.NewConfig()
	cfg.Clusters["test"] = &clientcmdapi.Cluster{Server: rc.Host, CertificateAuthorityData: rc.CAData}
	cfg.AuthInfos["agent"] = &clientcmdapi.AuthInfo{TokenFile: tokenFile}
	cfg.Contexts["test"] = &clientcmdapi.Context{Cluster: "test", AuthInfo: "agent"}
	cfg.CurrentContext = "test"
	path := filepath.Join(dir, "kubeconfig")
	if err := clientcmd.WriteToFile(*cfg, path); err != nil {
		t.Fatal(err)
	}
	if err := os.Chmod(path, 0o600); err != nil {
		t.Fatal(err)
	}
	return path
}

// pollPolicy calls cond every 100 ms until it holds, failing the test on its
// error or after limit.
func pollPolicy(t *testing.T, limit time.Duration, what string, cond func() (bool, error)) {
	t.Helper()
	deadline := time.Now().Add(limit)
	for {
		ok, err := cond()
		if err != nil {
			t.Fatalf("waiting for %s: %v", what, err)
		}
		if ok {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("timed out after %v waiting for %s", limit, what)
		}
		select {
		case <-t.Context().Done():
			t.Fatalf("waiting for %s: %v", what, t.Context().Err())
		case <-time.After(100 * time.Millisecond):
		}
	}
}
