package enroll

import (
	"bytes"
	"errors"
	"fmt"
	"path"
	"strings"

	"sigs.k8s.io/yaml"

	"github.com/mesh-cni/mesh-cni/internal/agent"
	"github.com/mesh-cni/mesh-cni/pkg/gate/gatepb"
)

// PolicyFile is the schema of the standalone enrollment policy (YAML or JSON).
// Unknown fields are errors, so a typo is rejected instead of ignored. See the
// package documentation for the precedence.
type PolicyFile struct {
	// Profile picks the label selectors used for pods whose labels the request
	// carries (KNI, hook): mesh-cni (default) or istio.
	Profile string `json:"profile,omitempty"`
	// Namespaces: every pod in a namespace matching one of these names (shell
	// glob patterns, e.g. "team-*") is enrolled.
	Namespaces []string `json:"namespaces,omitempty"`
	// Pods: single pods by namespace and name (both may be glob patterns).
	Pods []PodRef `json:"pods,omitempty"`
	// Exclude: pods (or, with no name, whole namespaces) that are never enrolled,
	// whatever else matches.
	Exclude []PodRef `json:"exclude,omitempty"`
	// Selectors replace the profile's pod selectors, per list: a list that is
	// given (even empty, which turns that kind off) replaces the profile's; one
	// left out keeps it. Namespace selectors are not allowed: no entry point
	// tells the agent a namespace's labels without the Kubernetes source.
	Selectors *SelectorSpec `json:"selectors,omitempty"`
}

// PodRef names pods by namespace and name; both are shell glob patterns
// (path.Match syntax). An empty name means every pod of the namespace.
type PodRef struct {
	Namespace string `json:"namespace"`
	Name      string `json:"name,omitempty"`
}

func (r PodRef) String() string {
	if r.Name == "" {
		return r.Namespace + "/*"
	}
	return r.Namespace + "/" + r.Name
}

func (r PodRef) matches(namespace, name string) bool {
	// Patterns were checked when the policy was parsed, so errors cannot occur.
	if ok, _ := path.Match(r.Namespace, namespace); !ok {
		return false
	}
	if r.Name == "" {
		return true
	}
	ok, _ := path.Match(r.Name, name)
	return ok
}

// filePolicy is a parsed, validated policy file.
type filePolicy struct {
	spec      PolicyFile
	selectors Selectors
}

// parsePolicy parses and validates a policy file's bytes. defaultProfile is
// used when the file names none.
func parsePolicy(data []byte, defaultProfile string) (*filePolicy, error) {
	// A zero-length file is what an editor that truncates before writing leaves
	// for a moment; taking it as "enroll nothing" would release every pod.
	if len(bytes.TrimSpace(data)) == 0 {
		return nil, errors.New("the policy file is empty (write {} for a policy that enrolls nothing by name)")
	}
	var spec PolicyFile
	if err := yaml.UnmarshalStrict(data, &spec); err != nil {
		return nil, fmt.Errorf("parse: %w", err)
	}
	profile := spec.Profile
	if profile == "" {
		profile = defaultProfile
	}
	sel, err := ProfileSelectors(profile)
	if err != nil {
		return nil, fmt.Errorf("profile: %w", err)
	}
	if spec.Selectors != nil {
		if spec.Selectors.Namespace != nil {
			return nil, errors.New("selectors.namespace: namespace labels are only known to the Kubernetes source; list namespaces under namespaces: instead")
		}
		custom, err := parseSelectors(sel.Profile+"+file", *spec.Selectors)
		if err != nil {
			return nil, err
		}
		sel.Profile = custom.Profile
		if spec.Selectors.Pod != nil {
			sel.Pod = custom.Pod
		}
		if spec.Selectors.PodOptOut != nil {
			sel.PodOptOut = custom.PodOptOut
		}
		if spec.Selectors.PodOptOutAnnotation != nil {
			sel.PodOptOutAnnotation = custom.PodOptOutAnnotation
		}
	}
	var errs []error
	for i, ns := range spec.Namespaces {
		if err := checkPattern(ns); err != nil {
			errs = append(errs, fmt.Errorf("namespaces[%d]: %w", i, err))
		}
	}
	for i, r := range spec.Pods {
		if err := checkRef(r, true); err != nil {
			errs = append(errs, fmt.Errorf("pods[%d]: %w", i, err))
		}
	}
	for i, r := range spec.Exclude {
		if err := checkRef(r, false); err != nil {
			errs = append(errs, fmt.Errorf("exclude[%d]: %w", i, err))
		}
	}
	if err := errors.Join(errs...); err != nil {
		return nil, err
	}
	return &filePolicy{spec: spec, selectors: sel}, nil
}

func checkPattern(p string) error {
	if strings.TrimSpace(p) == "" {
		return errors.New("empty name")
	}
	if _, err := path.Match(p, ""); err != nil {
		return fmt.Errorf("pattern %q: %w", p, err)
	}
	return nil
}

func checkRef(r PodRef, needName bool) error {
	if err := checkPattern(r.Namespace); err != nil {
		return fmt.Errorf("namespace: %w", err)
	}
	if r.Name == "" {
		if needName {
			return errors.New("name is required (list the namespace under namespaces: to enroll all its pods)")
		}
		return nil
	}
	if err := checkPattern(r.Name); err != nil {
		return fmt.Errorf("name: %w", err)
	}
	return nil
}

// decide applies the file policy. Labels and annotations are only consulted
// when the request carried them (KNI, hook); a CNI request is matched by
// namespace and name alone.
func (p *filePolicy) decide(pod *gatepb.PodIdentity) agent.Decision {
	ns, name := pod.GetNamespace(), pod.GetName()
	for _, r := range p.spec.Exclude {
		if r.matches(ns, name) {
			return agent.Decision{Enroll: false, Reason: fmt.Sprintf("excluded by the policy file (exclude %s)", r)}
		}
	}
	if why, out := p.selectors.OptOut(pod.GetLabels(), pod.GetAnnotations()); out {
		return agent.Decision{Enroll: false, Reason: why}
	}
	for _, r := range p.spec.Pods {
		if r.matches(ns, name) {
			return agent.Decision{Enroll: true, Reason: fmt.Sprintf("named by the policy file (pods %s)", r)}
		}
	}
	if why, in := p.selectors.PodEnabled(pod.GetLabels()); in {
		return agent.Decision{Enroll: true, Reason: why}
	}
	for _, pattern := range p.spec.Namespaces {
		if ok, _ := path.Match(pattern, ns); ok {
			return agent.Decision{Enroll: true, Reason: fmt.Sprintf("namespace %s is enrolled by the policy file (namespaces %s)", ns, pattern)}
		}
	}
	why := fmt.Sprintf("the policy file names neither pod %s/%s nor its namespace", ns, name)
	if len(pod.GetLabels()) == 0 {
		why += " (the request carried no pod labels)"
	} else {
		why += ", and its labels do not match " + p.selectors.Profile + "'s selectors"
	}
	return agent.Decision{Enroll: false, Reason: why}
}
