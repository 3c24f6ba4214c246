package e2e

import (
	"context"
	"errors"
	"io"
	"net"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/mesh-cni/mesh-cni/internal/netns"
	"github.com/mesh-cni/mesh-cni/pkg/zds"
	"github.com/mesh-cni/mesh-cni/pkg/zds/zdspb"
	"github.com/mesh-cni/mesh-cni/test/harness"
	"github.com/mesh-cni/mesh-cni/test/proxy"
)

// nodeProxy is the reference proxy run as a node proxy, the way ztunnel runs:
// one process in the host's network namespace (in no pod) that takes the pods
// from the agent's ZDS socket and opens its listeners inside each of them.
type nodeProxy struct {
	proc    *harness.Process
	records string
}

// startNodeProxy starts it and waits until it has served its first snapshot.
func startNodeProxy(ctx context.Context, t *testing.T, zdsSocket, name string) *nodeProxy {
	t.Helper()
	n := &nodeProxy{records: filepath.Join(t.TempDir(), name+"-records.jsonl")}
	n.proc = harness.StartProcess(t, harness.ProcessOptions{
		Path: harness.Bins(t).Path("refproxy"),
		Args: []string{"-zds", zdsSocket, "-record", n.records},
		Name: name,
		// In a container of its own, as ztunnel runs: the agent tells it apart
		// from the pods by its cgroup, learned from its ZDS connection.
		OwnCgroup: true,
	})
	readyCtx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	if _, err := n.proc.WaitForLine(readyCtx, "ready"); err != nil {
		t.Fatalf("node proxy %s: %v", name, err)
	}
	return n
}

// listening waits until the node proxy reports the pod's listeners.
func (n *nodeProxy) listening(ctx context.Context, t *testing.T, p *harness.Pod) string {
	t.Helper()
	ctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	// The first line naming the pod is the one saying its listeners are open.
	line, err := n.proc.WaitForLine(ctx, `"pod":"`+p.UID+`"`)
	if err != nil {
		t.Fatalf("node proxy never served pod %s: %v", p.Name, err)
	}
	if !strings.Contains(line, "proxy listening") {
		t.Fatalf("node proxy's first line about pod %s is not its listeners: %s", p.Name, line)
	}
	return line
}

// proxyListenersIn lists the listeners on the proxy's outbound and inbound
// ports inside p's network namespace, as the kernel shows them (ss), whoever
// owns them.
func proxyListenersIn(ctx context.Context, t *testing.T, p *harness.Pod) []string {
	t.Helper()
	out, err := p.Exec(ctx, "ss", "-Hltn")
	if err != nil {
		t.Fatal(err)
	}
	var addrs []string
	for _, line := range strings.Split(string(out), "\n") {
		fields := strings.Fields(line)
		if len(fields) < 4 {
			continue
		}
		if ap, err := netip.ParseAddrPort(strings.Replace(fields[3], "*:", "[::]:", 1)); err == nil &&
			(ap.Port() == proxy.DefaultOutboundPort || ap.Port() == proxy.DefaultInboundPort) {
			addrs = append(addrs, fields[3])
		}
	}
	return addrs
}

// hops counts the node proxy's clean records of connections to target that
// went out through from's listener and in through to's.
func hops(recs []proxy.Record, from, to *harness.Pod, target netip.AddrPort) (out, in int) {
	for _, r := range recs {
		if r.Error != "" || !sameAddrPort(r.OriginalDst, target) || r.DstSource != proxy.SourceGetsockopt {
			continue
		}
		switch {
		case r.Direction == proxy.Outbound && r.Pod == from.UID:
			out++
		case r.Direction == proxy.Inbound && r.Pod == to.UID:
			in++
		}
	}
	return out, in
}

// checkPath connects from one pod to target in another and proves the
// connection went out through the node proxy's listener in from and in through
// its listener in to, each recovering the original destination.
func (n *nodeProxy) checkPath(ctx context.Context, t *testing.T, from, to *harness.Pod, target netip.AddrPort) {
	t.Helper()
	n.checkPathMarked(ctx, t, from, to, target, 0)
}

