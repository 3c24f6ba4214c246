package kni

import (
	"fmt"
	"maps"
	"regexp"
	"slices"

	"github.com/mesh-cni/mesh-cni/internal/kni/knipb"
	"github.com/mesh-cni/mesh-cni/pkg/gate"
	"github.com/mesh-cni/mesh-cni/pkg/gate/gatepb"
)

// Where the interposer finds what KNI does not carry in dedicated fields.
const (
	// DefaultIfname is the pod interface kubelet reads its IPs from, and the
	// attachment's interface name when the runtime reports none.
	DefaultIfname = "eth0"
	// ExtradataNetns is the extradata key some runtimes put the netns path in
	// (next to, or instead of, isolation.path).
	ExtradataNetns = "netns"
	// The sandbox labels kubelet sets on every pod sandbox; KNI requests carry the
	// sandbox's labels, so these name the pod even where the request does not.
	LabelPodUID       = "io.kubernetes.pod.uid"
	LabelPodName      = "io.kubernetes.pod.name"
	LabelPodNamespace = "io.kubernetes.pod.namespace"
)

// uidExtradataKeys are the extradata keys the pod uid is taken from, in order,
// before falling back to the LabelPodUID sandbox label. KNI has no uid field on
// attach; the uid is optional for the gate (it only ends up in records and logs).
var uidExtradataKeys = []string{"pod_uid", "uid"}

// The gate's bounds that the conversion applies itself, so a request the gate
// would refuse fails here with a message about the KNI field it came from.
const (
	maxInterfaces = 16
	maxUIDLen     = 128
)

var uidPattern = regexp.MustCompile(`^[A-Za-z0-9-]+$`)

// AttachToGate turns a successful attach (the request kubelet sent and the
// response the network runtime gave) into the gate Add that enrolls the pod.
//
//   - pod: name and namespace from the request, else from the sandbox labels
//     LabelPodName/LabelPodNamespace; uid from extradata "pod_uid" or "uid", else
//     the LabelPodUID label (a value that is not uid-shaped is ignored: the uid is
//     informational); labels and annotations copied, fitted to the gate's bounds
//     (gate.FitPodMetadata: an oversized entry never refuses the pod).
//   - attachment: container id = the request id (the sandbox id); ifname = the
//     first interface (see below), DefaultIfname when the runtime reported none;
//     network = the network argument.
//   - netns: isolation.path, else extradata["netns"] of the request, else of the
//     response. Without one the pod cannot be enrolled and the attach must fail.
//   - interfaces: the response's ipconfigs, DefaultIfname first, the others by
//     name; bare IPs become host prefixes (/32, /128) as the gate wants CIDR.
//
// An error wraps gate.ErrInvalidRequest and says which field is wrong.
func AttachToGate(req *knipb.AttachInterfaceRequest, resp *knipb.AttachInterfaceResponse, network string) (*gatepb.AddRequest, error) {
	pod, att, err := attachIdentity(req, network)
	if err != nil {
		return nil, err
	}
	netnsPath := netnsOf(req.GetIsolation(), req.GetExtradata())
	if netnsPath == "" {
		netnsPath = resp.GetExtradata()[ExtradataNetns]
	}
	if netnsPath == "" {
		return nil, gate.Invalid("attach of sandbox %.80q carries no network namespace (isolation.path and extradata[%q] are empty)", req.GetId(), ExtradataNetns)
	}
	ifs, err := interfacesOf(resp.GetIpconfigs())
	if err != nil {
		return nil, err
	}
	if len(ifs) > 0 {
		att.Ifname = ifs[0].GetName()
	}
	// The gate checks the netns further (that it is a network namespace) when
	// the Add arrives; here only its shape, so the conversion stays pure.
	if err := gate.ValidateDel(&gatepb.DelRequest{Pod: pod, Attachment: att, NetnsPath: netnsPath}); err != nil {
		return nil, err
	}
	return &gatepb.AddRequest{
		Pod:        pod,
		Attachment: att,
		NetnsPath:  netnsPath,
		Interfaces: ifs,
		Source:     gatepb.Source_SOURCE_KNI,
	}, nil
}

