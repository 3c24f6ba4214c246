package redirect

import (
	"cmp"
	"encoding/binary"
	"errors"
	"fmt"
	"net/netip"
	"slices"
)

// Limits of one pod's lists. The lists live in maps shared by all pods, one copy per
// distinct list, so these limits only keep one list from filling them.
const (
	MaxExcludedPorts = 256
	MaxCIDRs         = 256
)

// MaxKubeletPorts is how many ports of one pod its probes and hooks may name
// (MAX_KUBELET_PORTS of bpf/lib/common.h): they live in the pod's own pod_net
// entry, which the data path scans for each of the kubelet's connections.
const MaxKubeletPorts = len(redirectPodNetInfo{}.KubeletPorts)

// Settings are one pod's redirection settings.
type Settings struct {
	// OutboundPort is the proxy's outbound listener inside the pod, reached on
	// 127.0.0.1 / [::1] (15001). InboundPort is its inbound listener, on the
	// wildcard or the pod address (15006).
	OutboundPort, InboundPort uint16
	// ProxyMark, when not 0, exempts sockets carrying this SO_MARK from
	// redirection: an opt-in for proxies that cannot be told apart by cgroup.
	// Setting SO_MARK needs only CAP_NET_RAW, which container runtimes grant by
	// default, so any pod can forge it. Only the bits in ProxyMarkMask are
	// compared; a zero mask means all bits.
	ProxyMark     uint32
	ProxyMarkMask uint32
	// ProxyUID, when set, exempts connects made by processes running as this uid
	// (in the initial user namespace): an opt-in like ProxyMark, for a proxy
	// whose uid no pod can run as.
	ProxyUID *uint32
	// InboundExcludedPorts are destination ports of inbound connections that are
	// never captured: the proxy's own ports (HBONE, health, metrics).
	InboundExcludedPorts []uint16
	// OutboundExcludedPorts are destination ports of outbound connects that are
	// never redirected, to any host.
	OutboundExcludedPorts []uint16
	// ExcludedCIDRs are outbound destinations never redirected.
	ExcludedCIDRs []netip.Prefix
	// ProbeSources are inbound sources never captured: an opt-in by address,
	// which anything able to use such an address (a masquerading node, a
	// spoofing pod) passes too. The kubelet's probes are recognised by their
	// socket instead (Datapath.SetProbeCgroups).
	ProbeSources []netip.Prefix
	// KubeletPortsOnly lets the kubelet's connections (Datapath.SetProbeCgroups)
	// pass the inbound capture only to KubeletPorts, the ports of the pod's own
	// probes and lifecycle hooks: a probe another pod's author aims at this pod
	// (its host field) reaches any other port through the proxy, like any
	// connection. Off, the kubelet reaches every port (a source that does not
	// know the pod's spec).
	KubeletPortsOnly bool
	KubeletPorts     []uint16
	// FailOpen passes traffic through unredirected while no proxy listens, instead
	// of refusing outbound connects and resetting inbound connections.
	FailOpen bool
	// ReplyMark, when not 0, is given (the bits under ReplyMarkMask) to the
	// proxy's sockets that connect to one of the pod's own addresses, and with
	// tcp_fwmark_accept to the application's side of those connections; a
	// policy route in the pod's namespace (fwmark ReplyMark -> table
	// ReplyTable, local 0/0 dev lo) then delivers the application's replies
	// back to the proxy on loopback. That is what a proxy connecting with the
	// client's address as source (IP_TRANSPARENT, as ztunnel does by default)
	// needs; Istio's in-pod rules use the same mark and table.
	ReplyMark     uint32
	ReplyMarkMask uint32
	// BypassInbound leaves the pod's inbound connections uncaptured (its
	// outbound ones are still redirected).
	BypassInbound bool
	// DNSCapture sends the pod's DNS (UDP datagrams and connects, and TCP
	// connects, to port 53 of any address) to the proxy's DNS listener on
	// loopback, DNSPort (15053). While nothing listens there, queries go to the
	// resolver as sent (a pod keeps name resolution while its proxy restarts),
	// unless DNSFailClosed.
	DNSCapture    bool
	DNSPort       uint16
	DNSFailClosed bool
	// DenyRawSockets refuses the pod raw IP sockets (socket() fails with
	// EPERM): with the CAP_NET_RAW runtimes grant by default, a raw socket
	// sends TCP without connect(), past the outbound capture. Packet sockets
	// are not covered: see DenyPacketSockets.
	DenyRawSockets bool
	// DenyPacketSockets refuses the pod packet (AF_PACKET) sockets, which send
	// any frame (a TCP handshake as another address, ARP answers for it). It
	// needs the BPF LSM on the node (Config.PacketSockets).
	DenyPacketSockets bool
	// Capture is what an in-pod sidecar's capture adds (Istio's sidecar mode).
	Capture Capture
}

