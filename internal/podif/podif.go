// Package podif reads the interfaces of the calling thread's network namespace
// (run it inside a pod's with netns.Do): loopback left out, in index order, each
// with its addresses. Dumps go through netlinksafe, which retries a dump the
// kernel interrupted because an address or link changed meanwhile.
package podif

import (
	"fmt"
	"net"
	"net/netip"
	"slices"

	"github.com/containernetworking/plugins/pkg/netlinksafe"
	"github.com/vishvananda/netlink"
)

// Interface is one interface of the namespace.
type Interface struct {
	Name  string
	Index int
	MAC   net.HardwareAddr
	// Addrs are the interface's addresses with their prefix length, IPv4
	// ones unmapped.
	Addrs []netip.Prefix
}

// List returns the namespace's interfaces but loopback.
func List() ([]Interface, error) {
	links, err := netlinksafe.LinkList()
	if err != nil {
		return nil, fmt.Errorf("list interfaces: %w", err)
	}
	slices.SortFunc(links, func(x, y netlink.Link) int { return x.Attrs().Index - y.Attrs().Index })
	var out []Interface
	for _, l := range links {
		a := l.Attrs()
		if a.Flags&net.FlagLoopback != 0 {
			continue
		}
		addrs, err := netlinksafe.AddrList(l, netlink.FAMILY_ALL)
		if err != nil {
			return nil, fmt.Errorf("list the addresses of %s: %w", a.Name, err)
		}
		i := Interface{Name: a.Name, Index: a.Index, MAC: a.HardwareAddr}
		for _, ad := range addrs {
			ip, ok := netip.AddrFromSlice(ad.IP)
			if !ok || ad.IPNet == nil {
				continue
			}
			bits, _ := ad.IPNet.Mask.Size()
			ip = ip.Unmap()
			if ip.Is4() && bits > 32 {
				bits -= 96
			}
			i.Addrs = append(i.Addrs, netip.PrefixFrom(ip, bits))
		}
		out = append(out, i)
	}
	return out, nil
}
