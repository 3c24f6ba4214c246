package zds_test

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"go.uber.org/zap/zaptest"
	"golang.org/x/sys/unix"

	"github.com/mesh-cni/mesh-cni/internal/netns"
	"github.com/mesh-cni/mesh-cni/pkg/zds"
	"github.com/mesh-cni/mesh-cni/pkg/zds/zdspb"
	"github.com/mesh-cni/mesh-cni/pkg/zds/zdstest"
	"github.com/mesh-cni/mesh-cni/test/fixtures"
)

// rootReason is why these tests need root.
const rootReason = "creates network namespaces"

func pod(t *testing.T, name string) zds.Pod {
	return zds.Pod{
		UID:            name + "-uid-" + fixtures.RandomHex(4),
		Name:           name,
		Namespace:      "ns-" + name,
		ServiceAccount: "sa-" + name,
		NetnsPath:      fixtures.NewNetns(t, filepath.Join(t.TempDir(), name)).Path,
	}
}

// startServer runs a server on a socket in t.TempDir() until the test ends.
func startServer(t *testing.T, snap zds.Snapshotter, cfg zds.Config) (*zds.Server, string) {
	t.Helper()
	if cfg.SocketPath == "" {
		cfg.SocketPath = filepath.Join(t.TempDir(), "zds.sock")
	}
	cfg.Snapshot = snap
	cfg.Logger = zaptest.NewLogger(t)
	if cfg.LivenessInterval == 0 {
		cfg.LivenessInterval = 50 * time.Millisecond
	}
	s, err := zds.NewServer(fixtures.Context(t, time.Minute), cfg)
	if err != nil {
		t.Fatalf("new server: %v", err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- s.Serve(ctx) }()
	t.Cleanup(func() {
		cancel()
		if err := <-done; err != nil {
			t.Errorf("serve: %v", err)
		}
	})
	return s, cfg.SocketPath
}

// dialProxy connects a test proxy and says hello with version v.
func dialProxy(t *testing.T, ctx context.Context, path string, v zdspb.Version) *zds.ProxyConn {
	t.Helper()
	pc, err := zds.Dial(ctx, path)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { pc.Close() })
	if err := pc.Hello(v); err != nil {
		t.Fatal(err)
	}
	return pc
}

func recv(t *testing.T, ctx context.Context, pc *zds.ProxyConn) *zds.Request {
	t.Helper()
	req, err := pc.Recv(ctx)
	if err != nil {
		t.Fatalf("receive request: %v", err)
	}
	if req.Netns != nil {
		t.Cleanup(func() { req.Netns.Close() })
	}
	return req
}

func ack(t *testing.T, pc *zds.ProxyConn, msg string) {
	t.Helper()
	if err := pc.Ack(msg); err != nil {
		t.Fatalf("ack: %v", err)
	}
}

// takeSnapshot acks every request up to and including SnapshotSent and returns
// the requests before it.
func takeSnapshot(t *testing.T, ctx context.Context, pc *zds.ProxyConn) []*zds.Request {
	t.Helper()
	var got []*zds.Request
	for {
		req := recv(t, ctx, pc)
		ack(t, pc, "")
		if req.GetSnapshotSent() != nil {
			return got
		}
		got = append(got, req)
	}
}

// syncedProxy is a V1 proxy on path that has taken the snapshot.
func syncedProxy(t *testing.T, ctx context.Context, path string) *zds.ProxyConn {
	t.Helper()
	pc := dialProxy(t, ctx, path, zdspb.Version_V1)
	takeSnapshot(t, ctx, pc)
	return pc
}

// snapshotOf is takeSnapshot for a snapshot of n requests.
func snapshotOf(t *testing.T, ctx context.Context, pc *zds.ProxyConn, n int) []*zds.Request {
	t.Helper()
	got := takeSnapshot(t, ctx, pc)
	if len(got) != n {
		t.Fatalf("snapshot has %d requests, want %d: %v", len(got), n, got)
	}
	return got
}

// expectEOF reads until the server closes the connection; any request on the
// way is a failure.
func expectEOF(t *testing.T, ctx context.Context, pc *zds.ProxyConn) {
	t.Helper()
	req, err := pc.Recv(ctx)
	// A reset instead of an orderly close when the server hung up on unread data.
	if !errors.Is(err, io.EOF) && !errors.Is(err, unix.ECONNRESET) {
		t.Fatalf("want the server to close the connection, got request %v, error %v", req, err)
	}
}

