package e2e

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"os"
	"path/filepath"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/cilium/ebpf"
	"github.com/containernetworking/cni/libcni"

	"github.com/mesh-cni/mesh-cni/test/fixtures"
	"github.com/mesh-cni/mesh-cni/test/harness"
	"github.com/mesh-cni/mesh-cni/test/proxy"
)

// meshPod is a pod added through [bridge, mesh-cni] with, optionally, the
// reference proxy running inside it.
type meshPod struct {
	*harness.Pod
	records string // the proxy's record file, "" without a proxy
	proxy   *harness.Process
}

func addMeshPod(ctx context.Context, t *testing.T, node *harness.Node, list *libcni.NetworkConfigList, namespace, name string) *meshPod {
	t.Helper()
	p := node.NewPod(t, namespace, name)
	if _, err := node.Add(ctx, p, list); err != nil {
		if a, ok := agents.Load(socketOf(list)); ok {
			a.(*agent).diagnoseSocket(t, node)
		}
		t.Fatalf("ADD %s/%s: %v", namespace, name, err)
	}
	return &meshPod{Pod: p}
}

// startProxy runs the reference proxy inside the pod, the way a sidecar runs,
// with args added to its flags.
func (p *meshPod) startProxy(ctx context.Context, t *testing.T, args ...string) {
	t.Helper()
	p.proxy, p.records = p.StartRefproxy(ctx, t, args...)
}

// roundTripMarked is harness.Pod's EchoRoundTrip from a socket marked with
// SO_MARK before it connects (0: none).
func roundTripMarked(ctx context.Context, p *harness.Pod, addr netip.AddrPort, payload []byte, mark int) error {
	ctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	c, err := p.Netns().Dial(ctx, &net.Dialer{Control: fixtures.MarkControl(mark)}, "tcp", addr.String())
	if err != nil {
		return err
	}
	return fixtures.EchoRoundTrip(ctx, c, payload)
}

// TestRedirectThroughChain: pods added through the real chain with the eBPF data
// path get their traffic redirected through their proxies, in both directions,
// over IPv4 and IPv6, with the original destination intact.
func TestRedirectThroughChain(t *testing.T) {
	t.Parallel()
	ctx := testContext(t)
	_, node, list := meshedNode(ctx, t, "30s", "--inbound-excluded-ports", "15001,15006,15008,15020,15021,15053,15090,9090", "--outbound-excluded-ports", "9090")
	ca := addMeshPod(ctx, t, node, list, "shop", "client")
	sb := addMeshPod(ctx, t, node, list, "shop", "server")
	other := addMeshPod(ctx, t, node, list, "kube-system", "outsider")
	ca.startProxy(ctx, t)
	sb.startProxy(ctx, t)
	app := sb.ServeEcho(t, 8080)
	excluded := sb.ServeEcho(t, 9090)
	payload := bytes.Repeat([]byte("mesh-cni "), 8<<10)

	for i, dst := range []netip.Addr{sb.IPv4(t), sb.IPv6(t)} {
		target := netip.AddrPortFrom(dst, 8080)
		if err := ca.EchoRoundTrip(ctx, target, payload); err != nil {
			t.Fatalf("A -> %s: %v", target, err)
		}
		out := proxy.AwaitRecords(ctx, t, ca.records, i+1)[i]
		if out.Direction != "outbound" || !sameAddrPort(out.OriginalDst, target) || out.DstSource != "getsockopt" || out.Error != "" {
			t.Fatalf("client proxy record %+v, want outbound to %s via getsockopt", out, target)
		}
		in := proxy.AwaitRecords(ctx, t, sb.records, i+1)[i]
		if in.Direction != "inbound" || !sameAddrPort(in.OriginalDst, target) || in.DstSource != "getsockopt" || in.Error != "" {
			t.Fatalf("server proxy record %+v, want inbound to %s via getsockopt", in, target)
		}
		if int(in.BytesToDst) != len(payload) {
			t.Fatalf("server proxy forwarded %d bytes, want %d", in.BytesToDst, len(payload))
		}
	}
	// The application only ever saw its own proxy as the client.
	for _, c := range app.Clients() {
		if c == ca.IPv4(t) || c == ca.IPv6(t) {
			t.Fatalf("the server saw the client %s directly: the inbound proxy was bypassed", c)
		}
	}

	// An excluded port goes direct both ways: no new proxy records.
	before := len(proxy.MustReadRecords(t, ca.records)) + len(proxy.MustReadRecords(t, sb.records))
	if err := ca.EchoRoundTrip(ctx, netip.AddrPortFrom(sb.IPv4(t), 9090), payload); err != nil {
		t.Fatalf("A -> B:9090 (excluded): %v", err)
	}
	if got := excluded.Clients(); len(got) != 1 || got[0] != ca.IPv4(t) {
		t.Fatalf("excluded port saw clients %v, want exactly the client pod %s", got, ca.IPv4(t))
	}
	// A pod that is not enrolled is not redirected: it reaches B's port 9090 directly.
	if err := other.EchoRoundTrip(ctx, netip.AddrPortFrom(sb.IPv4(t), 9090), payload); err != nil {
		t.Fatalf("outsider -> B:9090: %v", err)
	}
	if after := len(proxy.MustReadRecords(t, ca.records)) + len(proxy.MustReadRecords(t, sb.records)); after != before {
		t.Fatalf("proxies recorded %d new connections for traffic that must not be redirected", after-before)
	}
	// The proxy's own marked connections were never looped: one record each way
	// per connection made.
	if n := len(proxy.MustReadRecords(t, ca.records)); n != 2 {
		t.Fatalf("client proxy has %d records, want 2", n)
	}
}

