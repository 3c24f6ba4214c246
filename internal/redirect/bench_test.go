package redirect

import (
	"context"
	"fmt"
	"net"
	"sync"
	"testing"

	"github.com/cilium/ebpf"
	"golang.org/x/sys/unix"

	"github.com/mesh-cni/mesh-cni/internal/netns"
	"github.com/mesh-cni/mesh-cni/test/fixtures"
)

// BenchmarkEnrollRelease is the data path's share of a pod's ADD and DEL: the pod's
// sk_lookup program loaded and attached to its netns, pins, map entries; then their
// removal.
func BenchmarkEnrollRelease(b *testing.B) {
	requireRoot(b)
	ctx := context.Background()
	d, _ := testDatapath(b)
	a, _ := newPodPair(b)
	target := Target{NetnsPath: a.path, Settings: testSettings()}
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		e, err := d.Enroll(ctx, target)
		if err != nil {
			b.Fatal(err)
		}
		if err := d.Release(ctx, e.Cookie); err != nil {
			b.Fatal(err)
		}
	}
}

// BenchmarkConnect is one redirected connect of an enrolled pod per op, to its
// outbound proxy (which accepts and closes), and reports the connect4
// program's mean run time (BPF run-time statistics, which also count the
// cheap runs of other processes' connects on the host meanwhile: runs/op says
// how many): the data path's share of a connect.
func BenchmarkConnect(b *testing.B) {
	requireRoot(b)
	d, _ := testDatapath(b)
	a, peer := newPodPair(b)
	s := testSettings()
	fixtures.Serve(b, a.listen(b, fmt.Sprintf("[::]:%d", s.OutboundPort)), func(net.Conn) {})
	enroll(b, d, a, s)
	stats, err := ebpf.EnableStats(unix.BPF_STATS_RUN_TIME)
	if err != nil {
		b.Fatalf("BPF run-time statistics: %v", err)
	}
	defer stats.Close()
	target := hostPort(peer.addr4, appPort)
	before, err := d.objs.MeshConnect4.Stats()
	if err != nil {
		b.Fatal(err)
	}
	b.ResetTimer()
	err = netns.Do(a.path, func() error {
		for range b.N {
			c, err := net.Dial("tcp", target)
			if err != nil {
				return err
			}
			c.Close()
		}
		return nil
	})
	b.StopTimer()
	if err != nil {
		b.Fatal(err)
	}
	after, err := d.objs.MeshConnect4.Stats()
	if err != nil {
		b.Fatal(err)
	}
	runs := after.RunCount - before.RunCount
	if runs < uint64(b.N) {
		b.Fatalf("connect4 ran %d times for %d connects", runs, b.N)
	}
	b.ReportMetric(float64((after.Runtime-before.Runtime).Nanoseconds())/float64(runs), "ns/connect4")
	b.ReportMetric(float64(runs)/float64(b.N), "runs/op")
}

// BenchmarkEnrollConcurrent16 enrolls and releases 16 pods at once, as 16 pods
// starting together on a node do.
func BenchmarkEnrollConcurrent16(b *testing.B) {
	requireRoot(b)
	ctx := context.Background()
	d, _ := testDatapath(b)
	var targets []Target
	for len(targets) < 16 {
		a, c := newPodPair(b)
		for _, p := range []*pod{a, c} {
			targets = append(targets, Target{NetnsPath: p.path, Settings: testSettings()})
		}
	}
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		var wg sync.WaitGroup
		errs := make(chan error, len(targets))
		for _, t := range targets {
			wg.Go(func() {
				e, err := d.Enroll(ctx, t)
				if err == nil {
					err = d.Release(ctx, e.Cookie)
				}
				if err != nil {
					errs <- err
				}
			})
		}
		wg.Wait()
		close(errs)
		for err := range errs {
			b.Fatal(err)
		}
	}
}