// sendFdRefused sends msg with an fd of the file at path attached where the
// protocol carries none: the server must hang up, and close its copy of the fd
// too.
func sendFdRefused(t *testing.T, ctx context.Context, pc *zds.ProxyConn, msg []byte, path string) {
	t.Helper()
	f, err := os.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	ino := fixtures.Inode(t, path)
	err = pc.SendRaw(msg, int(f.Fd()))
	f.Close()
	if err != nil {
		t.Fatal(err)
	}
	expectEOF(t, ctx, pc)
	fixtures.WaitFor(t, time.Minute, "the server to close the fd it was sent", func() bool { return openFdsTo(t, ino) == 0 })
}

// async runs fn and returns a channel with its error.
func async(fn func() error) <-chan error {
	ch := make(chan error, 1)
	go func() { ch <- fn() }()
	return ch
}

func wait(t *testing.T, ctx context.Context, ch <-chan error) error {
	t.Helper()
	select {
	case err := <-ch:
		return err
	case <-ctx.Done():
		t.Fatalf("waiting for call: %v", ctx.Err())
		return nil
	}
}

func checkAdd(t *testing.T, req *zds.Request, want zds.Pod) {
	t.Helper()
	add := req.GetAdd()
	if add == nil {
		t.Fatalf("want AddWorkload for %s, got %v", want.UID, req.WorkloadRequest)
	}
	info := add.GetWorkloadInfo()
	if add.GetUid() != want.UID || info.GetName() != want.Name || info.GetNamespace() != want.Namespace ||
		info.GetServiceAccount() != want.ServiceAccount {
		t.Errorf("AddWorkload %v, want pod %+v", add, want)
	}
	if req.Netns == nil {
		t.Fatalf("AddWorkload for %s without netns fd", want.UID)
	}
	// The fd must be the pod's namespace: same nsfs inode and the same netns
	// cookie, the key the data path uses.
	gotID, err := zds.FdNetnsID(int(req.Netns.Fd()))
	if err != nil {
		t.Fatal(err)
	}
	var st unix.Stat_t
	if err := unix.Stat(want.NetnsPath, &st); err != nil {
		t.Fatal(err)
	}
	if gotID != (zds.NetnsID{Dev: st.Dev, Ino: st.Ino}) {
		t.Errorf("fd for %s is netns %+v, want inode %d", want.UID, gotID, st.Ino)
	}
	gotCookie, err := netns.CookieFd(int(req.Netns.Fd()))
	if err != nil {
		t.Fatal(err)
	}
	wantCookie, err := netns.Cookie(want.NetnsPath)
	if err != nil {
		t.Fatal(err)
	}
	if gotCookie != wantCookie {
		t.Errorf("fd for %s has netns cookie %d, want %d", want.UID, gotCookie, wantCookie)
	}
}

// addAcked adds p, which the proxy on pc must receive as an AddWorkload and
// ack, and fails the test unless the add then returns without error.
func addAcked(t *testing.T, ctx context.Context, srv *zds.Server, pc *zds.ProxyConn, p zds.Pod) {
	t.Helper()
	done := async(func() error { return srv.AddPod(ctx, p) })
	checkAdd(t, recv(t, ctx, pc), p)
	ack(t, pc, "")
	if err := wait(t, ctx, done); err != nil {
		t.Fatalf("add %s: %v", p.UID, err)
	}
}

// delAcked deletes the pod uid, which each of pcs must receive as a
// DelWorkload and ack, and fails the test unless the delete then returns
// without error.
func delAcked(t *testing.T, ctx context.Context, srv *zds.Server, uid string, pcs ...*zds.ProxyConn) {
	t.Helper()
	done := async(func() error { return srv.DelPod(ctx, uid) })
	for _, pc := range pcs {
		checkDel(t, recv(t, ctx, pc), uid)
		ack(t, pc, "")
	}
	if err := wait(t, ctx, done); err != nil {
		t.Fatalf("delete %s: %v", uid, err)
	}
}

func checkDel(t *testing.T, req *zds.Request, uid string) {
	t.Helper()
	if req.GetDel().GetUid() != uid || req.Netns != nil {
		t.Fatalf("want DelWorkload %s without fd, got %v (fd %v)", uid, req.WorkloadRequest, req.Netns)
	}
}

