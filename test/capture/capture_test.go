package capture_test

import (
	"context"
	"flag"
	"fmt"
	"net/netip"
	"os"
	"path/filepath"
	"sync"
	"testing"
	"time"

	"github.com/mesh-cni/mesh-cni/test/capture"
	"github.com/mesh-cni/mesh-cni/test/fixtures"
	"github.com/mesh-cni/mesh-cni/test/harness"
	"github.com/mesh-cni/mesh-cni/test/proxy"
)

// binDir holds the refproxy binary, built once for the whole package run.
var binDir string

func TestMain(m *testing.M) {
	os.Exit(testMain(m))
}

func testMain(m *testing.M) int {
	dir, err := os.MkdirTemp("", "capture-test-bin-")
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	defer os.RemoveAll(dir)
	binDir = dir
	// istio-cni's in-pod rules come from hack/build-istio.sh's cache: found
	// there, or built here (minutes, cold) before any test's deadline starts.
	// Only root runs the tests that use them.
	flag.Parse()
	if os.Geteuid() == 0 && !testing.Short() {
		if _, err := istioBuild(); err != nil {
			fmt.Fprintf(os.Stderr, "capture: %v\n", err)
			return 1
		}
	}
	return m.Run()
}

var buildOnce = sync.OnceValues(func() (string, error) {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	return proxy.Binary(ctx, binDir)
})

func refproxyBinary(t *testing.T) string {
	t.Helper()
	bin, err := buildOnce()
	if err != nil {
		t.Fatalf("build refproxy: %v", err)
	}
	return bin
}

// rootReason is why these tests need root.
const rootReason = "creates network namespaces and netfilter rules"

type installer func(context.Context, string, capture.Rules) (capture.Cleanup, error)

var installers = []struct {
	name    string
	install installer
}{
	{"iptables", capture.InstallIPTables},
	{"nftables", capture.InstallNFTables},
	{"istio-cni", installIstio},
}

// istioBuild finds (or builds, once per package run) hack/build-istio.sh's
// cache, which holds the istio-inpod helper.
var istioBuild = sync.OnceValues(func() (string, error) {
	dir, err := harness.IstioBinDir(context.Background())
	return filepath.Join(dir, capture.IstioBinary), err
})

// installIstio applies istio-cni's own rules; they take no Rules: they are
// Istio's, whose ports and mark are DefaultRules'.
func installIstio(ctx context.Context, netnsPath string, _ capture.Rules) (capture.Cleanup, error) {
	helper, err := istioBuild()
	if err != nil {
		return nil, fmt.Errorf("istio-inpod: %w", err)
	}
	return capture.InstallIstio(ctx, helper, netnsPath)
}

func installCapture(t *testing.T, ctx context.Context, install installer, pod *fixtures.Pod) {
	t.Helper()
	cleanup, err := install(ctx, pod.Path, capture.DefaultRules())
	if err != nil {
		t.Fatalf("install capture in %s: %v", pod.Path, err)
	}
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		if err := cleanup(ctx); err != nil {
			t.Errorf("remove capture: %v", err)
		}
	})
}

// startRefproxy runs the refproxy binary in the pod with nsenter and returns its
// record file. It is stopped with SIGTERM in cleanup and must exit with status 0.
func startRefproxy(t *testing.T, ctx context.Context, pod *fixtures.Pod, extra ...string) string {
	t.Helper()
	dir := t.TempDir()
	records := filepath.Join(dir, "records.jsonl")
	logPath := filepath.Join(dir, "refproxy.log")
	logFile, err := os.Create(logPath)
	if err != nil {
		t.Fatal(err)
	}
	defer logFile.Close()
	p, err := proxy.StartProcess(ctx, proxy.ProcessOptions{
		Binary: refproxyBinary(t),
		NetNS:  pod.Path,
		Args:   append([]string{"-record", records, "-log-level", "debug"}, extra...),
		Stderr: logFile,
	})
	if err != nil {
		t.Fatalf("start refproxy in %s: %v", pod.Path, err)
	}
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		if err := p.Stop(ctx); err != nil {
			t.Errorf("stop refproxy: %v", err)
		}
		if t.Failed() {
			if log, err := os.ReadFile(logPath); err == nil {
				t.Logf("refproxy log (%s):\n%s", pod.Path, log)
			}
		}
	})
	return records
}

