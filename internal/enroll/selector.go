package enroll

import (
	"fmt"
	"strings"

	"k8s.io/apimachinery/pkg/labels"

	"github.com/mesh-cni/mesh-cni/internal/agent"
)

// Profile names: which labels enroll pods and which opt them out.
const (
	// ProfileMeshCNI is the default: mesh-cni.io/dataplane-mode=enabled on a
	// namespace or pod enrolls, =disabled on a pod (label or annotation) opts out.
	ProfileMeshCNI = "mesh-cni"
	// ProfileIstio reads Istio ambient's labels: istio.io/dataplane-mode=ambient
	// on a namespace or pod enrolls, =none on a pod opts out, and so does a pod
	// that already runs an Istio sidecar (annotation sidecar.istio.io/status)
	// from ambient: the Kubernetes source, which reads the pod's spec, enrolls
	// it in sidecar mode instead (IstioSidecarPod), as istio-cni does.
	ProfileIstio = "istio"
)

// Profiles lists the profile names in the order they are documented.
func Profiles() []string { return []string{ProfileMeshCNI, ProfileIstio} }

// Label keys and values of the profiles.
const (
	LabelDataplaneMode = "mesh-cni.io/dataplane-mode"
	ValueEnabled       = "enabled"
	ValueDisabled      = "disabled"

	// LabelEnforce on a namespace, with ValueEnforce, overrules its pods'
	// opt-outs, under every profile: a pod-level opt-out there is ignored
	// (and reported), and the admission policy mesh-enforced-namespaces
	// refuses pods that gain one.
	LabelEnforce = "mesh-cni.io/enforce"
	ValueEnforce = "true"

	IstioLabelDataplaneMode = "istio.io/dataplane-mode"
	IstioValueAmbient       = "ambient"
	IstioValueNone          = "none"
	IstioAnnotationSidecar  = "sidecar.istio.io/status"
)

// What the Kubernetes source writes back to the pod: the outcome of each
// decision in an annotation, and an Event when enrollment failed.
const (
	AnnotationRedirection = "mesh-cni.io/redirection"
	// IstioAnnotationRedirection is what istiod reads (and istio-cni writes):
	// a pod with it "enabled" is given tunnel protocol HBONE, so its peers
	// reach it through its node proxy's 15008 with mTLS. Under the istio
	// profile the Kubernetes source sets it on enrolled pods once the node
	// proxy has acked them, and removes it when they leave the mesh.
	IstioAnnotationRedirection = "ambient.istio.io/redirection"
	// The per-pod capture annotations of the istio profile (IstioCapture).
	IstioAnnotationDNSCapture    = "ambient.istio.io/dns-capture"
	IstioAnnotationBypassInbound = "ambient.istio.io/bypass-inbound-capture"
	// Outcomes, as the agent reports them and as the annotation's value.
	OutcomeEnabled  = agent.OutcomeEnabled
	OutcomeDisabled = agent.OutcomeDisabled
	OutcomeFailed   = agent.OutcomeFailed
	// EventReasonEnrollFailed is the reason of the Warning Event on a pod whose
	// enrollment failed.
	EventReasonEnrollFailed = "MeshEnrollmentFailed"
	// EventReasonOptOutIgnored is the reason of the Warning Event on a pod
	// whose opt-out was ignored because its namespace enforces the mesh.
	EventReasonOptOutIgnored = "MeshOptOutIgnored"
	eventSourceComponent     = "mesh-agent"
)

// Selectors decide enrollment from labels. Each list is "any of": a label set
// matches the list when it matches at least one selector in it. An empty list
// matches nothing.
//
// Precedence, for labels that disagree: a pod opt-out (label or annotation)
// wins over everything, unless the pod's namespace enforces the mesh
// (LabelEnforce); then a pod's own enable label; then its namespace's labels.
// So a pod labelled disabled in an enabled namespace stays out, unless that
// namespace enforces, and a pod labelled enabled in a namespace labelled
// disabled (or not labelled) is in.
type Selectors struct {
	// Profile names where the selectors came from, for reasons and logs.
	Profile string
	// Namespace: a pod whose namespace's labels match is enrolled.
	Namespace []labels.Selector
	// Pod: a pod whose own labels match is enrolled.
	Pod []labels.Selector
	// PodOptOut: a pod whose labels match is never enrolled.
	PodOptOut []labels.Selector
	// PodOptOutAnnotation: a pod whose annotations match is never enrolled.
	PodOptOutAnnotation []labels.Selector
}

// labelProfile is a profile built on one label: key=on enrolls a namespace or
// a pod, key=off opts a pod out, as a label or an annotation, and so do the
// other annotations given.
func labelProfile(key, on, off string, optOutAnnotations ...string) SelectorSpec {
	return SelectorSpec{
		Namespace:           []string{key + "=" + on},
		Pod:                 []string{key + "=" + on},
		PodOptOut:           []string{key + "=" + off},
		PodOptOutAnnotation: append([]string{key + "=" + off}, optOutAnnotations...),
	}
}