func checkKeep(t *testing.T, req *zds.Request, uid string) {
	t.Helper()
	if req.GetKeep().GetUid() != uid || req.Netns != nil {
		t.Fatalf("want KeepWorkload %s without fd, got %v", uid, req.WorkloadRequest)
	}
}

// TestSnapshot connects a proxy to an agent with enrolled pods: it gets every
// pod with its real netns fd, a KeepWorkload for the pod whose namespace is gone,
// nothing for an invalid entry, and SnapshotSent; then it counts as connected.
func TestSnapshot(t *testing.T) {
	fixtures.RequireRoot(t, rootReason)
	ctx := fixtures.Context(t, time.Minute)
	a, b := pod(t, "a"), pod(t, "b")
	gone := zds.Pod{UID: "gone-uid", Name: "gone", Namespace: "ns", NetnsPath: "/run/netns/zds-no-such-netns"}
	st := zdstest.NewPods(a, zds.Pod{Name: "no-uid", NetnsPath: a.NetnsPath}, gone, b)
	srv, path := startServer(t, st, zds.Config{})
	if srv.EverConnected() || srv.Connected() != 0 {
		t.Fatal("connected before any proxy")
	}

	pc := dialProxy(t, ctx, path, zdspb.Version_V1)
	got := snapshotOf(t, ctx, pc, 3)
	checkAdd(t, got[0], a)
	checkKeep(t, got[1], gone.UID)
	checkAdd(t, got[2], b)

	if err := srv.WaitForProxy(ctx); err != nil {
		t.Fatal(err)
	}
	if srv.Connected() != 1 || !srv.EverConnected() {
		t.Errorf("Connected %d EverConnected %v after snapshot", srv.Connected(), srv.EverConnected())
	}
}

// TestSnapshotKeep: a pod listed with Keep goes out as KeepWorkload without a
// descriptor, though its namespace opens (the proxy keeps what it runs for
// it); the AddWorkload that follows the snapshot carries its namespace.
func TestSnapshotKeep(t *testing.T) {
	fixtures.RequireRoot(t, rootReason)
	ctx := fixtures.Context(t, time.Minute)
	a, kept := pod(t, "a"), pod(t, "kept")
	keep := kept
	keep.Keep = true
	srv, path := startServer(t, zdstest.NewPods(a, keep), zds.Config{})

	pc := dialProxy(t, ctx, path, zdspb.Version_V1)
	got := snapshotOf(t, ctx, pc, 2)
	checkAdd(t, got[0], a)
	checkKeep(t, got[1], kept.UID)
	addAcked(t, ctx, srv, pc, kept)
}

// TestAddToNewestDeleteToAll: with two proxies connected (an upgrade in progress),
// a new pod goes to the newest only, a pod both have is deleted on both, a pod
// only the newest has is deleted there only, and a pod a proxy already has is
// not sent again.
func TestAddToNewestDeleteToAll(t *testing.T) {
	fixtures.RequireRoot(t, rootReason)
	ctx := fixtures.Context(t, time.Minute)
	p1, p2, p3 := pod(t, "p1"), pod(t, "p2"), pod(t, "p3")
	st := zdstest.NewPods(p1)
	srv, path := startServer(t, st, zds.Config{})

	old := dialProxy(t, ctx, path, zdspb.Version_V1)
	checkAdd(t, takeSnapshot(t, ctx, old)[0], p1)
	newer := dialProxy(t, ctx, path, zdspb.Version_V1)
	checkAdd(t, takeSnapshot(t, ctx, newer)[0], p1)
	fixtures.WaitFor(t, time.Minute, "two proxies", func() bool { return srv.Connected() == 2 })

	// Already acked with the same namespace: returns without a request (one
	// would never be acked here and time out).
	if err := srv.AddPod(ctx, p1); err != nil {
		t.Fatalf("re-add p1: %v", err)
	}

	st.Add(p2)
	addAcked(t, ctx, srv, newer, p2)

	// p1 goes from both. The old proxy's next request is this delete, so it was
	// never sent p2.
	st.Del(p1.UID)
	delAcked(t, ctx, srv, p1.UID, old, newer)

	// p2 only went to the newer proxy, so only it hears of the delete.
	st.Del(p2.UID)
	delAcked(t, ctx, srv, p2.UID, newer)

	// The newer proxy goes away: the old one is the newest again, and its next
	// request is p3's add (no delete of p2 came before it).
	newer.Close()
	fixtures.WaitFor(t, time.Minute, "the closed proxy to be dropped", func() bool { return srv.Connected() == 1 })
	st.Add(p3)
	addAcked(t, ctx, srv, old, p3)
	if err := srv.DelPod(ctx, "never-added"); err != nil {
		t.Errorf("delete of an unknown pod: %v", err)
	}
}