// checkPathMarked is checkPath with the client's socket marked (SO_MARK, which a
// pod's root may set with CAP_NET_RAW); 0 leaves it unmarked.
func (n *nodeProxy) checkPathMarked(ctx context.Context, t *testing.T, from, to *harness.Pod, target netip.AddrPort, mark int) {
	t.Helper()
	before, err := proxy.ReadRecords(n.records)
	if err != nil && !errors.Is(err, os.ErrNotExist) {
		t.Fatal(err)
	}
	out0, in0 := hops(before, from, to, target)
	if err := roundTripMarked(ctx, from, target, []byte("through the node proxy"), mark); err != nil {
		t.Fatalf("%s -> %s: %v", from.Name, target, err)
	}
	waitCtx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	recs, err := proxy.WaitForRecords(waitCtx, n.records, func(r []proxy.Record) bool {
		out, in := hops(r, from, to, target)
		return out > out0 && in > in0
	})
	if err != nil {
		t.Fatalf("node proxy records for %s -> %s (want one outbound in %s's listener and one inbound in %s's): %v\n%+v",
			from.Name, target, from.Name, to.Name, err, recs)
	}
}

// startZDSAgent starts an agent with extraArgs serving ZDS on a socket of its
// own, which it returns. The reference node proxy does not use service
// accounts, which enrollment=all cannot know: the agent serves without them.
func startZDSAgent(ctx context.Context, t *testing.T, extraArgs ...string) (*agent, string) {
	t.Helper()
	a := newAgent(t, extraArgs...)
	zdsSocket := a.agentPath("zds", "ztunnel.sock")
	a.Args = append(a.Args, "--zds-socket", zdsSocket, "--zds-without-service-accounts")
	a.start(ctx)
	return a, zdsSocket
}

// TestZDSNodeProxy: with the agent's ZDS server on and one node proxy process
// on the host, pods added through the CNI chain are handed to the proxy, which
// opens listeners inside them, and their traffic is redirected through those
// listeners. A garbage client on the ZDS socket does not disturb the proxy; a
// restarted proxy gets a snapshot and traffic resumes; an agent restarted after
// a pod was deleted while it was down sends a snapshot without that pod.
func TestZDSNodeProxy(t *testing.T) {
	t.Parallel()
	ctx := testContext(t)
	a, zdsSocket := startZDSAgent(ctx, t)
	np := startNodeProxy(ctx, t, zdsSocket, "node-proxy-1")

	node := meshNode(t)
	list := chain(t, node, a, "30s")
	// The proxy has connected, so (--zds-wait=auto) each ADD returns only once
	// the proxy acked the pod: its listeners exist before the pod starts.
	client := addMeshPod(ctx, t, node, list, "shop", "zds-client")
	srv := addMeshPod(ctx, t, node, list, "shop", "zds-server")
	gone := addMeshPod(ctx, t, node, list, "shop", "zds-gone")
	for _, p := range []*meshPod{client, srv, gone} {
		if l := proxyListenersIn(ctx, t, p.Pod); len(l) != 4 {
			t.Fatalf("right after its ADD, %s has proxy listeners %v, want the node proxy's four", p.Name, l)
		}
		np.listening(ctx, t, p.Pod)
	}
	app := srv.ServeEcho(t, 8080)
	for _, dst := range []netip.Addr{srv.IPv4(t), srv.IPv6(t)} {
		np.checkPath(ctx, t, client.Pod, srv.Pod, netip.AddrPortFrom(dst, 8080))
	}
	for _, c := range app.Clients() {
		if c == client.IPv4(t) || c == client.IPv6(t) {
			t.Fatalf("the server saw the client %s directly: the node proxy's inbound listener was bypassed", c)
		}
	}

	// A client speaking garbage on the ZDS socket is dropped on its own; the
	// working proxy keeps getting pods and carrying traffic.
	garbage, err := net.Dial("unixpacket", zdsSocket)
	if err != nil {
		t.Fatalf("dial the zds socket: %v", err)
	}
	defer garbage.Close()
	if _, err := garbage.Write([]byte("\xff\xfe this is not a ZdsHello \x00\x01")); err != nil {
		t.Fatalf("write garbage: %v", err)
	}
	garbage.SetReadDeadline(time.Now().Add(20 * time.Second))
	if n, err := garbage.Read(make([]byte, 1024)); !errors.Is(err, io.EOF) && !(err == nil && n == 0) {
		t.Fatalf("after garbage the agent answered %d bytes, %v; want the connection closed", n, err)
	}
	late := addMeshPod(ctx, t, node, list, "shop", "zds-late")
	np.listening(ctx, t, late.Pod)
	np.checkPath(ctx, t, late.Pod, srv.Pod, netip.AddrPortFrom(srv.IPv4(t), 8080))

	// A restarted node proxy gets every enrolled pod in its snapshot; while it is
	// away the pods' traffic has no listener and is refused (fail closed).
	if err := np.proc.Stop(ctx); err != nil {
		t.Fatalf("stop node proxy: %v", err)
	}
	if err := client.EchoRoundTrip(ctx, netip.AddrPortFrom(srv.IPv4(t), 8080), []byte("x")); !errors.Is(err, syscall.ECONNREFUSED) {
		t.Fatalf("client -> server with the node proxy stopped: %v, want connection refused", err)
	}
	np = startNodeProxy(ctx, t, zdsSocket, "node-proxy-2")
	for _, p := range []*meshPod{client, srv, gone, late} {
		np.listening(ctx, t, p.Pod)
	}
	np.checkPath(ctx, t, client.Pod, srv.Pod, netip.AddrPortFrom(srv.IPv4(t), 8080))

	// A pod deleted while the agent is down: DEL succeeds without the agent and
	// the sandbox's namespace goes away. The restarted agent releases the pod at
	// its first reconcile, and the proxy's next snapshot no longer names it.
	a.stop(ctx)
	if err := node.Del(ctx, gone.Pod, list); err != nil {
		t.Fatalf("DEL with the agent down: %v", err)
	}
	if err := netns.Remove(gone.NetNSPath); err != nil {
		t.Fatal(err)
	}
	a.start(ctx)
	dropCtx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	line, err := np.proc.WaitForLine(dropCtx, "not in the agent's snapshot")
	if err != nil {
		t.Fatalf("node proxy did not drop the deleted pod after the agent restarted: %v", err)
	}
	if !strings.Contains(line, gone.UID) {
		t.Fatalf("node proxy dropped another pod than %s (%s): %s", gone.Name, gone.UID, line)
	}
	if n := strings.Count(np.proc.Output(), "not in the agent's snapshot"); n != 1 {
		t.Fatalf("node proxy dropped %d pods after the agent restarted, want only %s:\n%s", n, gone.Name, np.proc.Output())
	}
	if e := enrollmentOf(ctx, a, gone.ContainerID); e != nil {
		t.Fatalf("the restarted agent still lists the deleted pod: %v", e)
	}
	np.checkPath(ctx, t, client.Pod, srv.Pod, netip.AddrPortFrom(srv.IPv4(t), 8080))
}

