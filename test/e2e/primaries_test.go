package e2e

import (
	"bytes"
	"context"
	"fmt"
	"net"
	"net/netip"
	"slices"
	"testing"
	"time"

	"github.com/containernetworking/cni/libcni"
	"github.com/containernetworking/cni/pkg/types"
	types100 "github.com/containernetworking/cni/pkg/types/100"

	"github.com/mesh-cni/mesh-cni/test/fixtures"
	"github.com/mesh-cni/mesh-cni/test/harness"
	"github.com/mesh-cni/mesh-cni/test/proxy"
)

// primaryCase is one row of the primary CNI matrix: a primary network and the IP
// families its pods get addresses in.
type primaryCase struct {
	primary  harness.Primary
	families harness.Families
}

func (c primaryCase) name() string { return string(c.primary) + "/" + c.families.String() }

// matrixFamilies are the families every primary runs with: each of them supports
// IPv4, IPv6 and both.
var matrixFamilies = []harness.Families{harness.IPv4Only, harness.IPv6Only, harness.DualStack}

// primaryMatrix is every primary and family TestPrimaries runs, and so exactly
// what the README's compatibility section lists (TestReadmePrimaryCNIs). flannel's
// CNI plugin and Calico's are not in it: the Go module proxy this project builds
// its plugins from does not serve github.com/flannel-io/cni-plugin, nor
// github.com/projectcalico/api, which Calico's plugin needs.
func primaryMatrix() []primaryCase {
	var out []primaryCase
	for _, p := range harness.Primaries() {
		for _, f := range matrixFamilies {
			out = append(out, primaryCase{p, f})
		}
	}
	return out
}

// TestPrimaries runs the gate and the traffic through the proxies over every
// primary of the matrix: the gate holds an enrolled pod until the agent is ready
// and then admits it with the primary's result; an enrolled pod's outbound and
// inbound connections reach the proxies with their exact original destination in
// every family; an excluded pod passes the gate with no agent and its traffic is
// left alone; DEL leaves nothing behind. It asserts only what a pod and a proxy
// can observe, not how the agent captures traffic.
func TestPrimaries(t *testing.T) {
	t.Parallel()
	for _, c := range primaryMatrix() {
		t.Run(c.name(), func(t *testing.T) {
			t.Parallel()
			runPrimaryCase(t, c)
		})
	}
}

