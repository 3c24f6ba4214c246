package nethook

import (
	"fmt"
	"maps"
	"net"
	"net/netip"
	"slices"

	"github.com/mesh-cni/mesh-cni/pkg/gate"
	"github.com/mesh-cni/mesh-cni/pkg/gate/gatepb"
	"github.com/mesh-cni/mesh-cni/pkg/nethook/nethookpb"
)

// DefaultIfname is the attachment's interface name when the previous result
// names no pod interface, and the interface listed first when it does.
const DefaultIfname = "eth0"

// The gate's bounds that the conversion applies itself, so a request the gate
// would refuse fails here with a message about the hook field it came from.
const (
	maxInterfaces = 16
	maxAddresses  = 32
	maxIfnameLen  = 15
)

// SetupToGate turns a SetupPodNetwork call into the gate Add that enrolls the
// pod.
//
//   - pod: pod_namespace, pod_name, pod_uid; labels and annotations copied.
//   - attachment: container id = sandbox_id; ifname = the first pod interface
//     (see below), DefaultIfname when there is none; network = the argument.
//   - netns: netns_path (required).
//   - interfaces: from prev_result, the network devices (type NETDEV) that carry
//     at least one address: the hook's interface records say nothing about
//     which side of a veth they are on, and the host-side devices a primary
//     reports (veth peers, bridges) carry no pod address. DefaultIfname first,
//     the rest in prev_result order; an interface listed twice (by two earlier
//     plugins) is merged. Bare IPs become host prefixes (/32, /128).
//
// An error wraps gate.ErrInvalidRequest and says which field is wrong.
func SetupToGate(req *nethookpb.SetupPodNetworkRequest, network string) (*gatepb.AddRequest, error) {
	pod := &gatepb.PodIdentity{
		Namespace:   req.GetPodNamespace(),
		Name:        req.GetPodName(),
		Uid:         req.GetPodUid(),
		Labels:      maps.Clone(req.GetLabels()),
		Annotations: maps.Clone(req.GetAnnotations()),
	}
	att := &gatepb.Attachment{ContainerId: req.GetSandboxId(), Ifname: DefaultIfname, Network: network}
	if req.GetNetnsPath() == "" {
		return nil, invalid("setup of sandbox %.80q carries no netns_path", req.GetSandboxId())
	}
	ifs, err := interfacesOf(req.GetPrevResult().GetInterfaces())
	if err != nil {
		return nil, fmt.Errorf("prev_result of sandbox %.80q: %w", req.GetSandboxId(), err)
	}
	if len(ifs) > 0 {
		att.Ifname = ifs[0].GetName()
	}
	// The gate checks the netns further (that it is a network namespace) when
	// the Add arrives; here only its shape, so the conversion stays pure.
	if err := gate.ValidateDel(&gatepb.DelRequest{Pod: pod, Attachment: att, NetnsPath: req.GetNetnsPath()}); err != nil {
		return nil, fmt.Errorf("setup of sandbox %.80q: %w", req.GetSandboxId(), err)
	}
	return &gatepb.AddRequest{
		Pod:        pod,
		Attachment: att,
		NetnsPath:  req.GetNetnsPath(),
		Interfaces: ifs,
		Source:     gatepb.Source_SOURCE_HOOK,
	}, nil
}

// TeardownToGate turns a TeardownPodNetwork call into the gate Del that
// releases the pod. The attachment's ifname is DefaultIfname: the hook releases
// every interface the agent holds for the sandbox, so it is only a starting
// point. The pod identity carries no labels or annotations, which a release
// does not need; an identity the gate would refuse is left out rather than
// failing the release. The netns may be empty or gone.
func TeardownToGate(req *nethookpb.TeardownPodNetworkRequest, network string) (*gatepb.DelRequest, error) {
	del := &gatepb.DelRequest{
		Pod:        &gatepb.PodIdentity{Namespace: req.GetPodNamespace(), Name: req.GetPodName(), Uid: req.GetPodUid()},
		Attachment: &gatepb.Attachment{ContainerId: req.GetSandboxId(), Ifname: DefaultIfname, Network: network},
		NetnsPath:  req.GetNetnsPath(),
		Source:     gatepb.Source_SOURCE_HOOK,
	}
	if err := gate.ValidateDel(del); err != nil {
		del.Pod = nil
		if err := gate.ValidateDel(del); err != nil {
			return nil, fmt.Errorf("teardown of sandbox %.80q: %w", req.GetSandboxId(), err)
		}
	}
	return del, nil
}

