package gate

import (
	"errors"
	"fmt"
	"net"
	"net/netip"
	"path/filepath"
	"regexp"

	"github.com/mesh-cni/mesh-cni/internal/netns"
	"github.com/mesh-cni/mesh-cni/pkg/gate/gatepb"
)

// Bounds on request fields. Every string a caller sends ends up in logs, state
// records and file names, so each is bounded and restricted to the characters its
// kind allows.
const (
	maxNamespaceLen   = 63
	maxPodNameLen     = 253
	maxUIDLen         = 128
	maxContainerIDLen = 128
	maxNetworkLen     = 128
	maxIfnameLen      = 15
	maxPathLen        = 4096
	maxInterfaces     = 16
	maxAddresses      = 32
	maxMetadata       = 256
	maxMetaKeyLen     = 317
	maxMetaValueLen   = 4096
	maxAttachments    = 65536
)

var (
	dnsLabel     = regexp.MustCompile(`^[a-z0-9]([-a-z0-9]*[a-z0-9])?$`)
	dnsSubdomain = regexp.MustCompile(`^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$`)
	uidPattern   = regexp.MustCompile(`^[A-Za-z0-9-]+$`)
	// The CNI spec restricts container ids and network names to these characters.
	cniIdentifier = regexp.MustCompile(`^[A-Za-z0-9][A-Za-z0-9_.\-]*$`)
)

// ErrInvalidRequest is the cause of every validation failure.
var ErrInvalidRequest = errors.New("invalid gate request")

// Invalid returns an error wrapping ErrInvalidRequest.
func Invalid(format string, args ...any) error {
	return fmt.Errorf("%w: %s", ErrInvalidRequest, fmt.Sprintf(format, args...))
}

// ValidateAdd checks an Add request completely, including that the netns path is a
// network namespace on this host.
func ValidateAdd(req *gatepb.AddRequest) error {
	return validatePodRequest(req.GetPod(), req.GetAttachment(), req.GetNetnsPath(), req.GetInterfaces(), true)
}

// ValidateAddFields is ValidateAdd without opening the namespace: for a server
// that opens it once itself (netns.OpenHandle) and uses that descriptor for the
// whole request, so the path is read once and cannot be swapped in between.
func ValidateAddFields(req *gatepb.AddRequest) error {
	return validatePodRequest(req.GetPod(), req.GetAttachment(), req.GetNetnsPath(), req.GetInterfaces(), false)
}

// ValidateDel checks a Del request. The netns may already be gone, so only the
// shape of its path is checked.
func ValidateDel(req *gatepb.DelRequest) error {
	if err := validateAttachment(req.GetAttachment()); err != nil {
		return err
	}
	if req.GetPod() != nil {
		if err := validatePod(req.GetPod()); err != nil {
			return err
		}
	}
	if req.GetNetnsPath() == "" {
		return nil
	}
	return validateNetnsPath(req.GetNetnsPath(), false)
}

// ValidateCheck checks a Check request.
func ValidateCheck(req *gatepb.CheckRequest) error {
	return validatePodRequest(req.GetPod(), req.GetAttachment(), req.GetNetnsPath(), req.GetInterfaces(), true)
}

// validatePodRequest checks what Add and Check both carry: the pod, its
// attachment, a netns path (with open, one that is a network namespace on this
// host), and the interfaces.
func validatePodRequest(pod *gatepb.PodIdentity, att *gatepb.Attachment, netnsPath string, ifs []*gatepb.Interface, open bool) error {
	if err := validatePod(pod); err != nil {
		return err
	}
	if err := validateAttachment(att); err != nil {
		return err
	}
	if err := validateNetnsPath(netnsPath, open); err != nil {
		return err
	}
	return validateInterfaces(ifs)
}

// ValidateGC checks a GC request.
func ValidateGC(req *gatepb.GCRequest) error {
	if err := validateNetwork(req.GetNetwork()); err != nil {
		return err
	}
	if n := len(req.GetValid()); n > maxAttachments {
		return Invalid("%d valid attachments, more than the limit of %d", n, maxAttachments)
	}
	for i, a := range req.GetValid() {
		if err := validateContainerID(a.GetContainerId()); err != nil {
			return fmt.Errorf("valid attachment %d: %w", i, err)
		}
		if err := ValidateIfname(a.GetIfname()); err != nil {
			return fmt.Errorf("valid attachment %d: %w", i, err)
		}
	}
	return nil
}

func validatePod(p *gatepb.PodIdentity) error {
	if p == nil {
		return Invalid("pod identity is missing")
	}
	ns, name := p.GetNamespace(), p.GetName()
	if len(ns) == 0 || len(ns) > maxNamespaceLen || !dnsLabel.MatchString(ns) {
		return Invalid("pod namespace %.80q is not a DNS-1123 label of at most %d characters", ns, maxNamespaceLen)
	}
	if len(name) == 0 || len(name) > maxPodNameLen || !dnsSubdomain.MatchString(name) {
		return Invalid("pod name %.80q is not a DNS-1123 subdomain of at most %d characters", name, maxPodNameLen)
	}
	if uid := p.GetUid(); uid != "" && (len(uid) > maxUIDLen || !uidPattern.MatchString(uid)) {
		return Invalid("pod uid %.80q is not a uid of at most %d characters", uid, maxUIDLen)
	}
	if err := validateMetadata("label", p.GetLabels()); err != nil {
		return err
	}
	return validateMetadata("annotation", p.GetAnnotations())
}

