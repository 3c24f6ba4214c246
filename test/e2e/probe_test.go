package e2e

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/containernetworking/plugins/pkg/netlinksafe"
	"github.com/vishvananda/netlink"

	"github.com/mesh-cni/mesh-cni/internal/netns"
	"github.com/mesh-cni/mesh-cni/test/fixtures"
	"github.com/mesh-cni/mesh-cni/test/harness"
	"github.com/mesh-cni/mesh-cni/test/proxy"
)

// TestKubeletProbesBypassProxy: a readiness-style check by the kubelet (a process
// of the kubelet's cgroup, in the node's network namespace, where kubelet runs)
// reaches the application directly, so a proxy enforcing mTLS or policy cannot
// fail it; a connection from the same node address by any other process of the
// node is captured like a pod's, and pod-to-pod connections go through both
// proxies. The agent runs in the node's namespace, as the DaemonSet does.
func TestKubeletProbesBypassProxy(t *testing.T) {
	t.Parallel()
	ctx := testContext(t)
	node := meshNode(t)
	kubelet := harness.NewCgroup(t, "kubelet")
	a := newAgent(t, "--probe-cgroups", kubelet)
	a.NetNSPath = node.NetNSPath
	a.start(ctx)
	list := chain(t, node, a, "30s")
	client := addMeshPod(ctx, t, node, list, "shop", "probe-client")
	srv := addMeshPod(ctx, t, node, list, "shop", "probe-server")
	client.startProxy(ctx, t)
	srv.startProxy(ctx, t)
	app := srv.ServeEcho(t, 8080)

	node.WaitAddressesUsable(ctx, t)
	records := 0
	for _, dst := range []netip.Addr{srv.IPv4(t), srv.IPv6(t)} {
		target := netip.AddrPortFrom(dst, 8080)
		// The probe: the kubelet's cgroup, from the node.
		before := len(proxy.MustReadRecords(t, srv.records))
		if err := probeFromCgroup(ctx, t, node.NetNSPath, kubelet, target); err != nil {
			t.Fatalf("kubelet probe to %s: %v", target, err)
		}
		seen := app.Clients()
		if got := len(proxy.MustReadRecords(t, srv.records)); got != before || len(seen) == 0 || !isNodeAddress(t, node, seen[len(seen)-1].WithZone("")) {
			t.Fatalf("kubelet probe to %s: the application saw %v, the inbound proxy %d new records: want it straight from a node address", target, seen, got-before)
		}
		// The same node address, another process: through the inbound proxy.
		if err := probeFrom(ctx, t, node, target); err != nil {
			t.Fatalf("node process -> %s: %v", target, err)
		}
		records++
		if in := proxy.AwaitRecords(ctx, t, srv.records, records)[records-1]; in.Direction != "inbound" || !sameAddrPort(in.OriginalDst, target) {
			t.Fatalf("server proxy record %+v, want the node process's connection to %s", in, target)
		}
		// A pod's connection: through both proxies.
		if err := client.EchoRoundTrip(ctx, target, []byte("pod to pod")); err != nil {
			t.Fatalf("pod -> %s: %v", target, err)
		}
		records++
		if in := proxy.AwaitRecords(ctx, t, srv.records, records)[records-1]; in.Direction != "inbound" || !sameAddrPort(in.OriginalDst, target) {
			t.Fatalf("server proxy record %+v, want the pod's connection to %s", in, target)
		}
	}
}

// TestHelperProbe is not a test: it is the process probeFromCgroup starts in a
// cgroup, as the kubelet is in its own. It probes MESH_PROBE_TARGET from the
// network namespace it was started in and prints OK or the error.
func TestHelperProbe(t *testing.T) {
	target := os.Getenv("MESH_PROBE_TARGET")
	if target == "" {
		t.Skip("helper process of probeFromCgroup")
	}
	if err := echoLine(context.Background(), target); err != nil {
		fmt.Println("ERR", err)
		return
	}
	fmt.Println("OK")
}