// HBONEPort is ztunnel's in-pod HBONE listener, the one port of a pod's proxy
// that peers reach directly: inbound connections to it are never captured.
const HBONEPort = 15008

// DefaultSettings are ztunnel's in-pod conventions for ports. The proxy is told
// apart by its cgroup (Datapath.SetProxyCgroups); the mark and uid exemptions are
// off, as a pod can forge a mark with a default capability.
func DefaultSettings() Settings {
	return Settings{
		OutboundPort:         15001,
		InboundPort:          15006,
		InboundExcludedPorts: []uint16{HBONEPort},
		DNSPort:              15053,
		ReplyMark:            ReplyMark,
		ReplyMarkMask:        ReplyMarkMask,
	}
}

// ZtunnelMark is the SO_MARK ztunnel and Istio's sidecars set on their own sockets
// (0x539 under mask 0xfff), for Settings.ProxyMark when a proxy is to be known by
// it (an opt-in).
const (
	ZtunnelMark     = 0x539
	ZtunnelMarkMask = 0xfff
)

// ReplyMark, ReplyMarkMask and ReplyTable are Settings.ReplyMark's defaults and
// the routing table of the pod's reply route: istio-cni's values (its connmark
// 0x111 under 0xfff, table 100), so the two agree on what a mark means in a pod.
const (
	ReplyMark     = 0x111
	ReplyMarkMask = 0xfff
	ReplyTable    = 100
	// ReplyRulePriority is the priority of the pod's fwmark rule, before the
	// main table's (32766).
	ReplyRulePriority = 32764
)

// Validate reports what is wrong with s, all problems at once.
func (s Settings) Validate() error {
	var errs []error
	if s.OutboundPort == 0 {
		errs = append(errs, errors.New("outbound port is 0"))
	}
	if s.InboundPort == 0 {
		errs = append(errs, errors.New("inbound port is 0"))
	}
	if s.OutboundPort != 0 && s.OutboundPort == s.InboundPort {
		errs = append(errs, fmt.Errorf("outbound and inbound port are both %d", s.OutboundPort))
	}
	if s.DNSCapture && s.DNSPort == 0 {
		errs = append(errs, errors.New("DNS capture with DNS port 0"))
	}
	if s.DNSFailClosed && !s.DNSCapture {
		errs = append(errs, errors.New("DNS fail-closed without DNS capture"))
	}
	if s.ProxyMark&^s.markMask() != 0 {
		errs = append(errs, fmt.Errorf("proxy mark %#x has bits outside mask %#x", s.ProxyMark, s.ProxyMarkMask))
	}
	if s.ReplyMark != 0 && s.ReplyMark&^s.replyMask() != 0 {
		errs = append(errs, fmt.Errorf("reply mark %#x has bits outside mask %#x", s.ReplyMark, s.ReplyMarkMask))
	}
	errs = append(errs, validatePortList("inbound excluded", s.InboundExcludedPorts)...)
	errs = append(errs, validatePortList("outbound excluded", s.OutboundExcludedPorts)...)
	if len(s.KubeletPorts) > 0 && !s.KubeletPortsOnly {
		errs = append(errs, errors.New("kubelet ports without KubeletPortsOnly"))
	}
	if slices.Contains(s.KubeletPorts, 0) {
		errs = append(errs, errors.New("kubelet port 0"))
	}
	if n := len(normalizePorts(s.KubeletPorts)); n > MaxKubeletPorts {
		errs = append(errs, fmt.Errorf("%d ports named by the pod's probes and hooks, at most %d", n, MaxKubeletPorts))
	}
	errs = append(errs, validatePrefixes("excluded CIDR", s.ExcludedCIDRs)...)
	errs = append(errs, validatePrefixes("probe source", s.ProbeSources)...)
	errs = append(errs, s.Capture.validate()...)
	if err := errors.Join(errs...); err != nil {
		return fmt.Errorf("invalid redirect settings: %w", err)
	}
	return nil
}

