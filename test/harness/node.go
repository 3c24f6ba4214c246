package harness

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"os"
	"path/filepath"
	"slices"
	"sort"
	"strings"
	"testing"
	"time"

	"github.com/containernetworking/cni/libcni"
	"github.com/containernetworking/cni/pkg/invoke"
	"github.com/containernetworking/cni/pkg/version"
	"github.com/containernetworking/plugins/pkg/netlinksafe"
	"github.com/vishvananda/netlink"

	"github.com/mesh-cni/mesh-cni/internal/netns"
	"github.com/mesh-cni/mesh-cni/test/fixtures"
)

// CNIVersion is the spec version of every config the harness writes.
const CNIVersion = "1.1.0"

// DefaultBridge is the bridge device the primary network creates in the node netns.
const DefaultBridge = "cni0"

// NodeOptions configures NewNode. The zero value is a node with the reference plugins.
type NodeOptions struct {
	// Binaries to take the plugins from; default Bins(tb).
	Binaries *Binaries
	// Plugins are the binary names linked into the node's CNI bin dir; default
	// ReferencePluginNames(). Add "mesh-cni" to chain the product plugin (or leave
	// it out to let the agent install it).
	Plugins []string
	// Dir holds the node's directories; default tb.TempDir(). Set it to keep the
	// node's state beyond the test that made it (e.g. to inspect it after a
	// subtest's cleanup ran).
	Dir string
	// Primary is the node's primary network; default PrimaryBridge.
	Primary Primary
	// Families are the IP families pods get addresses in; default DualStack.
	Families Families
	// BridgeName of the primary network (PrimaryBridge); default DefaultBridge.
	BridgeName string
	// IPv4Range and IPv6Range are the pod ranges; default a random 10.x.y.0/24 and
	// fd00:x:y::/64.
	IPv4Range, IPv6Range netip.Prefix
	// PluginCreatesBridge (PrimaryBridge) leaves the bridge to the bridge plugin instead of making
	// it with a fixed MAC address in NewNode. A bridge the plugin makes takes the
	// lowest MAC of its ports, so it changes as pods come and go, and the bridge
	// plugin's CHECK then fails for pods added earlier ("Bridge interface cni0 Mac
	// doesn't match").
	PluginCreatesBridge bool
}

// Node is a test "node": a network namespace that holds the primary network's
// node side (the bridge and host-side veths, the routes, or the parent interface),
// plus the directories a container runtime and the CNI
// plugins use on a node. It is removed in the test's cleanup.
type Node struct {
	// NetNSPath is the node's network namespace; CNI plugins run inside it.
	NetNSPath string
	// BinDir is the CNI bin dir (symlinks to the built plugins).
	BinDir string
	// ConfDir is the CNI conf dir (/etc/cni/net.d on a real node).
	ConfDir string
	// DataDir is host-local's dataDir.
	DataDir string
	// CacheDir is libcni's cache dir (/var/lib/cni on a real node).
	CacheDir string
	// PluginLog collects what plugins write to stderr on successful calls (failed
	// calls carry it in their error); it is logged when the test fails.
	PluginLog string
	// Primary, Families, BridgeName, IPv4Range, IPv6Range describe the primary
	// network.
	Primary              Primary
	Families             Families
	BridgeName           string
	IPv4Range, IPv6Range netip.Prefix
	// CNI is the libcni handle the node's calls go through.
	CNI *libcni.CNIConfig
}

