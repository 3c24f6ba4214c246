package proxy_test

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/netip"
	"os"
	"path/filepath"
	"slices"
	"testing"
	"time"

	"go.uber.org/zap/zaptest"
	"golang.org/x/sys/unix"
	"google.golang.org/protobuf/proto"

	"github.com/mesh-cni/mesh-cni/pkg/zds"
	"github.com/mesh-cni/mesh-cni/pkg/zds/zdspb"
	"github.com/mesh-cni/mesh-cni/pkg/zds/zdstest"
	"github.com/mesh-cni/mesh-cni/test/capture"
	"github.com/mesh-cni/mesh-cni/test/fixtures"
	"github.com/mesh-cni/mesh-cni/test/proxy"
)

func zdsPod(t *testing.T, name string, p *fixtures.Pod) zds.Pod {
	return zds.Pod{UID: name + "-" + fixtures.RandomHex(4), Name: name, Namespace: "default", ServiceAccount: "sa-" + name, NetnsPath: p.Path}
}

// startAgent runs a ZDS server at path until it is closed or the test ends.
func startAgent(t *testing.T, path string, snap zds.Snapshotter) *zds.Server {
	t.Helper()
	ctx, cancel := context.WithTimeout(t.Context(), time.Minute)
	defer cancel()
	srv, err := zds.NewServer(ctx, zds.Config{SocketPath: path, Snapshot: snap, Logger: zaptest.NewLogger(t).Named("agent"),
		LivenessInterval: 100 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() { done <- srv.Serve(context.Background()) }()
	t.Cleanup(func() {
		if err := srv.Close(); err != nil {
			t.Errorf("close agent: %v", err)
		}
		if err := <-done; err != nil {
			t.Errorf("serve: %v", err)
		}
	})
	return srv
}

func startNode(t *testing.T, ctx context.Context, cfg proxy.NodeConfig) *proxy.Node {
	t.Helper()
	cfg.Proxy.Logger = zaptest.NewLogger(t).Named("node")
	n, err := proxy.StartNode(ctx, cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := n.Close(); err != nil {
			t.Errorf("close node proxy: %v", err)
		}
	})
	return n
}

func waitNode(t *testing.T, ctx context.Context, n *proxy.Node, what string, done func(proxy.NodeStatus) bool) proxy.NodeStatus {
	t.Helper()
	st, err := n.WaitStatus(ctx, done)
	if err != nil {
		t.Fatalf("node proxy: %s: %v", what, err)
	}
	return st
}

func podUIDs(st proxy.NodeStatus) []string {
	var uids []string
	for _, p := range st.Pods {
		uids = append(uids, p.UID)
	}
	return uids
}

func sameUIDs(st proxy.NodeStatus, want ...string) bool {
	slices.Sort(want)
	return slices.Equal(podUIDs(st), want)
}

func installIPTables(t *testing.T, ctx context.Context, pods ...*fixtures.Pod) {
	t.Helper()
	for _, p := range pods {
		cleanup, err := capture.InstallIPTables(ctx, p.Path, capture.DefaultRules())
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() {
			ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
			defer cancel()
			if err := cleanup(ctx); err != nil {
				t.Errorf("remove capture: %v", err)
			}
		})
	}
}

func zdsPath(t *testing.T) string {
	return filepath.Join(t.TempDir(), "ztunnel.sock")
}

// roundTrip sends a payload from A to dst and back through the capture.
func roundTrip(t *testing.T, ctx context.Context, from *fixtures.Pod, dst netip.AddrPort, size int) {
	t.Helper()
	conn, err := from.DialTCP(ctx, dst)
	if err != nil {
		t.Fatalf("dial %s: %v", dst, err)
	}
	if err := fixtures.EchoRoundTrip(ctx, conn, fixtures.RandomBytes(size)); err != nil {
		t.Fatalf("%s → %s: %v", from.Path, dst, err)
	}
}

