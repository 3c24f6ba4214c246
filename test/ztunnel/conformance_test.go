package ztunnel_test

import (
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"runtime"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"go.uber.org/zap/zaptest"
	"golang.org/x/sys/unix"
	"google.golang.org/protobuf/encoding/protowire"

	"github.com/mesh-cni/mesh-cni/pkg/zds"
	"github.com/mesh-cni/mesh-cni/test/fixtures"
	"github.com/mesh-cni/mesh-cni/test/ztunnel"
)

// rootReason is why these tests need root.
const rootReason = "network namespaces"

func testCtx(t *testing.T) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	t.Cleanup(cancel)
	return ctx
}

func newNetns(t *testing.T) string {
	t.Helper()
	return fixtures.NewNetns(t, filepath.Join("/run/netns", fmt.Sprintf("ztunnel-%d-%s", os.Getpid(), fixtures.RandomHex(4)))).Path
}

// pods is the agent's list of enrolled pods.
type pods struct {
	mu   sync.Mutex
	list []zds.Pod
}

func (p *pods) EnrolledPods(context.Context) ([]zds.Pod, error) {
	p.mu.Lock()
	defer p.mu.Unlock()
	return append([]zds.Pod(nil), p.list...), nil
}

func (p *pods) set(list ...zds.Pod) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.list = list
}

// workloads is a Handler that records what the client started and stopped.
// A uid in failing fails to start that many more times.
type workloads struct {
	mu      sync.Mutex
	running map[string]ztunnel.WorkloadInfo
	synced  int
	failing map[string]int
	tries   map[string]int
	changed chan struct{}
}

func newWorkloads() *workloads {
	return &workloads{running: map[string]ztunnel.WorkloadInfo{}, failing: map[string]int{}, tries: map[string]int{}, changed: make(chan struct{})}
}

func (w *workloads) notifyLocked() {
	close(w.changed)
	w.changed = make(chan struct{})
}

func (w *workloads) Start(uid string, info ztunnel.WorkloadInfo, ns *os.File) error {
	defer ns.Close()
	if _, err := zds.FdNetnsID(int(ns.Fd())); err != nil {
		return err
	}
	w.mu.Lock()
	defer w.mu.Unlock()
	w.tries[uid]++
	w.notifyLocked()
	if w.failing[uid] > 0 {
		w.failing[uid]--
		return errors.New("address in use")
	}
	w.running[uid] = info
	return nil
}

func (w *workloads) triesOf(uid string) int {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.tries[uid]
}

func (w *workloads) Stop(uid string) {
	w.mu.Lock()
	defer w.mu.Unlock()
	delete(w.running, uid)
	w.notifyLocked()
}

func (w *workloads) Reconcile(keep map[string]bool) {
	w.mu.Lock()
	defer w.mu.Unlock()
	for uid := range w.running {
		if !keep[uid] {
			delete(w.running, uid)
		}
	}
	w.synced++
	w.notifyLocked()
}

// wait waits until cond holds over the running workloads and the number of
// snapshots taken.
func (w *workloads) wait(t *testing.T, ctx context.Context, what string, cond func(map[string]ztunnel.WorkloadInfo, int) bool) {
	t.Helper()
	for {
		w.mu.Lock()
		ok := cond(w.running, w.synced)
		state := fmt.Sprintf("%d snapshots, running %+v", w.synced, w.running)
		ch := w.changed
		w.mu.Unlock()
		if ok {
			return
		}
		select {
		case <-ch:
		case <-ctx.Done():
			t.Fatalf("waiting for %s: %v (%s)", what, ctx.Err(), state)
		}
	}
}

func startServer(t *testing.T, snap zds.Snapshotter, path string) *zds.Server {
	t.Helper()
	if path == "" {
		path = filepath.Join(t.TempDir(), "ztunnel.sock")
	}
	srv, err := zds.NewServer(context.Background(), zds.Config{SocketPath: path, Snapshot: snap, Logger: zaptest.NewLogger(t).Named("agent")})
	if err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() { done <- srv.Serve(context.Background()) }()
	t.Cleanup(func() {
		srv.Close()
		<-done
	})
	return srv
}

