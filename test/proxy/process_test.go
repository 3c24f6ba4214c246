package proxy_test

import (
	"context"
	"net/netip"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/mesh-cni/mesh-cni/test/fixtures"
	"github.com/mesh-cni/mesh-cni/test/proxy"
)

func TestBinaryFromEnv(t *testing.T) {
	dir := t.TempDir()
	t.Setenv(proxy.EnvBinDir, dir)
	if _, err := proxy.Binary(t.Context(), t.TempDir()); err == nil {
		t.Fatal("missing prebuilt refproxy accepted")
	}
	bin := filepath.Join(dir, "refproxy")
	if err := os.WriteFile(bin, []byte("#!/bin/sh\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	if _, err := proxy.Binary(t.Context(), t.TempDir()); err == nil {
		t.Fatal("non-executable prebuilt refproxy accepted")
	}
	if err := os.Chmod(bin, 0o755); err != nil {
		t.Fatal(err)
	}
	if got, err := proxy.Binary(t.Context(), t.TempDir()); err != nil || got != bin {
		t.Fatalf("Binary = %q, %v; want %q", got, err, bin)
	}
}

// TestStartProcessNotReady checks that a process that exits or says something other
// than "ready" is reported, and reaped, instead of waited on.
func TestStartProcessNotReady(t *testing.T) {
	ctx := fixtures.Context(t, time.Minute)
	for _, tc := range []struct {
		script, want string
	}{
		{"exit 3", "before ready"},
		{"echo hello; exec sleep 60", `printed "hello"`},
	} {
		bin := filepath.Join(t.TempDir(), "fake")
		if err := os.WriteFile(bin, []byte("#!/bin/sh\n"+tc.script+"\n"), 0o755); err != nil {
			t.Fatal(err)
		}
		_, err := proxy.StartProcess(ctx, proxy.ProcessOptions{Binary: bin})
		if err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("StartProcess(%q) = %v, want an error with %q", tc.script, err, tc.want)
		}
	}
	short, cancelShort := context.WithTimeout(ctx, 100*time.Millisecond)
	defer cancelShort()
	bin := filepath.Join(t.TempDir(), "silent")
	if err := os.WriteFile(bin, []byte("#!/bin/sh\nexec sleep 60\n"), 0o755); err != nil {
		t.Fatal(err)
	}
	if _, err := proxy.StartProcess(short, proxy.ProcessOptions{Binary: bin}); err == nil || !strings.Contains(err.Error(), "waiting for refproxy") {
		t.Errorf("StartProcess of a silent process = %v", err)
	}
}

// TestProcessLifecycle builds refproxy, runs it in a pod with nsenter, and stops it:
// it must exit with status 0 on SIGTERM.
func TestProcessLifecycle(t *testing.T) {
	fixtures.RequireRoot(t, rootReason)
	ctx := fixtures.Context(t, 5*time.Minute)
	bin, err := proxy.Binary(ctx, t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	pod, _ := fixtures.NewPodPair(t)
	records := filepath.Join(t.TempDir(), "records.jsonl")
	p, err := proxy.StartProcess(ctx, proxy.ProcessOptions{Binary: bin, NetNS: pod.Path, Args: []string{"-echo", "-record", records}})
	if err != nil {
		t.Fatal(err)
	}
	conn, err := pod.DialTCP(ctx, netip.AddrPortFrom(pod.IPv4, proxy.DefaultInboundPort))
	if err != nil {
		t.Fatal(err)
	}
	if err := fixtures.EchoRoundTrip(ctx, conn, []byte("hi")); err != nil {
		t.Fatal(err)
	}
	got, err := proxy.WaitForRecords(ctx, records, func(rs []proxy.Record) bool { return len(rs) == 1 })
	if err != nil {
		t.Fatal(err)
	}
	if got[0].DstSource != proxy.SourceLocalAddr || got[0].BytesToClient != 2 {
		t.Errorf("record %+v", got[0])
	}
	if err := p.Stop(ctx); err != nil {
		t.Fatalf("stop: %v", err)
	}
}