// TestAckDeadline: a proxy that does not ack within the deadline fails the add
// and loses its connection; nothing is left to add to.
func TestAckDeadline(t *testing.T) {
	fixtures.RequireRoot(t, rootReason)
	ctx := fixtures.Context(t, time.Minute)
	p := pod(t, "slow")
	st := zdstest.NewPods()
	srv, path := startServer(t, st, zds.Config{AckTimeout: 300 * time.Millisecond})
	pc := syncedProxy(t, ctx, path)
	fixtures.WaitFor(t, time.Minute, "the proxy", func() bool { return srv.Connected() == 1 })

	st.Add(p)
	done := async(func() error { return srv.AddPod(ctx, p) })
	checkAdd(t, recv(t, ctx, pc), p)
	// No ack.
	err := wait(t, ctx, done)
	if !errors.Is(err, os.ErrDeadlineExceeded) || !errors.Is(err, zds.ErrNoProxy) {
		t.Fatalf("add without ack: %v, want a deadline error and ErrNoProxy", err)
	}
	expectEOF(t, ctx, pc)
	fixtures.WaitFor(t, time.Minute, "the proxy to be dropped", func() bool { return srv.Connected() == 0 })
	if err := srv.AddPod(ctx, p); !errors.Is(err, zds.ErrNoProxy) {
		t.Errorf("add with no proxy: %v, want ErrNoProxy", err)
	}
	if err := srv.DelPod(ctx, p.UID); err != nil {
		t.Errorf("delete with no proxy: %v", err)
	}
}

// TestAckError: a proxy's refusal is an AckError for that pod; the connection
// stays, and the same pod can be added again.
func TestAckError(t *testing.T) {
	fixtures.RequireRoot(t, rootReason)
	ctx := fixtures.Context(t, time.Minute)
	p := pod(t, "refused")
	srv, path := startServer(t, zdstest.NewPods(), zds.Config{})
	pc := syncedProxy(t, ctx, path)

	done := async(func() error { return srv.AddPod(ctx, p) })
	checkAdd(t, recv(t, ctx, pc), p)
	ack(t, pc, "cannot bind 15001")
	var ae *zds.AckError
	if err := wait(t, ctx, done); !errors.As(err, &ae) || ae.UID != p.UID || ae.Msg != "cannot bind 15001" {
		t.Fatalf("refused add: %v, want an AckError", err)
	}
	addAcked(t, ctx, srv, pc, p)
	done = async(func() error { return srv.DelPod(ctx, p.UID) })
	checkDel(t, recv(t, ctx, pc), p.UID)
	ack(t, pc, "still draining")
	if err := wait(t, ctx, done); !errors.As(err, &ae) || ae.Request != "delete" {
		t.Fatalf("refused delete: %v, want an AckError", err)
	}
	if srv.Connected() != 1 {
		t.Errorf("connections after refusals: %d", srv.Connected())
	}
}

