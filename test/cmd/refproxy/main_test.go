package main

import (
	"bufio"
	"bytes"
	"context"
	"io"
	"net/netip"
	"path/filepath"
	"testing"
	"time"

	"go.uber.org/zap/zaptest"

	"github.com/mesh-cni/mesh-cni/internal/netns"
	"github.com/mesh-cni/mesh-cni/pkg/zds"
	"github.com/mesh-cni/mesh-cni/test/fixtures"
	"github.com/mesh-cni/mesh-cni/test/proxy"
)

func TestRunBadFlags(t *testing.T) {
	for _, args := range [][]string{
		{"-mark", "zero"},
		{"-mark", "0"},
		{"-mark", "0x1ffffffff"},
		{"-outbound-port", "70000"},
		{"-inbound-port", "0"},
		{"-log-level", "loud"},
		{"-no-such-flag"},
		{"stray"},
	} {
		var stdout, stderr bytes.Buffer
		if code := run(t.Context(), args, &stdout, &stderr); code != 2 {
			t.Errorf("run(%q) = %d, want 2 (stderr %q)", args, code, stderr.String())
		}
		if stdout.Len() != 0 {
			t.Errorf("run(%q) printed %q on stdout", args, stdout.String())
		}
	}
}

// running is run started on a goroutine, past its "ready".
type running struct {
	out    *bufio.Reader
	stderr bytes.Buffer
	stop   context.CancelFunc
	exit   chan int
}

// startRun starts run with args inside the namespace at netnsPath ("": the
// test's; run binds its listeners on the calling thread) and waits for its
// first stdout line, which must be exactly "ready". It is stopped in t's
// cleanup if end did not.
func startRun(ctx context.Context, t *testing.T, netnsPath string, args ...string) *running {
	t.Helper()
	ctx, stop := context.WithCancel(ctx)
	r := &running{stop: stop, exit: make(chan int, 1)}
	stdoutR, stdoutW := io.Pipe()
	go func() {
		code := -1
		do := func(fn func() error) error { return fn() }
		if netnsPath != "" {
			do = func(fn func() error) error { return netns.Do(netnsPath, fn) }
		}
		if err := do(func() error { code = run(ctx, args, stdoutW, &r.stderr); return nil }); err != nil {
			t.Errorf("enter %s: %v", netnsPath, err)
		}
		stdoutW.Close()
		r.exit <- code
	}()
	t.Cleanup(func() {
		stop()
		// Drain, so a run still writing is not left blocked on the pipe.
		_, _ = io.Copy(io.Discard, stdoutR)
	})
	r.out = bufio.NewReader(stdoutR)
	if line, err := r.out.ReadString('\n'); err != nil || line != "ready\n" {
		t.Fatalf("first stdout line %q, %v", line, err)
	}
	return r
}

// end cancels run's context, as SIGTERM does, and checks that it prints
// nothing more and returns 0.
func (r *running) end(t *testing.T) {
	t.Helper()
	r.stop()
	if rest, err := io.ReadAll(r.out); err != nil || len(rest) != 0 {
		t.Errorf("more stdout after ready: %q, %v", rest, err)
	}
	if code := <-r.exit; code != 0 {
		t.Fatalf("run returned %d after cancel; stderr:\n%s", code, r.stderr.String())
	}
}

// TestRunServesUntilCancelled runs the command in-process inside a pod namespace:
// it prints exactly "ready", serves (echo mode) and records, and returns 0 when its
// context ends, as on SIGTERM.
func TestRunServesUntilCancelled(t *testing.T) {
	fixtures.RequireRoot(t, "creates network namespaces")
	ctx := fixtures.Context(t, time.Minute)
	pod, _ := fixtures.NewPodPair(t)
	records := filepath.Join(t.TempDir(), "records.jsonl")

	r := startRun(ctx, t, pod.Path, "-echo", "-record", records, "-outbound-port", "15101", "-mark", "1337")
	conn, err := pod.DialTCP(ctx, netip.MustParseAddrPort("127.0.0.1:15101"))
	if err != nil {
		t.Fatal(err)
	}
	if err := fixtures.EchoRoundTrip(ctx, conn, []byte("hello through refproxy")); err != nil {
		t.Fatal(err)
	}
	if _, err := proxy.WaitForRecords(ctx, records, func(rs []proxy.Record) bool { return len(rs) == 1 }); err != nil {
		t.Fatal(err)
	}

	r.end(t)
}

// TestRunNodeMode runs the command as a node proxy (-zds) in-process, in the
// host namespace: it prints "ready" once the agent's snapshot is served, and the
// pod it was handed has its (echo) listener inside the pod's namespace.
func TestRunNodeMode(t *testing.T) {
	fixtures.RequireRoot(t, "creates network namespaces")
	ctx := fixtures.Context(t, time.Minute)
	pod, _ := fixtures.NewPodPair(t)
	path := filepath.Join(t.TempDir(), "ztunnel.sock")
	uid := "refproxy-test-pod"
	srv, err := zds.NewServer(ctx, zds.Config{SocketPath: path, Logger: zaptest.NewLogger(t),
		Snapshot: zds.SnapshotFunc(func(context.Context) ([]zds.Pod, error) {
			return []zds.Pod{{UID: uid, Name: "p", Namespace: "default", NetnsPath: pod.Path}}, nil
		})})
	if err != nil {
		t.Fatal(err)
	}
	serveDone := make(chan error, 1)
	go func() { serveDone <- srv.Serve(ctx) }()
	defer func() {
		srv.Close()
		if err := <-serveDone; err != nil {
			t.Errorf("serve: %v", err)
		}
	}()
	records := filepath.Join(t.TempDir(), "records.jsonl")

	r := startRun(ctx, t, "", "-zds", path, "-echo", "-record", records)
	conn, err := pod.DialTCP(ctx, netip.MustParseAddrPort("[::1]:15001"))
	if err != nil {
		t.Fatal(err)
	}
	if err := fixtures.EchoRoundTrip(ctx, conn, []byte("hello through the node proxy")); err != nil {
		t.Fatal(err)
	}
	got, err := proxy.WaitForRecords(ctx, records, func(rs []proxy.Record) bool { return len(rs) == 1 })
	if err != nil {
		t.Fatal(err)
	}
	if got[0].Pod != uid || got[0].Direction != proxy.Outbound {
		t.Errorf("record %+v, want an outbound record of pod %s", got[0], uid)
	}
	r.end(t)
}

// TestRunNodeModeNoAgent: with no agent there is no snapshot and no "ready", and
// SIGTERM still ends the command cleanly.
func TestRunNodeModeNoAgent(t *testing.T) {
	ctx := fixtures.Context(t, 100*time.Millisecond)
	var stdout, stderr bytes.Buffer
	if code := run(ctx, []string{"-zds", filepath.Join(t.TempDir(), "none.sock")}, &stdout, &stderr); code != 0 {
		t.Fatalf("run = %d; stderr:\n%s", code, stderr.String())
	}
	if stdout.Len() != 0 {
		t.Errorf("printed %q without an agent", stdout.String())
	}
}
