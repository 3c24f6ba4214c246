package redirect

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"runtime"
	"slices"
	"sync"
	"testing"
	"time"

	"golang.org/x/sys/unix"
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

// BenchmarkSpliceHop is one 64-byte round trip per iteration between an
// application and its outbound proxy, which echoes: the application's write
// spliced into the proxy or not, the echo always TCP. Both ends are threads
// pinned to a CPU, reading and writing blocking sockets, so that Go's
// scheduler adds nothing: the same CPU for both, or one each, where every
// message wakes a thread on the other CPU. It reports the median and 99th
// percentile round trip. A diagnostic of what the splice can save per hop,
// not a target; the variants run one after another, so compare them within
// one run.
func BenchmarkSpliceHop(b *testing.B) {
	if runtime.NumCPU() < 2 {
		b.Skip("needs two CPUs")
	}
	d, _ := spliceDatapath(b, 0)
	a, peer := newPodPair(b)
	s := testSettings()
	s.Splice = true
	ln := a.listen(b, fmt.Sprintf("[::]:%d", s.OutboundPort))
	enroll(b, d, a, s)
	for _, v := range []struct {
		name     string
		splice   bool
		app, prx int
	}{
		{"tcp/one-cpu", false, 1, 1}, {"splice/one-cpu", true, 1, 1},
		{"tcp/two-cpus", false, 0, 1}, {"splice/two-cpus", true, 0, 1},
	} {
		b.Run(v.name, func(b *testing.B) {
			// The switch decides at each connect: off, the application's
			// socket never joins the sockhash.
			var on uint32
			if v.splice {
				on = 1
			}
			if err := d.objs.SpliceNode.Put(uint32(0), redirectSpliceConfig{Enabled: on, MaxUnread: DefaultSpliceMaxUnread}); err != nil {
				b.Fatal(err)
			}
			proxyErr := make(chan error, 1)
			go func() {
				conn, err := ln.Accept()
				if err != nil {
					proxyErr <- err
					return
				}
				defer conn.Close()
				proxyErr <- pinnedEcho(conn, v.prx)
			}()
			conn, err := a.dial(hostPort(peer.addr4, appPort), dialOpts{})
			if err != nil {
				b.Fatal(err)
			}
			rtts, err := pinnedPingPong(conn, v.app, b.N, b.ResetTimer)
			conn.Close()
			if perr := <-proxyErr; err != nil || perr != nil {
				b.Fatal(errors.Join(err, perr))
			}
			slices.Sort(rtts)
			b.ReportMetric(float64(rtts[len(rtts)/2].Nanoseconds())/1e3, "p50-µs")
			b.ReportMetric(float64(rtts[len(rtts)*99/100].Nanoseconds())/1e3, "p99-µs")
		})
	}
}

// pinThread locks the goroutine to its thread and the thread to cpu. The
// goroutine keeps the thread: when it exits, Go ends the thread, affinity and
// all, instead of running other goroutines on it.
func pinThread(cpu int) error {
	runtime.LockOSThread()
	var set unix.CPUSet
	set.Set(cpu)
	return unix.SchedSetaffinity(0, &set)
}

// readRetry is read(2) on a blocking socket, retried on the EAGAIN the
// sockmap reader returns when a spurious wake-up ends its wait.
func readRetry(fd int, p []byte) (int, error) {
	for {
		n, err := unix.Read(fd, p)
		if err != unix.EAGAIN {
			return n, err
		}
	}
}

// pinnedEcho echoes conn on a thread pinned to cpu until the peer closes.
func pinnedEcho(conn net.Conn, cpu int) error {
	if err := pinThread(cpu); err != nil {
		return err
	}
	fd, err := blockingFd(conn)
	if err != nil {
		return err
	}
	defer unix.Close(fd)
	buf := make([]byte, 64)
	for {
		n, err := readRetry(fd, buf)
		if n == 0 || err != nil {
			return err
		}
		if _, err := unix.Write(fd, buf[:n]); err != nil {
			return err
		}
	}
}

// pinnedPingPong makes n round trips of 64 bytes on conn from a thread pinned
// to cpu, calling start before the first, and returns each one's time.
func pinnedPingPong(conn net.Conn, cpu, n int, start func()) ([]time.Duration, error) {
	if err := pinThread(cpu); err != nil {
		return nil, err
	}
	fd, err := blockingFd(conn)
	if err != nil {
		return nil, err
	}
	defer unix.Close(fd)
	buf := make([]byte, 64)
	rtts := make([]time.Duration, 0, n)
	start()
	for range n {
		t0 := time.Now()
		if _, err := unix.Write(fd, buf); err != nil {
			return nil, err
		}
		for got := 0; got < len(buf); {
			k, err := readRetry(fd, buf[got:])
			if err != nil {
				return nil, err
			}
			if k == 0 {
				return nil, io.ErrUnexpectedEOF
			}
			got += k
		}
		rtts = append(rtts, time.Since(t0))
	}
	return rtts, nil
}
