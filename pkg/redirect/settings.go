package redirect

import (
	"cmp"
	"encoding/binary"
	"errors"
	"fmt"
	"net/netip"
	"slices"
)

// Limits of one pod's settings. MaxExcludedPorts is the size of the array in the BPF
// settings value (bpf/redirect.c MAX_EXCLUDED_PORTS); the CIDR lists live in LPM
// tries shared by all pods, so their limit only keeps one pod from filling them.
const (
	MaxExcludedPorts = len(redirectPodSettings{}.ExcludedPorts)
	MaxCIDRs         = 256
)

// Settings are one pod's redirection settings.
type Settings struct {
	// OutboundPort is the proxy's outbound listener inside the pod, reached on
	// 127.0.0.1 / [::1] (15001). InboundPort is its inbound listener, on the
	// wildcard or the pod address (15006).
	OutboundPort, InboundPort uint16
	// ProxyMark marks the proxy's own sockets (SO_MARK): they are never redirected.
	// 0 turns the mark check off. Only the bits in ProxyMarkMask are compared;
	// a zero mask means all bits.
	ProxyMark     uint32
	ProxyMarkMask uint32
	// ProxyUID, when set, exempts connects made by processes running as this uid
	// (in the initial user namespace).
	ProxyUID *uint32
	// ExcludedPorts are never redirected, in either direction (destination port).
	ExcludedPorts []uint16
	// ExcludedCIDRs are outbound destinations never redirected.
	ExcludedCIDRs []netip.Prefix
	// ProbeSources are inbound sources never redirected (the node's addresses, so
	// kubelet probes reach the application).
	ProbeSources []netip.Prefix
	// FailOpen passes traffic through unredirected while no proxy listens, instead
	// of refusing outbound connects and dropping inbound SYNs.
	FailOpen bool
}

// DefaultSettings are ztunnel's in-pod conventions.
func DefaultSettings() Settings {
	return Settings{
		OutboundPort:  15001,
		InboundPort:   15006,
		ProxyMark:     0x539,
		ProxyMarkMask: 0xfff,
		ExcludedPorts: []uint16{15001, 15006, 15008, 15020, 15021, 15053, 15090},
	}
}

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
	if s.ProxyMark&^s.markMask() != 0 {
		errs = append(errs, fmt.Errorf("proxy mark %#x has bits outside mask %#x", s.ProxyMark, s.ProxyMarkMask))
	}
	if slices.Contains(s.ExcludedPorts, 0) {
		errs = append(errs, errors.New("excluded port 0"))
	}
	if n := len(normalizePorts(s.ExcludedPorts)); n > MaxExcludedPorts {
		errs = append(errs, fmt.Errorf("%d excluded ports, at most %d", n, MaxExcludedPorts))
	}
	errs = append(errs, validatePrefixes("excluded CIDR", s.ExcludedCIDRs)...)
	errs = append(errs, validatePrefixes("probe source", s.ProbeSources)...)
	if err := errors.Join(errs...); err != nil {
		return fmt.Errorf("invalid redirect settings: %w", err)
	}
	return nil
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
	n.ExcludedPorts = normalizePorts(s.ExcludedPorts)
	n.ExcludedCIDRs = normalizePrefixes(s.ExcludedCIDRs)
	n.ProbeSources = normalizePrefixes(s.ProbeSources)
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

// toBPF converts normalized settings to the map value.
func (s Settings) toBPF() redirectPodSettings {
	v := redirectPodSettings{
		OutboundPort:    s.OutboundPort,
		InboundPort:     s.InboundPort,
		ProxyMark:       s.ProxyMark,
		ProxyMarkMask:   s.ProxyMarkMask,
		NrExcludedPorts: uint32(len(s.ExcludedPorts)),
	}
	copy(v.ExcludedPorts[:], s.ExcludedPorts)
	if s.ProxyUID != nil {
		v.ProxyUid = *s.ProxyUID
		v.Flags |= redirectSettingFlagsSETTING_PROXY_UID
	}
	if s.FailOpen {
		v.Flags |= redirectSettingFlagsSETTING_FAIL_OPEN
	}
	if len(s.ExcludedCIDRs) > 0 {
		v.Flags |= redirectSettingFlagsSETTING_EXCLUDED_CIDRS
	}
	if len(s.ProbeSources) > 0 {
		v.Flags |= redirectSettingFlagsSETTING_PROBE_SOURCES
	}
	return v
}

// settingsFromBPF is the inverse of toBPF; the CIDR lists come from the tries.
func settingsFromBPF(v redirectPodSettings, excluded, probes []netip.Prefix) Settings {
	s := Settings{
		OutboundPort:  v.OutboundPort,
		InboundPort:   v.InboundPort,
		ProxyMark:     v.ProxyMark,
		ProxyMarkMask: v.ProxyMarkMask,
		FailOpen:      v.Flags&redirectSettingFlagsSETTING_FAIL_OPEN != 0,
		ExcludedCIDRs: normalizePrefixes(excluded),
		ProbeSources:  normalizePrefixes(probes),
	}
	if v.Flags&redirectSettingFlagsSETTING_PROXY_UID != 0 {
		uid := v.ProxyUid
		s.ProxyUID = &uid
	}
	n := min(int(v.NrExcludedPorts), len(v.ExcludedPorts))
	if n > 0 {
		s.ExcludedPorts = slices.Clone(v.ExcludedPorts[:n])
	}
	return s
}

// Prefix lengths in the tries: the cookie (64 bits) is always covered, then the
// address as IPv6, IPv4 as IPv4-mapped (96 bits of ::ffff:0:0/96 before it).
const (
	lpmCookieBits = 64
	lpmV4Offset   = 96
)

func lpmKey(cookie uint64, p netip.Prefix) redirectLpmKey {
	bits := p.Bits()
	a := p.Addr()
	if a.Is4() {
		bits += lpmV4Offset
		a = netip.AddrFrom16(a.As16())
	}
	return redirectLpmKey{
		Prefixlen: uint32(lpmCookieBits + bits),
		Cookie:    cookieWords(cookie),
		Addr:      addrWords(a.As16()),
	}
}

// prefixFromLPM is the inverse of lpmKey. ok is false for keys no lpmKey makes.
func prefixFromLPM(k redirectLpmKey) (cookie uint64, p netip.Prefix, ok bool) {
	bits := int(k.Prefixlen) - lpmCookieBits
	if bits < 0 || bits > 128 {
		return 0, netip.Prefix{}, false
	}
	a := netip.AddrFrom16(wordsAddr(k.Addr))
	if a.Is4In6() && bits >= lpmV4Offset {
		return wordsCookie(k.Cookie), netip.PrefixFrom(a.Unmap(), bits-lpmV4Offset), true
	}
	return wordsCookie(k.Cookie), netip.PrefixFrom(a, bits), true
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

func cookieWords(c uint64) [2]uint32 { return [2]uint32{uint32(c), uint32(c >> 32)} }

func wordsCookie(w [2]uint32) uint64 { return uint64(w[0]) | uint64(w[1])<<32 }