func validatePortList(what string, ports []uint16) []error {
	var errs []error
	if slices.Contains(ports, 0) {
		errs = append(errs, fmt.Errorf("%s port 0", what))
	}
	if n := len(normalizePorts(ports)); n > MaxExcludedPorts {
		errs = append(errs, fmt.Errorf("%d %s ports, at most %d", n, what, MaxExcludedPorts))
	}
	return errs
}

func validatePrefixes(what string, ps []netip.Prefix) []error {
	var errs []error
	for _, p := range ps {
		if !p.IsValid() {
			errs = append(errs, fmt.Errorf("invalid %s %q", what, p))
		}
	}
	if n := len(normalizePrefixes(ps)); n > MaxCIDRs {
		errs = append(errs, fmt.Errorf("%d %ss, at most %d", n, what, MaxCIDRs))
	}
	return errs
}

func (s Settings) markMask() uint32 {
	if s.ProxyMarkMask == 0 {
		return ^uint32(0)
	}
	return s.ProxyMarkMask
}

func (s Settings) replyMask() uint32 {
	if s.ReplyMarkMask == 0 {
		return ^uint32(0)
	}
	return s.ReplyMarkMask
}

// normalized returns s in the canonical form the data path stores and List returns:
// ports and prefixes sorted and deduplicated, prefixes masked, IPv4-mapped prefixes
// as IPv4, empty lists nil.
func (s Settings) normalized() Settings {
	n := s
	if n.ProxyMark == 0 {
		n.ProxyMarkMask = 0
	} else {
		n.ProxyMarkMask = s.markMask()
	}
	if s.ProxyUID != nil {
		uid := *s.ProxyUID
		n.ProxyUID = &uid
	}
	if n.ReplyMark == 0 {
		n.ReplyMarkMask = 0
	} else {
		n.ReplyMarkMask = s.replyMask()
	}
	n.InboundExcludedPorts = normalizePorts(s.InboundExcludedPorts)
	n.OutboundExcludedPorts = normalizePorts(s.OutboundExcludedPorts)
	n.ExcludedCIDRs = normalizePrefixes(s.ExcludedCIDRs)
	n.ProbeSources = normalizePrefixes(s.ProbeSources)
	n.KubeletPorts = normalizePorts(s.KubeletPorts)
	n.Capture = s.Capture.normalized()
	return n
}

func normalizePorts(ports []uint16) []uint16 {
	if len(ports) == 0 {
		return nil
	}
	out := slices.Clone(ports)
	slices.Sort(out)
	return slices.Compact(out)
}