// serve runs the ztunnel-behaving client on path and returns what Serve
// returned, once it does.
func serve(t *testing.T, ctx context.Context, path string, h ztunnel.Handler, opts ztunnel.Options) <-chan error {
	t.Helper()
	c, err := ztunnel.Dial(ctx, path)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(ctx)
	done := make(chan error, 1)
	go func() { done <- ztunnel.NewSession(h, opts).Serve(ctx, c) }()
	t.Cleanup(func() {
		cancel()
		c.Close()
	})
	return done
}

func zdsPod(t *testing.T, name string) zds.Pod {
	return zds.Pod{UID: name + "-" + fixtures.RandomHex(4), Name: name, Namespace: "shop", ServiceAccount: "sa-" + name, NetnsPath: newNetns(t)}
}

// TestConformance runs the agent's ZDS server against the client that behaves
// as ztunnel's inpod module (ztunnel commit 62d826530e5ce85764e309170205b293efcbc80b):
// the snapshot (with a KeepWorkload for a pod whose namespace cannot be
// opened), an add and a delete after it, each with the pod's service account.
// Any deviation ztunnel would refuse fails the client's Serve.
func TestConformance(t *testing.T) {
	fixtures.RequireRoot(t, rootReason)
	ctx := testCtx(t)
	a, b, c := zdsPod(t, "a"), zdsPod(t, "b"), zdsPod(t, "c")
	gone := zds.Pod{UID: "gone-" + fixtures.RandomHex(4), Name: "gone", Namespace: "shop", ServiceAccount: "sa-gone", NetnsPath: "/run/netns/ztunnel-no-such-" + fixtures.RandomHex(4)}
	snap := &pods{}
	snap.set(a, b, gone)
	path := filepath.Join(t.TempDir(), "ztunnel.sock")
	srv := startServer(t, snap, path)

	w := newWorkloads()
	// A workload this ztunnel still runs from an earlier agent: not in the
	// snapshot, so it is dropped when the snapshot ends.
	w.running["stale"] = ztunnel.WorkloadInfo{Name: "stale"}
	done := serve(t, ctx, path, w, ztunnel.Options{RequireServiceAccount: true})
	w.wait(t, ctx, "the snapshot", func(r map[string]ztunnel.WorkloadInfo, synced int) bool { return synced == 1 })
	w.wait(t, ctx, "a and b running with their service accounts", func(r map[string]ztunnel.WorkloadInfo, _ int) bool {
		return len(r) == 2 && r[a.UID].ServiceAccount == a.ServiceAccount && r[b.UID] == ztunnel.WorkloadInfo{Name: "b", Namespace: "shop", ServiceAccount: "sa-b"}
	})

	snap.set(a, b, c)
	if err := srv.AddPod(ctx, c); err != nil {
		t.Fatalf("add c: %v", err)
	}
	w.wait(t, ctx, "c running", func(r map[string]ztunnel.WorkloadInfo, _ int) bool { return r[c.UID].ServiceAccount == "sa-c" })
	snap.set(b, c)
	if err := srv.DelPod(ctx, a.UID); err != nil {
		t.Fatalf("delete a: %v", err)
	}
	w.wait(t, ctx, "a stopped", func(r map[string]ztunnel.WorkloadInfo, _ int) bool { _, ok := r[a.UID]; return !ok })

	srv.Close()
	select {
	case err := <-done:
		if err != nil {
			t.Fatalf("the ztunnel-behaving client found a deviation: %v", err)
		}
	case <-ctx.Done():
		t.Fatal("client still serving after the agent closed")
	}
}

// TestConformanceEmptyServiceAccount (ztunnel commit
// 62d826530e5ce85764e309170205b293efcbc80b, src/identity/manager.rs builds
// spiffe://<td>/ns/<ns>/sa/<sa>): the client refuses a pod handed over
// without a service account (ztunnel would ack it and never serve it), so the
// conformance tests fail on it.
func TestConformanceEmptyServiceAccount(t *testing.T) {
	fixtures.RequireRoot(t, rootReason)
	ctx := testCtx(t)
	p := zdsPod(t, "nosa")
	p.ServiceAccount = ""
	snap := &pods{}
	snap.set(p)
	path := filepath.Join(t.TempDir(), "ztunnel.sock")
	startServer(t, snap, path)
	w := newWorkloads()
	select {
	case err := <-serve(t, ctx, path, w, ztunnel.Options{RequireServiceAccount: true}):
		if !errors.Is(err, ztunnel.ErrDeviation) || !strings.Contains(err.Error(), "service_account") {
			t.Fatalf("Serve = %v, want a deviation about the service account", err)
		}
	case <-ctx.Done():
		t.Fatal("the client took a pod without a service account")
	}
}