// TestZDSProxyNeverAcks: with --zds-wait=always, a node proxy that says hello,
// acks its snapshot and then stops answering makes a pod's ADD wait and then
// fail with an error that names the node proxy, and the pod is not enrolled.
func TestZDSProxyNeverAcks(t *testing.T) {
	t.Parallel()
	ctx := testContext(t)
	a, zdsSocket := startZDSAgent(ctx, t, "--zds-wait=always")

	pc, err := zds.Dial(ctx, zdsSocket)
	if err != nil {
		t.Fatal(err)
	}
	defer pc.Close()
	if err := pc.Hello(zdspb.Version_V1); err != nil {
		t.Fatal(err)
	}
	recvCtx, cancel := context.WithTimeout(ctx, 10*time.Second)
	req, err := pc.Recv(recvCtx)
	cancel()
	if err != nil || req.GetSnapshotSent() == nil {
		t.Fatalf("first request = %v, %v; want SnapshotSent (no pods yet)", req, err)
	}
	if err := pc.Ack(""); err != nil {
		t.Fatal(err)
	}
	// From here on the proxy reads but never answers.
	got := make(chan *zds.Request, 4)
	go func() {
		defer close(got)
		for {
			r, err := pc.Recv(ctx)
			if err != nil {
				return
			}
			if r.Netns != nil {
				r.Netns.Close()
			}
			got <- r
		}
	}()

	node := meshNode(t)
	list := chain(t, node, a, "8s")
	pod := node.NewPod(t, "shop", "zds-unacked")
	start := time.Now()
	_, err = node.Add(ctx, pod, list)
	if err == nil {
		t.Fatal("ADD succeeded though the node proxy never acked the pod")
	}
	t.Logf("ADD failed after %v: %v", time.Since(start).Round(time.Millisecond), err)
	cniErr := cniCode(t, err)
	if msg := cniErr.Error(); !strings.Contains(msg, "ZDS") && !strings.Contains(msg, "node proxy") {
		t.Fatalf("ADD error %q does not say the node proxy (ZDS) held the pod", msg)
	}
	select {
	case r := <-got:
		if r.GetAdd().GetUid() != pod.UID {
			t.Fatalf("the silent proxy was sent %v, want AddWorkload for %s", r, pod.UID)
		}
	default:
		t.Fatal("the agent never sent the pod to the connected proxy")
	}
	if e := enrollmentOf(ctx, a, pod.ContainerID); e != nil {
		t.Fatalf("a pod whose handoff failed is enrolled: %v", e)
	}
}