// NewNode makes a node. Everything it creates is removed in tb.Cleanup.
func NewNode(tb testing.TB, opts NodeOptions) *Node {
	tb.Helper()
	bins := opts.Binaries
	if bins == nil {
		bins = Bins(tb)
	}
	plugins := opts.Plugins
	if plugins == nil {
		plugins = ReferencePluginNames()
	}
	bins.Require(tb, plugins...)
	dir := opts.Dir
	if dir == "" {
		dir = tb.TempDir()
	}
	n := &Node{
		BinDir:     filepath.Join(dir, "bin"),
		ConfDir:    filepath.Join(dir, "net.d"),
		DataDir:    filepath.Join(dir, "host-local"),
		CacheDir:   filepath.Join(dir, "cache"),
		PluginLog:  filepath.Join(dir, "plugin-stderr.log"),
		Primary:    opts.Primary,
		Families:   opts.Families,
		BridgeName: opts.BridgeName,
		IPv4Range:  opts.IPv4Range,
		IPv6Range:  opts.IPv6Range,
	}
	if n.Primary == "" {
		n.Primary = PrimaryBridge
	}
	if !slices.Contains(Primaries(), n.Primary) {
		tb.Fatalf("unknown primary %q (known: %v)", n.Primary, Primaries())
	}
	if n.BridgeName == "" {
		n.BridgeName = DefaultBridge
	}
	if !n.IPv4Range.IsValid() || !n.IPv6Range.IsValid() {
		r := fixtures.RandomBytes(2)
		if !n.IPv4Range.IsValid() {
			n.IPv4Range = netip.PrefixFrom(netip.AddrFrom4([4]byte{10, r[0], r[1], 0}), 24)
		}
		if !n.IPv6Range.IsValid() {
			n.IPv6Range = netip.MustParsePrefix(fmt.Sprintf("fd00:%x:%x::/64", r[0], r[1]))
		}
	}
	for _, d := range []string{n.BinDir, n.ConfDir, n.DataDir, n.CacheDir} {
		if err := os.MkdirAll(d, 0o755); err != nil {
			tb.Fatalf("node dir: %v", err)
		}
	}
	for _, name := range plugins {
		if err := os.Symlink(bins.Path(name), filepath.Join(n.BinDir, name)); err != nil {
			tb.Fatalf("link plugin %s into node bin dir: %v", name, err)
		}
	}
	logFile, err := os.OpenFile(n.PluginLog, os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o644)
	if err != nil {
		tb.Fatalf("plugin log: %v", err)
	}
	// An explicit exec: libcni would otherwise create its default lazily, which races
	// when one node's calls run in parallel.
	n.CNI = libcni.NewCNIConfigWithCacheDir([]string{n.BinDir}, n.CacheDir, &invoke.DefaultExec{
		RawExec:       &invoke.RawExec{Stderr: logFile},
		PluginDecoder: version.PluginDecoder{},
	})

	// Registered before the namespace's removal, so it runs after it:
	// removing the namespace destroys the bridge and the host-side veths.
	tb.Cleanup(func() {
		logFile.Close()
		if tb.Failed() {
			if out, err := os.ReadFile(n.PluginLog); err == nil && len(out) > 0 {
				tb.Logf("plugin stderr on node %s:\n%s", filepath.Base(n.NetNSPath), out)
			}
		}
	})
	n.NetNSPath = fixtures.NewNetns(tb, filepath.Join(NetnsDir, NetnsPrefix()+"node-"+fixtures.RandomHex(4))).Path
	switch {
	case n.Primary == PrimaryBridge && !opts.PluginCreatesBridge:
		if err := n.createBridge(tb); err != nil {
			tb.Fatal(err)
		}
	case n.Primary.needsParent():
		if err := n.createParent(); err != nil {
			tb.Fatal(err)
		}
	}
	return n
}

// createBridge makes the node's bridge with an explicitly set MAC address: the
// kernel then keeps that address instead of following the ports' (what a node
// whose bridge is made by its provisioning looks like). The bridge plugin adopts an
// existing bridge of its name.
func (n *Node) createBridge(tb testing.TB) error {
	mac := fixtures.RandomBytes(6)
	mac[0] = mac[0]&^0x01 | 0x02 // unicast, locally administered
	err := n.Do(func() error {
		return netlink.LinkAdd(&netlink.Bridge{LinkAttrs: netlink.LinkAttrs{
			Name:         n.BridgeName,
			HardwareAddr: net.HardwareAddr(mac),
		}})
	})
	if err != nil {
		return fmt.Errorf("create bridge %s in node netns: %w", n.BridgeName, err)
	}
	return nil
}

// Do runs fn with the calling thread inside the node's netns (see netns.Do).
func (n *Node) Do(fn func() error) error {
	return netns.Do(n.NetNSPath, fn)
}

