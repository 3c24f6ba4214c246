package agentcli

import (
	"errors"
	"fmt"
	"net/netip"
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

// probeSourceList is --probe-sources: CIDRs, and the word "node" for the node's own
// addresses (kept current); "none" alone for no probe sources at all.
type probeSourceList struct {
	node  bool
	cidrs prefixList
}

func (l *probeSourceList) String() string {
	var parts []string
	if l.node {
		parts = append(parts, "node")
	}
	if c := l.cidrs.String(); c != "" {
		parts = append(parts, c)
	}
	if len(parts) == 0 {
		return "none"
	}
	return strings.Join(parts, ",")
}

func (l *probeSourceList) Set(s string) error {
	var out probeSourceList
	parts := splitList(s)
	if len(parts) == 1 && parts[0] == "none" {
		*l = out
		return nil
	}
	var cidrs []string
	for _, part := range parts {
		switch part {
		case "node":
			out.node = true
		case "none":
			return errors.New(`"none" cannot be combined with other probe sources`)
		default:
			cidrs = append(cidrs, part)
		}
	}
	if err := out.cidrs.Set(strings.Join(cidrs, ",")); err != nil {
		return err
	}
	*l = out
	return nil
}