// TestMisbehavingProxies runs proxies that break the protocol in different ways
// next to a good one: each bad connection is closed on its own, any fd it sent
// is closed, and the good proxy keeps working.
func TestMisbehavingProxies(t *testing.T) {
	fixtures.RequireRoot(t, rootReason)
	ctx := fixtures.Context(t, time.Minute)
	p1 := pod(t, "p1")
	st := zdstest.NewPods(p1)
	srv, path := startServer(t, st, zds.Config{AckTimeout: 2 * time.Second})
	good := syncedProxy(t, ctx, path)

	spare := fixtures.NewNetns(t, filepath.Join(t.TempDir(), "spare")).Path
	for _, tc := range []struct {
		name string
		run  func(t *testing.T)
	}{
		{"empty hello", func(t *testing.T) {
			// ZdsHello{version: NOT_USED} encodes to zero bytes, and a zero-length
			// SOCK_SEQPACKET read is how the peer's close looks.
			expectEOF(t, ctx, dialProxy(t, ctx, path, zdspb.Version_NOT_USED))
		}},
		{"garbage hello", func(t *testing.T) {
			pc, err := zds.Dial(ctx, path)
			if err != nil {
				t.Fatal(err)
			}
			defer pc.Close()
			if err := pc.SendRaw([]byte("GET / HTTP/1.1\r\n\r\n")); err != nil {
				t.Fatal(err)
			}
			expectEOF(t, ctx, pc)
		}},
		{"fd with hello", func(t *testing.T) {
			pc, err := zds.Dial(ctx, path)
			if err != nil {
				t.Fatal(err)
			}
			defer pc.Close()
			hello := []byte{0x08, 0x01} // ZdsHello{version: V1}
			sendFdRefused(t, ctx, pc, hello, spare)
		}},
		{"close without hello", func(t *testing.T) {
			pc, err := zds.Dial(ctx, path)
			if err != nil {
				t.Fatal(err)
			}
			pc.Close()
		}},
		{"close during snapshot", func(t *testing.T) {
			pc := dialProxy(t, ctx, path, zdspb.Version_V1)
			checkAdd(t, recv(t, ctx, pc), p1)
			pc.Close()
		}},
		{"garbage ack", func(t *testing.T) {
			pc := dialProxy(t, ctx, path, zdspb.Version_V1)
			checkAdd(t, recv(t, ctx, pc), p1)
			if err := pc.SendRaw([]byte{0xde, 0xad, 0xbe, 0xef}); err != nil {
				t.Fatal(err)
			}
			expectEOF(t, ctx, pc)
		}},
		{"fd with ack", func(t *testing.T) {
			pc := dialProxy(t, ctx, path, zdspb.Version_V1)
			checkAdd(t, recv(t, ctx, pc), p1)
			ackWithFd := []byte{0x0a, 0x00} // WorkloadResponse{ack: {}}
			sendFdRefused(t, ctx, pc, ackWithFd, spare)
		}},
		{"speaks out of turn", func(t *testing.T) {
			pc := syncedProxy(t, ctx, path)
			// An ack nobody asked for: the liveness check finds it.
			ack(t, pc, "")
			expectEOF(t, ctx, pc)
		}},
	} {
		t.Run(tc.name, tc.run)
	}

	// Every bad connection is gone; the good proxy is the only one and works.
	fixtures.WaitFor(t, time.Minute, "only the good proxy left", func() bool { return srv.Connected() == 1 })
	p2 := pod(t, "p2")
	st.Add(p2)
	addAcked(t, ctx, srv, good, p2)
}

// openFdsTo counts this process's fds that refer to the network namespace with
// inode ino.
func openFdsTo(t *testing.T, ino uint64) int {
	t.Helper()
	entries, err := os.ReadDir("/proc/self/fd")
	if err != nil {
		t.Fatal(err)
	}
	want := fmt.Sprintf("net:[%d]", ino)
	n := 0
	for _, e := range entries {
		if target, err := os.Readlink(filepath.Join("/proc/self/fd", e.Name())); err == nil && target == want {
			n++
		}
	}
	return n
}

// TestLiveness: an idle proxy that goes away is noticed without any request.
func TestLiveness(t *testing.T) {
	fixtures.RequireRoot(t, rootReason)
	ctx := fixtures.Context(t, time.Minute)
	srv, path := startServer(t, zdstest.NewPods(), zds.Config{})
	pc := syncedProxy(t, ctx, path)
	fixtures.WaitFor(t, time.Minute, "the proxy", func() bool { return srv.Connected() == 1 })
	pc.Close()
	fixtures.WaitFor(t, time.Minute, "the proxy to be dropped", func() bool { return srv.Connected() == 0 })
	if !srv.EverConnected() {
		t.Error("EverConnected forgot the proxy")
	}
}