// refused checks that nothing listens at dst inside the pod, or soon will not.
// Soon, because a listener closed by the node proxy can outlive its Close by a
// moment in this test process: another test's fork copies every fd into the
// child, and the copy lasts until the child's exec closes it. A SYN in that
// window is answered (then reset), so only a refusal counts.
func refused(t *testing.T, ctx context.Context, in *fixtures.Pod, dst netip.AddrPort) {
	t.Helper()
	ctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	tick := time.NewTicker(10 * time.Millisecond)
	defer tick.Stop()
	for {
		conn, err := in.DialTCP(ctx, dst)
		if err == nil {
			conn.Close()
		}
		if errors.Is(err, unix.ECONNREFUSED) {
			return
		}
		select {
		case <-ctx.Done():
			t.Fatalf("%s in %s still accepts connections: last dial: %v", dst, in.Path, err)
		case <-tick.C:
		}
	}
}

// TestNodeForwards runs one node proxy for two pods behind the iptables capture:
// A is handed over in the snapshot, B by an AddPod after it. A's connection to B's
// app goes through the node proxy's outbound listener inside A and its inbound
// listener inside B, and each record names its pod. Deleting B closes its
// listeners.
func TestNodeForwards(t *testing.T) {
	fixtures.RequireRoot(t, rootReason)
	fixtures.Both(t, "ipv4", "ipv6", func(t *testing.T, v6 bool) {
		ctx := fixtures.Context(t, time.Minute)
		a, b := fixtures.NewPodPair(t)
		const appPort = 9000
		b.ServeEcho(t, appPort)
		podA, podB := zdsPod(t, "a", a), zdsPod(t, "b", b)
		store := zdstest.NewPods(podA)
		path := zdsPath(t)
		srv := startAgent(t, path, store)
		records := filepath.Join(t.TempDir(), "records.jsonl")
		n := startNode(t, ctx, proxy.NodeConfig{ZDSPath: path, Proxy: proxy.Config{RecordPath: records}})
		waitNode(t, ctx, n, "snapshot with A", func(st proxy.NodeStatus) bool { return st.Snapshots == 1 && sameUIDs(st, podA.UID) })

		store.Add(podB)
		if err := srv.AddPod(ctx, podB); err != nil {
			t.Fatalf("add B: %v", err)
		}
		// The ack means B's listeners exist: no waiting needed.
		st := n.Status()
		if !sameUIDs(st, podA.UID, podB.UID) {
			t.Fatalf("pods after AddPod: %+v", st.Pods)
		}
		for _, p := range st.Pods {
			want := map[string]string{podA.UID: "a", podB.UID: "b"}[p.UID]
			if p.Name != want || p.Namespace != "default" || p.ServiceAccount != "sa-"+want || len(p.Addrs) != 4 {
				t.Errorf("pod info %+v", p)
			}
		}
		installIPTables(t, ctx, a, b)

		dst := netip.AddrPortFrom(b.Addr(v6), appPort)
		const conns, size = 2, 256 << 10
		for range conns {
			roundTrip(t, ctx, a, dst, size)
		}
		got := waitRecords(t, ctx, records, 2*conns)
		var out, in int
		for _, r := range got {
			if r.Error != "" || r.OriginalDst != dst || r.DstSource != proxy.SourceGetsockopt || r.Client.Addr() != a.Addr(v6) ||
				r.BytesToDst != size || r.BytesToClient != size {
				t.Errorf("record %+v", r)
			}
			switch {
			case r.Direction == proxy.Outbound && r.Pod == podA.UID && r.Local == netip.AddrPortFrom(loopback(v6), proxy.DefaultOutboundPort):
				out++
			case r.Direction == proxy.Inbound && r.Pod == podB.UID && r.Local == netip.AddrPortFrom(b.Addr(v6), proxy.DefaultInboundPort):
				in++
			default:
				t.Errorf("record from an unexpected listener: %+v", r)
			}
		}
		if out != conns || in != conns || len(n.Records()) != 2*conns {
			t.Errorf("%d outbound records in A, %d inbound in B, %d in memory; want %d each", out, in, len(n.Records()), conns)
		}

		store.Del(podB.UID)
		if err := srv.DelPod(ctx, podB.UID); err != nil {
			t.Fatalf("delete B: %v", err)
		}
		if st := n.Status(); !sameUIDs(st, podA.UID) {
			t.Fatalf("pods after DelPod: %+v", st.Pods)
		}
		refused(t, ctx, b, netip.AddrPortFrom(b.Addr(v6), proxy.DefaultInboundPort))
		refused(t, ctx, b, netip.AddrPortFrom(loopback(v6), proxy.DefaultOutboundPort))
	})
}

