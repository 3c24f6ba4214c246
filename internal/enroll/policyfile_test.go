package enroll

import (
	"strings"
	"testing"

	"github.com/mesh-cni/mesh-cni/pkg/gate/gatepb"
)

const samplePolicy = `
profile: mesh-cni
namespaces: [shop, "team-*"]
pods:
  - {namespace: legacy, name: "billing-*"}
exclude:
  - {namespace: shop, name: "db-*"}
  - {namespace: shop-batch}
  - {namespace: "team-*", name: canary}
`

func TestFilePolicyDecide(t *testing.T) {
	p, err := parsePolicy([]byte(samplePolicy), "")
	if err != nil {
		t.Fatal(err)
	}
	on := map[string]string{LabelDataplaneMode: ValueEnabled}
	off := map[string]string{LabelDataplaneMode: ValueDisabled}
	cases := []struct {
		name        string
		pod         *gatepb.PodIdentity
		enroll      bool
		reason      string
		labels, ann map[string]string
	}{
		{name: "namespace listed", pod: pod("shop", "web-1"), enroll: true, reason: "namespaces shop"},
		{name: "namespace glob", pod: pod("team-a", "api"), enroll: true, reason: "team-*"},
		{name: "excluded pod in listed namespace", pod: pod("shop", "db-0"), enroll: false, reason: "exclude shop/db-*"},
		{name: "excluded by glob namespace", pod: pod("team-b", "canary"), enroll: false, reason: "exclude"},
		{name: "pod named by glob", pod: pod("legacy", "billing-7f9"), enroll: true, reason: "pods legacy/billing-*"},
		{name: "other pod of that namespace", pod: pod("legacy", "cron"), enroll: false, reason: "no pod labels"},
		{name: "whole namespace excluded", pod: pod("shop-batch", "job"), enroll: false, reason: "shop-batch/*"},
		{name: "unknown namespace", pod: pod("other", "x"), enroll: false},
		{name: "KNI pod label enrolls", pod: pod("other", "x"), labels: on, enroll: true, reason: "pod labels match"},
		{name: "KNI opt-out label beats namespace", pod: pod("shop", "web-2"), labels: off, enroll: false, reason: "opt-out"},
		{name: "KNI opt-out annotation beats pod entry", pod: pod("legacy", "billing-1"), ann: off, enroll: false, reason: "opt-out"},
		{name: "exclude beats pod label", pod: pod("shop", "db-1"), labels: on, enroll: false, reason: "exclude"},
		{name: "labels that do not match", pod: pod("other", "x"), labels: map[string]string{"app": "x"}, enroll: false, reason: "do not match"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			tc.pod.Labels, tc.pod.Annotations = tc.labels, tc.ann
			d := p.decide(tc.pod)
			if d.Enroll != tc.enroll || !strings.Contains(d.Reason, tc.reason) {
				t.Fatalf("decision %+v, want enroll=%v with a reason saying %q", d, tc.enroll, tc.reason)
			}
		})
	}
}

func TestFilePolicyCustomSelectors(t *testing.T) {
	p, err := parsePolicy([]byte(`
profile: istio
selectors:
  pod: ["app in (web, api)", "tier=front,env!=dev"]
  podOptOut: []
`), ProfileMeshCNI)
	if err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		labels map[string]string
		ann    map[string]string
		enroll bool
	}{
		{labels: map[string]string{"app": "web"}, enroll: true},
		{labels: map[string]string{"tier": "front", "env": "prod"}, enroll: true},
		{labels: map[string]string{"tier": "front", "env": "dev"}, enroll: false},
		// The profile's ambient label was replaced by the custom pod list.
		{labels: map[string]string{IstioLabelDataplaneMode: IstioValueAmbient}, enroll: false},
		// The opt-out label list was emptied; the istio annotation opt-outs stay.
		{labels: map[string]string{"app": "web", IstioLabelDataplaneMode: IstioValueNone}, enroll: true},
		{labels: map[string]string{"app": "web"}, ann: map[string]string{IstioAnnotationSidecar: "{}"}, enroll: false},
	} {
		pi := pod("any", "p")
		pi.Labels, pi.Annotations = tc.labels, tc.ann
		if d := p.decide(pi); d.Enroll != tc.enroll {
			t.Errorf("labels %v annotations %v: %+v, want enroll=%v", tc.labels, tc.ann, d, tc.enroll)
		}
	}
}

func TestParsePolicyRejects(t *testing.T) {
	for _, tc := range []struct{ name, yaml, want string }{
		{"empty file", "  \n", "empty"},
		{"unknown field", "namespace: [shop]", "unknown field"},
		{"not yaml", "namespaces: [shop", "parse"},
		{"bad profile", "profile: linkerd", "unknown selector profile"},
		{"bad glob", "namespaces: ['shop[']", "syntax error in pattern"},
		{"pod without name", "pods: [{namespace: shop}]", "name is required"},
		{"pod without namespace", "pods: [{name: web}]", "namespace"},
		{"empty namespace entry", "namespaces: ['']", "empty name"},
		{"namespace selectors", "selectors: {namespace: [a=b]}", "only known to the Kubernetes source"},
		{"bad selector", "selectors: {pod: ['a in (b']}", "selectors.pod"},
		{"empty opt-out selector", "selectors: {podOptOut: ['']}", "match everything"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, err := parsePolicy([]byte(tc.yaml), "")
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("error %v, want one saying %q", err, tc.want)
			}
		})
	}
	// {} is the valid policy that enrolls nothing by name.
	if _, err := parsePolicy([]byte("{}"), ""); err != nil {
		t.Fatalf("{}: %v", err)
	}
}

func pod(namespace, name string) *gatepb.PodIdentity {
	return &gatepb.PodIdentity{Namespace: namespace, Name: name, Uid: "uid-" + name}
}