// TestAddPodWait: a pod enrolled while no proxy is connected waits for the next
// proxy; the pod comes in that proxy's snapshot and is not sent twice.
func TestAddPodWait(t *testing.T) {
	fixtures.RequireRoot(t, rootReason)
	ctx := fixtures.Context(t, time.Minute)
	p := pod(t, "early")
	st := zdstest.NewPods()
	srv, path := startServer(t, st, zds.Config{})
	st.Add(p)
	if err := srv.AddPod(ctx, p); !errors.Is(err, zds.ErrNoProxy) {
		t.Fatalf("AddPod with no proxy: %v, want ErrNoProxy", err)
	}
	short, cancel := context.WithTimeout(ctx, 50*time.Millisecond)
	defer cancel()
	if err := srv.AddPodWait(short, p); !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("AddPodWait with no proxy coming: %v", err)
	}
	done := async(func() error { return srv.AddPodWait(ctx, p) })
	pc := dialProxy(t, ctx, path, zdspb.Version_V1)
	checkAdd(t, snapshotOf(t, ctx, pc, 1)[0], p)
	if err := wait(t, ctx, done); err != nil {
		t.Fatalf("AddPodWait: %v", err)
	}
	// The next request is the delete, not a second add.
	st.Del(p.UID)
	delAcked(t, ctx, srv, p.UID, pc)
}

// TestAddPodErrors: pods that cannot be handed off fail before any proxy sees them.
func TestAddPodErrors(t *testing.T) {
	fixtures.RequireRoot(t, rootReason)
	ctx := fixtures.Context(t, time.Minute)
	srv, path := startServer(t, zdstest.NewPods(), zds.Config{})
	pc := syncedProxy(t, ctx, path)
	regular := filepath.Join(t.TempDir(), "file")
	if err := os.WriteFile(regular, nil, 0o600); err != nil {
		t.Fatal(err)
	}
	good := pod(t, "good")
	for name, p := range map[string]zds.Pod{
		"no uid":      {NetnsPath: good.NetnsPath},
		"no netns":    {UID: "u"},
		"gone netns":  {UID: "u", NetnsPath: "/run/netns/zds-no-such-netns"},
		"not a netns": {UID: "u", NetnsPath: regular},
		"mount ns":    {UID: "u", NetnsPath: "/proc/self/ns/mnt"},
		"too big":     {UID: "u", Name: strings.Repeat("n", zds.MaxRequestSize), NetnsPath: good.NetnsPath},
	} {
		if err := srv.AddPod(ctx, p); err == nil || errors.Is(err, zds.ErrNoProxy) {
			t.Errorf("%s: AddPod = %v, want a pod error", name, err)
		}
	}
	if err := srv.DelPod(ctx, ""); err == nil {
		t.Error("DelPod without uid accepted")
	}
	// None of it reached the proxy: its next request is this add.
	addAcked(t, ctx, srv, pc, good)
}

// TestSocket checks the socket's mode and directory and that only a stale socket
// is ever replaced.
func TestSocket(t *testing.T) {
	fixtures.RequireRoot(t, rootReason)
	ctx := fixtures.Context(t, time.Minute)
	dir := filepath.Join(t.TempDir(), "ztunnel")
	path := filepath.Join(dir, "zds.sock")
	cfg := zds.Config{SocketPath: path, Snapshot: zdstest.NewPods(), Logger: zaptest.NewLogger(t)}

	srv, err := zds.NewServer(ctx, cfg)
	if err != nil {
		t.Fatal(err)
	}
	for p, want := range map[string]os.FileMode{dir: os.ModeDir | 0o700, path: os.ModeSocket | 0o600} {
		if info, err := os.Lstat(p); err != nil || info.Mode() != want {
			t.Errorf("%s: mode %v (%v), want %v", p, info.Mode(), err, want)
		}
	}
	if entries, _ := os.ReadDir(dir); len(entries) != 1 {
		t.Errorf("socket dir holds %v, want only the socket", entries)
	}
	// A live server keeps its socket; a second one fails (even before Serve: the
	// socket is listening).
	if _, err := zds.NewServer(ctx, cfg); err == nil || !strings.Contains(err.Error(), "in use") {
		t.Fatalf("second server on a live socket: %v", err)
	}
	if err := srv.Close(); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Lstat(path); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("socket left after Close: %v", err)
	}
	if err := srv.Serve(ctx); !errors.Is(err, zds.ErrServerClosed) {
		t.Errorf("Serve after Close: %v", err)
	}

	// A stale socket (its server died without removing it) is replaced.
	if err := leaveStaleSocket(path); err != nil {
		t.Fatal(err)
	}
	srv, err = zds.NewServer(ctx, cfg)
	if err != nil {
		t.Fatalf("server over a stale socket: %v", err)
	}
	pc := dialProxy(t, ctx, path, zdspb.Version_V1)
	go func() { _ = srv.Serve(ctx) }()
	takeSnapshot(t, ctx, pc)
	if err := srv.Close(); err != nil {
		t.Fatal(err)
	}

	// Never a file that is not a socket, never in a world-writable directory.
	if err := os.WriteFile(path, []byte("data"), 0o600); err != nil {
		t.Fatal(err)
	}
	if _, err := zds.NewServer(ctx, cfg); err == nil {
		t.Error("replaced a regular file")
	}
	if data, err := os.ReadFile(path); err != nil || string(data) != "data" {
		t.Errorf("regular file changed: %q %v", data, err)
	}
	open := filepath.Join(t.TempDir(), "open")
	if err := os.Mkdir(open, 0o777); err != nil {
		t.Fatal(err)
	}
	if err := os.Chmod(open, 0o777); err != nil {
		t.Fatal(err)
	}
	cfg.SocketPath = filepath.Join(open, "zds.sock")
	if _, err := zds.NewServer(ctx, cfg); err == nil || !strings.Contains(err.Error(), "world-writable") {
		t.Errorf("socket in a world-writable directory: %v", err)
	}
	cfg.SocketPath = filepath.Join(t.TempDir(), strings.Repeat("d", 100), "zds.sock")
	if _, err := zds.NewServer(ctx, cfg); err == nil || !strings.Contains(err.Error(), "too long") {
		t.Errorf("overlong socket path: %v", err)
	}
	cfg.SocketPath = "relative.sock"
	if _, err := zds.NewServer(ctx, cfg); err == nil {
		t.Error("relative socket path accepted")
	}
	if _, err := zds.NewServer(ctx, zds.Config{SocketPath: path}); err == nil {
		t.Error("config without Snapshot accepted")
	}
}