// TestFailClosedAndRelease: an enrolled pod with no proxy cannot talk (outbound
// refused, inbound reset); DEL removes redirection at once; a re-added pod
// is redirected again. With --fail-open, a pod without proxy passes traffic.
func TestFailClosedAndRelease(t *testing.T) {
	t.Parallel()
	ctx := testContext(t)
	a, node, list := meshedNode(ctx, t, "30s")
	lonely := addMeshPod(ctx, t, node, list, "shop", "no-proxy")
	peer := addMeshPod(ctx, t, node, list, "kube-system", "peer")
	peer.ServeEcho(t, 8080)
	lonelyApp := lonely.ServeEcho(t, 8080)

	err := lonely.EchoRoundTrip(ctx, netip.AddrPortFrom(peer.IPv4(t), 8080), []byte("x"))
	if !errors.Is(err, syscall.ECONNREFUSED) {
		t.Fatalf("outbound from an enrolled pod with no proxy: %v, want connection refused", err)
	}
	shortCtx, cancel := context.WithTimeout(ctx, 2*time.Second)
	err = peer.EchoRoundTrip(shortCtx, netip.AddrPortFrom(lonely.IPv4(t), 8080), []byte("x"))
	cancel()
	if !errors.Is(err, syscall.ECONNREFUSED) {
		t.Fatalf("inbound to an enrolled pod with no proxy: %v, want connection refused (reset, as by a closed port)", err)
	}
	if len(lonelyApp.Clients()) != 0 {
		t.Fatal("the application of a fail-closed pod received a connection")
	}

	cookieDir, cookie := podPinDir(t, a, lonely.Pod)
	if !settingsEntryExists(t, a, cookie) {
		t.Fatal("enrolled pod has no entry in the pinned pods map")
	}
	if err := node.Del(ctx, lonely.Pod, list); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(cookieDir); !errors.Is(err, os.ErrNotExist) {
		t.Fatalf("pod's link pins %s still exist after DEL: %v", cookieDir, err)
	}
	if settingsEntryExists(t, a, cookie) {
		t.Fatal("the pod's netns cookie entry is still in the settings map after DEL")
	}
	if _, err := node.Add(ctx, lonely.Pod, list); err != nil {
		t.Fatal(err)
	}
	if err := lonely.EchoRoundTrip(ctx, netip.AddrPortFrom(peer.IPv4(t), 8080), []byte("x")); !errors.Is(err, syscall.ECONNREFUSED) {
		t.Fatalf("re-added pod without proxy: %v, want connection refused again", err)
	}

	t.Run("fail-open", func(t *testing.T) {
		open := newAgent(t, "--fail-open")
		open.start(ctx)
		node := meshNode(t)
		list := chain(t, node, open, "30s")
		p := addMeshPod(ctx, t, node, list, "shop", "open")
		q := addMeshPod(ctx, t, node, list, "kube-system", "q")
		q.ServeEcho(t, 8080)
		p.ServeEcho(t, 8080)
		if err := p.EchoRoundTrip(ctx, netip.AddrPortFrom(q.IPv4(t), 8080), []byte("x")); err != nil {
			t.Fatalf("fail-open outbound: %v", err)
		}
		if err := q.EchoRoundTrip(ctx, netip.AddrPortFrom(p.IPv4(t), 8080), []byte("x")); err != nil {
			t.Fatalf("fail-open inbound: %v", err)
		}
	})
}