// TestNodeAgentRestart stops the agent: traffic keeps flowing through the node
// proxy's listeners meanwhile. B is deleted while the agent is away; the node
// proxy reconnects to the new agent, and the snapshot, which no longer names B,
// makes it drop B.
func TestNodeAgentRestart(t *testing.T) {
	fixtures.RequireRoot(t, rootReason)
	ctx := fixtures.Context(t, time.Minute)
	a, b := fixtures.NewPodPair(t)
	const appPort = 9000
	b.ServeEcho(t, appPort)
	podA, podB := zdsPod(t, "a", a), zdsPod(t, "b", b)
	store := zdstest.NewPods(podA, podB)
	path := zdsPath(t)
	srv := startAgent(t, path, store)
	n := startNode(t, ctx, proxy.NodeConfig{ZDSPath: path, ReconnectMax: 200 * time.Millisecond})
	waitNode(t, ctx, n, "snapshot with A and B", func(st proxy.NodeStatus) bool {
		return st.Snapshots == 1 && sameUIDs(st, podA.UID, podB.UID)
	})
	installIPTables(t, ctx, a, b)
	dst := netip.AddrPortFrom(b.IPv4, appPort)
	roundTrip(t, ctx, a, dst, 64<<10)

	if err := srv.Close(); err != nil {
		t.Fatal(err)
	}
	waitNode(t, ctx, n, "disconnect", func(st proxy.NodeStatus) bool { return !st.Connected })
	roundTrip(t, ctx, a, dst, 64<<10)

	store.Del(podB.UID)
	startAgent(t, path, store)
	st := waitNode(t, ctx, n, "second snapshot", func(st proxy.NodeStatus) bool { return st.Snapshots == 2 })
	if !sameUIDs(st, podA.UID) {
		t.Fatalf("pods after the second snapshot: %+v", st.Pods)
	}
	refused(t, ctx, b, netip.AddrPortFrom(b.IPv4, proxy.DefaultInboundPort))
	// A's listener is still there.
	conn, err := a.DialTCP(ctx, netip.MustParseAddrPort("127.0.0.1:15001"))
	if err != nil {
		t.Fatalf("A's outbound listener: %v", err)
	}
	conn.Close()
}