func interfacesOf(in []*nethookpb.NetworkInterface) ([]*gatepb.Interface, error) {
	var out []*gatepb.Interface
	byName := map[string]*gatepb.Interface{}
	for _, ni := range in {
		if ni.GetType() != nethookpb.DeviceType_NETDEV || len(ni.GetAddresses()) == 0 {
			continue
		}
		name := ni.GetName()
		if err := checkIfname(name); err != nil {
			return nil, err
		}
		mac := ni.GetMacAddress()
		if mac != "" {
			if _, err := net.ParseMAC(mac); err != nil {
				return nil, invalid("interface %s: MAC %.40q: %v", name, mac, err)
			}
		}
		addrs, err := toPrefixes(ni.GetAddresses())
		if err != nil {
			return nil, fmt.Errorf("interface %s: %w", name, err)
		}
		if prev, ok := byName[name]; ok {
			for _, a := range addrs {
				if !slices.Contains(prev.Addresses, a) {
					prev.Addresses = append(prev.Addresses, a)
				}
			}
			if len(prev.Addresses) > maxAddresses {
				return nil, invalid("interface %s has more than %d addresses", name, maxAddresses)
			}
			if prev.Mac == "" {
				prev.Mac = mac
			}
			continue
		}
		if len(out) == maxInterfaces {
			return nil, invalid("more than %d pod interfaces", maxInterfaces)
		}
		gi := &gatepb.Interface{Name: name, Mac: mac, Addresses: addrs}
		byName[name] = gi
		out = append(out, gi)
	}
	if i := slices.IndexFunc(out, func(gi *gatepb.Interface) bool { return gi.GetName() == DefaultIfname }); i > 0 {
		eth0 := out[i]
		out = slices.Insert(slices.Delete(out, i, i+1), 0, eth0)
	}
	return out, nil
}

// toPrefixes turns addresses as plugins report them, bare ("10.1.0.5") or in
// CIDR notation ("10.1.0.5/24"), into the CIDR notation the gate records. A
// bare address becomes a host prefix. Zones are dropped.
func toPrefixes(ips []string) ([]string, error) {
	if len(ips) > maxAddresses {
		return nil, invalid("%d addresses, more than the limit of %d", len(ips), maxAddresses)
	}
	out := make([]string, 0, len(ips))
	for _, s := range ips {
		if p, err := netip.ParsePrefix(s); err == nil {
			out = append(out, p.String())
			continue
		}
		a, err := netip.ParseAddr(s)
		if err != nil {
			return nil, invalid("address %.60q is neither an IP address nor in CIDR notation", s)
		}
		a = a.WithZone("")
		out = append(out, netip.PrefixFrom(a, a.BitLen()).String())
	}
	return out, nil
}

// checkIfname applies the kernel's rules for interface names, as the gate does.
func checkIfname(name string) error {
	if len(name) == 0 || len(name) > maxIfnameLen || name == "." || name == ".." {
		return invalid("interface name %.80q must be 1-%d characters and not . or ..", name, maxIfnameLen)
	}
	for _, r := range name {
		if r == '/' || r == ':' || r <= ' ' || r == 0x7f {
			return invalid("interface name %.80q contains %q", name, r)
		}
	}
	return nil
}

func invalid(format string, args ...any) error {
	return fmt.Errorf("%w: %s", gate.ErrInvalidRequest, fmt.Sprintf(format, args...))
}