// podPinDir is where the agent pinned the pod's inbound capture link, and the pod's netns
// cookie.
func podPinDir(t *testing.T, a *agent, p *harness.Pod) (string, uint64) {
	t.Helper()
	for _, e := range a.list(context.Background()).GetEnrollments() {
		if e.GetAttachment().GetContainerId() == p.ContainerID {
			dir := filepath.Join(a.BPFFS, "pods", fmt.Sprint(e.GetNetnsCookie()))
			entries, err := os.ReadDir(dir)
			if err != nil || len(entries) == 0 {
				t.Fatalf("enrolled pod has no link pins in %s: %v", dir, err)
			}
			return dir, e.GetNetnsCookie()
		}
	}
	t.Fatalf("pod %s is not enrolled", p.Name)
	return "", 0
}

// settingsEntryExists looks the cookie up in the agent's pinned pods map,
// the map every program keys on.
func settingsEntryExists(t *testing.T, a *agent, cookie uint64) bool {
	t.Helper()
	m, err := ebpf.LoadPinnedMap(filepath.Join(a.BPFFS, "maps", "pods"), &ebpf.LoadPinOptions{ReadOnly: true})
	if err != nil {
		t.Fatalf("open pinned pods map: %v", err)
	}
	defer m.Close()
	value := make([]byte, m.ValueSize())
	err = m.Lookup(cookie, value)
	if errors.Is(err, ebpf.ErrKeyNotExist) {
		return false
	}
	if err != nil {
		t.Fatalf("look up cookie %d: %v", cookie, err)
	}
	return true
}

// TestAgentRestartKeepsDataPath: kill -9 the agent while a client keeps
// connecting; every connection still goes through the proxies, and the
// restarted agent adopts what it enrolled before.
func TestAgentRestartKeepsDataPath(t *testing.T) {
	t.Parallel()
	ctx := testContext(t)
	a, node, list := meshedNode(ctx, t, "30s")
	ca := addMeshPod(ctx, t, node, list, "shop", "client")
	sb := addMeshPod(ctx, t, node, list, "shop", "server")
	ca.startProxy(ctx, t)
	sb.startProxy(ctx, t)
	app := sb.ServeEcho(t, 8080)
	before := a.list(ctx).GetEnrollments()

	var ok, failed atomic.Int64
	stop := make(chan struct{})
	done := make(chan struct{})
	go func() {
		defer close(done)
		target := netip.AddrPortFrom(sb.IPv4(t), 8080)
		for {
			select {
			case <-stop:
				return
			default:
			}
			if err := ca.EchoRoundTrip(ctx, target, []byte("ping")); err != nil {
				failed.Add(1)
			} else {
				ok.Add(1)
			}
		}
	}()
	fixtures.WaitFor(t, 30*time.Second, "connections before the kill", func() bool { return ok.Load() >= 20 })
	a.kill()
	atKill := ok.Load()
	fixtures.WaitFor(t, 30*time.Second, "connections while the agent is down", func() bool { return ok.Load() >= atKill+50 })
	a.start(ctx)
	afterStart := ok.Load()
	fixtures.WaitFor(t, 30*time.Second, "connections after the restart", func() bool { return ok.Load() >= afterStart+20 })
	close(stop)
	<-done

	total := int(ok.Load())
	t.Logf("%d connections succeeded (%d while the agent was down), %d failed", total, afterStart-atKill, failed.Load())
	if failed.Load() != 0 {
		t.Fatalf("%d connections failed across the agent restart", failed.Load())
	}
	for _, c := range app.Clients() {
		if c == ca.IPv4(t) {
			t.Fatal("a connection reached the server directly, bypassing the proxies")
		}
	}
	outRecs := proxy.AwaitRecords(ctx, t, ca.records, total)
	if len(outRecs) != total {
		t.Fatalf("client proxy handled %d connections, the client made %d", len(outRecs), total)
	}
	after := a.list(ctx).GetEnrollments()
	if len(after) != len(before) {
		t.Fatalf("restarted agent lists %d enrollments, had %d", len(after), len(before))
	}
	for i := range before {
		if before[i].GetNetnsCookie() != after[i].GetNetnsCookie() || before[i].GetAttachment().GetContainerId() != after[i].GetAttachment().GetContainerId() {
			t.Fatalf("enrollment %d changed across the restart: %v -> %v", i, before[i], after[i])
		}
	}
}

// socketOf finds the gate socket a conflist points at, for diagnostics.
func socketOf(list *libcni.NetworkConfigList) string {
	for _, p := range list.Plugins {
		if p.Network.Type == "mesh-cni" {
			var c struct {
				SocketPath string `json:"socketPath"`
			}
			if json.Unmarshal(p.Bytes, &c) == nil {
				return c.SocketPath
			}
		}
	}
	return ""
}

func sameAddrPort(a, b netip.AddrPort) bool {
	return a.Addr().Unmap() == b.Addr().Unmap() && a.Port() == b.Port()
}