func runPrimaryCase(t *testing.T, c primaryCase) {
	ctx := testContext(t)
	a := newAgent(t)
	node := harness.NewNode(t, harness.NodeOptions{
		Plugins:  append(harness.ReferencePluginNames(), "mesh-cni"),
		Primary:  c.primary,
		Families: c.families,
	})
	// The rows of a driver the kernel may lack (harness.KernelOption) are
	// skipped where it does; the README says they have not run on the kernel
	// the suite runs on (this one's has no ipvlan).
	node.RequirePrimary(t)
	list := chain(t, node, a, "60s")
	linksBefore := linkNames(t, node)

	// With no agent, a pod of an excluded namespace passes straight through.
	outsider := node.NewPod(t, "kube-system", "outsider")
	res, err := node.Add(ctx, outsider, list)
	if err != nil {
		t.Fatalf("ADD of an excluded pod with no agent: %v", err)
	}
	assertChainResult(t, res, outsider, c.families)

	// Enrolled pods are held after the primary did its work, until the agent is
	// ready, then admitted with the primary's result.
	client := node.NewPod(t, "shop", "client")
	srv := node.NewPod(t, "shop", "server")
	cAdd, sAdd := addAsync(ctx, t, node, client, list), addAsync(ctx, t, node, srv, list)
	waitPodInterface(t, client)
	waitPodInterface(t, srv)
	assertHeld(t, cAdd, "for the client with no agent running")
	select {
	case r := <-sAdd:
		t.Fatalf("ADD of the server completed with no agent running (err %v): it must wait", r.err)
	default:
	}
	a.start(ctx)
	assertChainResult(t, awaitAdd(t, cAdd, "of the client").res, client, c.families)
	assertChainResult(t, awaitAdd(t, sAdd, "of the server").res, srv, c.families)
	enrolled := map[string]bool{}
	for _, e := range a.list(ctx).GetEnrollments() {
		enrolled[e.GetAttachment().GetContainerId()] = true
	}
	if !enrolled[client.ContainerID] || !enrolled[srv.ContainerID] || enrolled[outsider.ContainerID] || len(enrolled) != 2 {
		t.Fatalf("agent holds %v, want exactly the client and the server", enrolled)
	}

	// Traffic: client -> server on every address of the server goes out through
	// the client's proxy and in through the server's, both seeing the address and
	// port the client dialled.
	cm, sm := &meshPod{Pod: client}, &meshPod{Pod: srv}
	cm.startProxy(ctx, t)
	sm.startProxy(ctx, t)
	app := srv.ServeEcho(t, 8080)
	outsiderApp := outsider.ServeEcho(t, 8080)
	payload := bytes.Repeat([]byte("mesh-cni "), 4<<10)
	var outbound, inbound int
	for _, dst := range srv.Addrs() {
		target := netip.AddrPortFrom(dst, 8080)
		if err := client.EchoRoundTrip(ctx, target, payload); err != nil {
			t.Fatalf("client -> %s: %v", target, err)
		}
		outbound++
		inbound++
		assertRecord(t, proxy.AwaitRecords(ctx, t, cm.records, outbound)[outbound-1], proxy.Outbound, target)
		in := proxy.AwaitRecords(ctx, t, sm.records, inbound)[inbound-1]
		assertRecord(t, in, proxy.Inbound, target)
		if int(in.BytesToDst) != len(payload) {
			t.Fatalf("server proxy forwarded %d bytes to the application, want %d", in.BytesToDst, len(payload))
		}
	}
	for _, seen := range app.Clients() {
		if slices.Contains(client.Addrs(), seen) {
			t.Fatalf("the server's application saw the client %s directly: the inbound proxy was bypassed", seen)
		}
	}

	// The excluded pod: its outbound connection is not captured (it has no
	// proxy, so a captured connect would be refused), though the enrolled
	// server's inbound side still is; an enrolled pod's connection to it goes
	// through the client's proxy and arrives unintercepted (a captured SYN
	// would be dropped for want of a proxy).
	target := netip.AddrPortFrom(srv.Addrs()[0], 8080)
	if err := outsider.EchoRoundTrip(ctx, target, payload); err != nil {
		t.Fatalf("excluded pod -> %s: %v", target, err)
	}
	inbound++
	assertRecord(t, proxy.AwaitRecords(ctx, t, sm.records, inbound)[inbound-1], proxy.Inbound, target)
	target = netip.AddrPortFrom(outsider.Addrs()[0], 8080)
	if err := client.EchoRoundTrip(ctx, target, payload); err != nil {
		t.Fatalf("client -> excluded pod %s: %v", target, err)
	}
	outbound++
	assertRecord(t, proxy.AwaitRecords(ctx, t, cm.records, outbound)[outbound-1], proxy.Outbound, target)
	if seen := outsiderApp.Clients(); len(seen) != 1 || !slices.Contains(client.Addrs(), seen[0]) {
		t.Fatalf("excluded pod's application saw clients %v, want one connection from the client pod %v", seen, client.Addrs())
	}
	if n := len(proxy.MustReadRecords(t, cm.records)); n != outbound {
		t.Fatalf("client proxy has %d records, want %d (one per connection the client made)", n, outbound)
	}

	// DEL: the agent releases the pods, the primary takes back its interfaces
	// and addresses, and the node is as it was before the first ADD.
	for _, p := range []*harness.Pod{client, srv, outsider} {
		if err := node.Del(ctx, p, list); err != nil {
			t.Fatal(err)
		}
		if hasInterface(p, p.IfName) {
			t.Fatalf("pod %s still has %s after DEL", p.Name, p.IfName)
		}
	}
	if n := len(a.list(ctx).GetEnrollments()); n != 0 {
		t.Fatalf("after DEL of every pod the agent holds %d enrollments", n)
	}
	if after := linkNames(t, node); !slices.Equal(after, linksBefore) {
		t.Fatalf("node interfaces after DEL %v, before the first ADD %v", after, linksBefore)
	}
	if allocs, err := node.Allocations(list.Name); err != nil || len(allocs) != 0 {
		t.Fatalf("host-local still holds %v after DEL (%v)", allocs, err)
	}
}

