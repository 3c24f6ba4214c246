package enroll

import (
	"context"
	"testing"

	"go.uber.org/zap"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/kubernetes/fake"
	k8stesting "k8s.io/client-go/testing"
)

// TestReporterBehindItsOwnWrite: once the agent wrote a pod's annotation, a
// cached copy older than that write (the watch lagging in a burst) is not a
// disagreement for the audit to correct, which would write the same value
// again; a copy as new as the write, another pod of that name, or a
// resourceVersion that is no revision is taken at its word.
func TestReporterBehindItsOwnWrite(t *testing.T) {
	client := fake.NewClientset()
	client.PrependReactor("patch", "pods", func(k8stesting.Action) (bool, runtime.Object, error) {
		return true, &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Name: "p", Namespace: "ns", UID: "u1", ResourceVersion: "7"}}, nil
	})
	r := &reporter{
		log: zap.NewNop(), client: client, node: "n",
		cached:    func(string, string) *corev1.Pod { return nil },
		pending:   map[podKey]*pendingReport{},
		written:   map[podKey]writtenOutcome{},
		ignored:   map[podKey]string{},
		bare:      map[podKey]string{},
		writtenRV: map[podKey]uidVersion{},
	}
	key := podKey{"ns", "p"}
	r.pending[key] = &pendingReport{uid: "u1", outcome: OutcomeEnabled}
	if err := r.write(context.Background(), key); err != nil {
		t.Fatal(err)
	}
	if n := len(client.Actions()); n != 1 {
		t.Fatalf("%d requests for one outcome, want the one patch", n)
	}
	pod := func(uid, rv string) *corev1.Pod {
		return &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Name: "p", Namespace: "ns", UID: types.UID(uid), ResourceVersion: rv}}
	}
	for _, tc := range []struct {
		what string
		p    *corev1.Pod
		want bool
	}{
		{"older than the write", pod("u1", "6"), true},
		{"the write itself", pod("u1", "7"), false},
		{"newer than the write", pod("u1", "9"), false},
		{"another pod of that name", pod("u2", "3"), false},
		{"no revision", pod("u1", "x"), false},
	} {
		if got := r.behind(tc.p); got != tc.want {
			t.Errorf("%s: behind = %v, want %v", tc.what, got, tc.want)
		}
	}
	r.forget("ns", "p")
	if r.behind(pod("u1", "6")) {
		t.Error("a deleted pod's write still counts")
	}
}