// leaveStaleSocket leaves a socket file at path that nobody listens on, as a
// crashed agent does.
func leaveStaleSocket(path string) error {
	fd, err := unix.Socket(unix.AF_UNIX, unix.SOCK_SEQPACKET|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		return err
	}
	defer unix.Close(fd)
	return unix.Bind(fd, &unix.SockaddrUnix{Name: path})
}

// TestAnyHelloVersion: a proxy announcing a version other than V1 is served V1,
// as Istio's node agent serves it (it logs the version and goes on).
func TestAnyHelloVersion(t *testing.T) {
	fixtures.RequireRoot(t, rootReason)
	ctx := fixtures.Context(t, time.Minute)
	p1 := pod(t, "p1")
	_, path := startServer(t, zdstest.NewPods(p1), zds.Config{})
	pc := dialProxy(t, ctx, path, zdspb.Version(2))
	got := takeSnapshot(t, ctx, pc)
	if len(got) != 1 {
		t.Fatalf("snapshot for a version-2 proxy: %d requests before SnapshotSent, want the pod's add", len(got))
	}
	checkAdd(t, got[0], p1)
}

// TestNetnsSwappedBehindPath: a pod's netns path that now names another
// namespace than the one the agent enrolled (the path reused, or a namespace
// mounted over it) is never handed to the proxy as the pod's: AddPod refuses
// it, a snapshot sends KeepWorkload without a descriptor, and the pod whose
// path still names its namespace goes through.
func TestNetnsSwappedBehindPath(t *testing.T) {
	fixtures.RequireRoot(t, rootReason)
	ctx := fixtures.Context(t, time.Minute)
	swapped, intact := pod(t, "swapped"), pod(t, "intact")
	for _, p := range []*zds.Pod{&swapped, &intact} {
		c, err := netns.Cookie(p.NetnsPath)
		if err != nil {
			t.Fatal(err)
		}
		p.NetnsCookie = c
	}
	// Another namespace at the swapped pod's path.
	if err := netns.Remove(swapped.NetnsPath); err != nil {
		t.Fatal(err)
	}
	if err := netns.Create(swapped.NetnsPath); err != nil {
		t.Fatal(err)
	}

	srv, path := startServer(t, zdstest.NewPods(swapped, intact), zds.Config{})
	pc := dialProxy(t, ctx, path, zdspb.Version_V1)
	got := takeSnapshot(t, ctx, pc)
	if len(got) != 2 || got[0].GetKeep().GetUid() != swapped.UID || got[0].Netns != nil {
		t.Fatalf("snapshot %v: want KeepWorkload for %s without fd, then %s", got, swapped.UID, intact.UID)
	}
	checkAdd(t, got[1], intact)

	if err := srv.AddPod(ctx, swapped); !errors.Is(err, zds.ErrNetnsReplaced) {
		t.Fatalf("AddPod of the swapped pod = %v, want ErrNetnsReplaced", err)
	}
	// Nothing reached the proxy: its next request is this add.
	again := intact
	again.UID = "again-" + intact.UID
	addAcked(t, ctx, srv, pc, again)
}

