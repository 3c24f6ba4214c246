package enroll

import (
	"errors"
	"fmt"
	"net/netip"
	"slices"
	"strconv"
	"strings"

	corev1 "k8s.io/api/core/v1"

	"github.com/mesh-cni/mesh-cni/internal/podstore"
)

// The names and annotations of Istio's sidecar injection that decide a pod's
// sidecar capture, as istio-cni's plugin reads them.
const (
	IstioProxyContainer = "istio-proxy"
	// IstioInitContainer is the privileged init container of injection
	// without istio-cni: a pod that has it sets up its own capture.
	IstioInitContainer = "istio-init"
	// IstioLabelInject and IstioAnnotationInject, false, keep a pod out of
	// injection; the label wins when both are set.
	IstioLabelInject      = "sidecar.istio.io/inject"
	IstioAnnotationInject = "sidecar.istio.io/inject"

	istioInterceptionMode     = "sidecar.istio.io/interceptionMode"
	istioIncludeOutboundCIDRs = "traffic.sidecar.istio.io/includeOutboundIPRanges"
	istioExcludeOutboundCIDRs = "traffic.sidecar.istio.io/excludeOutboundIPRanges"
	istioIncludeInboundPorts  = "traffic.sidecar.istio.io/includeInboundPorts"
	istioExcludeInboundPorts  = "traffic.sidecar.istio.io/excludeInboundPorts"
	istioIncludeOutboundPorts = "traffic.sidecar.istio.io/includeOutboundPorts"
	istioExcludeOutboundPorts = "traffic.sidecar.istio.io/excludeOutboundPorts"
	istioExcludeInterfaces    = "traffic.sidecar.istio.io/excludeInterfaces"
	istioKubevirtInterfaces   = "traffic.sidecar.istio.io/kubevirtInterfaces"
	istioRerouteInterfaces    = "istio.io/reroute-virtual-interfaces"

	// IstioProxyUID is the uid the injector runs the proxy as unless its
	// container says otherwise.
	IstioProxyUID = 1337
	// istioStatusPort is the proxy's health port, never captured in either
	// direction unless an annotation says otherwise (istio-cni's default).
	istioStatusPort = 15020
)

// istioProxyPorts are the proxy's own ports istio-cni never captures inbound,
// whatever the annotations say: health, readiness, telemetry; and the
// tunnel's, which Istio's rules pass first.
var istioProxyPorts = []uint16{15008, 15020, 15021, 15090}

// IstioSidecarPod reports whether istio-cni's plugin would set up sidecar
// capture for the pod, and why not: it runs Istio's proxy container (as a
// sidecar, not a gateway, and not turned off), carries the injector's status,
// was not opted out of injection, and has no istio-init container of its own.
func IstioSidecarPod(p *corev1.Pod) (bool, string) {
	containers := slices.Concat(p.Spec.InitContainers, p.Spec.Containers)
	var proxy *corev1.Container
	for i, c := range containers {
		if c.Name == IstioInitContainer {
			return false, "the pod has its own " + IstioInitContainer + " container"
		}
		if c.Name == IstioProxyContainer {
			proxy = &containers[i]
		}
	}
	if proxy == nil {
		return false, "no " + IstioProxyContainer + " container"
	}
	for _, e := range proxy.Env {
		if e.Name == "DISABLE_ENVOY" {
			if off, err := strconv.ParseBool(e.Value); err == nil && off {
				return false, IstioProxyContainer + " has DISABLE_ENVOY=" + e.Value
			}
		}
	}
	if len(proxy.Args) >= 2 && proxy.Args[0] == "proxy" && proxy.Args[1] != "sidecar" {
		return false, "the proxy runs as " + proxy.Args[1] + ", not as a sidecar"
	}
	inject, ok := p.Labels[IstioLabelInject]
	if !ok {
		inject = p.Annotations[IstioAnnotationInject]
	}
	if on, err := strconv.ParseBool(inject); err == nil && !on {
		return false, "injection is off (" + IstioLabelInject + "=" + inject + ")"
	}
	if _, ok := p.Annotations[IstioAnnotationSidecar]; !ok {
		return false, "no " + IstioAnnotationSidecar + " annotation"
	}
	return true, ""
}