// encodedAddSize is the size of the AddWorkload WorkloadRequest for p, encoded
// from zds.proto's field numbers (independent of the agent's generated code).
func encodedAddSize(p zds.Pod) int {
	str := func(b []byte, num protowire.Number, s string) []byte {
		if s == "" {
			return b
		}
		return protowire.AppendString(protowire.AppendTag(b, num, protowire.BytesType), s)
	}
	info := str(str(str(nil, 1, p.Name), 2, p.Namespace), 3, p.ServiceAccount)
	add := str(nil, 1, p.UID)
	add = protowire.AppendBytes(protowire.AppendTag(add, 2, protowire.BytesType), info)
	return len(protowire.AppendBytes(protowire.AppendTag(nil, 1, protowire.BytesType), add))
}

// TestConformanceRequestCap (ztunnel commit
// 62d826530e5ce85764e309170205b293efcbc80b, src/inpod/protocol.rs
// read_message): ztunnel reads each request into 1,024 bytes and
// refuses a truncated one. An AddWorkload of exactly 1,024 bytes arrives whole;
// one byte more is refused by the agent before anything is sent, and the
// connection carries on.
func TestConformanceRequestCap(t *testing.T) {
	fixtures.RequireRoot(t, rootReason)
	ctx := testCtx(t)
	snap := &pods{}
	path := filepath.Join(t.TempDir(), "ztunnel.sock")
	srv := startServer(t, snap, path)
	w := newWorkloads()
	done := serve(t, ctx, path, w, ztunnel.Options{RequireServiceAccount: true})
	w.wait(t, ctx, "the snapshot", func(_ map[string]ztunnel.WorkloadInfo, synced int) bool { return synced == 1 })

	fit := zdsPod(t, "fit")
	for encodedAddSize(fit) < ztunnel.ReadBuffer {
		fit.Name += "n"
	}
	if got := encodedAddSize(fit); got != ztunnel.ReadBuffer {
		t.Fatalf("could not size a pod to %d bytes (got %d)", ztunnel.ReadBuffer, got)
	}
	over := zdsPod(t, "over")
	over.Name = strings.Repeat("o", len(fit.Name)+1)
	for encodedAddSize(over) <= ztunnel.ReadBuffer {
		over.Name += "o"
	}
	if err := srv.AddPod(ctx, over); err == nil || errors.Is(err, zds.ErrNoProxy) {
		t.Fatalf("AddPod of a %d-byte AddWorkload = %v, want refused", encodedAddSize(over), err)
	}
	snap.set(fit)
	if err := srv.AddPod(ctx, fit); err != nil {
		t.Fatalf("AddPod of a %d-byte AddWorkload: %v", encodedAddSize(fit), err)
	}
	w.wait(t, ctx, "the 1,024-byte pod running", func(r map[string]ztunnel.WorkloadInfo, _ int) bool {
		return r[fit.UID].Name == fit.Name
	})
	select {
	case err := <-done:
		t.Fatalf("client ended: %v", err)
	default:
	}
}

// Capabilities of ztunnel's container as Istio's chart runs it (istio/istio
// commit 86c9f01fd735fb01d8192f5bcaf0d424afb7f14c,
// manifests/charts/ztunnel/templates/daemonset.yaml): runAsUser 0,
// runAsGroup 1337, capabilities drop ALL, add NET_ADMIN, SYS_ADMIN, NET_RAW.
// Without CAP_DAC_OVERRIDE, root too needs the permission bits: write on the
// socket, search on its directory.
var ztunnelCaps = []uint{unix.CAP_NET_ADMIN, unix.CAP_SYS_ADMIN, unix.CAP_NET_RAW}

