package agent

import (
	"context"
	"errors"
	"fmt"
	"slices"

	"github.com/mesh-cni/mesh-cni/internal/hostproc"
	"github.com/mesh-cni/mesh-cni/internal/netns"
	"github.com/mesh-cni/mesh-cni/internal/podstore"
	"github.com/mesh-cni/mesh-cni/internal/redirect"
)

// RedirectDatapath adapts the eBPF data path to the gate, applying the node's
// redirection settings to every pod it enrolls.
type RedirectDatapath struct {
	DP       *redirect.Datapath
	Settings redirect.Settings
	// ProxyCgroups are the configured cgroups of the proxies (sidecars), below
	// the data path's cgroup v2 root; the connected node proxies' own cgroups are
	// added to them.
	ProxyCgroups []string
	// PodCgroups is the node's pod cgroup layout, where a sidecar container's
	// cgroup is found (nil, or an error: not known; sidecars are then known
	// by their uid).
	PodCgroups func() (hostproc.PodCgroupLayout, error)
}

// ProxyIdentifier is a data path that can tell the proxy's processes apart from
// the pods'.
type ProxyIdentifier interface {
	// SetProxyProcesses makes the cgroups of these processes, with the
	// configured ones, the proxy's.
	SetProxyProcesses(pids []int32) error
}

// SetProxyProcesses implements ProxyIdentifier.
func (r RedirectDatapath) SetProxyProcesses(pids []int32) error {
	cgroups := slices.Clone(r.ProxyCgroups)
	for _, pid := range pids {
		if pid <= 0 {
			// SO_PEERCRED gives 0 for a peer outside the agent's PID namespace.
			return errors.New("the node proxy's process is not visible to the agent: run the agent in the host's PID namespace (hostPID), or name the proxy's cgroup with --proxy-cgroups")
		}
		cg, err := r.DP.ProcessCgroup(int(pid))
		if err != nil {
			return err
		}
		cgroups = append(cgroups, cg)
	}
	return r.DP.SetProxyCgroups(cgroups)
}

// Enroll implements Datapath.
func (r RedirectDatapath) Enroll(ctx context.Context, ns *netns.Handle, capture podstore.Capture) (uint64, error) {
	e, err := r.DP.Enroll(ctx, redirect.Target{NetnsPath: ns.Path, Netns: ns.File, Settings: r.settingsFor(capture)})
	if err != nil {
		return 0, err
	}
	return e.Cookie, nil
}

// Istio's sidecar ports: its outbound and inbound listeners and its DNS
// proxy, inside the pod.
const (
	sidecarOutboundPort = 15001
	sidecarInboundPort  = 15006
	sidecarDNSPort      = 15053
)

// settingsFor is the node's settings with a pod's own deviations.
func (r RedirectDatapath) settingsFor(c podstore.Capture) redirect.Settings {
	s := r.Settings
	if sc := c.Sidecar; sc != nil {
		s.OutboundPort, s.InboundPort, s.DNSPort = sidecarOutboundPort, sidecarInboundPort, sidecarDNSPort
		s.InboundExcludedPorts = sc.InboundExcludedPorts
		s.OutboundExcludedPorts = sc.OutboundExcludedPorts
		s.ExcludedCIDRs = slices.Concat(s.ExcludedCIDRs, sc.ExcludedCIDRs)
		// Istio's sidecar rules send DNS to its proxy whether or not it
		// listens.
		s.DNSCapture, s.DNSFailClosed = sc.DNS, sc.DNS
		// Its inbound capture is the sidecar's include list's.
		s.BypassInbound = false
		s.Capture = redirect.Capture{
			LocalToInbound:        true,
			OutboundCIDRsOnly:     sc.OutboundCIDRsOnly,
			IncludedCIDRs:         sc.IncludedCIDRs,
			OutboundIncludedPorts: sc.OutboundIncludedPorts,
			InboundPortsOnly:      sc.InboundPortsOnly,
			InboundIncludedPorts:  sc.InboundIncludedPorts,
		}
		if ref, ok := r.sidecarCgroup(sc); ok {
			// The container alone: not even a node-wide uid opt-in.
			s.Capture.ProxyCgroup, s.ProxyUID = ref, nil
		} else {
			uid := sc.ProxyUID
			s.ProxyUID = &uid
		}
		if c.KubeletPorts != nil {
			s.KubeletPortsOnly, s.KubeletPorts = true, *c.KubeletPorts
		}
		return s
	}
	if c.DNS != nil {
		s.DNSCapture = *c.DNS
		s.DNSFailClosed = s.DNSFailClosed && s.DNSCapture
	}
	s.BypassInbound = s.BypassInbound || c.BypassInbound
	if c.KubeletPorts != nil {
		s.KubeletPortsOnly, s.KubeletPorts = true, *c.KubeletPorts
	}
	return s
}

// Release implements Datapath.
func (r RedirectDatapath) Release(ctx context.Context, cookie uint64, netnsPath string) error {
	if netnsPath != "" {
		if c, err := netns.Cookie(netnsPath); err == nil && c == cookie {
			return r.DP.ReleaseNetns(ctx, netnsPath)
		}
	}
	return r.DP.Release(ctx, cookie)
}

// Recollect implements ListenerRecollector.
func (r RedirectDatapath) Recollect(ctx context.Context, netnsPath string) error {
	return r.DP.Recollect(ctx, netnsPath)
}

// Check implements Datapath.
func (r RedirectDatapath) Check(ctx context.Context, cookie uint64) error {
	return r.DP.Check(ctx, cookie)
}

// Enrolled implements Datapath.
func (r RedirectDatapath) Enrolled(ctx context.Context) ([]uint64, error) {
	es, err := r.DP.List(ctx)
	if err != nil {
		return nil, fmt.Errorf("list data path enrollments: %w", err)
	}
	out := make([]uint64, len(es))
	for i, e := range es {
		out[i] = e.Cookie
	}
	return out, nil
}

// Counters implements CounterReader.
func (r RedirectDatapath) Counters() (redirect.Counters, error) { return r.DP.Counters() }

// Refusals implements RefusalReader.
func (r RedirectDatapath) Refusals() ([]redirect.Refusal, error) { return r.DP.Refusals() }

// sidecarCgroup finds the cgroup of sc's proxy container at the node's pod
// cgroup layout, if it runs and the layout is known.
func (r RedirectDatapath) sidecarCgroup(sc *podstore.Sidecar) (redirect.CgroupRef, bool) {
	if sc.ProxyContainer == "" || sc.CgroupUID == "" || r.PodCgroups == nil {
		return redirect.CgroupRef{}, false
	}
	l, err := r.PodCgroups()
	if err != nil {
		return redirect.CgroupRef{}, false
	}
	for _, path := range l.ContainerCgroups(sc.CgroupUID, sc.ProxyContainer) {
		if ref, err := r.DP.CgroupRef(path); err == nil {
			return ref, true
		}
	}
	return redirect.CgroupRef{}, false
}
