package nethook

import (
	"fmt"
	"slices"

	"github.com/mesh-cni/mesh-cni/internal/nethook/nethookpb"
	"github.com/mesh-cni/mesh-cni/pkg/gate"
	"github.com/mesh-cni/mesh-cni/pkg/gate/gatepb"
)

// DefaultIfname is the attachment's interface name when the previous result
// names no pod interface, and the interface listed first when it does.
const DefaultIfname = "eth0"

// The gate's bounds that the conversion applies itself, so a request the gate
// would refuse fails here with a message about the hook field it came from.
const (
	maxInterfaces = 16
)

// SetupToGate turns a SetupPodNetwork call into the gate Add that enrolls the
// pod.
//
//   - pod: pod_namespace, pod_name, pod_uid; labels and annotations copied,
//     fitted to the gate's bounds (gate.FitPodMetadata: an oversized entry
//     never refuses the pod).
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
	pod, _ := gate.FitPodMetadata(&gatepb.PodIdentity{
		Namespace:   req.GetPodNamespace(),
		Name:        req.GetPodName(),
		Uid:         req.GetPodUid(),
		Labels:      req.GetLabels(),
		Annotations: req.GetAnnotations(),
	})
	att := &gatepb.Attachment{ContainerId: req.GetSandboxId(), Ifname: DefaultIfname, Network: network}
	if req.GetNetnsPath() == "" {
		return nil, gate.Invalid("setup of sandbox %.80q carries no netns_path", req.GetSandboxId())
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
		gi, err := gate.NewInterface(ni.GetName(), ni.GetMacAddress(), ni.GetAddresses())
		if err != nil {
			return nil, err
		}
		name := gi.Name
		if prev, ok := byName[name]; ok {
			for _, a := range gi.Addresses {
				if !slices.Contains(prev.Addresses, a) {
					prev.Addresses = append(prev.Addresses, a)
				}
			}
			if len(prev.Addresses) > gate.MaxAddresses {
				return nil, gate.Invalid("interface %s has more than %d addresses", name, gate.MaxAddresses)
			}
			if prev.Mac == "" {
				prev.Mac = gi.Mac
			}
			continue
		}
		if len(out) == maxInterfaces {
			return nil, gate.Invalid("more than %d pod interfaces", maxInterfaces)
		}
		byName[name] = gi
		out = append(out, gi)
	}
	if i := slices.IndexFunc(out, func(gi *gatepb.Interface) bool { return gi.GetName() == DefaultIfname }); i > 0 {
		eth0 := out[i]
		out = slices.Insert(slices.Delete(out, i, i+1), 0, eth0)
	}
	return out, nil
}