// A pod whose namespace the caller already opened for its request is handed
// over as that descriptor: a namespace swapped in at the path meanwhile is
// never the one the proxy gets. The cookie check applies to the descriptor.
func TestAddPodUsesCallersNamespace(t *testing.T) {
	fixtures.RequireRoot(t, rootReason)
	ctx := fixtures.Context(t, time.Minute)
	held := pod(t, "held")
	f, err := netns.Open(held.NetnsPath)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	if held.NetnsCookie, err = netns.CookieFd(int(f.Fd())); err != nil {
		t.Fatal(err)
	}
	held.Netns = f
	wantID, err := zds.FdNetnsID(int(f.Fd()))
	if err != nil {
		t.Fatal(err)
	}
	if err := netns.Remove(held.NetnsPath); err != nil {
		t.Fatal(err)
	}
	if err := netns.Create(held.NetnsPath); err != nil {
		t.Fatal(err)
	}

	srv, path := startServer(t, zdstest.NewPods(), zds.Config{})
	pc := dialProxy(t, ctx, path, zdspb.Version_V1)
	if got := takeSnapshot(t, ctx, pc); len(got) != 0 {
		t.Fatalf("snapshot %v, want none", got)
	}
	done := async(func() error { return srv.AddPod(ctx, held) })
	req := recv(t, ctx, pc)
	if req.GetAdd().GetUid() != held.UID || req.Netns == nil {
		t.Fatalf("want AddWorkload for %s with an fd, got %v", held.UID, req.WorkloadRequest)
	}
	if got, err := zds.FdNetnsID(int(req.Netns.Fd())); err != nil || got != wantID {
		t.Errorf("the proxy got netns %+v (%v), want the caller's %+v, not the one now at the path", got, err, wantID)
	}
	ack(t, pc, "")
	if err := wait(t, ctx, done); err != nil {
		t.Fatal(err)
	}

	other := held
	other.UID = "other-" + held.UID
	other.NetnsCookie++
	if err := srv.AddPod(ctx, other); !errors.Is(err, zds.ErrNetnsReplaced) {
		t.Errorf("AddPod of a held namespace with another cookie = %v, want ErrNetnsReplaced", err)
	}
}

// TestProxiesKeptWhenServerCloses: a proxy that disconnects is reported gone,
// but the server closing (the agent stopping) reports nothing: the proxy still
// serves its pods, and its identity must stay in the data path until the next
// agent learns it.
func TestProxiesKeptWhenServerCloses(t *testing.T) {
	fixtures.RequireRoot(t, rootReason)
	ctx := fixtures.Context(t, time.Minute)
	var (
		mu      sync.Mutex
		reports [][]int32
	)
	last := func() ([]int32, int) {
		mu.Lock()
		defer mu.Unlock()
		if len(reports) == 0 {
			return nil, 0
		}
		return reports[len(reports)-1], len(reports)
	}
	srv, path := startServer(t, zdstest.NewPods(), zds.Config{ProxiesChanged: func(pids []int32) error {
		mu.Lock()
		defer mu.Unlock()
		reports = append(reports, slices.Clone(pids))
		return nil
	}})
	connect := func() *zds.ProxyConn {
		pc := syncedProxy(t, ctx, path)
		if err := srv.WaitForProxy(ctx); err != nil {
			t.Fatal(err)
		}
		return pc
	}
	self := []int32{int32(os.Getpid())}
	first := connect()
	if got, _ := last(); !slices.Equal(got, self) {
		t.Fatalf("after the proxy connected: reported %v, want %v", got, self)
	}
	first.Close()
	fixtures.WaitFor(t, 10*time.Second, "the disconnect reported", func() bool {
		got, _ := last()
		return len(got) == 0
	})

	connect()
	_, n := last()
	if err := srv.Close(); err != nil {
		t.Fatal(err)
	}
	if got, m := last(); m != n || !slices.Equal(got, self) {
		t.Errorf("after the server closed: %d more reports, last %v; want none, the proxy kept as %v", m-n, got, self)
	}
}
