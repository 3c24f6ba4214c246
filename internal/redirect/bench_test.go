package redirect

import (
	"context"
	"io"
	"net"
	"sync"
	"testing"
	"time"
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

// BenchmarkSpliceUpload is one bulk upload per iteration (64 MiB in 64 KiB
// writes) through the whole chain, application → its proxy → the server's
// proxy → a sink, with the application's side spliced under several bounds
// and, as the baseline, not spliced. It reports the share of the upload the
// client's proxy read through TCP: the bytes its application wrote while
// behind. A diagnostic of the bound, not a target: the variants run one after
// another, so compare them within one run.
func BenchmarkSpliceUpload(b *testing.B) {
	const size, write = 64 << 20, 64 << 10
	sink := func(conn net.Conn) { _, _ = io.Copy(io.Discard, struct{ io.Reader }{conn}); conn.Close() }
	for _, v := range []struct {
		name      string
		splice    bool
		maxUnread int64
	}{
		{"tcp", false, 0},
		{"bound=1MiB", true, 1 << 20},
		{"bound=4MiB", true, 4 << 20},
		{"bound=256MiB", true, 256 << 20},
	} {
		b.Run(v.name, func(b *testing.B) {
			requireRoot(b)
			var c *spliceChain
			if v.splice {
				c = newSpliceChain(b, v.maxUnread, proxyOpts{}, sink)
			} else {
				d, cfg := testDatapath(b)
				c = newChain(b, d, cfg, proxyOpts{}, sink)
			}
			buf := make([]byte, write)
			var read, tcp uint64
			b.SetBytes(size)
			b.ResetTimer()
			for range b.N {
				conn := c.dial(b, false)
				for n := 0; n < size; n += write {
					if _, err := conn.Write(buf); err != nil {
						b.Fatal(err)
					}
				}
				if err := conn.CloseWrite(); err != nil {
					b.Fatal(err)
				}
				// The sink closes once it has it all.
				_, _ = io.Copy(io.Discard, conn)
				conn.Close()
				// One record per proxy: the client's read the upload.
				for range 2 {
					select {
					case r := <-c.received:
						if r.read > 0 {
							read, tcp = read+r.read, tcp+min(r.tcp, r.read)
						}
					case err := <-c.errs:
						b.Fatal(err)
					case <-time.After(30 * time.Second):
						b.Fatal("a proxy did not finish")
					}
				}
			}
			b.StopTimer()
			if read > 0 {
				b.ReportMetric(float64(tcp)/float64(read), "tcp-share")
			}
		})
	}
}