// DetachToGate turns a detach into the gate Del that releases the pod. The
// attachment's ifname is DefaultIfname: the interposer releases every interface
// the agent holds for the sandbox (see Server), so it is only a starting point.
// The pod identity carries no labels or annotations, which a release does not
// need and which could only make the gate refuse it.
func DetachToGate(req *knipb.DetachInterfaceRequest, network string) (*gatepb.DelRequest, error) {
	pod := &gatepb.PodIdentity{
		Namespace: firstNonEmpty(req.GetNamespace(), req.GetLabels()[LabelPodNamespace]),
		Name:      firstNonEmpty(req.GetName(), req.GetLabels()[LabelPodName]),
		Uid:       uidOf(req.GetExtradata(), req.GetLabels()),
	}
	del := &gatepb.DelRequest{
		Pod:        pod,
		Attachment: &gatepb.Attachment{ContainerId: req.GetId(), Ifname: DefaultIfname, Network: network},
		NetnsPath:  netnsOf(req.GetIsolation(), req.GetExtradata()),
		Source:     gatepb.Source_SOURCE_KNI,
	}
	if err := gate.ValidateDel(del); err != nil {
		// The pod is only named in the agent's logs; a release must not fail
		// because kubelet sent an odd name.
		del.Pod = nil
		if err := gate.ValidateDel(del); err != nil {
			return nil, err
		}
	}
	return del, nil
}

// attachIdentity is the part of the Add that the request alone determines, so
// the interposer can refuse a pod it could never enroll before the network
// runtime sets anything up.
func attachIdentity(req *knipb.AttachInterfaceRequest, network string) (*gatepb.PodIdentity, *gatepb.Attachment, error) {
	labels := req.GetLabels()
	pod, _ := gate.FitPodMetadata(&gatepb.PodIdentity{
		Namespace:   firstNonEmpty(req.GetNamespace(), labels[LabelPodNamespace]),
		Name:        firstNonEmpty(req.GetName(), labels[LabelPodName]),
		Uid:         uidOf(req.GetExtradata(), labels),
		Labels:      labels,
		Annotations: req.GetAnnotations(),
	})
	att := &gatepb.Attachment{ContainerId: req.GetId(), Ifname: DefaultIfname, Network: network}
	if err := gate.ValidateDel(&gatepb.DelRequest{Pod: pod, Attachment: att}); err != nil {
		return nil, nil, fmt.Errorf("attach of sandbox %.80q: %w", req.GetId(), err)
	}
	return pod, att, nil
}

func netnsOf(iso *knipb.Isolation, extradata map[string]string) string {
	if p := iso.GetPath(); p != "" {
		return p
	}
	return extradata[ExtradataNetns]
}

func uidOf(extradata, labels map[string]string) string {
	for _, k := range uidExtradataKeys {
		if u := extradata[k]; validUID(u) {
			return u
		}
	}
	if u := labels[LabelPodUID]; validUID(u) {
		return u
	}
	return ""
}

func validUID(u string) bool {
	return u != "" && len(u) <= maxUIDLen && uidPattern.MatchString(u)
}

// interfacesOf lists the runtime's interfaces, DefaultIfname first and the rest
// by name, so the attachment's ifname does not depend on map order.
func interfacesOf(ipconfigs map[string]*knipb.IPConfig) ([]*gatepb.Interface, error) {
	if len(ipconfigs) > maxInterfaces {
		return nil, gate.Invalid("the network runtime reported %d interfaces, more than the limit of %d", len(ipconfigs), maxInterfaces)
	}
	names := slices.Sorted(maps.Keys(ipconfigs))
	if i := slices.Index(names, DefaultIfname); i > 0 {
		names = slices.Insert(slices.Delete(names, i, i+1), 0, DefaultIfname)
	}
	out := make([]*gatepb.Interface, 0, len(names))
	for _, name := range names {
		gi, err := gate.NewInterface(name, ipconfigs[name].GetMac(), ipconfigs[name].GetIp())
		if err != nil {
			return nil, err
		}
		out = append(out, gi)
	}
	return out, nil
}

func firstNonEmpty(vals ...string) string {
	for _, v := range vals {
		if v != "" {
			return v
		}
	}
	return ""
}