func assertRecord(t *testing.T, r proxy.Record, direction proxy.Direction, target netip.AddrPort) {
	t.Helper()
	if r.Direction != direction || !sameAddrPort(r.OriginalDst, target) || r.Error != "" {
		t.Fatalf("proxy record %+v, want %s to %s", r, direction, target)
	}
}

// assertChainResult checks a chain's result against the pod's real interface:
// the primary's interface in the pod's sandbox with its MAC, every address on it,
// exactly one address per family of the node, and routes.
func assertChainResult(t *testing.T, res types.Result, pod *harness.Pod, families harness.Families) *types100.Result {
	t.Helper()
	r, err := types100.GetResult(res)
	if err != nil {
		t.Fatalf("result of %s: %v", pod.Name, err)
	}
	idx := -1
	for i, iface := range r.Interfaces {
		if iface.Sandbox == pod.NetNSPath && iface.Name == pod.IfName {
			idx = i
		}
	}
	if idx < 0 {
		t.Fatalf("result of %s has no %s in the pod's sandbox: %+v", pod.Name, pod.IfName, r.Interfaces)
	}
	mac, addrs := interfaceState(t, pod, pod.IfName)
	if r.Interfaces[idx].Mac != mac {
		t.Fatalf("result MAC %s, pod %s's %s has %s", r.Interfaces[idx].Mac, pod.Name, pod.IfName, mac)
	}
	var v4, v6 int
	for _, ip := range r.IPs {
		if ip.Interface == nil || *ip.Interface != idx {
			t.Fatalf("result IP %s is not on the pod's interface", ip.Address.String())
		}
		if !slices.Contains(addrs, ip.Address.String()) {
			t.Fatalf("result IP %s is not on pod %s's %s (%v)", ip.Address.String(), pod.Name, pod.IfName, addrs)
		}
		if ip.Address.IP.To4() != nil {
			v4++
		} else {
			v6++
		}
	}
	want4, want6 := btoi(families.HasIPv4()), btoi(families.HasIPv6())
	if v4 != want4 || v6 != want6 {
		t.Fatalf("result has %d IPv4 and %d IPv6 addresses, want %d and %d (%s)", v4, v6, want4, want6, families)
	}
	if len(r.Routes) == 0 {
		t.Fatal("result has no routes (the primary's default routes are missing)")
	}
	return r
}

func btoi(b bool) int {
	if b {
		return 1
	}
	return 0
}

// interfaceState is the MAC and the addresses (CIDR notation) of a pod's interface.
func interfaceState(t *testing.T, pod *harness.Pod, name string) (string, []string) {
	t.Helper()
	var mac string
	var addrs []string
	if err := pod.Do(func() error {
		iface, err := net.InterfaceByName(name)
		if err != nil {
			return err
		}
		mac = iface.HardwareAddr.String()
		as, err := iface.Addrs()
		for _, a := range as {
			addrs = append(addrs, a.String())
		}
		return err
	}); err != nil {
		t.Fatalf("interface %s of pod %s: %v", name, pod.Name, err)
	}
	return mac, addrs
}

func hasInterface(p *harness.Pod, name string) bool {
	return p.Do(func() error { _, err := net.InterfaceByName(name); return err }) == nil
}

// linkNames are the node's interfaces, sorted by name.
func linkNames(t *testing.T, node *harness.Node) []string {
	t.Helper()
	links, err := node.Links()
	if err != nil {
		t.Fatal(err)
	}
	var names []string
	for _, l := range links {
		names = append(names, fmt.Sprintf("%s(%s)", l.Name, l.Type))
	}
	slices.Sort(names)
	return names
}

// chainedAfterMesh are the plugins TestChainAfterMeshCNI puts after mesh-cni, the
// way kubeadm-style and Calico-style conflists chain them after the primary.
var chainedAfterMesh = []string{"portmap", "bandwidth", "tuning"}

// chainPrimaries are the primaries TestChainAfterMeshCNI runs over: those with a
// host-side veth, which bandwidth shapes.
var chainPrimaries = []harness.Primary{harness.PrimaryBridge, harness.PrimaryPTP}