// dialAs connects to path from a thread with only caps effective and file
// system uid fsuid, the way a process with that identity would. The thread is
// discarded afterwards (never unlocked), so nothing else runs with it.
func dialAs(ctx context.Context, path string, fsuid int, caps []uint) (*ztunnel.Conn, error) {
	type result struct {
		c   *ztunnel.Conn
		err error
	}
	ch := make(chan result, 1)
	go func() {
		runtime.LockOSThread() // no unlock: the thread dies with this goroutine
		if fsuid != 0 {
			// This thread only; before the capabilities go (it needs CAP_SETUID).
			unix.Setfsuid(fsuid)
			if got, _ := unix.SetfsuidRetUid(-1); got != fsuid {
				ch <- result{err: fmt.Errorf("setfsuid(%d) left fsuid %d", fsuid, got)}
				return
			}
		}
		hdr := unix.CapUserHeader{Version: unix.LINUX_CAPABILITY_VERSION_3}
		var data [2]unix.CapUserData
		if err := unix.Capget(&hdr, &data[0]); err != nil {
			ch <- result{err: fmt.Errorf("capget: %w", err)}
			return
		}
		data[0].Effective, data[1].Effective = 0, 0
		for _, c := range caps {
			data[c/32].Effective |= 1 << (c % 32)
		}
		if err := unix.Capset(&hdr, &data[0]); err != nil {
			ch <- result{err: fmt.Errorf("capset: %w", err)}
			return
		}
		c, err := ztunnel.Dial(ctx, path)
		ch <- result{c, err}
	}()
	r := <-ch
	return r.c, r.err
}

// TestZtunnelAsIstioRunsItConnects (istio/istio commit
// 86c9f01fd735fb01d8192f5bcaf0d424afb7f14c: the ztunnel and istio-cni charts,
// both mounting /var/run/ztunnel as a DirectoryOrCreate hostPath): with the
// agent's socket defaults (socket
// 0600 root, a missing directory made 0700) and with the directory kubelet
// makes for the hostPath of both DaemonSets (DirectoryOrCreate: 0755 root),
// a process with ztunnel's identity (uid 0, only NET_ADMIN, SYS_ADMIN and
// NET_RAW) connects and takes its snapshot. A process with another file
// system uid (1337) is refused by the file modes, so the check is real.
func TestZtunnelAsIstioRunsItConnects(t *testing.T) {
	fixtures.RequireRoot(t, rootReason)
	ctx := testCtx(t)
	kubeletDir := filepath.Join(t.TempDir(), "kubelet-made")
	if err := os.Mkdir(kubeletDir, 0o755); err != nil {
		t.Fatal(err)
	}
	for name, path := range map[string]string{
		"directory made by the agent": filepath.Join(t.TempDir(), "ztunnel", "ztunnel.sock"),
		"directory made by kubelet":   filepath.Join(kubeletDir, "ztunnel.sock"),
	} {
		t.Run(name, func(t *testing.T) {
			p := zdsPod(t, "p")
			snap := &pods{}
			snap.set(p)
			startServer(t, snap, path)
			c, err := dialAs(ctx, path, 0, ztunnelCaps)
			if err != nil {
				t.Fatalf("ztunnel's identity cannot connect: %v", err)
			}
			w := newWorkloads()
			sctx, cancel := context.WithCancel(ctx)
			defer cancel()
			done := make(chan error, 1)
			go func() { done <- ztunnel.NewSession(w, ztunnel.Options{RequireServiceAccount: true}).Serve(sctx, c) }()
			w.wait(t, ctx, "the snapshot", func(r map[string]ztunnel.WorkloadInfo, synced int) bool {
				return synced == 1 && r[p.UID].ServiceAccount == p.ServiceAccount
			})
			cancel()
			c.Close()
			<-done

			if c, err := dialAs(ctx, path, 1337, nil); !errors.Is(err, unix.EACCES) {
				if c != nil {
					c.Close()
				}
				t.Fatalf("a process with file system uid 1337 connecting: %v, want EACCES", err)
			}
		})
	}
}

