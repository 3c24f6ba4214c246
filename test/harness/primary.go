package harness

import (
	"errors"
	"fmt"
	"os"
	"testing"

	"github.com/containernetworking/plugins/pkg/netlinksafe"
	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"

	"github.com/mesh-cni/mesh-cni/test/fixtures"
)

// Primary is the kind of primary network a node gives its pods: the plugin that
// makes a pod's interface and addresses ahead of anything chained after it.
type Primary string

// The primaries the harness can set up, each with host-local IPAM over the node's
// ranges.
const (
	// PrimaryBridge: a veth per pod on the node's bridge, the bridge as gateway.
	PrimaryBridge Primary = "bridge"
	// PrimaryPTP: a routed veth per pod, no bridge; the node routes between pods.
	PrimaryPTP Primary = "ptp"
	// PrimaryIPVLANL2 and PrimaryIPVLANL3: an ipvlan device per pod on the node's
	// parent interface, in L2 (ARP/ND between pods) or L3 (routed, no ARP) mode.
	PrimaryIPVLANL2 Primary = "ipvlan-l2"
	PrimaryIPVLANL3 Primary = "ipvlan-l3"
	// PrimaryMACVLAN: a macvlan device per pod on the node's parent interface,
	// bridge mode (pods on one parent reach each other).
	PrimaryMACVLAN Primary = "macvlan"
)

// Primaries lists every primary the harness supports, in a stable order.
func Primaries() []Primary {
	return []Primary{PrimaryBridge, PrimaryPTP, PrimaryIPVLANL2, PrimaryIPVLANL3, PrimaryMACVLAN}
}

// Plugin is the CNI plugin (binary name) that implements the primary.
func (p Primary) Plugin() string {
	switch p {
	case PrimaryIPVLANL2, PrimaryIPVLANL3:
		return "ipvlan"
	default:
		return string(p)
	}
}

// needsParent says whether the primary's pod interfaces hang off a parent
// interface in the node netns.
func (p Primary) needsParent() bool {
	return p.Plugin() == "ipvlan" || p.Plugin() == "macvlan"
}

// Families are the IP families a node's pods get addresses in.
type Families int

// DualStack is the zero value: every pod gets an IPv4 and an IPv6 address.
const (
	DualStack Families = iota
	IPv4Only
	IPv6Only
)

// String is how the families are named in test names and tables.
func (f Families) String() string {
	switch f {
	case IPv4Only:
		return "IPv4"
	case IPv6Only:
		return "IPv6"
	case DualStack:
		return "dual-stack"
	default:
		return fmt.Sprintf("Families(%d)", int(f))
	}
}

// HasIPv4 says whether pods get an IPv4 address.
func (f Families) HasIPv4() bool { return f != IPv6Only }

// HasIPv6 says whether pods get an IPv6 address.
func (f Families) HasIPv6() bool { return f != IPv4Only }

// ParentName is the parent interface NewNode makes in the node netns for primaries
// that need one (ipvlan, macvlan). It lives and dies with the node's namespace, so
// its name need not be unique on the machine.
const ParentName = "mcni-parent"

// createParent makes the node's parent interface: one end of a veth pair, both
// ends up. ipvlan and macvlan (bridge mode) forward between their own devices on
// one parent without involving it, which is all pods on one node need; a veth
// because kernels built without the dummy driver still have veth, which every
// primary here needs anyway.
func (n *Node) createParent() error {
	err := n.Do(func() error {
		veth := &netlink.Veth{LinkAttrs: netlink.LinkAttrs{Name: ParentName}, PeerName: ParentName + "-p"}
		if err := netlink.LinkAdd(veth); err != nil {
			return err
		}
		for _, name := range []string{ParentName, veth.PeerName} {
			l, err := netlinksafe.LinkByName(name)
			if err != nil {
				return err
			}
			if err := netlink.LinkSetUp(l); err != nil {
				return err
			}
		}
		return nil
	})
	if err != nil {
		return fmt.Errorf("create parent interface %s in node netns: %w", ParentName, err)
	}
	return nil
}