// TestNodeProcessRestart runs the refproxy binary in node mode (-zds) on the host:
// traffic between the pods goes through it; while it is stopped the capture has
// nowhere to send A's connections (refused); a new process takes the snapshot and
// traffic resumes.
func TestNodeProcessRestart(t *testing.T) {
	fixtures.RequireRoot(t, rootReason)
	ctx := fixtures.Context(t, 5*time.Minute)
	bin, err := proxy.Binary(ctx, t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	a, b := fixtures.NewPodPair(t)
	const appPort = 9000
	b.ServeEcho(t, appPort)
	podA, podB := zdsPod(t, "a", a), zdsPod(t, "b", b)
	path := zdsPath(t)
	srv := startAgent(t, path, zdstest.NewPods(podA, podB))
	installIPTables(t, ctx, a, b)
	dst := netip.AddrPortFrom(b.IPv4, appPort)

	run := func(records string) *proxy.Process {
		t.Helper()
		logPath := records + ".log"
		logFile, err := os.Create(logPath)
		if err != nil {
			t.Fatal(err)
		}
		defer logFile.Close()
		p, err := proxy.StartProcess(ctx, proxy.ProcessOptions{
			Binary: bin,
			Args:   []string{"-zds", path, "-record", records, "-log-level", "debug"},
			Stderr: logFile,
		})
		if err != nil {
			log, _ := os.ReadFile(logPath)
			t.Fatalf("start node refproxy: %v\n%s", err, log)
		}
		t.Cleanup(func() {
			if t.Failed() {
				log, _ := os.ReadFile(logPath)
				t.Logf("node refproxy log:\n%s", log)
			}
		})
		return p
	}
	stop := func(p *proxy.Process) {
		t.Helper()
		if err := p.Stop(ctx); err != nil {
			t.Fatalf("stop node refproxy: %v", err)
		}
	}

	first := filepath.Join(t.TempDir(), "first.jsonl")
	p := run(first)
	// "ready" came after the snapshot: both pods have their listeners.
	roundTrip(t, ctx, a, dst, 64<<10)
	waitRecords(t, ctx, first, 2)
	stop(p)

	conn, err := a.DialTCP(ctx, dst)
	if err == nil {
		conn.Close()
		t.Fatal("A reached B with the node proxy stopped")
	}
	if !errors.Is(err, unix.ECONNREFUSED) {
		t.Fatalf("A → B with the node proxy stopped: %v, want connection refused", err)
	}

	second := filepath.Join(t.TempDir(), "second.jsonl")
	p = run(second)
	roundTrip(t, ctx, a, dst, 64<<10)
	for _, r := range waitRecords(t, ctx, second, 2) {
		if r.Error != "" || r.OriginalDst != dst || (r.Pod != podA.UID && r.Pod != podB.UID) {
			t.Errorf("record after restart %+v", r)
		}
	}
	// The agent notices the first process is gone by its liveness check.
	for srv.Connected() != 1 {
		select {
		case <-ctx.Done():
			t.Fatalf("agent sees %d proxies, want 1", srv.Connected())
		case <-time.After(10 * time.Millisecond):
		}
	}
	stop(p)
}

// fakeAgent plays the agent's side of ZDS packet by packet, to send what a real
// agent never would.
type fakeAgent struct {
	t  *testing.T
	ln *net.UnixListener
}

type fakeConn struct {
	t  *testing.T
	uc *net.UnixConn
}

func newFakeAgent(t *testing.T, path string) *fakeAgent {
	ln, err := net.ListenUnix("unixpacket", &net.UnixAddr{Name: path, Net: "unixpacket"})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { ln.Close() })
	return &fakeAgent{t: t, ln: ln}
}

// accept takes the node proxy's next connection and checks its hello.
func (a *fakeAgent) accept(ctx context.Context) *fakeConn {
	a.t.Helper()
	stop := context.AfterFunc(ctx, func() { _ = a.ln.SetDeadline(time.Now()) })
	defer stop()
	uc, err := a.ln.AcceptUnix()
	if err != nil {
		a.t.Fatalf("accept: %v", err)
	}
	a.t.Cleanup(func() { uc.Close() })
	c := &fakeConn{t: a.t, uc: uc}
	var hello zdspb.ZdsHello
	if err := proto.Unmarshal(c.read(), &hello); err != nil || hello.GetVersion() != zdspb.Version_V1 {
		a.t.Fatalf("hello %v, %v", &hello, err)
	}
	return c
}

func (c *fakeConn) read() []byte {
	c.t.Helper()
	if err := c.uc.SetReadDeadline(time.Now().Add(30 * time.Second)); err != nil {
		c.t.Fatal(err)
	}
	buf := make([]byte, 4096)
	n, _, _, _, err := c.uc.ReadMsgUnix(buf, nil)
	if err != nil {
		c.t.Fatalf("read from node proxy: %v", err)
	}
	return buf[:n]
}

// send sends raw bytes with fds and returns the ack's error text.
func (c *fakeConn) send(b []byte, fds ...int) string {
	c.t.Helper()
	var oob []byte
	if len(fds) > 0 {
		oob = unix.UnixRights(fds...)
	}
	if _, _, err := c.uc.WriteMsgUnix(b, oob, nil); err != nil {
		c.t.Fatalf("send: %v", err)
	}
	var resp zdspb.WorkloadResponse
	if err := proto.Unmarshal(c.read(), &resp); err != nil || resp.GetAck() == nil {
		c.t.Fatalf("response %v, %v", &resp, err)
	}
	return resp.GetAck().GetError()
}

