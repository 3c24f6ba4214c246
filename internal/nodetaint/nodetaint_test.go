package nodetaint

import (
	"context"
	"encoding/json"
	"slices"
	"testing"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/client-go/kubernetes/fake"
	k8stesting "k8s.io/client-go/testing"
)

const key = "mesh-cni.io/agent-not-ready"

var (
	startNoSchedule = corev1.Taint{Key: key, Value: "true", Effect: corev1.TaintEffectNoSchedule}
	startNoExecute  = corev1.Taint{Key: key, Effect: corev1.TaintEffectNoExecute, TimeAdded: &metav1.Time{}}
	dedicated       = corev1.Taint{Key: "dedicated", Value: "infra", Effect: corev1.TaintEffectNoSchedule}
	cordoned        = corev1.Taint{Key: "node.kubernetes.io/unschedulable", Effect: corev1.TaintEffectNoSchedule}
)

func TestPatch(t *testing.T) {
	for _, tc := range []struct {
		name    string
		old     []corev1.Taint
		removed int
		want    []map[string]any
	}{
		{"no taints", nil, 0, nil},
		{"only others", []corev1.Taint{dedicated}, 0, nil},
		{"the key alone", []corev1.Taint{startNoSchedule}, 1, []map[string]any{
			{"op": "test", "path": "/spec/taints"}, {"op": "remove", "path": "/spec/taints"},
		}},
		{"every effect of the key, others kept in order", []corev1.Taint{dedicated, startNoSchedule, cordoned, startNoExecute}, 2, []map[string]any{
			{"op": "test", "path": "/spec/taints"}, {"op": "replace", "path": "/spec/taints"},
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			data, removed, err := Patch(tc.old, key)
			if err != nil {
				t.Fatal(err)
			}
			if removed != tc.removed {
				t.Errorf("removes %d taints, want %d", removed, tc.removed)
			}
			if tc.want == nil {
				if data != nil {
					t.Errorf("patch %s, want none", data)
				}
				return
			}
			var ops []struct {
				Op    string         `json:"op"`
				Path  string         `json:"path"`
				Value []corev1.Taint `json:"value"`
			}
			if err := json.Unmarshal(data, &ops); err != nil {
				t.Fatal(err)
			}
			if len(ops) != len(tc.want) {
				t.Fatalf("patch %s", data)
			}
			for i, w := range tc.want {
				if ops[i].Op != w["op"] || ops[i].Path != w["path"] {
					t.Errorf("op %d: %s %s, want %s %s", i, ops[i].Op, ops[i].Path, w["op"], w["path"])
				}
			}
			if !slices.EqualFunc(ops[0].Value, tc.old, func(a, b corev1.Taint) bool { return a.MatchTaint(&b) && a.Value == b.Value }) {
				t.Errorf("the test op holds %v, want every old taint %v", ops[0].Value, tc.old)
			}
			if ops[1].Op == "replace" && !slices.EqualFunc(ops[1].Value, []corev1.Taint{dedicated, cordoned}, func(a, b corev1.Taint) bool { return a.MatchTaint(&b) }) {
				t.Errorf("replaced with %v, want the other taints in their order", ops[1].Value)
			}
		})
	}
	if _, _, err := Patch([]corev1.Taint{startNoSchedule}, ""); err == nil {
		t.Error("an empty key gave a patch")
	}
}

func TestValidateKey(t *testing.T) {
	for _, k := range []string{key, "agent-not-ready", "node.cilium.io/agent-not-ready"} {
		if err := ValidateKey(k); err != nil {
			t.Errorf("%q: %v", k, err)
		}
	}
	for _, k := range []string{"", "a/b/c", "Not A Key", "x/", "-bad"} {
		if err := ValidateKey(k); err == nil {
			t.Errorf("%q accepted", k)
		}
	}
}

func node(taints ...corev1.Taint) *corev1.Node {
	return &corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: "n1", Labels: map[string]string{"pool": "a"}}, Spec: corev1.NodeSpec{Taints: taints}}
}

func taintsOf(t *testing.T, c *fake.Clientset) []corev1.Taint {
	t.Helper()
	n, err := c.CoreV1().Nodes().Get(context.Background(), "n1", metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	return n.Spec.Taints
}

func patches(c *fake.Clientset) int {
	n := 0
	for _, a := range c.Actions() {
		if a.GetVerb() == "patch" {
			n++
		}
	}
	return n
}

func TestRemove(t *testing.T) {
	ctx := context.Background()
	c := fake.NewClientset(node(dedicated, startNoSchedule, startNoExecute))
	r := Remover{Nodes: c.CoreV1().Nodes(), Node: "n1", Key: key}
	if n, err := r.Present(ctx); err != nil || n != 2 {
		t.Fatalf("Present: %d, %v; want 2", n, err)
	}
	found, err := r.Remove(ctx, true)
	if err != nil || found != 2 {
		t.Fatalf("Remove: %d, %v; want 2 removed", found, err)
	}
	if got := taintsOf(t, c); len(got) != 1 || got[0].Key != dedicated.Key {
		t.Errorf("taints after Remove %v, want only %v", got, dedicated)
	}
	// Nothing left: nothing written.
	before := patches(c)
	if found, err := r.Remove(ctx, false); err != nil || found != 0 {
		t.Fatalf("second Remove: %d, %v", found, err)
	}
	if patches(c) != before {
		t.Error("Remove patched a node without the taint")
	}
	if n, err := r.Present(ctx); err != nil || n != 0 {
		t.Errorf("Present after removal: %d, %v", n, err)
	}
}

// A taint another client adds between the agent's read and its patch is kept:
// the patch's test of the old taints fails and nothing is written.
func TestRemoveKeepsConcurrentChange(t *testing.T) {
	ctx := context.Background()
	c := fake.NewClientset(node(startNoSchedule))
	stale := node(startNoSchedule)
	// Reads return the node as it was; meanwhile an operator cordoned it.
	c.PrependReactor("get", "nodes", func(k8stesting.Action) (bool, runtime.Object, error) {
		return true, stale.DeepCopy(), nil
	})
	n, err := c.Tracker().Get(corev1.SchemeGroupVersion.WithResource("nodes"), "", "n1")
	if err != nil {
		t.Fatal(err)
	}
	cur := n.(*corev1.Node)
	cur.Spec.Taints = append(cur.Spec.Taints, cordoned)
	if err := c.Tracker().Update(corev1.SchemeGroupVersion.WithResource("nodes"), cur, ""); err != nil {
		t.Fatal(err)
	}
	r := Remover{Nodes: c.CoreV1().Nodes(), Node: "n1", Key: key}
	found, err := r.Remove(ctx, true)
	if err == nil {
		t.Fatal("Remove succeeded over a concurrent change of the taints")
	}
	if found != 1 {
		t.Errorf("found %d, want the 1 taint it read", found)
	}
	got, err := c.Tracker().Get(corev1.SchemeGroupVersion.WithResource("nodes"), "", "n1")
	if err != nil {
		t.Fatal(err)
	}
	if taints := got.(*corev1.Node).Spec.Taints; len(taints) != 2 {
		t.Errorf("taints %v: want both the startup taint and the concurrent one", taints)
	}
}