func normalizePrefixes(ps []netip.Prefix) []netip.Prefix {
	if len(ps) == 0 {
		return nil
	}
	out := make([]netip.Prefix, 0, len(ps))
	for _, p := range ps {
		if !p.IsValid() {
			continue
		}
		if a := p.Addr(); a.Is4In6() && p.Bits() >= 96 {
			p = netip.PrefixFrom(a.Unmap(), p.Bits()-96)
		}
		out = append(out, p.Masked())
	}
	slices.SortFunc(out, func(a, b netip.Prefix) int {
		if c := a.Addr().Compare(b.Addr()); c != 0 {
			return c
		}
		return cmp.Compare(a.Bits(), b.Bits())
	})
	return slices.Compact(out)
}

// toBPF converts normalized settings to the pods value; ps names the pod's lists
// in the set maps (0: none). The reply mark's value goes into pod_net
// (podAddrs.toBPF), its flag here.
func (s Settings) toBPF(ps podSets) redirectPodSettings {
	v := redirectPodSettings{
		OutboundPort:    s.OutboundPort,
		InboundPort:     s.InboundPort,
		ProxyMark:       s.ProxyMark,
		ProxyMarkMask:   s.ProxyMarkMask,
		ExcludedSet:     ps.excluded,
		ProbeSet:        ps.probes,
		InboundPortSet:  ps.inPorts,
		OutboundPortSet: ps.outPorts,
		DnsPort:         s.DNSPort,
	}
	setFlag(&v.Flags, s.ProxyMark != 0, redirectSettingFlagsSETTING_PROXY_MARK)
	setFlag(&v.Flags, s.FailOpen, redirectSettingFlagsSETTING_FAIL_OPEN)
	setFlag(&v.Flags, ps.excluded != 0, redirectSettingFlagsSETTING_EXCLUDED_CIDRS)
	setFlag(&v.Flags, ps.probes != 0, redirectSettingFlagsSETTING_PROBE_SOURCES)
	setFlag(&v.Flags, ps.inPorts != 0, redirectSettingFlagsSETTING_INBOUND_PORTS)
	setFlag(&v.Flags, ps.outPorts != 0, redirectSettingFlagsSETTING_OUTBOUND_PORTS)
	setFlag(&v.Flags, s.DNSCapture, redirectSettingFlagsSETTING_DNS_CAPTURE)
	setFlag(&v.Flags, s.DNSFailClosed, redirectSettingFlagsSETTING_DNS_FAIL_CLOSED)
	setFlag(&v.Flags, s.DenyRawSockets, redirectSettingFlagsSETTING_DENY_RAW)
	setFlag(&v.Flags, s.DenyPacketSockets, redirectSettingFlagsSETTING_DENY_PACKET)
	setFlag(&v.Flags, s.ReplyMark != 0, redirectSettingFlagsSETTING_REPLY_MARK)
	setFlag(&v.Flags, s.BypassInbound, redirectSettingFlagsSETTING_BYPASS_INBOUND)
	setFlag(&v.Flags, s.KubeletPortsOnly, redirectSettingFlagsSETTING_KUBELET_PORTS)
	setFlag(&v.Flags, !s.Capture.IsZero(), redirectSettingFlagsSETTING_CAPTURE)
	if s.ProxyUID != nil {
		v.ProxyUid = *s.ProxyUID
		v.Flags |= redirectSettingFlagsSETTING_PROXY_UID
	}
	return v
}

