package redirect

import (
	"context"
	"sync"
	"testing"
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