// TestChainAfterMeshCNI: plugins chained after mesh-cni get the primary's result
// intact from it and do their work with it, over the primaries with a host-side
// veth (bandwidth shapes that veth). portmap needs the pod's addresses (a host port
// reaches the pod, and the pod's inbound proxy sees the pod's own address and port
// as the original destination), bandwidth needs the host-side veth in the result
// (it fails without it) and appends its ifb device, tuning finds the pod's
// interface in the result and updates its MAC; the chain's CHECK passes, and DEL
// undoes all of it.
func TestChainAfterMeshCNI(t *testing.T) {
	t.Parallel()
	for _, p := range chainPrimaries {
		t.Run(string(p), func(t *testing.T) {
			t.Parallel()
			runChainAfterMesh(t, p)
		})
	}
}

func runChainAfterMesh(t *testing.T, primary harness.Primary) {
	ctx := testContext(t)
	a := newAgent(t)
	a.start(ctx)
	node := harness.NewNode(t, harness.NodeOptions{Plugins: append(harness.ReferencePluginNames(), "mesh-cni"), Primary: primary})
	const hostPort, podPort = 18080, 8080
	list := node.Conflist(t, "meshnet", a.meshEntry("60s"),
		map[string]any{"type": "portmap", "capabilities": map[string]any{"portMappings": true}},
		map[string]any{"type": "bandwidth", "ingressRate": 1_000_000_000, "ingressBurst": 10_000_000,
			"egressRate": 1_000_000_000, "egressBurst": 10_000_000},
		map[string]any{"type": "tuning", "capabilities": map[string]any{"mac": true}},
	)
	if got := pluginTypes(list); !slices.Equal(got[2:], chainedAfterMesh) {
		t.Fatalf("chain after mesh-cni is %v, want %v", got[2:], chainedAfterMesh)
	}
	linksBefore := linkNames(t, node)
	client, srv := node.NewPod(t, "shop", "client"), node.NewPod(t, "shop", "server")
	// Runtime arguments as kubelet passes them: a MAC for each pod (locally
	// administered), the host port for the server only.
	runtimeArgs := map[*harness.Pod]harness.RuntimeOption{
		client: harness.WithCapabilityArgs(map[string]any{"mac": "02:6d:65:73:68:01"}),
		srv: harness.WithCapabilityArgs(map[string]any{"mac": "02:6d:65:73:68:02", "portMappings": []map[string]any{
			{"hostPort": hostPort, "containerPort": podPort, "protocol": "tcp"},
		}}),
	}
	macs := map[*harness.Pod]string{client: "02:6d:65:73:68:01", srv: "02:6d:65:73:68:02"}
	var results []*types100.Result
	for _, p := range []*harness.Pod{client, srv} {
		res, err := node.Add(ctx, p, list, runtimeArgs[p])
		if err != nil {
			t.Fatalf("ADD %s through %v: %v", p.Name, pluginTypes(list), err)
		}
		r := assertChainResult(t, res, p, harness.DualStack)
		results = append(results, r)
		if got, _ := interfaceState(t, p, p.IfName); got != macs[p] {
			t.Fatalf("pod %s's %s has MAC %s, want tuning's %s", p.Name, p.IfName, got, macs[p])
		}
		// The primary's host-side veth and bandwidth's ifb device: both in the
		// result, both real interfaces of the node.
		nodeLinks := linkNames(t, node)
		var veth, ifb bool
		for _, iface := range r.Interfaces {
			if iface.Sandbox != "" {
				continue
			}
			veth = veth || slices.Contains(nodeLinks, iface.Name+"(veth)")
			ifb = ifb || slices.Contains(nodeLinks, iface.Name+"(ifb)")
		}
		if !veth || !ifb {
			t.Fatalf("result interfaces %+v: want the host-side veth and bandwidth's ifb, both on the node (%v)", r.Interfaces, nodeLinks)
		}
	}
	if err := node.Check(ctx, srv, list, runtimeArgs[srv]); err != nil {
		t.Fatalf("CHECK of the whole chain: %v", err)
	}

	cm, sm := &meshPod{Pod: client}, &meshPod{Pod: srv}
	cm.startProxy(ctx, t)
	sm.startProxy(ctx, t)
	srv.ServeEcho(t, podPort)
	payload := bytes.Repeat([]byte("mesh-cni "), 4<<10)
	var outbound, inbound int
	for _, dst := range srv.Addrs() {
		target := netip.AddrPortFrom(dst, podPort)
		if err := client.EchoRoundTrip(ctx, target, payload); err != nil {
			t.Fatalf("client -> %s: %v", target, err)
		}
		outbound++
		inbound++
		assertRecord(t, proxy.AwaitRecords(ctx, t, cm.records, outbound)[outbound-1], proxy.Outbound, target)
		assertRecord(t, proxy.AwaitRecords(ctx, t, sm.records, inbound)[inbound-1], proxy.Inbound, target)
	}
	// The host port, from the node, on an address of the node's own in each
	// family (on its loopback, so it outlives every pod): portmap's DNAT took
	// the pod's address from its prevResult.
	nodeAddrs := addNodeAddrs(t, node)
	for _, ip := range results[1].IPs {
		dst, _ := netip.AddrFromSlice(ip.Address.IP)
		dst = dst.Unmap()
		hp := netip.AddrPortFrom(nodeAddrs[btoi(dst.Is6())], hostPort)
		if err := nodeRoundTrip(ctx, node, hp, payload); err != nil {
			t.Fatalf("node -> host port %s: %v", hp, err)
		}
		inbound++
		assertRecord(t, proxy.AwaitRecords(ctx, t, sm.records, inbound)[inbound-1], proxy.Inbound, netip.AddrPortFrom(dst, podPort))
	}

	for _, p := range []*harness.Pod{client, srv} {
		if err := node.Del(ctx, p, list, runtimeArgs[p]); err != nil {
			t.Fatal(err)
		}
	}
	if n := len(a.list(ctx).GetEnrollments()); n != 0 {
		t.Fatalf("after DEL the agent holds %d enrollments", n)
	}
	if after := linkNames(t, node); !slices.Equal(after, linksBefore) {
		t.Fatalf("node interfaces after DEL %v, before the first ADD %v", after, linksBefore)
	}
	// With portmap's rules gone, the host port is the node's own again: a
	// listener on the node gets the connection instead of the deleted pod.
	var ln net.Listener
	if err := node.Do(func() (err error) { ln, err = net.Listen("tcp", fmt.Sprintf("[::]:%d", hostPort)); return err }); err != nil {
		t.Fatal(err)
	}
	fixtures.ServeEcho(t, ln)
	for _, addr := range nodeAddrs {
		if err := nodeRoundTrip(ctx, node, netip.AddrPortFrom(addr, hostPort), payload); err != nil {
			t.Fatalf("host port after DEL does not reach the node's own listener (portmap's rules left behind?): %v", err)
		}
	}
}