// TestZDSRefusedWithoutServiceAccounts: the real agent binary with ZDS on and an
// enrollment source that cannot know service accounts exits 2 at start, saying
// why and what to do, and leaves no ZDS socket behind; with
// --zds-without-service-accounts it starts.
func TestZDSRefusedWithoutServiceAccounts(t *testing.T) {
	t.Parallel()
	ctx := testContext(t)
	a := newAgent(t)
	zdsSocket := a.agentPath("zds", "ztunnel.sock")
	args := append(append([]string(nil), a.Args...), "--zds-socket", zdsSocket)
	out, err := exec.CommandContext(ctx, harness.Bins(t).Path("mesh-agent"), args...).CombinedOutput()
	var exit *exec.ExitError
	if !errors.As(err, &exit) || exit.ExitCode() != 2 {
		t.Fatalf("mesh-agent with ZDS and --enrollment=all: %v, want exit 2\n%s", err, out)
	}
	for _, want := range []string{"service account", "--enrollment=all", "--zds-without-service-accounts"} {
		if !strings.Contains(string(out), want) {
			t.Errorf("the refusal does not mention %q:\n%s", want, out)
		}
	}
	if _, err := os.Stat(zdsSocket); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("a refused agent left its ZDS socket: %v", err)
	}
	a.Args = append(args, "--zds-without-service-accounts")
	a.start(ctx)
}

// TestProxyKnownByCgroup: with the mark exemption off (the default), the node
// proxy is known by the cgroup of the process that connected to the ZDS socket. A
// pod's root that marks its connects with ztunnel's mark 0x539 (CAP_NET_RAW, a
// default capability) still goes through the node proxy, both ways, while the node
// proxy's own connections, marked the same, are not redirected again, also
// while the agent is stopped and once it runs again.
func TestProxyKnownByCgroup(t *testing.T) {
	t.Parallel()
	ctx := testContext(t)
	a, zdsSocket := startZDSAgent(ctx, t, "--proxy-mark", "0")
	np := startNodeProxy(ctx, t, zdsSocket, "node-proxy")
	node := meshNode(t)
	list := chain(t, node, a, "30s")
	client := addMeshPod(ctx, t, node, list, "shop", "cg-client")
	srv := addMeshPod(ctx, t, node, list, "shop", "cg-server")
	for _, p := range []*meshPod{client, srv} {
		np.listening(ctx, t, p.Pod)
	}
	app := srv.ServeEcho(t, 8080)
	for _, dst := range []netip.Addr{srv.IPv4(t), srv.IPv6(t)} {
		target := netip.AddrPortFrom(dst, 8080)
		np.checkPath(ctx, t, client.Pod, srv.Pod, target)
		np.checkPathMarked(ctx, t, client.Pod, srv.Pod, target, 0x539)
	}
	for _, c := range app.Clients() {
		if c == client.IPv4(t) || c == client.IPv6(t) {
			t.Fatalf("the server saw the client %s directly: a marked connect bypassed the node proxy", c)
		}
	}

	// The agent stopped (an upgrade, a crash) and started again: the node
	// proxy stays known by its cgroup throughout, so its own connects in the
	// pods are never sent back to it, and the pods keep their path.
	a.stop(ctx)
	target := netip.AddrPortFrom(srv.IPv4(t), 8080)
	np.checkPath(ctx, t, client.Pod, srv.Pod, target)
	a.start(ctx)
	np.checkPath(ctx, t, client.Pod, srv.Pod, target)
}
