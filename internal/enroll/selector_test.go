package enroll

import (
	"reflect"
	"strings"
	"testing"

	"github.com/mesh-cni/mesh-cni/internal/podstore"
)

type labelCase struct {
	name           string
	profile        string
	nsLabels       map[string]string
	podLabels      map[string]string
	podAnnotations map[string]string
	enroll         bool
	reason         string // a substring of the decision's reason
}

func TestSelectorsDecide(t *testing.T) {
	const (
		mode  = LabelDataplaneMode
		imode = IstioLabelDataplaneMode
	)
	on := map[string]string{mode: ValueEnabled}
	off := map[string]string{mode: ValueDisabled}
	ambient := map[string]string{imode: IstioValueAmbient}
	none := map[string]string{imode: IstioValueNone}
	cases := []labelCase{
		{name: "nothing labelled", enroll: false, reason: "neither the pod nor namespace"},
		{name: "namespace label", nsLabels: on, enroll: true, reason: "namespace shop labels match"},
		{name: "pod label", podLabels: on, enroll: true, reason: "pod labels match"},
		{name: "pod label, namespace disabled", nsLabels: off, podLabels: on, enroll: true, reason: "pod labels match"},
		{name: "pod opt-out label in enabled namespace", nsLabels: on, podLabels: off, enroll: false, reason: "opt-out"},
		{name: "pod opt-out annotation in enabled namespace", nsLabels: on, podAnnotations: off, enroll: false, reason: "pod annotations match opt-out"},
		{name: "conflict: pod label enabled, annotation disabled", podLabels: on, podAnnotations: off, enroll: false, reason: "opt-out"},
		{name: "namespace disabled only", nsLabels: off, enroll: false},
		{name: "unknown value is no enrollment", nsLabels: map[string]string{mode: "yes"}, enroll: false},
		{name: "annotation cannot enroll", podAnnotations: on, enroll: false},
		{name: "istio labels mean nothing to mesh-cni", nsLabels: ambient, podLabels: ambient, enroll: false},
		{name: "other labels kept apart", nsLabels: map[string]string{"team": "shop", mode: ValueEnabled}, podLabels: map[string]string{"app": "web"}, enroll: true},

		{name: "istio namespace ambient", profile: ProfileIstio, nsLabels: ambient, enroll: true, reason: "profile istio"},
		{name: "istio pod ambient", profile: ProfileIstio, podLabels: ambient, enroll: true},
		{name: "istio pod none in ambient namespace", profile: ProfileIstio, nsLabels: ambient, podLabels: none, enroll: false, reason: "opt-out"},
		{name: "istio sidecar pod in ambient namespace", profile: ProfileIstio, nsLabels: ambient,
			podAnnotations: map[string]string{IstioAnnotationSidecar: `{"containers":["istio-proxy"]}`}, enroll: false, reason: IstioAnnotationSidecar},
		{name: "istio pod ambient in none namespace", profile: ProfileIstio, nsLabels: none, podLabels: ambient, enroll: true},
		{name: "mesh-cni labels mean nothing to istio", profile: ProfileIstio, nsLabels: on, podLabels: on, enroll: false},
		{name: "istio pod none beats pod ambient annotation", profile: ProfileIstio, podLabels: ambient, podAnnotations: none, enroll: false},

		// A namespace that enforces the mesh overrules every pod opt-out, and says so.
		{name: "enforced: opt-out label ignored", nsLabels: withEnforce(on), podLabels: off, enroll: true,
			reason: `pod labels match opt-out "mesh-cni.io/dataplane-mode=disabled" (profile mesh-cni), ignored: namespace shop enforces the mesh (mesh-cni.io/enforce=true)`},
		{name: "enforced: opt-out annotation ignored", nsLabels: withEnforce(on), podAnnotations: off, enroll: true, reason: "pod annotations match opt-out"},
		{name: "enforced: pod enable label still enrolls", nsLabels: withEnforce(nil), podLabels: on, podAnnotations: off, enroll: true, reason: "ignored"},
		{name: "enforced without enrollment enrolls nothing", nsLabels: withEnforce(nil), podLabels: off, enroll: false, reason: "neither the pod nor namespace"},
		{name: "enforce is true or nothing", nsLabels: map[string]string{mode: ValueEnabled, LabelEnforce: "yes"}, podLabels: off, enroll: false, reason: "opt-out"},
		{name: "enforced istio: none ignored", profile: ProfileIstio, nsLabels: withEnforce(ambient), podLabels: none, enroll: true, reason: "ignored"},
		{name: "enforced istio: sidecar ignored", profile: ProfileIstio, nsLabels: withEnforce(ambient),
			podAnnotations: map[string]string{IstioAnnotationSidecar: "{}"}, enroll: true, reason: IstioAnnotationSidecar + "\" (profile istio), ignored"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			sel, err := ProfileSelectors(tc.profile)
			if err != nil {
				t.Fatal(err)
			}
			d := sel.Decide("shop", tc.nsLabels, tc.podLabels, tc.podAnnotations)
			if d.Enroll != tc.enroll {
				t.Fatalf("enroll = %v (%s), want %v", d.Enroll, d.Reason, tc.enroll)
			}
			if d.Reason == "" || !strings.Contains(d.Reason, tc.reason) {
				t.Fatalf("reason %q does not say %q", d.Reason, tc.reason)
			}
		})
	}
}

// withEnforce is labels plus the namespace label that enforces the mesh.
func withEnforce(labels map[string]string) map[string]string {
	out := map[string]string{LabelEnforce: ValueEnforce}
	for k, v := range labels {
		out[k] = v
	}
	return out
}

func TestProfileSelectorsUnknown(t *testing.T) {
	if _, err := ProfileSelectors("linkerd"); err == nil || !strings.Contains(err.Error(), "mesh-cni or istio") {
		t.Fatalf("unknown profile: %v, want an error naming the profiles", err)
	}
}

func TestParseSelectorsRejectsEmpty(t *testing.T) {
	// An empty selector matches everything: as an opt-out it would release
	// every pod, so it is refused.
	if _, err := parseSelectors("x", SelectorSpec{PodOptOut: []string{" "}}); err == nil {
		t.Fatal("an empty opt-out selector was accepted")
	}
	if _, err := parseSelectors("x", SelectorSpec{Pod: []string{"a in (b"}}); err == nil {
		t.Fatal("a malformed selector was accepted")
	}
}

// The per-pod capture annotations of the istio profile, read as istio-cni reads
// them: booleans by strconv.ParseBool, an unparseable value ignored.
func TestIstioCapture(t *testing.T) {
	yes, no := true, false
	for _, tc := range []struct {
		annotations map[string]string
		want        podstore.Capture
	}{
		{nil, podstore.Capture{}},
		{map[string]string{IstioAnnotationDNSCapture: "false"}, podstore.Capture{DNS: &no}},
		{map[string]string{IstioAnnotationDNSCapture: "1"}, podstore.Capture{DNS: &yes}},
		{map[string]string{IstioAnnotationDNSCapture: "maybe"}, podstore.Capture{}},
		{map[string]string{IstioAnnotationBypassInbound: "true"}, podstore.Capture{BypassInbound: true}},
		{map[string]string{IstioAnnotationBypassInbound: "False", IstioAnnotationDNSCapture: "T"}, podstore.Capture{DNS: &yes}},
	} {
		if got := IstioCapture(tc.annotations); !reflect.DeepEqual(got, tc.want) {
			t.Errorf("%v: %+v, want %+v", tc.annotations, got, tc.want)
		}
	}
}