// ConflistJSON returns a conflist for this node's primary network: [primary
// (host-local over the node's ranges for its families, default routes; the bridge
// as gateway without masquerade for PrimaryBridge), extra...]. Each extra entry is a
// plugin config appended after the primary, such as the mesh-cni entry.
func (n *Node) ConflistJSON(name string, extra ...map[string]any) ([]byte, error) {
	primary, err := n.primaryEntry()
	if err != nil {
		return nil, err
	}
	plugins := []any{primary}
	for _, e := range extra {
		plugins = append(plugins, e)
	}
	out, err := json.MarshalIndent(map[string]any{
		"cniVersion": CNIVersion,
		"name":       name,
		"plugins":    plugins,
	}, "", "  ")
	if err != nil {
		return nil, fmt.Errorf("marshal conflist %q: %w", name, err)
	}
	return out, nil
}

// Conflist is ConflistJSON parsed by libcni, failing the test on error.
func (n *Node) Conflist(tb testing.TB, name string, extra ...map[string]any) *libcni.NetworkConfigList {
	tb.Helper()
	raw, err := n.ConflistJSON(name, extra...)
	if err != nil {
		tb.Fatal(err)
	}
	list, err := libcni.NetworkConfFromBytes(raw)
	if err != nil {
		tb.Fatalf("parse conflist %q: %v\n%s", name, err, raw)
	}
	return list
}

// WriteConf writes data to ConfDir/filename (atomically, mode 0644) and returns the
// path.
func (n *Node) WriteConf(tb testing.TB, filename string, data []byte) string {
	tb.Helper()
	path := filepath.Join(n.ConfDir, filename)
	if err := writeFileAtomic(path, data, 0o644); err != nil {
		tb.Fatal(err)
	}
	return path
}

// WriteConflist writes list to ConfDir/filename and returns the path.
func (n *Node) WriteConflist(tb testing.TB, filename string, list *libcni.NetworkConfigList) string {
	tb.Helper()
	return n.WriteConf(tb, filename, list.Bytes)
}

// LoadConflist picks the node's network config the way kubelet's runtimes do: the
// first valid .conf, .conflist or .json file in ConfDir in lexical order, a .conf
// being turned into a one-plugin list. It returns the list and the file it came
// from.
func (n *Node) LoadConflist() (*libcni.NetworkConfigList, string, error) {
	files, err := libcni.ConfFiles(n.ConfDir, []string{".conf", ".conflist", ".json"})
	if err != nil {
		return nil, "", fmt.Errorf("list %s: %w", n.ConfDir, err)
	}
	sort.Strings(files)
	var errs []error
	for _, f := range files {
		var list *libcni.NetworkConfigList
		if strings.HasSuffix(f, ".conflist") {
			list, err = libcni.NetworkConfFromFile(f)
		} else {
			list, err = confToList(f)
		}
		if err != nil {
			errs = append(errs, fmt.Errorf("%s: %w", f, err))
			continue
		}
		if len(list.Plugins) == 0 {
			errs = append(errs, fmt.Errorf("%s: no plugins", f))
			continue
		}
		return list, f, nil
	}
	return nil, "", errors.Join(append([]error{fmt.Errorf("no valid network config in %s", n.ConfDir)}, errs...)...)
}

// confToList reads a single-plugin .conf file as a one-plugin list, as runtimes still
// accept it (libcni deprecated its own helpers for this).
func confToList(path string) (*libcni.NetworkConfigList, error) {
	data, err := os.ReadFile(path)
	if err != nil {
		return nil, err
	}
	var plugin map[string]any
	if err := json.Unmarshal(data, &plugin); err != nil {
		return nil, fmt.Errorf("parse: %w", err)
	}
	if _, ok := plugin["type"].(string); !ok {
		return nil, errors.New("no plugin type: not a single-plugin config")
	}
	list := map[string]any{"name": plugin["name"], "plugins": []any{plugin}}
	if v, ok := plugin["cniVersion"]; ok {
		list["cniVersion"] = v
	}
	raw, err := json.Marshal(list)
	if err != nil {
		return nil, fmt.Errorf("convert to list: %w", err)
	}
	return libcni.NetworkConfFromBytes(raw)
}

