package k8s

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"
	"time"

	authenticationv1 "k8s.io/api/authentication/v1"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/kubernetes"
	"sigs.k8s.io/yaml"

	meshinstall "github.com/mesh-cni/mesh-cni/install/kubernetes"
	"github.com/mesh-cni/mesh-cni/internal/agentcli"
	"github.com/mesh-cni/mesh-cni/internal/nodetaint"
	"github.com/mesh-cni/mesh-cni/test/fixtures"
	"github.com/mesh-cni/mesh-cni/test/harness"
)

var (
	startupNoSchedule = corev1.Taint{Key: agentcli.DefaultStartupTaint, Value: "true", Effect: corev1.TaintEffectNoSchedule}
	startupNoExecute  = corev1.Taint{Key: agentcli.DefaultStartupTaint, Effect: corev1.TaintEffectNoExecute}
	dedicatedTaint    = corev1.Taint{Key: "example.com/dedicated", Value: "infra", Effect: corev1.TaintEffectNoSchedule}
)

// testPolicyStartupTaint: with install/kubernetes' startup-taint component,
// the agent's kubelet-minted token removes the startup taint from its own
// node, and nothing else: not from another node, no other taint, label,
// annotation or spec field, and not with a token that names no node. Then the
// real agent removes it from its node only once it is ready. The steps run in
// order: they share node A's taints.
func testPolicyStartupTaint(t *testing.T, pc *policyCluster) {
	ctx := apiContext(t)
	pc.setTaints(ctx, t, pc.nodeA, startupNoSchedule, dedicatedTaint)

	// The default install grants no node write at all.
	_, err := startupRemover(pc.agent, pc.nodeA).Remove(ctx, true)
	if !apierrors.IsForbidden(err) || isPolicyRefusal(err) {
		t.Fatalf("removing the startup taint without the component: %v; want RBAC's refusal", err)
	}
	agentArg := pc.applyStartupTaintComponent(ctx, t)
	// RBAC's authorizer follows the ClusterRole from its own watch.
	pollPolicy(t, 30*time.Second, "RBAC to let the agent read its node", func() (bool, error) {
		_, err := startupRemover(pc.agent, pc.nodeA).Present(ctx)
		return err == nil, nil
	})

	t.Run("OwnNode", func(t *testing.T) { testStartupTaintOwnNode(t, pc) })
	t.Run("OtherNode", func(t *testing.T) { testStartupTaintOtherNode(t, pc) })
	t.Run("OtherChanges", func(t *testing.T) { testStartupTaintOtherChanges(t, pc) })
	t.Run("TokenWithoutNode", func(t *testing.T) { testStartupTaintTokenWithoutNode(t, pc) })
	t.Run("RealAgent", func(t *testing.T) { testStartupTaintRealAgent(t, pc, agentArg) })
}

func startupRemover(c kubernetes.Interface, node string) nodetaint.Remover {
	return nodetaint.Remover{Nodes: c.CoreV1().Nodes(), Node: node, Key: agentcli.DefaultStartupTaint}
}

// applyStartupTaintComponent applies the component's ClusterRole patch as
// kustomize would, and returns the flag its DaemonSet patch adds (no kubelet
// runs the DaemonSet here: the tests start the agent with that flag).
func (pc *policyCluster) applyStartupTaintComponent(ctx context.Context, t *testing.T) string {
	t.Helper()
	patches, err := meshinstall.ReadComponent(meshinstall.StartupTaintComponent)
	if err != nil {
		t.Fatal(err)
	}
	var arg string
	for _, p := range patches {
		ops, err := yaml.YAMLToJSON([]byte(p.Patch))
		if err != nil {
			t.Fatal(err)
		}
		switch p.Target.Kind {
		case "ClusterRole":
			if _, err := pc.admin.RbacV1().ClusterRoles().Patch(ctx, p.Target.Name, types.JSONPatchType, ops, metav1.PatchOptions{}); err != nil {
				t.Fatalf("apply the component's ClusterRole patch: %v", err)
			}
		case "DaemonSet":
			var list []struct {
				Path  string `json:"path"`
				Value any    `json:"value"`
			}
			if err := json.Unmarshal(ops, &list); err != nil {
				t.Fatal(err)
			}
			for _, o := range list {
				if s, ok := o.Value.(string); ok && strings.HasSuffix(o.Path, "/args/-") {
					arg = s
				}
			}
		default:
			t.Fatalf("the component patches a %s, which this test does not apply", p.Target.Kind)
		}
	}
	if !strings.HasPrefix(arg, "--startup-taint=") {
		t.Fatalf("the component's DaemonSet patch adds no --startup-taint (%q)", arg)
	}
	return arg
}