// settingsFromBPF is the inverse of toBPF; the lists come from the set maps, the
// reply mark and the kubelet's ports from the pod's pod_net entry (nil: none).
func settingsFromBPF(v redirectPodSettings, n *redirectPodNetInfo, excluded, probes []netip.Prefix, inPorts, outPorts []uint16) Settings {
	s := Settings{
		OutboundPort:          v.OutboundPort,
		InboundPort:           v.InboundPort,
		FailOpen:              v.Flags&redirectSettingFlagsSETTING_FAIL_OPEN != 0,
		InboundExcludedPorts:  normalizePorts(inPorts),
		OutboundExcludedPorts: normalizePorts(outPorts),
		ExcludedCIDRs:         normalizePrefixes(excluded),
		ProbeSources:          normalizePrefixes(probes),
		DNSCapture:            v.Flags&redirectSettingFlagsSETTING_DNS_CAPTURE != 0,
		DNSPort:               v.DnsPort,
		DNSFailClosed:         v.Flags&redirectSettingFlagsSETTING_DNS_FAIL_CLOSED != 0,
		DenyRawSockets:        v.Flags&redirectSettingFlagsSETTING_DENY_RAW != 0,
		DenyPacketSockets:     v.Flags&redirectSettingFlagsSETTING_DENY_PACKET != 0,
		BypassInbound:         v.Flags&redirectSettingFlagsSETTING_BYPASS_INBOUND != 0,
		KubeletPortsOnly:      v.Flags&redirectSettingFlagsSETTING_KUBELET_PORTS != 0,
	}
	if s.KubeletPortsOnly && n != nil {
		s.KubeletPorts = normalizePorts(portsFromBPF(n.KubeletPorts[:], n.NrKubeletPorts))
	}
	if v.Flags&redirectSettingFlagsSETTING_PROXY_MARK != 0 {
		s.ProxyMark, s.ProxyMarkMask = v.ProxyMark, v.ProxyMarkMask
	}
	if v.Flags&redirectSettingFlagsSETTING_REPLY_MARK != 0 && n != nil {
		s.ReplyMark, s.ReplyMarkMask = n.ReplyMark, n.ReplyMarkMask
	}
	if v.Flags&redirectSettingFlagsSETTING_PROXY_UID != 0 {
		uid := v.ProxyUid
		s.ProxyUID = &uid
	}
	return s
}

// setFlag sets f in flags when on.
func setFlag[F ~uint32](flags *F, on bool, f F) {
	if on {
		*flags |= f
	}
}

func portsFromBPF(ports []uint16, n uint32) []uint16 {
	if k := min(int(n), len(ports)); k > 0 {
		return slices.Clone(ports[:k])
	}
	return nil
}

// Prefix lengths in the tries: the set id (32 bits) is always covered, then the
// address as IPv6, IPv4 as IPv4-mapped (96 bits of ::ffff:0:0/96 before it).
const (
	lpmSetBits  = 32
	lpmV4Offset = 96
)

func lpmKey(set uint32, p netip.Prefix) redirectLpmKey {
	bits := p.Bits()
	a := p.Addr()
	if a.Is4() {
		bits += lpmV4Offset
		a = netip.AddrFrom16(a.As16())
	}
	return redirectLpmKey{
		Prefixlen: uint32(lpmSetBits + bits),
		Set:       set,
		Addr:      addrWords(a.As16()),
	}
}

// prefixFromLPM is the inverse of lpmKey. ok is false for keys no lpmKey makes.
func prefixFromLPM(k redirectLpmKey) (set uint32, p netip.Prefix, ok bool) {
	bits := int(k.Prefixlen) - lpmSetBits
	if bits < 0 || bits > 128 {
		return 0, netip.Prefix{}, false
	}
	a := netip.AddrFrom16(wordsAddr(k.Addr))
	if a.Is4In6() && bits >= lpmV4Offset {
		return k.Set, netip.PrefixFrom(a.Unmap(), bits-lpmV4Offset), true
	}
	return k.Set, netip.PrefixFrom(a, bits), true
}

// The BPF side keeps addresses as __u32[4] in network byte order: the bytes in
// memory are the address bytes, which on this (little-endian) host read as
// native-endian words.
func addrWords(b [16]byte) [4]uint32 {
	var w [4]uint32
	for i := range w {
		w[i] = binary.NativeEndian.Uint32(b[i*4:])
	}
	return w
}

func wordsAddr(w [4]uint32) [16]byte {
	var b [16]byte
	for i, v := range w {
		binary.NativeEndian.PutUint32(b[i*4:], v)
	}
	return b
}