// addNodeAddrs gives the node an IPv4 and an IPv6 address of its own, from the
// documentation ranges, on its loopback (up, as on every node; no DAD there),
// and returns them.
func addNodeAddrs(t *testing.T, node *harness.Node) [2]netip.Addr {
	t.Helper()
	addrs := [2]netip.Addr{netip.MustParseAddr("192.0.2.1"), netip.MustParseAddr("2001:db8::1")}
	err := node.Do(func() error {
		for _, a := range addrs {
			if err := fixtures.AddAddr("lo", netip.PrefixFrom(a, a.BitLen())); err != nil {
				return err
			}
		}
		return nil
	})
	if err != nil {
		t.Fatalf("node addresses: %v", err)
	}
	return addrs
}

func pluginTypes(list *libcni.NetworkConfigList) []string {
	var out []string
	for _, p := range list.Plugins {
		out = append(out, p.Network.Type)
	}
	return out
}

// nodeRoundTrip is roundTrip from the node's network namespace (the host of the
// pods).
func nodeRoundTrip(ctx context.Context, node *harness.Node, addr netip.AddrPort, payload []byte) error {
	ctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	var conn net.Conn
	if err := node.Do(func() error {
		var d net.Dialer
		var err error
		conn, err = d.DialContext(ctx, "tcp", addr.String())
		return err
	}); err != nil {
		return fmt.Errorf("dial %s from the node: %w", addr, err)
	}
	defer conn.Close()
	if err := fixtures.EchoRoundTrip(ctx, conn, payload); err != nil {
		return fmt.Errorf("%s from the node: %w", addr, err)
	}
	return nil
}