// TestPendingRetry (workloadmanager.rs, statemanager.rs): a pod whose proxy
// fails to start is nacked, the connection stays, and ztunnel tries it again
// every retry interval until it starts; a pod deleted while pending is not
// tried again, and none is pending once every one started.
func TestPendingRetry(t *testing.T) {
	fixtures.RequireRoot(t, rootReason)
	ctx := testCtx(t)
	late, gone := zdsPod(t, "late"), zdsPod(t, "gone")
	snap := &pods{}
	snap.set(late, gone)
	path := filepath.Join(t.TempDir(), "ztunnel.sock")
	srv := startServer(t, snap, path)
	w := newWorkloads()
	w.failing[late.UID] = 2
	w.failing[gone.UID] = 1 << 30
	c, err := ztunnel.Dial(ctx, path)
	if err != nil {
		t.Fatal(err)
	}
	sctx, cancel := context.WithCancel(ctx)
	session := ztunnel.NewSession(w, ztunnel.Options{RequireServiceAccount: true, RetryInterval: 20 * time.Millisecond})
	done := make(chan error, 1)
	go func() { done <- session.Serve(sctx, c) }()
	t.Cleanup(func() {
		cancel()
		c.Close()
		<-done
	})

	w.wait(t, ctx, "the snapshot", func(_ map[string]ztunnel.WorkloadInfo, synced int) bool { return synced == 1 })
	w.wait(t, ctx, "late started on its third try", func(r map[string]ztunnel.WorkloadInfo, _ int) bool {
		_, ok := r[late.UID]
		return ok
	})
	if n := w.triesOf(late.UID); n != 3 {
		t.Errorf("late started after %d tries, want 3 (two failures, then the retry that worked)", n)
	}
	w.wait(t, ctx, "gone tried again", func(map[string]ztunnel.WorkloadInfo, int) bool { return w.tries[gone.UID] >= 3 })
	if got := session.Pending(); len(got) != 1 || got[0] != gone.UID {
		t.Errorf("pending %v, want only %s", got, gone.UID)
	}

	snap.set(late)
	if err := srv.DelPod(ctx, gone.UID); err != nil {
		t.Fatalf("delete gone: %v", err)
	}
	if got := session.Pending(); len(got) != 0 {
		t.Errorf("pending %v after the delete, want none", got)
	}
	before := w.triesOf(gone.UID)
	// What is asserted is that nothing happens: ten retry intervals, in which
	// a pod still pending would have been tried again.
	time.Sleep(10 * 20 * time.Millisecond)
	if after := w.triesOf(gone.UID); after != before {
		t.Errorf("gone tried %d more times after it was deleted", after-before)
	}
	select {
	case err := <-done:
		t.Fatalf("the connection ended: %v; a pod that fails to start must not end it", err)
	default:
	}
}

// TestProtocolErrorStops (workloadmanager.rs run_internal): on a protocol
// error, here a second SnapshotSent, ztunnel nacks and stops its workload
// manager for good instead of connecting again.
func TestProtocolErrorStops(t *testing.T) {
	fixtures.RequireRoot(t, rootReason)
	ctx := testCtx(t)
	path := filepath.Join(t.TempDir(), "ztunnel.sock")
	ln, err := net.ListenUnix("unixpacket", &net.UnixAddr{Name: path, Net: "unixpacket"})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { ln.Close() })
	var accepted atomic.Int32
	go func() {
		snapshotSent := protowire.AppendBytes(protowire.AppendTag(nil, 3, protowire.BytesType), nil)
		for {
			c, err := ln.AcceptUnix()
			if err != nil {
				return
			}
			accepted.Add(1)
			go func() {
				defer c.Close()
				buf := make([]byte, 1024)
				if _, err := c.Read(buf); err != nil { // hello
					return
				}
				for range 2 {
					if _, err := c.Write(snapshotSent); err != nil {
						return
					}
					if _, err := c.Read(buf); err != nil { // ack
						return
					}
				}
				_, _ = c.Read(buf) // until the client hangs up
			}()
		}
	}()
	err = ztunnel.Run(ctx, ztunnel.Config{ZDSPath: path, Log: zaptest.NewLogger(t)})
	if !errors.Is(err, ztunnel.ErrProtocol) {
		t.Fatalf("Run = %v, want it stopped on the protocol error", err)
	}
	if n := accepted.Load(); n != 1 {
		t.Errorf("the client connected %d times, want once: a protocol error ends it for good", n)
	}
}