// Link is an interface in the node netns.
type Link struct {
	Name string
	Type string // netlink kind: "bridge", "veth", "device" (lo), ...
	MAC  net.HardwareAddr
}

// Links lists the interfaces in the node netns.
func (n *Node) Links() ([]Link, error) {
	var out []Link
	err := netns.Do(n.NetNSPath, func() error {
		links, err := netlinksafe.LinkList()
		if err != nil {
			return fmt.Errorf("list links: %w", err)
		}
		for _, l := range links {
			out = append(out, Link{Name: l.Attrs().Name, Type: l.Type(), MAC: l.Attrs().HardwareAddr})
		}
		return nil
	})
	return out, err
}

// Veths lists the names of the veth interfaces in the node netns: one per attached
// pod with the bridge plugin.
func (n *Node) Veths() ([]string, error) {
	links, err := n.Links()
	if err != nil {
		return nil, err
	}
	var out []string
	for _, l := range links {
		if l.Type == "veth" {
			out = append(out, l.Name)
		}
	}
	return out, nil
}

// Allocation is one address host-local has reserved.
type Allocation struct {
	Addr        netip.Addr
	ContainerID string
	IfName      string
}

// Allocations lists host-local's reservations for the network called network.
func (n *Node) Allocations(network string) ([]Allocation, error) {
	dir := filepath.Join(n.DataDir, network)
	entries, err := os.ReadDir(dir)
	if errors.Is(err, os.ErrNotExist) {
		return nil, nil
	}
	if err != nil {
		return nil, fmt.Errorf("list host-local store: %w", err)
	}
	var out []Allocation
	for _, e := range entries {
		// Reservation files are named by the address; the store also keeps a
		// lock file and last_reserved_ip.N.
		addr, err := netip.ParseAddr(e.Name())
		if err != nil {
			continue
		}
		data, err := os.ReadFile(filepath.Join(dir, e.Name()))
		if err != nil {
			return nil, fmt.Errorf("read reservation: %w", err)
		}
		// "<container id>\r\n<ifname>"
		id, ifname, _ := strings.Cut(string(data), "\r\n")
		out = append(out, Allocation{Addr: addr, ContainerID: strings.TrimSpace(id), IfName: strings.TrimSpace(ifname)})
	}
	return out, nil
}

func writeFileAtomic(path string, data []byte, mode os.FileMode) error {
	tmp, err := os.CreateTemp(filepath.Dir(path), "."+filepath.Base(path)+".tmp-")
	if err != nil {
		return fmt.Errorf("write %s: %w", path, err)
	}
	defer os.Remove(tmp.Name())
	if _, err := tmp.Write(data); err != nil {
		tmp.Close()
		return fmt.Errorf("write %s: %w", path, err)
	}
	if err := tmp.Chmod(mode); err != nil {
		tmp.Close()
		return fmt.Errorf("write %s: %w", path, err)
	}
	if err := tmp.Close(); err != nil {
		return fmt.Errorf("write %s: %w", path, err)
	}
	if err := os.Rename(tmp.Name(), path); err != nil {
		return fmt.Errorf("write %s: %w", path, err)
	}
	return nil
}

// WaitAddressesUsable waits until none of the node's IPv6 addresses is still
// tentative: until duplicate address detection is done (a second or two after
// the primary made the bridge) the node neither sends from its gateway address
// nor answers neighbour solicitations for it, so pods cannot reach it.
func (n *Node) WaitAddressesUsable(ctx context.Context, tb testing.TB) {
	tb.Helper()
	for {
		var tentative bool
		if err := n.Do(func() (err error) {
			tentative, err = fixtures.HasTentative(nil)
			return err
		}); err != nil {
			tb.Fatal(err)
		}
		if !tentative {
			return
		}
		select {
		case <-ctx.Done():
			tb.Fatal("the node's IPv6 addresses stayed tentative")
		case <-time.After(50 * time.Millisecond):
		}
	}
}