// ProbePrimary reports whether the kernel can make the interfaces the node's
// primary needs, by making one on the node's parent and deleting it. A kernel
// built without ipvlan (CONFIG_IPVLAN unset, no module) fails here with
// "operation not supported".
func (n *Node) ProbePrimary() error {
	var probe netlink.Link
	switch n.Primary.Plugin() {
	case "ipvlan":
		probe = &netlink.IPVlan{LinkAttrs: netlink.LinkAttrs{Name: "mcni-probe"}, Mode: netlink.IPVLAN_MODE_L2}
	case "macvlan":
		probe = &netlink.Macvlan{LinkAttrs: netlink.LinkAttrs{Name: "mcni-probe"}, Mode: netlink.MACVLAN_MODE_BRIDGE}
	default:
		return nil
	}
	err := n.Do(func() error {
		parent, err := netlinksafe.LinkByName(ParentName)
		if err != nil {
			return err
		}
		probe.Attrs().ParentIndex = parent.Attrs().Index
		if err := netlink.LinkAdd(probe); err != nil {
			return err
		}
		return netlink.LinkDel(probe)
	})
	if err != nil {
		return fmt.Errorf("kernel cannot make %s interfaces: %w", n.Primary.Plugin(), err)
	}
	return nil
}

// KernelOption is the kernel config option that builds the driver plugin
// needs, for the primaries' plugins whose driver a supported kernel may be
// built without; ok is false for the drivers every supported kernel has.
func KernelOption(plugin string) (option string, ok bool) {
	if plugin == "ipvlan" {
		return "CONFIG_IPVLAN", true
	}
	return "", false
}

// RequirePrimary fails tb unless the kernel can make the interfaces of the
// node's primary (ProbePrimary). It skips instead only where the kernel lacks
// an optional driver (fixtures.RequireFeature): KernelOption names its option,
// the kernel does not know the link kind (EOPNOTSUPP) and has no module of
// that name loaded or built in. Any other failure, or one of a driver every
// kernel has, fails: a primary the kernel should support never skips.
func (n *Node) RequirePrimary(tb testing.TB) {
	tb.Helper()
	err := n.ProbePrimary()
	if err == nil {
		return
	}
	plugin := n.Primary.Plugin()
	option, ok := KernelOption(plugin)
	if !ok {
		tb.Fatal(err)
	}
	fixtures.RequireFeature(tb, fixtures.Feature{
		Name: fmt.Sprintf("%s links (%s)", plugin, n.Primary),
		// ipvlan, the one driver KernelOption names, is in Linux 3.19.
		Since: fixtures.KernelVersion{Major: 3, Minor: 19},
		Off: func(err error) string {
			if _, serr := os.Stat("/sys/module/" + plugin); errors.Is(err, unix.EOPNOTSUPP) && errors.Is(serr, os.ErrNotExist) {
				return fmt.Sprintf("it has no %s driver, built in or as a module (%s)", plugin, option)
			}
			return ""
		},
	}, err)
}

// primaryEntry is the conflist entry of the node's primary plugin.
func (n *Node) primaryEntry() (map[string]any, error) {
	var ranges, routes []any
	if n.Families.HasIPv4() {
		ranges = append(ranges, []any{map[string]any{"subnet": n.IPv4Range.String()}})
		routes = append(routes, map[string]any{"dst": "0.0.0.0/0"})
	}
	if n.Families.HasIPv6() {
		ranges = append(ranges, []any{map[string]any{"subnet": n.IPv6Range.String()}})
		routes = append(routes, map[string]any{"dst": "::/0"})
	}
	ipam := map[string]any{
		"type":    "host-local",
		"dataDir": n.DataDir,
		"ranges":  ranges,
		"routes":  routes,
	}
	switch n.Primary {
	case PrimaryBridge:
		return map[string]any{
			"type":      "bridge",
			"bridge":    n.BridgeName,
			"isGateway": true,
			"ipMasq":    false,
			"ipam":      ipam,
		}, nil
	case PrimaryPTP:
		return map[string]any{"type": "ptp", "ipMasq": false, "ipam": ipam}, nil
	case PrimaryIPVLANL2, PrimaryIPVLANL3:
		mode := "l2"
		if n.Primary == PrimaryIPVLANL3 {
			mode = "l3"
		}
		return map[string]any{"type": "ipvlan", "master": ParentName, "mode": mode, "ipam": ipam}, nil
	case PrimaryMACVLAN:
		return map[string]any{"type": "macvlan", "master": ParentName, "mode": "bridge", "ipam": ipam}, nil
	default:
		return nil, fmt.Errorf("unknown primary %q", n.Primary)
	}
}