// ProfileSelectors returns the selectors of a named profile ("" is the default,
// mesh-cni).
func ProfileSelectors(profile string) (Selectors, error) {
	switch profile {
	case "", ProfileMeshCNI:
		return parseSelectors(ProfileMeshCNI, labelProfile(LabelDataplaneMode, ValueEnabled, ValueDisabled))
	case ProfileIstio:
		return parseSelectors(ProfileIstio, labelProfile(IstioLabelDataplaneMode, IstioValueAmbient, IstioValueNone, IstioAnnotationSidecar))
	default:
		return Selectors{}, fmt.Errorf("unknown selector profile %q: want %s", profile, strings.Join(Profiles(), " or "))
	}
}

// SelectorSpec is Selectors in Kubernetes label-selector syntax
// ("key=value", "key in (a,b)", "key", "!key", comma meaning AND).
type SelectorSpec struct {
	Namespace           []string `json:"namespace,omitempty"`
	Pod                 []string `json:"pod,omitempty"`
	PodOptOut           []string `json:"podOptOut,omitempty"`
	PodOptOutAnnotation []string `json:"podOptOutAnnotation,omitempty"`
}

func parseSelectors(profile string, spec SelectorSpec) (Selectors, error) {
	s := Selectors{Profile: profile}
	for _, f := range []struct {
		name string
		in   []string
		out  *[]labels.Selector
	}{
		{"namespace", spec.Namespace, &s.Namespace},
		{"pod", spec.Pod, &s.Pod},
		{"podOptOut", spec.PodOptOut, &s.PodOptOut},
		{"podOptOutAnnotation", spec.PodOptOutAnnotation, &s.PodOptOutAnnotation},
	} {
		for _, text := range f.in {
			// An empty selector would match every label set: for an opt-out
			// that silently releases every pod, so it is refused everywhere.
			if strings.TrimSpace(text) == "" {
				return s, fmt.Errorf("selectors.%s: an empty selector would match everything", f.name)
			}
			sel, err := labels.Parse(text)
			if err != nil {
				return s, fmt.Errorf("selectors.%s %q: %w", f.name, text, err)
			}
			*f.out = append(*f.out, sel)
		}
	}
	return s, nil
}

// firstMatch returns the first selector in list that matches set.
func firstMatch(list []labels.Selector, set map[string]string) (labels.Selector, bool) {
	for _, sel := range list {
		if sel.Matches(labels.Set(set)) {
			return sel, true
		}
	}
	return nil, false
}

// OptOut reports whether the pod's labels or annotations opt it out, and why.
func (s Selectors) OptOut(podLabels, podAnnotations map[string]string) (string, bool) {
	if sel, ok := firstMatch(s.PodOptOut, podLabels); ok {
		return fmt.Sprintf("pod labels match opt-out %q (profile %s)", sel.String(), s.Profile), true
	}
	if sel, ok := firstMatch(s.PodOptOutAnnotation, podAnnotations); ok {
		return fmt.Sprintf("pod annotations match opt-out %q (profile %s)", sel.String(), s.Profile), true
	}
	return "", false
}

// PodEnabled reports whether the pod's own labels enroll it, and why.
func (s Selectors) PodEnabled(podLabels map[string]string) (string, bool) {
	if sel, ok := firstMatch(s.Pod, podLabels); ok {
		return fmt.Sprintf("pod labels match %q (profile %s)", sel.String(), s.Profile), true
	}
	return "", false
}

// NamespaceEnabled reports whether a namespace's labels enroll its pods, and why.
func (s Selectors) NamespaceEnabled(namespace string, nsLabels map[string]string) (string, bool) {
	if sel, ok := firstMatch(s.Namespace, nsLabels); ok {
		return fmt.Sprintf("namespace %s labels match %q (profile %s)", namespace, sel.String(), s.Profile), true
	}
	return "", false
}

// Enforced reports whether a namespace's labels overrule its pods' opt-outs.
func Enforced(nsLabels map[string]string) bool {
	return nsLabels[LabelEnforce] == ValueEnforce
}

// Decide applies the precedence: pod opt-out, then pod enable, then namespace.
func (s Selectors) Decide(namespace string, nsLabels, podLabels, podAnnotations map[string]string) agent.Decision {
	d, _ := s.decide(namespace, nsLabels, podLabels, podAnnotations)
	return d
}

// decide is Decide, also saying which pod opt-out it ignored because the
// namespace enforces the mesh ("" when none).
func (s Selectors) decide(namespace string, nsLabels, podLabels, podAnnotations map[string]string) (agent.Decision, string) {
	ignored := ""
	if why, out := s.OptOut(podLabels, podAnnotations); out {
		if !Enforced(nsLabels) {
			return agent.Decision{Enroll: false, Reason: why}, ""
		}
		ignored = why
	}
	d := agent.Decision{Enroll: false, Reason: fmt.Sprintf("neither the pod nor namespace %s carries an enrollment label (profile %s)", namespace, s.Profile)}
	if why, in := s.PodEnabled(podLabels); in {
		d = agent.Decision{Enroll: true, Reason: why}
	} else if why, in := s.NamespaceEnabled(namespace, nsLabels); in {
		d = agent.Decision{Enroll: true, Reason: why}
	}
	if ignored == "" || !d.Enroll {
		// An opt-out where nothing enrolls the pod changes nothing.
		return d, ""
	}
	ignored = fmt.Sprintf("%s, ignored: namespace %s enforces the mesh (%s=%s)", ignored, namespace, LabelEnforce, ValueEnforce)
	d.Reason += "; " + ignored
	return d, ignored
}