// probeFromCgroup probes target from the network namespace at netnsPath (the
// node's, or a pod's) in a process of cgroup.
func probeFromCgroup(ctx context.Context, t *testing.T, netnsPath, cgroup string, target netip.AddrPort) error {
	t.Helper()
	cg, err := os.Open(cgroup)
	if err != nil {
		t.Fatal(err)
	}
	defer cg.Close()
	cmd := exec.CommandContext(ctx, os.Args[0], "-test.run=^TestHelperProbe$", "-test.v=false")
	cmd.Env = append(os.Environ(), "MESH_PROBE_TARGET="+target.String())
	cmd.SysProcAttr = &syscall.SysProcAttr{UseCgroupFD: true, CgroupFD: int(cg.Fd())}
	var out bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &out
	cmd.WaitDelay = 10 * time.Second
	if err := netns.Do(netnsPath, cmd.Start); err != nil {
		t.Fatal(err)
	}
	if err := cmd.Wait(); err != nil {
		return fmt.Errorf("probe helper: %w (%s)", err, out.String())
	}
	if line := strings.TrimSpace(strings.TrimSuffix(strings.TrimSpace(out.String()), "PASS")); line != "OK" {
		return errors.New(line)
	}
	return nil
}

// probeFrom connects from the node's namespace and echoes a line, as an HTTP or
// TCP probe would reach the port.
func probeFrom(ctx context.Context, t *testing.T, node *harness.Node, target netip.AddrPort) error {
	t.Helper()
	return node.Do(func() error { return echoLine(ctx, target.String()) })
}

// echoLine connects to target from the calling thread's namespace and has a line
// echoed, retrying while the node's IPv6 address is still tentative.
func echoLine(ctx context.Context, target string) error {
	payload := []byte("GET /ready HTTP/1.0\r\n\r\n")
	ctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	var (
		c   net.Conn
		err error
	)
	for {
		var d net.Dialer
		c, err = d.DialContext(ctx, "tcp", target)
		// The node's IPv6 address on the bridge stays tentative until duplicate
		// address detection is done.
		if errors.Is(err, syscall.EADDRNOTAVAIL) && ctx.Err() == nil {
			time.Sleep(50 * time.Millisecond)
			continue
		}
		if err != nil {
			return err
		}
		break
	}
	return fixtures.EchoRoundTrip(ctx, c, payload)
}

// isNodeAddress reports whether a is an address of the node's namespace.
func isNodeAddress(t *testing.T, node *harness.Node, a netip.Addr) bool {
	t.Helper()
	var found bool
	if err := node.Do(func() error {
		addrs, err := netlinksafe.AddrList(nil, netlink.FAMILY_ALL)
		for _, x := range addrs {
			if ip, ok := netip.AddrFromSlice(x.IP); ok && ip.Unmap() == a {
				found = true
			}
		}
		return err
	}); err != nil {
		t.Fatal(err)
	}
	return found
}

// TestProxyCgroupsFromRoot: --proxy-cgroups names cgroups from the root of the
// cgroup v2 hierarchy, however it is mounted (on a hybrid node at unified/),
// without --cgroup-root: a process of the named cgroup in a meshed pod, as a
// sidecar proxy's own connections are, reaches its destination directly,
// while the pod's other processes are redirected to its proxy, which is not
// running here, so they fail closed.
func TestProxyCgroupsFromRoot(t *testing.T) {
	t.Parallel()
	ctx := testContext(t)
	sidecars := harness.NewCgroup(t, "sidecars")
	_, node, list := meshedNode(ctx, t, "30s", "--proxy-cgroups", "/"+filepath.Base(sidecars))
	client := addMeshPod(ctx, t, node, list, "shop", "sidecar-client")
	server := addMeshPod(ctx, t, node, list, "kube-system", "outsider") // not enrolled
	app := server.ServeEcho(t, 8080)

	node.WaitAddressesUsable(ctx, t)
	for _, dst := range []netip.Addr{server.IPv4(t), server.IPv6(t)} {
		target := netip.AddrPortFrom(dst, 8080)
		if err := probeFromCgroup(ctx, t, client.NetNSPath, sidecars, target); err != nil {
			t.Fatalf("from the proxy's cgroup to %s: %v, want straight to the application", target, err)
		}
		if seen := app.Clients(); len(seen) == 0 || !slices.Contains([]netip.Addr{client.IPv4(t), client.IPv6(t)}, seen[len(seen)-1].WithZone("")) {
			t.Fatalf("from the proxy's cgroup to %s: the application saw %v, want the client pod", target, seen)
		}
		if err := client.EchoRoundTrip(ctx, target, []byte("from the pod")); err == nil {
			t.Fatalf("pod -> %s reached the application: want redirected to its proxy, which is not running", target)
		}
	}
}
