package agentcli

import (
	"errors"
	"fmt"
	"net/netip"
	"slices"
	"strconv"
	"strings"
)

// intList is a comma-separated list of integers.
type intList []int

func toIntList(ports []uint16) intList {
	out := make(intList, len(ports))
	for i, p := range ports {
		out[i] = int(p)
	}
	return out
}

func (l *intList) String() string {
	parts := make([]string, len(*l))
	for i, v := range *l {
		parts[i] = strconv.Itoa(v)
	}
	return strings.Join(parts, ",")
}

func (l *intList) Set(s string) error {
	var out intList
	for _, part := range splitList(s) {
		v, err := strconv.Atoi(part)
		if err != nil || v < 0 {
			return fmt.Errorf("%q is not a non-negative integer", part)
		}
		out = append(out, v)
	}
	*l = out
	return nil
}

// prefixList is a comma-separated list of CIDRs.
type prefixList []netip.Prefix

func (l *prefixList) String() string {
	parts := make([]string, len(*l))
	for i, p := range *l {
		parts[i] = p.String()
	}
	return strings.Join(parts, ",")
}

func (l *prefixList) Set(s string) error {
	var out prefixList
	for _, part := range splitList(s) {
		p, err := netip.ParsePrefix(part)
		if err != nil {
			return fmt.Errorf("%q is not a CIDR: %w", part, err)
		}
		out = append(out, p.Masked())
	}
	*l = out
	return nil
}

// stringList is a comma-separated list of strings.
type stringList []string

func (l *stringList) String() string { return strings.Join(*l, ",") }

func (l *stringList) Set(s string) error {
	out := splitList(s)
	for _, v := range out {
		if v == "" {
			return errors.New("empty element")
		}
	}
	*l = out
	return nil
}

func splitList(s string) []string {
	var out []string
	for _, part := range strings.Split(s, ",") {
		if part = strings.TrimSpace(part); part != "" {
			out = append(out, part)
		}
	}
	return out
}

// probeSourceList is --probe-sources: CIDRs, or "none". The word "node" (the
// node's addresses, once the default) is refused with the reason.
type probeSourceList struct {
	cidrs prefixList
}

func (l *probeSourceList) String() string {
	if c := l.cidrs.String(); c != "" {
		return c
	}
	return "none"
}

func (l *probeSourceList) Set(s string) error {
	var cidrs []string
	err := eachOrNone(s, "probe sources", func(part string) error {
		if part == "node" {
			return errors.New(`"node" is no longer a probe source: any traffic the node masquerades or forwards, and any pod that can send from a node address, would pass the inbound capture with it; the kubelet's probes are recognised by their socket instead (--probe-cgroups)`)
		}
		cidrs = append(cidrs, part)
		return nil
	})
	if err != nil {
		return err
	}
	var out probeSourceList
	if err := out.cidrs.Set(strings.Join(cidrs, ",")); err != nil {
		return err
	}
	*l = out
	return nil
}

// eachOrNone passes each item of list s to item, in order; the lone word
// "none" is the empty list, and refused among other items (what names them).
func eachOrNone(s, what string, item func(string) error) error {
	parts := splitList(s)
	if len(parts) == 1 && parts[0] == "none" {
		return nil
	}
	for _, part := range parts {
		if part == "none" {
			return fmt.Errorf(`"none" cannot be combined with other %s`, what)
		}
		if err := item(part); err != nil {
			return err
		}
	}
	return nil
}

// probeCgroupList is --probe-cgroups: "kubelet" (the kubelet's process, found by
// what a pod cannot fake: hostproc.KubeletFinder), cgroup paths, or "none".
type probeCgroupList struct {
	kubelet bool
	paths   []string
}

func (l *probeCgroupList) String() string {
	parts := slices.Clone(l.paths)
	if l.kubelet {
		parts = append([]string{"kubelet"}, parts...)
	}
	if len(parts) == 0 {
		return "none"
	}
	return strings.Join(parts, ",")
}

func (l *probeCgroupList) Set(s string) error {
	var out probeCgroupList
	err := eachOrNone(s, "probe cgroups", func(part string) error {
		switch {
		case part == "kubelet":
			out.kubelet = true
		case !strings.HasPrefix(part, "/"):
			return fmt.Errorf("probe cgroup %q: want kubelet or an absolute cgroup path", part)
		default:
			out.paths = append(out.paths, part)
		}
		return nil
	})
	if err != nil {
		return err
	}
	if out.kubelet && len(out.paths) > 0 {
		return errors.New(`"kubelet" cannot be combined with cgroup paths: it follows the kubelet's own cgroup`)
	}
	*l = out
	return nil
}