func (c *fakeConn) request(req *zdspb.WorkloadRequest, fds ...int) string {
	c.t.Helper()
	b, err := proto.Marshal(req)
	if err != nil {
		c.t.Fatal(err)
	}
	return c.send(b, fds...)
}

// expectClosed checks that the node proxy hung up.
func (c *fakeConn) expectClosed() {
	c.t.Helper()
	if err := c.uc.SetReadDeadline(time.Now().Add(30 * time.Second)); err != nil {
		c.t.Fatal(err)
	}
	n, _, _, _, err := c.uc.ReadMsgUnix(make([]byte, 64), nil)
	if n != 0 || (err != nil && !errors.Is(err, io.EOF)) {
		c.t.Fatalf("want the node proxy to close the connection, got %d bytes, %v", n, err)
	}
}

func addReq(uid string, info bool) *zdspb.WorkloadRequest {
	add := &zdspb.AddWorkload{Uid: uid}
	if info {
		add.WorkloadInfo = &zdspb.WorkloadInfo{Name: uid, Namespace: "default"}
	}
	return &zdspb.WorkloadRequest{Payload: &zdspb.WorkloadRequest_Add{Add: add}}
}

func keepReq(uid string) *zdspb.WorkloadRequest {
	return &zdspb.WorkloadRequest{Payload: &zdspb.WorkloadRequest_Keep{Keep: &zdspb.KeepWorkload{Uid: uid}}}
}

func delReq(uid string) *zdspb.WorkloadRequest {
	return &zdspb.WorkloadRequest{Payload: &zdspb.WorkloadRequest_Del{Del: &zdspb.DelWorkload{Uid: uid}}}
}

func snapshotSentReq() *zdspb.WorkloadRequest {
	return &zdspb.WorkloadRequest{Payload: &zdspb.WorkloadRequest_SnapshotSent{SnapshotSent: &zdspb.SnapshotSent{}}}
}

func openFd(t *testing.T, path string) int {
	t.Helper()
	fd, err := unix.Open(path, unix.O_RDONLY|unix.O_CLOEXEC, 0)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { unix.Close(fd) })
	return fd
}