// IstioSidecarCapture reads a sidecar pod's capture (IstioSidecarPod true) the
// way istio-cni's plugin does: its annotations, with istio-cni's defaults
// where one is absent, and the proxy container's uid and DNS capture. An
// annotation that does not parse fails the pod, as it fails istio-cni's ADD;
// so do the interface annotations, which select traffic by interface, which
// the data path does not see.
func IstioSidecarCapture(p *corev1.Pod) (*podstore.Sidecar, error) {
	a := p.Annotations
	sc := &podstore.Sidecar{ProxyUID: IstioProxyUID, CgroupUID: string(p.UID)}
	if hash := a[corev1.MirrorPodAnnotationKey]; hash != "" {
		sc.CgroupUID = hash
	}
	var errs []error
	fail := func(key string, err error) { errs = append(errs, fmt.Errorf("annotation %s=%q: %w", key, a[key], err)) }

	if m, ok := a[istioInterceptionMode]; ok && m != "REDIRECT" && m != "TPROXY" {
		fail(istioInterceptionMode, errors.New("want REDIRECT or TPROXY"))
	}
	for _, key := range []string{istioExcludeInterfaces, istioKubevirtInterfaces, istioRerouteInterfaces} {
		if strings.TrimSpace(a[key]) != "" {
			fail(key, errors.New("capture by interface is not supported: mesh-cni captures sockets, not interfaces"))
		}
	}
	all, cidrs, err := istioCIDRs(a, istioIncludeOutboundCIDRs, "*")
	if err != nil {
		fail(istioIncludeOutboundCIDRs, err)
	}
	sc.OutboundCIDRsOnly, sc.IncludedCIDRs = !all, cidrs
	if _, sc.ExcludedCIDRs, err = istioCIDRs(a, istioExcludeOutboundCIDRs, ""); err != nil {
		fail(istioExcludeOutboundCIDRs, err)
	}
	all, ports, err := istioPorts(a, istioIncludeInboundPorts, "*", true)
	if err != nil {
		fail(istioIncludeInboundPorts, err)
	}
	sc.InboundPortsOnly, sc.InboundIncludedPorts = !all, ports
	if _, ports, err = istioPorts(a, istioExcludeInboundPorts, strconv.Itoa(istioStatusPort), false); err != nil {
		fail(istioExcludeInboundPorts, err)
	}
	sc.InboundExcludedPorts = slices.Compact(slices.Sorted(slices.Values(slices.Concat(ports, istioProxyPorts))))
	if sc.InboundPortsOnly {
		// An explicit list is all Istio's rules capture: the exclusions apply
		// to "*" only, but the tunnel's, which passes first.
		sc.InboundExcludedPorts = []uint16{istioProxyPorts[0]}
	}
	if _, sc.OutboundExcludedPorts, err = istioPorts(a, istioExcludeOutboundPorts, strconv.Itoa(istioStatusPort), false); err != nil {
		fail(istioExcludeOutboundPorts, err)
	}
	if _, sc.OutboundIncludedPorts, err = istioPorts(a, istioIncludeOutboundPorts, "", false); err != nil {
		fail(istioIncludeOutboundPorts, err)
	}
	if !sc.OutboundCIDRsOnly {
		// With every destination redirected, included ports add nothing.
		sc.OutboundIncludedPorts = nil
	}
	for _, c := range slices.Concat(p.Spec.InitContainers, p.Spec.Containers) {
		if c.Name != IstioProxyContainer {
			continue
		}
		if sec := c.SecurityContext; sec != nil && sec.RunAsUser != nil && *sec.RunAsUser > 0 && *sec.RunAsUser <= 1<<32-1 {
			sc.ProxyUID = uint32(*sec.RunAsUser)
		}
		for _, e := range c.Env {
			if e.Name == "ISTIO_META_DNS_CAPTURE" {
				// Istio logs a value that does not parse and leaves DNS alone.
				sc.DNS, _ = strconv.ParseBool(e.Value)
			}
		}
	}
	if err := errors.Join(errs...); err != nil {
		return nil, fmt.Errorf("sidecar capture of pod %s/%s (Istio's annotations): %w", p.Namespace, p.Name, err)
	}
	return sc, nil
}

// IstioProxyContainerID is the runtime's id of the pod's running proxy
// container, from its status ("" while it is not running or not reported):
// a native sidecar is an init container.
func IstioProxyContainerID(p *corev1.Pod) string {
	for _, st := range slices.Concat(p.Status.InitContainerStatuses, p.Status.ContainerStatuses) {
		if st.Name != IstioProxyContainer || st.State.Running == nil {
			continue
		}
		// "<runtime>://<id>"
		if _, id, ok := strings.Cut(st.ContainerID, "://"); ok && id != "" && !strings.ContainsAny(id, "/.") {
			return id
		}
	}
	return ""
}

// istioCIDRs reads a list of CIDRs annotation; all reports wildcard "*".
func istioCIDRs(a map[string]string, key, def string) (all bool, out []netip.Prefix, _ error) {
	v, ok := a[key]
	if !ok {
		v = def
	}
	v = strings.TrimSpace(v)
	if v == "*" {
		return true, nil, nil
	}
	for f := range strings.SplitSeq(v, ",") {
		if f = strings.TrimSpace(f); f == "" {
			continue
		}
		p, err := netip.ParsePrefix(f)
		if err != nil {
			return false, nil, err
		}
		out = append(out, p)
	}
	return false, out, nil
}

// istioPorts reads a list of ports annotation; all reports wildcard "*", which
// only include lists take.
func istioPorts(a map[string]string, key, def string, wildcard bool) (all bool, out []uint16, _ error) {
	v, ok := a[key]
	if !ok {
		v = def
	}
	v = strings.TrimSpace(v)
	if v == "*" {
		if !wildcard {
			return false, nil, errors.New(`"*" is not a port list here`)
		}
		return true, nil, nil
	}
	for f := range strings.SplitSeq(v, ",") {
		if f = strings.TrimSpace(f); f == "" {
			continue
		}
		n, err := strconv.ParseUint(f, 10, 16)
		if err != nil || n == 0 {
			return false, nil, fmt.Errorf("%q is not a port", f)
		}
		out = append(out, uint16(n))
	}
	if len(out) == 0 {
		return false, nil, nil
	}
	slices.Sort(out)
	return false, slices.Compact(out), nil
}
