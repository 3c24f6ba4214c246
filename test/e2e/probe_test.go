package e2e

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/netip"
	"syscall"
	"testing"
	"time"

	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"

	"github.com/mesh-cni/mesh-cni/internal/netns"
	"github.com/mesh-cni/mesh-cni/test/harness"
)

// TestKubeletProbesBypassProxy: with the defaults, a readiness-style check from the
// node's own network namespace (where kubelet runs) reaches the application
// directly, so a proxy enforcing mTLS or policy cannot fail it, while pod-to-pod
// connections still go through both proxies. The agent runs in the node's
// namespace, as the DaemonSet does, and learns the node's addresses there.
func TestKubeletProbesBypassProxy(t *testing.T) {
	t.Parallel()
	ctx := testContext(t)
	node := meshNode(t)
	a := newAgent(t)
	a.NetNSPath = node.NetNSPath
	a.start(ctx)
	list := chain(t, node, a, "30s")
	client := addMeshPod(ctx, t, node, list, "shop", "probe-client")
	srv := addMeshPod(ctx, t, node, list, "shop", "probe-server")
	client.startProxy(ctx, t)
	srv.startProxy(ctx, t)
	var app server
	app.serve(t, srv.Pod, 8080)

	waitNodeAddresses(ctx, t, node)
	for i, dst := range []netip.Addr{srv.IPv4(t), srv.IPv6(t)} {
		target := netip.AddrPortFrom(dst, 8080)
		// The probe, from the node. The bridge (and with it the node's address
		// on the pods' network) appeared with the first ADD, after the agent
		// started: the agent learns it within a moment.
		var (
			before int
			err    error
			seen   []netip.Addr
		)
		if !harness.Eventually(ctx, 10*time.Second, 100*time.Millisecond, func() bool {
			before = len(srv.proxyRecords(t))
			err = probeFrom(ctx, t, node, target)
			seen = app.seen()
			return err == nil && len(srv.proxyRecords(t)) == before && len(seen) > 0 && isNodeAddress(t, node, seen[len(seen)-1].WithZone(""))
		}) {
			t.Fatalf("probe from the node to %s: %v; the application saw %v, the inbound proxy %d new records: want it straight from a node address",
				target, err, seen, len(srv.proxyRecords(t))-before)
		}
		// A pod's connection: through both proxies.
		if err := roundTrip(ctx, client.Pod, target, []byte("pod to pod")); err != nil {
			t.Fatalf("pod -> %s: %v", target, err)
		}
		in := srv.waitRecords(ctx, t, i+1)[i]
		if in.Direction != "inbound" || !sameAddrPort(in.OriginalDst, target) {
			t.Fatalf("server proxy record %+v, want the pod's connection to %s", in, target)
		}
	}
}

// probeFrom connects from the node's namespace and echoes a line, as an HTTP or
// TCP probe would reach the port.
func probeFrom(ctx context.Context, t *testing.T, node *harness.Node, target netip.AddrPort) error {
	t.Helper()
	payload := []byte("GET /ready HTTP/1.0\r\n\r\n")
	ctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	var c net.Conn
	for {
		err := netns.Do(node.NetNSPath, func() error {
			var (
				d   net.Dialer
				err error
			)
			c, err = d.DialContext(ctx, "tcp", target.String())
			return err
		})
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
	defer c.Close()
	_ = c.SetDeadline(time.Now().Add(5 * time.Second))
	if _, err := c.Write(payload); err != nil {
		return err
	}
	_ = c.(*net.TCPConn).CloseWrite()
	got, err := io.ReadAll(c)
	if err != nil {
		return err
	}
	if !bytes.Equal(got, payload) {
		return fmt.Errorf("echo mismatch: %q", got)
	}
	return nil
}

// isNodeAddress reports whether a is an address of the node's namespace.
func isNodeAddress(t *testing.T, node *harness.Node, a netip.Addr) bool {
	t.Helper()
	var found bool
	if err := node.Do(func() error {
		addrs, err := netlink.AddrList(nil, netlink.FAMILY_ALL)
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

// waitNodeAddresses waits until the node's addresses are past duplicate address
// detection (a tentative IPv6 address cannot be a source).
func waitNodeAddresses(ctx context.Context, t *testing.T, node *harness.Node) {
	t.Helper()
	for {
		var tentative bool
		if err := node.Do(func() error {
			addrs, err := netlink.AddrList(nil, netlink.FAMILY_V6)
			for _, a := range addrs {
				if a.Flags&unix.IFA_F_TENTATIVE != 0 {
					tentative = true
				}
			}
			return err
		}); err != nil {
			t.Fatal(err)
		}
		if !tentative {
			return
		}
		select {
		case <-ctx.Done():
			t.Fatal("the node's IPv6 addresses stayed tentative")
		case <-time.After(50 * time.Millisecond):
		}
	}
}
