package agent

import (
	"context"
	"testing"

	"github.com/mesh-cni/mesh-cni/internal/podstore"
	"github.com/mesh-cni/mesh-cni/internal/redirect"
	"github.com/mesh-cni/mesh-cni/pkg/gate/gatepb"
)

// A pod's splice choice comes from the request's annotations when the policy
// has no copy of its own (file and all sources: KNI and hook requests carry
// them), is kept in its record, and decides its settings over the node's
// default; anything but enabled or disabled is no choice.
func TestSpliceChoice(t *testing.T) {
	e := newServiceEnv(t)
	ctx := context.Background()
	for i, tc := range []struct {
		value string
		want  *bool
	}{{"enabled", ptr(true)}, {"disabled", ptr(false)}, {"on", nil}, {"", nil}} {
		req := addRequest("shop", "web", "c0ffee0"+string(rune('a'+i)))
		if tc.value != "" {
			req.Pod.Annotations = map[string]string{AnnotationSplice: tc.value}
		}
		resp, err := e.svc.Add(ctx, req)
		if err != nil {
			t.Fatalf("Add: %v", err)
		}
		got := e.dp.enrolled[resp.GetNetnsCookie()].Splice
		if (got == nil) != (tc.want == nil) || got != nil && *got != *tc.want {
			t.Errorf("annotation %q: the data path was asked for splice %v, want %v", tc.value, deref(got), deref(tc.want))
		}
		rec, _ := e.store.Get(keyOf(req.GetAttachment()))
		if (rec.Capture.Splice == nil) != (tc.want == nil) {
			t.Errorf("annotation %q: record's splice %v, want %v", tc.value, deref(rec.Capture.Splice), deref(tc.want))
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
