package bench

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"testing"
	"time"

	"github.com/containernetworking/cni/libcni"

	"github.com/mesh-cni/mesh-cni/test/harness"
)

// BenchmarkChainAdd measures a pod's CNI ADD through [bridge] and through
// [bridge, mesh-cni] with a ready agent, alternating the two in every iteration
// so machine noise hits both alike. Only the ADD is timed; creating the pod's
// namespace and the DEL are not. It reports both medians, the overhead in ms and
// the ratio.
func BenchmarkChainAdd(b *testing.B) {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Minute)
	defer cancel()
	dir, err := os.MkdirTemp("", "mesh-bench-")
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() { os.RemoveAll(dir) })
	socket := filepath.Join(dir, "gate.sock")
	agent := harness.StartProcess(b, harness.ProcessOptions{
		Path: harness.Bins(b).Path("mesh-agent"),
		Args: []string{"run", "--socket", socket, "--state-dir", filepath.Join(dir, "pods"), "--datapath", "none", "--log-level", "warn"},
	})
	_ = agent
	readyCtx, readyCancel := context.WithTimeout(ctx, 30*time.Second)
	defer readyCancel()
	if err := harness.WaitForHealthy(readyCtx, socket); err != nil {
		b.Fatal(err)
	}

	node := harness.NewNode(b, harness.NodeOptions{Plugins: append(harness.ReferencePluginNames(), "mesh-cni")})
	bridgeOnly := node.Conflist(b, "bridgeonly")
	withMesh := node.Conflist(b, "withmesh", map[string]any{"type": "mesh-cni", "socketPath": socket, "gateTimeout": "30s", "logLevel": "warn"})

	addOnce := func(list *libcni.NetworkConfigList, i int) time.Duration {
		pod := node.NewPod(b, "bench", fmt.Sprintf("%s-%d", list.Name, i))
		start := time.Now()
		if _, err := node.Add(ctx, pod, list); err != nil {
			b.Fatal(err)
		}
		took := time.Since(start)
		if err := node.Del(ctx, pod, list); err != nil {
			b.Fatal(err)
		}
		return took
	}
	// Warm both paths (bridge creation, page cache) before measuring.
	addOnce(bridgeOnly, -1)
	addOnce(withMesh, -1)

	var bridgeTimes, meshTimes []time.Duration
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		if i%2 == 0 {
			bridgeTimes = append(bridgeTimes, addOnce(bridgeOnly, i))
			meshTimes = append(meshTimes, addOnce(withMesh, i))
		} else {
			meshTimes = append(meshTimes, addOnce(withMesh, i))
			bridgeTimes = append(bridgeTimes, addOnce(bridgeOnly, i))
		}
	}
	b.StopTimer()
	bridgeMed, meshMed := median(bridgeTimes), median(meshTimes)
	b.ReportMetric(ms(bridgeMed), "bridge-ms")
	b.ReportMetric(ms(meshMed), "bridge+mesh-ms")
	b.ReportMetric(ms(meshMed-bridgeMed), "overhead-ms")
	b.ReportMetric(float64(meshMed)/float64(bridgeMed), "ratio")
}

func median(ds []time.Duration) time.Duration {
	s := slices.Clone(ds)
	slices.Sort(s)
	return s[len(s)/2]
}

func ms(d time.Duration) float64 { return float64(d) / float64(time.Millisecond) }