func validateMetadata(kind string, m map[string]string) error {
	if len(m) > maxMetadata {
		return Invalid("%d pod %ss, more than the limit of %d", len(m), kind, maxMetadata)
	}
	for k, v := range m {
		if k == "" || len(k) > maxMetaKeyLen {
			return Invalid("pod %s key %.80q is empty or longer than %d", kind, k, maxMetaKeyLen)
		}
		if len(v) > maxMetaValueLen {
			return Invalid("pod %s %.80q has a value longer than %d", kind, k, maxMetaValueLen)
		}
	}
	return nil
}

func validateAttachment(a *gatepb.Attachment) error {
	if a == nil {
		return Invalid("attachment (container id, ifname, network) is missing")
	}
	if err := validateContainerID(a.GetContainerId()); err != nil {
		return err
	}
	if err := ValidateIfname(a.GetIfname()); err != nil {
		return err
	}
	return validateNetwork(a.GetNetwork())
}

func validateContainerID(id string) error {
	if len(id) == 0 || len(id) > maxContainerIDLen || !cniIdentifier.MatchString(id) {
		return Invalid("container id %.80q must be 1-%d characters of A-Z a-z 0-9 _ . -", id, maxContainerIDLen)
	}
	return nil
}

func validateNetwork(name string) error {
	if len(name) == 0 || len(name) > maxNetworkLen || !cniIdentifier.MatchString(name) {
		return Invalid("network name %.80q must be 1-%d characters of A-Z a-z 0-9 _ . -", name, maxNetworkLen)
	}
	return nil
}

// MaxAddresses is the limit of addresses per interface in a request.
const MaxAddresses = maxAddresses

// ToPrefixes turns addresses as network runtimes and plugins report them, bare
// ("10.1.0.5") or in CIDR notation ("10.1.0.5/24"), into the CIDR notation the
// gate takes. A bare address becomes a host prefix; zones are dropped.
func ToPrefixes(ips []string) ([]string, error) {
	if len(ips) > maxAddresses {
		return nil, Invalid("%d addresses, more than the limit of %d", len(ips), maxAddresses)
	}
	out := make([]string, 0, len(ips))
	for _, s := range ips {
		if p, err := netip.ParsePrefix(s); err == nil {
			out = append(out, p.String())
			continue
		}
		a, err := netip.ParseAddr(s)
		if err != nil {
			return nil, Invalid("address %.60q is neither an IP address nor in CIDR notation", s)
		}
		a = a.WithZone("")
		out = append(out, netip.PrefixFrom(a, a.BitLen()).String())
	}
	return out, nil
}

// NewInterface is a pod interface as a runtime reports it (its MAC may be
// unknown, its addresses bare or in CIDR notation), checked, in the gate's
// form.
func NewInterface(name, mac string, ips []string) (*gatepb.Interface, error) {
	if err := ValidateIfname(name); err != nil {
		return nil, err
	}
	if err := validateMAC(name, mac); err != nil {
		return nil, err
	}
	addrs, err := ToPrefixes(ips)
	if err != nil {
		return nil, fmt.Errorf("interface %s: %w", name, err)
	}
	return &gatepb.Interface{Name: name, Mac: mac, Addresses: addrs}, nil
}

// validateMAC checks interface ifname's MAC, if it has one.
func validateMAC(ifname, mac string) error {
	if mac == "" {
		return nil
	}
	if _, err := net.ParseMAC(mac); err != nil {
		return Invalid("interface %s: MAC %.40q: %v", ifname, mac, err)
	}
	return nil
}

// ValidateIfname applies the kernel's rules for interface names.
func ValidateIfname(name string) error {
	if len(name) == 0 || len(name) > maxIfnameLen || name == "." || name == ".." {
		return Invalid("interface name %.80q must be 1-%d characters and not . or ..", name, maxIfnameLen)
	}
	for _, r := range name {
		if r == '/' || r == ':' || r <= ' ' || r == 0x7f {
			return Invalid("interface name %.80q contains %q", name, r)
		}
	}
	return nil
}

func validateNetnsPath(path string, mustExist bool) error {
	if path == "" {
		return Invalid("netns path is missing")
	}
	if len(path) > maxPathLen || !filepath.IsAbs(path) || filepath.Clean(path) != path {
		return Invalid("netns path %.120q must be an absolute, clean path", path)
	}
	if !mustExist {
		return nil
	}
	if err := netns.Validate(path); err != nil {
		return fmt.Errorf("%w: %w", ErrInvalidRequest, err)
	}
	return nil
}

func validateInterfaces(ifs []*gatepb.Interface) error {
	if len(ifs) > maxInterfaces {
		return Invalid("%d interfaces, more than the limit of %d", len(ifs), maxInterfaces)
	}
	for _, i := range ifs {
		if err := ValidateIfname(i.GetName()); err != nil {
			return err
		}
		if err := validateMAC(i.GetName(), i.GetMac()); err != nil {
			return err
		}
		if len(i.GetAddresses()) > maxAddresses {
			return Invalid("interface %s has %d addresses, more than the limit of %d", i.GetName(), len(i.GetAddresses()), maxAddresses)
		}
		for _, a := range i.GetAddresses() {
			if _, err := netip.ParsePrefix(a); err != nil {
				return Invalid("interface %s: address %.60q is not in CIDR notation: %v", i.GetName(), a, err)
			}
		}
	}
	return nil
}