func (pc *policyCluster) node(ctx context.Context, t *testing.T, name string) *corev1.Node {
	t.Helper()
	n, err := pc.admin.CoreV1().Nodes().Get(ctx, name, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	return n
}

// setTaints sets the node's taints as an operator or a node pool would, with
// a label and an annotation of its own next to them.
func (pc *policyCluster) setTaints(ctx context.Context, t *testing.T, name string, taints ...corev1.Taint) *corev1.Node {
	t.Helper()
	n := pc.node(ctx, t, name)
	n.Spec.Taints = taints
	n.Labels = map[string]string{"pool": "mesh"}
	n.Annotations = map[string]string{"example.com/owner": "infra"}
	n, err := pc.admin.CoreV1().Nodes().Update(ctx, n, metav1.UpdateOptions{})
	if err != nil {
		t.Fatalf("set the taints of node %s: %v", name, err)
	}
	return n
}

func taintKeys(taints []corev1.Taint) []string {
	var out []string
	for _, t := range taints {
		out = append(out, t.ToString())
	}
	return out
}

// nodeUnchanged fails unless the node's taints, labels, annotations and spec
// are as before.
func (pc *policyCluster) nodeUnchanged(ctx context.Context, t *testing.T, before *corev1.Node) {
	t.Helper()
	now := pc.node(ctx, t, before.Name)
	if !equalJSON(t, now.Spec, before.Spec) || !equalJSON(t, now.Labels, before.Labels) || !equalJSON(t, now.Annotations, before.Annotations) {
		t.Errorf("node %s changed: taints %v labels %v annotations %v unschedulable %v (before %v %v %v %v)", now.Name,
			taintKeys(now.Spec.Taints), now.Labels, now.Annotations, now.Spec.Unschedulable,
			taintKeys(before.Spec.Taints), before.Labels, before.Annotations, before.Spec.Unschedulable)
	}
}

// testStartupTaintOwnNode: the agent's own patch (internal/nodetaint) removes
// every taint of the key, whatever its effect and value, and leaves the others.
func testStartupTaintOwnNode(t *testing.T, pc *policyCluster) {
	ctx := apiContext(t)
	before := pc.setTaints(ctx, t, pc.nodeA, startupNoSchedule, dedicatedTaint, startupNoExecute)
	found, err := startupRemover(pc.agent, pc.nodeA).Remove(ctx, true)
	if err != nil || found != 2 {
		t.Fatalf("the agent removing the startup taints of its node: %d found, %v", found, err)
	}
	now := pc.node(ctx, t, pc.nodeA)
	if got := taintKeys(now.Spec.Taints); !slices.Equal(got, []string{dedicatedTaint.ToString()}) {
		t.Errorf("taints after the removal %v, want only %s", got, dedicatedTaint.ToString())
	}
	if !equalJSON(t, now.Labels, before.Labels) || !equalJSON(t, now.Annotations, before.Annotations) {
		t.Errorf("labels %v annotations %v changed with the removal", now.Labels, now.Annotations)
	}
	// A node without it: nothing to write, nothing refused.
	if found, err := startupRemover(pc.agent, pc.nodeA).Remove(ctx, true); err != nil || found != 0 {
		t.Errorf("a second removal: %d found, %v", found, err)
	}
}

// testStartupTaintOtherNode: the same removal on node B is refused.
func testStartupTaintOtherNode(t *testing.T, pc *policyCluster) {
	ctx := apiContext(t)
	before := pc.setTaints(ctx, t, pc.nodeB, startupNoSchedule, dedicatedTaint)
	_, err := startupRemover(pc.agent, pc.nodeB).Remove(ctx, true)
	expectRefused(t, "removing the startup taint of node B", err,
		"the mesh-agent of node "+pc.nodeA+" may only change that node, not node "+pc.nodeB)
	pc.nodeUnchanged(ctx, t, before)
}

// testStartupTaintOtherChanges: on its own node, every other change, alone or
// next to the startup taint's removal, is refused.
func testStartupTaintOtherChanges(t *testing.T, pc *policyCluster) {
	ctx := apiContext(t)
	before := pc.setTaints(ctx, t, pc.nodeA, startupNoSchedule, dedicatedTaint)
	replaceTaints := func(taints ...corev1.Taint) []map[string]any {
		return []map[string]any{{"op": "replace", "path": "/spec/taints", "value": taints}}
	}
	removeStartup := map[string]any{"op": "replace", "path": "/spec/taints", "value": []corev1.Taint{dedicatedTaint}}
	const onlyTaint = "may only remove the " + agentcli.DefaultStartupTaint + " taints of its node, and change no other taint"
	for _, tc := range []struct {
		what  string
		typ   types.PatchType
		patch any
		says  string
	}{
		{"removing another taint", types.JSONPatchType, replaceTaints(startupNoSchedule), onlyTaint},
		{"adding a taint", types.JSONPatchType, replaceTaints(startupNoSchedule, dedicatedTaint, startupNoExecute), onlyTaint},
		{"adding a taint while removing the startup taint", types.JSONPatchType, replaceTaints(dedicatedTaint, corev1.Taint{Key: "example.com/mine", Effect: corev1.TaintEffectNoSchedule}), onlyTaint},
		{"changing the startup taint's effect", types.JSONPatchType, replaceTaints(startupNoExecute, dedicatedTaint), onlyTaint},
		{"changing another taint's value", types.JSONPatchType, replaceTaints(startupNoSchedule, corev1.Taint{Key: dedicatedTaint.Key, Value: "apps", Effect: dedicatedTaint.Effect}), onlyTaint},
		{"a label", types.MergePatchType, map[string]any{"metadata": map[string]any{"labels": map[string]any{"pool": "other"}}}, "may not change a node's labels"},
		{"an annotation", types.MergePatchType, map[string]any{"metadata": map[string]any{"annotations": map[string]any{"example.com/owner": nil}}}, "annotations"},
		{"cordoning", types.MergePatchType, map[string]any{"spec": map[string]any{"unschedulable": true}}, "may not change a node's spec but remove its startup taint"},
		{"the removal with a label", types.JSONPatchType, []map[string]any{removeStartup, {"op": "add", "path": "/metadata/labels/example.com~1mesh", "value": "x"}}, "labels"},
		{"the removal with cordoning", types.JSONPatchType, []map[string]any{removeStartup, {"op": "add", "path": "/spec/unschedulable", "value": true}}, "spec"},
		{"the removal with a provider ID", types.JSONPatchType, []map[string]any{removeStartup, {"op": "add", "path": "/spec/providerID", "value": "fake://elsewhere"}}, "spec"},
	} {
		body, err := json.Marshal(tc.patch)
		if err != nil {
			t.Fatal(err)
		}
		_, err = pc.agent.CoreV1().Nodes().Patch(ctx, pc.nodeA, tc.typ, body, metav1.PatchOptions{FieldManager: nodetaint.FieldManager})
		expectRefused(t, tc.what, err, tc.says)
	}
	pc.nodeUnchanged(ctx, t, before)
	if err := pc.agent.CoreV1().Nodes().Delete(ctx, pc.nodeA, metav1.DeleteOptions{}); err == nil {
		t.Error("the agent deleted its node")
	}
	pc.nodeUnchanged(ctx, t, before)
}

// testStartupTaintTokenWithoutNode: the agent's service account with a token
// that names no node removes nothing, not even from node A.
func testStartupTaintTokenWithoutNode(t *testing.T, pc *policyCluster) {
	ctx := apiContext(t)
	before := pc.setTaints(ctx, t, pc.nodeA, startupNoSchedule, dedicatedTaint)
	unbound, err := pc.admin.CoreV1().ServiceAccounts(meshinstall.Namespace).CreateToken(ctx, meshinstall.ServiceAccount, &authenticationv1.TokenRequest{}, metav1.CreateOptions{})
	if err != nil {
		t.Fatal(err)
	}
	c := tokenClient(t, pc.api, unbound.Status.Token)
	_, err = startupRemover(c, pc.nodeA).Remove(ctx, true)
	expectRefused(t, "an unbound token removing the startup taint", err, "this request's credential names none")
	pc.nodeUnchanged(ctx, t, before)
}

// testStartupTaintRealAgent: the agent with the component's flag and its
// kubelet-minted token keeps the startup taint on its node while it is not
// ready (no primary CNI config, so no chain entry), removes it only once
// /readyz says ready, leaves the node's other taints, and removes it again
// when an operator puts it back.
func testStartupTaintRealAgent(t *testing.T, pc *policyCluster, arg string) {
	ctx := apiContext(t)
	pc.setTaints(ctx, t, pc.nodeA, startupNoSchedule, dedicatedTaint)
	node := harness.NewNode(t, harness.NodeOptions{Plugins: harness.ReferencePluginNames()})
	a := prepareAgent(t)
	a.Kubeconfig = writeTokenKubeconfig(t, pc.api, pc.token, a.dir)
	a.Args = append(a.Args, "--enrollment", "kubernetes", "--kubeconfig", a.Kubeconfig, "--node-name", pc.nodeA, "--api-timeout", "3s",
		"--cni-install=true", "--cni-conf-dir", node.ConfDir, "--cni-bin-dir", node.BinDir,
		"--install-state-dir", filepath.Join(t.TempDir(), "install"), "--plugin-binary", harness.Bins(t).Path("mesh-cni"),
		"--metrics-addr", "127.0.0.1:0", "--reconcile-interval", "1s", arg)
	a.Proc = harness.StartProcess(t, harness.ProcessOptions{Path: harness.Bins(t).Path("mesh-agent"), Args: a.Args, Name: "mesh-agent"})
	waitCtx, cancel := context.WithTimeout(ctx, time.Minute)
	defer cancel()
	addr := harness.AgentMetricsAddr(waitCtx, t, a.Proc)
	if _, err := a.Proc.WaitForLine(waitCtx, "the node carries the startup taint"); err != nil {
		t.Fatalf("the agent did not read its node's startup taint: %v", err)
	}

	hasStartup := func() bool {
		return slices.ContainsFunc(pc.node(ctx, t, pc.nodeA).Spec.Taints, func(x corev1.Taint) bool { return x.Key == agentcli.DefaultStartupTaint })
	}
	// Not ready, for many of its checks: the taint stays.
	if fixtures.Eventually(ctx, 5*time.Second, 100*time.Millisecond, func() bool { return !hasStartup() }) {
		t.Fatal("the startup taint was removed while the agent was not ready")
	}
	if ready, body := readyz(t, addr); ready || !strings.Contains(body, "cni-config") {
		t.Fatalf("/readyz %s: want not ready for its chain entry", body)
	}
	if v := startupTaintMetric(t, addr); v != "1" {
		t.Errorf("meshcni_startup_taint %s while the taint is on the node, want 1", v)
	}

	// The primary's config: the chain entry goes in, the agent is ready, the
	// taint goes; it never goes while /readyz says not ready (the taints are
	// read before /readyz, and readiness only comes here).
	primary, err := node.ConflistJSON("meshnet")
	if err != nil {
		t.Fatal(err)
	}
	node.WriteConf(t, "10-meshnet.conflist", primary)
	pollPolicy(t, time.Minute, "the startup taint removed once the agent is ready", func() (bool, error) {
		if hasStartup() {
			return false, nil
		}
		if ready, body := readyz(t, addr); !ready {
			return false, fmt.Errorf("the startup taint is gone while /readyz says %s", body)
		}
		return true, nil
	})
	now := pc.node(ctx, t, pc.nodeA)
	if got := taintKeys(now.Spec.Taints); !slices.Equal(got, []string{dedicatedTaint.ToString()}) {
		t.Errorf("taints %v after the agent's removal, want only %s", got, dedicatedTaint.ToString())
	}
	if now.Labels["pool"] != "mesh" || now.Annotations["example.com/owner"] != "infra" {
		t.Errorf("labels %v annotations %v changed", now.Labels, now.Annotations)
	}
	pollPolicy(t, 30*time.Second, "meshcni_startup_taint at 0", func() (bool, error) { return startupTaintMetric(t, addr) == "0", nil })

	// Put back (by an operator, or a node pool's template), with other
	// effects: removed again at the next check, the other taints kept.
	added := corev1.Taint{Key: "example.com/added-later", Effect: corev1.TaintEffectPreferNoSchedule}
	pc.setTaints(ctx, t, pc.nodeA, dedicatedTaint, startupNoExecute, added, startupNoSchedule)
	pollPolicy(t, time.Minute, "the re-added startup taint removed", func() (bool, error) { return !hasStartup(), nil })
	if got := taintKeys(pc.node(ctx, t, pc.nodeA).Spec.Taints); !slices.Equal(got, []string{dedicatedTaint.ToString(), added.ToString()}) {
		t.Errorf("taints %v after the second removal, want %s and %s", got, dedicatedTaint.ToString(), added.ToString())
	}
	if strings.Contains(a.Proc.Output(), "may only") {
		t.Errorf("the agent's writes were refused by the admission policy:\n%s", a.Proc.Output())
	}
}

// httpGet is the status code and body of url.
func httpGet(t *testing.T, url string) (int, []byte) {
	t.Helper()
	resp, err := http.Get(url)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatal(err)
	}
	return resp.StatusCode, body
}

// readyz is the agent's /readyz: whether it answers 200, and its body.
func readyz(t *testing.T, addr string) (bool, string) {
	t.Helper()
	code, body := httpGet(t, "http://"+addr+"/readyz")
	return code == http.StatusOK, strings.TrimSpace(string(body))
}

// startupTaintMetric is the sample of meshcni_startup_taint on /metrics.
func startupTaintMetric(t *testing.T, addr string) string {
	t.Helper()
	_, body := httpGet(t, "http://"+addr+"/metrics")
	m := regexp.MustCompile(`(?m)^meshcni_startup_taint (\S+)$`).FindSubmatch(body)
	if m == nil {
		t.Fatalf("no meshcni_startup_taint on /metrics")
	}
	return string(m[1])
}