// TestNodeRequests drives the node proxy with every kind of request, in and out
// of order, the way ztunnel treats them: repeated adds, a new namespace for a
// known pod, a fd that is not a namespace (refused, connection kept), keep and
// delete during the snapshot, and protocol violations (refused, then the proxy
// reconnects): keep after the snapshot, an add without fd or without
// workload_info, two fds, garbage.
func TestNodeRequests(t *testing.T) {
	fixtures.RequireRoot(t, rootReason)
	ctx := fixtures.Context(t, time.Minute)
	a, b := fixtures.NewPodPair(t)
	path := zdsPath(t)
	agent := newFakeAgent(t, path)
	n := startNode(t, ctx, proxy.NodeConfig{ZDSPath: path, ReconnectMax: 50 * time.Millisecond})
	fdA, fdB := openFd(t, a.Path), openFd(t, b.Path)

	c := agent.accept(ctx)
	if msg := c.request(addReq("a", true), fdA); msg != "" {
		t.Fatalf("add a: %s", msg)
	}
	first := n.Status().Pods
	if msg := c.request(addReq("a", true), fdA); msg != "" {
		t.Fatalf("repeated add a: %s", msg)
	}
	if again := n.Status().Pods; len(again) != 1 || !slices.Equal(again[0].Addrs, first[0].Addrs) || again[0].Netns != first[0].Netns {
		t.Fatalf("repeated add changed the pod: %+v → %+v", first, again)
	}
	null := openFd(t, "/dev/null")
	if msg := c.request(addReq("x", true), null); msg == "" {
		t.Fatal("a /dev/null fd was accepted as a netns")
	}
	if msg := c.request(keepReq("unknown")); msg != "" {
		t.Fatalf("keep: %s", msg)
	}
	if msg := c.request(addReq("c", true), fdB); msg != "" {
		t.Fatalf("add c: %s", msg)
	}
	if msg := c.request(delReq("c")); msg != "" {
		t.Fatalf("delete c during the snapshot: %s", msg)
	}
	if msg := c.request(snapshotSentReq()); msg != "" {
		t.Fatalf("snapshot sent: %s", msg)
	}
	// c was deleted before the snapshot ended, x never started.
	if st := n.Status(); !sameUIDs(st, "a") || st.Snapshots != 1 {
		t.Fatalf("after the snapshot: %+v", st)
	}
	// A new namespace for a: listeners move there.
	if msg := c.request(addReq("a", true), fdB); msg != "" {
		t.Fatalf("add a with B's netns: %s", msg)
	}
	if st := n.Status(); len(st.Pods) != 1 || st.Pods[0].Netns == first[0].Netns {
		t.Fatalf("a kept its old netns: %+v", st.Pods)
	}
	refused(t, ctx, a, netip.MustParseAddrPort("127.0.0.1:15001"))
	conn, err := b.DialTCP(ctx, netip.MustParseAddrPort("127.0.0.1:15001"))
	if err != nil {
		t.Fatalf("a's listener in B's netns: %v", err)
	}
	conn.Close()

	helloAndSend := func(what string, fds []int, req *zdspb.WorkloadRequest, raw []byte) {
		t.Helper()
		c := agent.accept(ctx)
		var msg string
		if raw != nil {
			msg = c.send(raw, fds...)
		} else {
			msg = c.request(req, fds...)
		}
		if msg == "" {
			t.Fatalf("%s accepted", what)
		}
		c.expectClosed()
	}
	if msg := c.request(keepReq("a")); msg == "" {
		t.Fatal("keep after the snapshot accepted")
	}
	c.expectClosed()
	helloAndSend("add without fd", nil, addReq("d", true), nil)
	helloAndSend("add without workload_info", []int{fdA}, addReq("d", false), nil)
	helloAndSend("add with two fds", []int{fdA, fdB}, addReq("d", true), nil)
	helloAndSend("delete with an fd", []int{fdA}, delReq("a"), nil)
	helloAndSend("garbage", nil, nil, []byte("\xff\xff\xff"))
	if st := n.Status(); !sameUIDs(st, "a") {
		t.Fatalf("pods changed by refused requests: %+v", st.Pods)
	}

	// A last connection with an empty snapshot drops a.
	c = agent.accept(ctx)
	if msg := c.request(snapshotSentReq()); msg != "" {
		t.Fatalf("snapshot sent: %s", msg)
	}
	if st := n.Status(); len(st.Pods) != 0 || st.Snapshots != 2 {
		t.Fatalf("after an empty snapshot: %+v", st)
	}
	refused(t, ctx, b, netip.MustParseAddrPort("127.0.0.1:15001"))
}

// TestStartNodeErrors checks the configurations StartNode refuses.
func TestStartNodeErrors(t *testing.T) {
	ctx := fixtures.Context(t, time.Minute)
	for name, cfg := range map[string]proxy.NodeConfig{
		"netns":      {Proxy: proxy.Config{NetNS: "/run/netns/x"}},
		"same ports": {Proxy: proxy.Config{OutboundPort: 16000, InboundPort: 16000}},
		"records":    {Proxy: proxy.Config{RecordPath: filepath.Join(t.TempDir(), "no", "dir", "r.jsonl")}},
	} {
		if n, err := proxy.StartNode(ctx, cfg); err == nil {
			n.Close()
			t.Errorf("%s: StartNode accepted %+v", name, cfg)
		}
	}
}

func ExampleStartNode() {
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	n, err := proxy.StartNode(ctx, proxy.NodeConfig{ZDSPath: zds.DefaultSocketPath, Proxy: proxy.Config{RecordPath: "/tmp/node.jsonl"}})
	if err != nil {
		fmt.Println(err)
		return
	}
	defer n.Close()
	// ... the agent hands pods over; each gets listeners in its own namespace.
}
