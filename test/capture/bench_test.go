package capture_test

import (
	"context"
	"io"
	"net/netip"
	"testing"
	"time"

	"github.com/mesh-cni/mesh-cni/test/capture"
	"github.com/mesh-cni/mesh-cni/test/fixtures"
	"github.com/mesh-cni/mesh-cni/test/proxy"
)

// BenchmarkConnectEcho measures one pod-to-pod connect, 64-byte echo and close per
// iteration, A → B:8080 over IPv4: without capture, and through each capture
// variant with a refproxy in each pod ("forward") or with A's proxy answering
// itself ("echo", the cost of the capture and one proxy hop alone). These are the
// baselines mesh-cni's eBPF capture is compared with.
func BenchmarkConnectEcho(b *testing.B) {
	fixtures.RequireRoot(b, "creates network namespaces and netfilter rules")
	b.Run("nocapture", func(b *testing.B) { benchConnectEcho(b, nil, false) })
	for _, inst := range installers {
		b.Run(inst.name+"/forward", func(b *testing.B) { benchConnectEcho(b, inst.install, false) })
		b.Run(inst.name+"/echo", func(b *testing.B) { benchConnectEcho(b, inst.install, true) })
	}
}

func benchConnectEcho(b *testing.B, install installer, echo bool) {
	ctx, cancel := context.WithTimeout(b.Context(), 10*time.Minute)
	defer cancel()
	podA, podB := fixtures.NewPodPair(b)
	podB.ServeEcho(b, 8080)
	if install != nil {
		var args []string
		if echo {
			args = append(args, "-echo")
		}
		startBenchProxy(b, ctx, podA, args...)
		startBenchProxy(b, ctx, podB)
		for _, pod := range []*fixtures.Pod{podA, podB} {
			cleanup, err := install(ctx, pod.Path, capture.DefaultRules())
			if err != nil {
				b.Fatal(err)
			}
			b.Cleanup(func() {
				if err := cleanup(context.Background()); err != nil {
					b.Errorf("remove capture: %v", err)
				}
			})
		}
	}
	dst := netip.AddrPortFrom(podB.IPv4, 8080)
	msg := make([]byte, 64)
	buf := make([]byte, len(msg))
	for b.Loop() {
		conn, err := podA.DialTCP(ctx, dst)
		if err != nil {
			b.Fatal(err)
		}
		if _, err := conn.Write(msg); err != nil {
			b.Fatal(err)
		}
		if _, err := io.ReadFull(conn, buf); err != nil {
			b.Fatal(err)
		}
		conn.Close()
	}
}

func startBenchProxy(b *testing.B, ctx context.Context, pod *fixtures.Pod, args ...string) {
	b.Helper()
	bin, err := buildOnce()
	if err != nil {
		b.Fatalf("build refproxy: %v", err)
	}
	p, err := proxy.StartProcess(ctx, proxy.ProcessOptions{Binary: bin, NetNS: pod.Path, Args: append(args, "-log-level", "warn")})
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		if err := p.Stop(ctx); err != nil {
			b.Errorf("stop refproxy: %v", err)
		}
	})
}
