package proxy_test

import (
	"context"
	"errors"
	"io"
	"net/netip"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"go.uber.org/zap/zaptest"

	"github.com/mesh-cni/mesh-cni/test/capture"
	"github.com/mesh-cni/mesh-cni/test/fixtures"
	"github.com/mesh-cni/mesh-cni/test/proxy"
)

// rootReason is why these tests need root.
const rootReason = "creates network namespaces"

// startProxy runs the proxy in-process, listening and dialing in pod's namespace.
func startProxy(t *testing.T, ctx context.Context, pod *fixtures.Pod, cfg proxy.Config) *proxy.Proxy {
	t.Helper()
	cfg.NetNS = pod.Path
	cfg.Logger = zaptest.NewLogger(t)
	p, err := proxy.Start(ctx, cfg)
	if err != nil {
		t.Fatalf("start proxy: %v", err)
	}
	t.Cleanup(func() {
		if err := p.Close(); err != nil {
			t.Errorf("close proxy: %v", err)
		}
	})
	return p
}

func loopback(v6 bool) netip.Addr {
	if v6 {
		return netip.IPv6Loopback()
	}
	return netip.MustParseAddr("127.0.0.1")
}

// waitRecords waits until the proxy has recorded n connections (records are added
// when a connection ends, a moment after the client sees it end), and no more.
func waitRecords(t *testing.T, ctx context.Context, path string, n int) []proxy.Record {
	t.Helper()
	got := proxy.AwaitRecords(ctx, t, path, n)
	if len(got) != n {
		t.Fatalf("want %d records, got %+v", n, got)
	}
	return got
}

// TestEchoDirect dials the echo-mode proxy's listeners directly (no capture): the
// outbound one has no original destination and echoes anyway, the inbound one falls
// back to its local address.
func TestEchoDirect(t *testing.T) {
	fixtures.RequireRoot(t, rootReason)
	fixtures.Both(t, "ipv4", "ipv6", func(t *testing.T, v6 bool) {
		ctx := fixtures.Context(t, time.Minute)
		pod, _ := fixtures.NewPodPair(t)
		records := filepath.Join(t.TempDir(), "records.jsonl")
		p := startProxy(t, ctx, pod, proxy.Config{Echo: true, RecordPath: records})

		out := netip.AddrPortFrom(loopback(v6), proxy.DefaultOutboundPort)
		in := netip.AddrPortFrom(pod.Addr(v6), proxy.DefaultInboundPort)
		data := fixtures.RandomBytes(64 << 10)
		for _, dst := range []netip.AddrPort{out, in} {
			conn, err := pod.DialTCP(ctx, dst)
			if err != nil {
				t.Fatal(err)
			}
			if err := fixtures.EchoRoundTrip(ctx, conn, data); err != nil {
				t.Fatalf("echo via %s: %v", dst, err)
			}
			// One at a time, so the records come in a known order.
			waitRecords(t, ctx, records, map[netip.AddrPort]int{out: 1, in: 2}[dst])
		}
		got := waitRecords(t, ctx, records, 2)
		size := int64(len(data))
		o, i := got[0], got[1]
		if o.Direction != proxy.Outbound || o.DstSource != proxy.SourceNone || o.OriginalDst.IsValid() ||
			o.Local != out || o.Client.Addr() != loopback(v6) || o.BytesToDst != size || o.BytesToClient != size || o.Error != "" {
			t.Errorf("outbound record %+v", o)
		}
		if i.Direction != proxy.Inbound || i.DstSource != proxy.SourceLocalAddr || i.OriginalDst != in ||
			i.Local != in || i.Client.Addr() != pod.Addr(v6) || i.BytesToDst != size || i.BytesToClient != size || i.Error != "" {
			t.Errorf("inbound record %+v", i)
		}
		if mem := p.Records(); len(mem) != 2 || mem[0].Local != o.Local || mem[1].Local != i.Local {
			t.Errorf("in-memory records %+v differ from the file's %+v", mem, got)
		}
	})
}

