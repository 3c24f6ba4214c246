package agent

import (
	"context"
	"path/filepath"
	"testing"

	"go.uber.org/zap/zaptest"

	"github.com/mesh-cni/mesh-cni/internal/podstore"
	"github.com/mesh-cni/mesh-cni/internal/redirect"
	"github.com/mesh-cni/mesh-cni/pkg/gate/gatepb"
	"github.com/mesh-cni/mesh-cni/test/fixtures"
)

// A pod's splice choice: only "enabled" asks, any other value of the
// annotation opts out, no annotation leaves the node's default. The choice a
// policy made reaches the data path and stays in the pod's record, and
// decides the pod's settings over the node's default. The all source reads
// it from the request, its only copy.
func TestSpliceChoice(t *testing.T) {
	for _, tc := range []struct {
		annotations map[string]string
		want        *bool
	}{
		{map[string]string{AnnotationSplice: "enabled"}, ptr(true)},
		{map[string]string{AnnotationSplice: "disabled"}, ptr(false)},
		{map[string]string{AnnotationSplice: "false"}, ptr(false)},
		{map[string]string{AnnotationSplice: "Enabled"}, ptr(false)},
		{map[string]string{AnnotationSplice: ""}, ptr(false)},
		{map[string]string{"other": "enabled"}, nil},
		{nil, nil},
	} {
		if got := SpliceChoice(tc.annotations); deref(got) != deref(tc.want) {
			t.Errorf("SpliceChoice(%v) = %v, want %v", tc.annotations, deref(got), deref(tc.want))
		}
		d, err := EnrollAll{}.Decide(context.Background(), &gatepb.PodIdentity{Annotations: tc.annotations})
		if err != nil || deref(d.Capture.Splice) != deref(tc.want) {
			t.Errorf("EnrollAll with %v: splice %v (%v), want %v", tc.annotations, deref(d.Capture.Splice), err, deref(tc.want))
		}
	}

	e := newServiceEnv(t)
	ctx := context.Background()
	for i, choice := range []*bool{ptr(true), ptr(false), nil} {
		e.policy.splice = choice
		req := addRequest("shop", "web", "c0ffee0"+string(rune('a'+i)))
		resp, err := e.svc.Add(ctx, req)
		if err != nil {
			t.Fatalf("Add: %v", err)
		}
		if got := e.dp.enrolled[resp.GetNetnsCookie()].Splice; deref(got) != deref(choice) {
			t.Errorf("the policy chose splice %v: the data path was asked for %v", deref(choice), deref(got))
		}
		if rec, _ := e.store.Get(keyOf(req.GetAttachment())); deref(rec.Capture.Splice) != deref(choice) {
			t.Errorf("the policy chose splice %v: the record keeps %v", deref(choice), deref(rec.Capture.Splice))
		}
		if _, err := e.svc.Del(ctx, &gatepb.DelRequest{Attachment: req.GetAttachment(), NetnsPath: podNetns}); err != nil {
			t.Fatal(err)
		}
	}

	for _, tc := range []struct {
		node   bool
		choice *bool
		want   bool
	}{
		{false, nil, false}, {false, ptr(true), true}, {true, nil, true}, {true, ptr(false), false},
	} {
		r := RedirectDatapath{Settings: redirect.Settings{Splice: tc.node}}
		if got := r.settingsFor(podstore.Capture{Splice: tc.choice}).Splice; got != tc.want {
			t.Errorf("node default %v, pod's choice %v: splice %v, want %v", tc.node, deref(tc.choice), got, tc.want)
		}
	}
}

func ptr(b bool) *bool { return &b }

func deref(b *bool) any {
	if b == nil {
		return "none"
	}
	return *b
}

// A pod keeps the splice the agent gave it only while the agent's settings
// still give it: an agent started with another --splice applies its choice to
// the pods it keeps, at its first reconcile, without enrolling them again.
func TestSpliceChoiceFollowsTheAgent(t *testing.T) {
	fixtures.RequireRoot(t, "BPF, network namespaces")
	if err := redirect.SpliceSupport(); err != nil {
		t.Skipf("kernel cannot splice: %v", err)
	}
	ctx := context.Background()
	cfg := redirect.Config{PinRoot: filepath.Join(t.TempDir(), "bpf"), Logger: zaptest.NewLogger(t), Splice: true}
	t.Cleanup(func() {
		if err := redirect.Uninstall(ctx, cfg); err != nil {
			t.Errorf("uninstall: %v", err)
		}
	})
	store, problems, err := podstore.Open(t.TempDir())
	if err != nil || len(problems) > 0 {
		t.Fatal(err, problems)
	}
	pod := fixtures.NewNetns(t, filepath.Join(t.TempDir(), "pod"))
	// Each pass is one agent's life: open the pinned data path, serve with
	// the node's default splice, close.
	for i, nodeSplice := range []bool{true, false, true} {
		d, err := redirect.Open(ctx, cfg)
		if err != nil {
			t.Fatal(err)
		}
		settings := redirect.DefaultSettings()
		settings.Splice = nodeSplice
		ready := NewReadiness(CondDatapath)
		ready.Set(CondDatapath, true, "")
		policy := &fakePolicy{enrolled: map[string]bool{"shop": true}, outcomes: map[string]string{}}
		svc := NewService(zaptest.NewLogger(t), ready, policy, RedirectDatapath{DP: d, Settings: settings}, store)
		if i == 0 {
			req := addRequest("shop", "web", "c0ffee01")
			req.NetnsPath, req.Interfaces = pod.Path, nil
			if _, err := svc.Add(ctx, req); err != nil {
				t.Fatalf("Add: %v", err)
			}
		} else if res, err := svc.Reconcile(ctx); err != nil || res.Kept != 1 {
			t.Fatalf("reconcile: %+v, %v; want the pod kept", res, err)
		}
		es, err := d.List(ctx)
		d.Close()
		if err != nil || len(es) != 1 {
			t.Fatalf("enrollments %+v, %v", es, err)
		}
		if es[0].Settings.Splice != nodeSplice {
			t.Errorf("agent %d, node default splice %v: the pod is enrolled with splice %v", i, nodeSplice, es[0].Settings.Splice)
		}
	}
}