// TestCaptureThroughProxies sends A → B:8080 through the capture and a refproxy in
// each pod, and checks the bytes and both proxies' records, for each capture
// variant and address family.
func TestCaptureThroughProxies(t *testing.T) {
	fixtures.RequireRoot(t, rootReason)
	for _, inst := range installers {
		t.Run(inst.name, func(t *testing.T) {
			fixtures.Both(t, "ipv4", "ipv6", func(t *testing.T, v6 bool) { testThroughProxies(t, inst.install, v6) })
		})
	}
}

func testThroughProxies(t *testing.T, install installer, v6 bool) {
	ctx, cancel := context.WithTimeout(t.Context(), 2*time.Minute)
	defer cancel()
	a, b := fixtures.NewPodPair(t)
	const appPort = 8080
	b.ServeEcho(t, appPort)
	recA := startRefproxy(t, ctx, a)
	recB := startRefproxy(t, ctx, b)
	installCapture(t, ctx, install, a)
	installCapture(t, ctx, install, b)

	dst := netip.AddrPortFrom(b.Addr(v6), appPort)
	payload := fixtures.RandomBytes(256 << 10)
	conn, err := a.DialTCP(ctx, dst)
	if err != nil {
		t.Fatal(err)
	}
	if err := fixtures.EchoRoundTrip(ctx, conn, payload); err != nil {
		t.Fatalf("A → %s: %v", dst, err)
	}

	atLeastOne := func(rs []proxy.Record) bool { return len(rs) > 0 }
	gotA, err := proxy.WaitForRecords(ctx, recA, atLeastOne)
	if err != nil {
		t.Fatalf("A's records: %v", err)
	}
	gotB, err := proxy.WaitForRecords(ctx, recB, atLeastOne)
	if err != nil {
		t.Fatalf("B's records: %v", err)
	}
	// Exactly one record each: A's marked onward connection was not captured again
	// by A (no second outbound record), and B's onward connection to the app was
	// not captured by B (no outbound record there).
	if len(gotA) != 1 || len(gotB) != 1 {
		t.Fatalf("want exactly one record per proxy, A has %+v, B has %+v", gotA, gotB)
	}
	loopback := netip.MustParseAddr("127.0.0.1")
	if v6 {
		loopback = netip.IPv6Loopback()
	}
	size := int64(len(payload))
	checkRecord(t, "A", gotA[0], proxy.Record{
		Direction:     proxy.Outbound,
		OriginalDst:   dst,
		DstSource:     proxy.SourceGetsockopt,
		Local:         netip.AddrPortFrom(loopback, capture.DefaultOutboundPort),
		BytesToDst:    size,
		BytesToClient: size,
	}, a.Addr(v6))
	checkRecord(t, "B", gotB[0], proxy.Record{
		Direction:     proxy.Inbound,
		OriginalDst:   dst,
		DstSource:     proxy.SourceGetsockopt,
		Local:         netip.AddrPortFrom(b.Addr(v6), capture.DefaultInboundPort),
		BytesToDst:    size,
		BytesToClient: size,
	}, a.Addr(v6))
}

// checkRecord compares the fields of got that a test can predict with want; the
// client must come from clientIP.
func checkRecord(t *testing.T, who string, got, want proxy.Record, clientIP netip.Addr) {
	t.Helper()
	if got.Direction != want.Direction || got.OriginalDst != want.OriginalDst || got.DstSource != want.DstSource ||
		got.Local != want.Local || got.BytesToDst != want.BytesToDst || got.BytesToClient != want.BytesToClient ||
		got.Error != "" || got.Client.Addr() != clientIP {
		t.Errorf("%s's record:\n got %+v\nwant %+v with client %s and no error", who, got, want, clientIP)
	}
}