// TestDirectDialRefused dials the forwarding proxy's listeners directly: the
// outbound connection has no original destination and the inbound one would loop
// back to the proxy, so both are closed and recorded with their error.
func TestDirectDialRefused(t *testing.T) {
	fixtures.RequireRoot(t, rootReason)
	fixtures.Both(t, "ipv4", "ipv6", func(t *testing.T, v6 bool) {
		ctx := fixtures.Context(t, time.Minute)
		pod, _ := fixtures.NewPodPair(t)
		records := filepath.Join(t.TempDir(), "records.jsonl")
		startProxy(t, ctx, pod, proxy.Config{RecordPath: records})

		out := netip.AddrPortFrom(loopback(v6), proxy.DefaultOutboundPort)
		in := netip.AddrPortFrom(pod.Addr(v6), proxy.DefaultInboundPort)
		for _, dst := range []netip.AddrPort{out, in} {
			conn, err := pod.DialTCP(ctx, dst)
			if err != nil {
				t.Fatal(err)
			}
			if _, err := io.ReadAll(conn); err != nil && !isReset(err) {
				t.Errorf("read from refused connection via %s: %v", dst, err)
			}
			conn.Close()
		}
		for _, r := range waitRecords(t, ctx, records, 2) {
			switch r.Direction {
			case proxy.Outbound:
				if !strings.Contains(r.Error, "original destination") || r.DstSource != proxy.SourceNone {
					t.Errorf("outbound record %+v, want an original destination error", r)
				}
			case proxy.Inbound:
				if !strings.Contains(r.Error, proxy.ErrLoop.Error()) || r.DstSource != proxy.SourceLocalAddr || r.OriginalDst != in {
					t.Errorf("inbound record %+v, want a loop error", r)
				}
			}
		}
	})
}

func isReset(err error) bool {
	return errors.Is(err, os.ErrDeadlineExceeded) || strings.Contains(err.Error(), "connection reset")
}

// TestForwardThroughIPTables runs the proxy in-process in pod A behind the iptables
// capture: A's connection to B's echo server is redirected to the proxy, which finds
// the original destination with getsockopt and dials it (with its mark, from A's
// namespace) without being captured again.
func TestForwardThroughIPTables(t *testing.T) {
	fixtures.RequireRoot(t, rootReason)
	fixtures.Both(t, "ipv4", "ipv6", func(t *testing.T, v6 bool) {
		ctx := fixtures.Context(t, time.Minute)
		a, b := fixtures.NewPodPair(t)
		b.ServeEcho(t, 9000)
		records := filepath.Join(t.TempDir(), "records.jsonl")
		p := startProxy(t, ctx, a, proxy.Config{RecordPath: records})
		cleanup, err := capture.InstallIPTables(ctx, a.Path, capture.DefaultRules())
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() {
			if err := cleanup(context.Background()); err != nil {
				t.Errorf("remove capture: %v", err)
			}
		})

		dst := netip.AddrPortFrom(b.Addr(v6), 9000)
		data := fixtures.RandomBytes(1 << 20)
		const conns = 3
		for range conns {
			conn, err := a.DialTCP(ctx, dst)
			if err != nil {
				t.Fatal(err)
			}
			if err := fixtures.EchoRoundTrip(ctx, conn, data); err != nil {
				t.Fatalf("A → %s: %v", dst, err)
			}
		}
		got := waitRecords(t, ctx, records, conns)
		for _, r := range got {
			if r.Direction != proxy.Outbound || r.DstSource != proxy.SourceGetsockopt || r.OriginalDst != dst ||
				r.Local != netip.AddrPortFrom(loopback(v6), proxy.DefaultOutboundPort) || r.Client.Addr() != a.Addr(v6) ||
				r.BytesToDst != int64(len(data)) || r.BytesToClient != int64(len(data)) || r.Error != "" {
				t.Errorf("record %+v", r)
			}
		}
		if len(p.Records()) != conns {
			t.Errorf("in-memory records %+v", p.Records())
		}
	})
}

// TestLoopDetected installs a capture that does not exempt the proxy's mark: the
// proxy's onward connection is captured again, and the proxy recognises its own
// connection coming back instead of dialing in circles.
func TestLoopDetected(t *testing.T) {
	fixtures.RequireRoot(t, rootReason)
	ctx := fixtures.Context(t, time.Minute)
	a, b := fixtures.NewPodPair(t)
	b.ServeEcho(t, 9000)
	records := filepath.Join(t.TempDir(), "records.jsonl")
	startProxy(t, ctx, a, proxy.Config{RecordPath: records, Mark: 0x539})
	rules := capture.DefaultRules()
	rules.Mark = 0x540
	cleanup, err := capture.InstallNFTables(ctx, a.Path, rules)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := cleanup(context.Background()); err != nil {
			t.Errorf("remove capture: %v", err)
		}
	})
	conn, err := a.DialTCP(ctx, netip.AddrPortFrom(b.IPv4, 9000))
	if err != nil {
		t.Fatal(err)
	}
	if err := fixtures.EchoRoundTrip(ctx, conn, []byte("loop")); err == nil {
		t.Fatal("echo through a looping capture succeeded")
	}
	_, err = proxy.WaitForRecords(ctx, records, func(rs []proxy.Record) bool {
		for _, r := range rs {
			if strings.Contains(r.Error, proxy.ErrLoop.Error()) {
				return true
			}
		}
		return false
	})
	if err != nil {
		t.Fatalf("no loop recorded: %v", err)
	}
}

// TestCloseEndsConnections closes the proxy while a client holds a connection open:
// Close returns, the client sees its connection end, and the connection is recorded.
func TestCloseEndsConnections(t *testing.T) {
	fixtures.RequireRoot(t, rootReason)
	ctx := fixtures.Context(t, time.Minute)
	pod, _ := fixtures.NewPodPair(t)
	p, err := proxy.Start(ctx, proxy.Config{Echo: true, NetNS: pod.Path, Logger: zaptest.NewLogger(t)})
	if err != nil {
		t.Fatal(err)
	}
	conn, err := pod.DialTCP(ctx, netip.AddrPortFrom(netip.MustParseAddr("127.0.0.1"), proxy.DefaultOutboundPort))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	// A byte echoed back proves the proxy has accepted the connection.
	buf := make([]byte, 1)
	if _, err := conn.Write([]byte{'x'}); err != nil {
		t.Fatal(err)
	}
	if _, err := io.ReadFull(conn, buf); err != nil {
		t.Fatal(err)
	}
	if err := p.Close(); err != nil {
		t.Fatalf("close: %v", err)
	}
	if err := conn.SetReadDeadline(time.Now().Add(30 * time.Second)); err != nil {
		t.Fatal(err)
	}
	if _, err := conn.Read(buf); err == nil || errors.Is(err, os.ErrDeadlineExceeded) {
		t.Fatalf("connection still open after Close: %v", err)
	}
	if recs := p.Records(); len(recs) != 1 || recs[0].BytesToClient != 1 {
		t.Fatalf("records after close %+v", recs)
	}
	if err := p.Close(); err != nil {
		t.Fatalf("second close: %v", err)
	}
}

func TestStartErrors(t *testing.T) {
	fixtures.RequireRoot(t, rootReason)
	ctx := fixtures.Context(t, time.Minute)
	pod, _ := fixtures.NewPodPair(t)
	if _, err := proxy.Start(ctx, proxy.Config{NetNS: pod.Path, OutboundPort: 16000, InboundPort: 16000}); err == nil {
		t.Error("same outbound and inbound port accepted")
	}
	if _, err := proxy.Start(ctx, proxy.Config{NetNS: t.TempDir()}); err == nil {
		t.Error("a directory accepted as netns")
	}
	if _, err := proxy.Start(ctx, proxy.Config{NetNS: pod.Path, RecordPath: filepath.Join(t.TempDir(), "no", "such", "dir")}); err == nil {
		t.Error("unwritable record path accepted")
	}
	startProxy(t, ctx, pod, proxy.Config{})
	if _, err := proxy.Start(ctx, proxy.Config{NetNS: pod.Path}); err == nil {
		t.Error("second proxy on the same ports started")
	}
	// The failed start released what it had bound: a third proxy on other ports works.
	startProxy(t, ctx, pod, proxy.Config{OutboundPort: 16001, InboundPort: 16006})
}
