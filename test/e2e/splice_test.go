package e2e

import (
	"bytes"
	"fmt"
	"io"
	"net"
	"net/netip"
	"strings"
	"testing"
	"time"

	"github.com/mesh-cni/mesh-cni/test/harness"
)

// With --splice=all, pods' connections through the reference proxies (copying
// with read(2), as the proxy contract then asks) arrive exact both ways over
// IPv4 and IPv6, and the agent counts them spliced while they are open: the
// outbound hop into the client's proxy and the server's answers into the
// server's proxy. A connection spliced when the agent is killed (SIGKILL) stays
// exact through its restart.
func TestSpliceThroughChain(t *testing.T) {
	t.Parallel()
	ctx := testContext(t)
	a := newAgent(t, "--splice=all", "--metrics-addr", "127.0.0.1:0")
	a.start(ctx)
	addr := a.metricsAddr(ctx, t)
	if v := metricValue(scrape(t, addr), "meshcni_datapath_splice_enabled", nil); v != 1 {
		// Some kernels refuse tracing programs even to root: the read
		// accounting cannot load there. Any other reason is a failure.
		if why := a.Proc.Output(); strings.Contains(why, "splicing is off") && strings.Contains(why, "operation not permitted") {
			t.Skip("this kernel refuses the splice's programs (the agent's log says which)")
		}
		t.Fatalf("meshcni_datapath_splice_enabled = %v with --splice=all; the agent's log:\n%s", v, a.Proc.Output())
	}

	node := meshNode(t)
	list := chain(t, node, a, "30s")
	client := addMeshPod(ctx, t, node, list, "shop", "client")
	srv := addMeshPod(ctx, t, node, list, "shop", "server")
	client.startProxy(ctx, t, "-read-copy")
	srv.startProxy(ctx, t, "-read-copy")
	var app server
	app.serve(t, srv.Pod, 8080)

	payload := make([]byte, 4<<20)
	for i := range payload {
		payload[i] = byte(i*31 + i>>11)
	}
	spliceState := func(state string) float64 {
		return metricValue(scrape(t, addr), "meshcni_datapath_splice_connections", map[string]string{"state": state})
	}
	for i, dst := range []netip.Addr{srv.IPv4(t), srv.IPv6(t)} {
		target := netip.AddrPortFrom(dst, 8080)
		c, err := dialInPod(ctx, client.Pod, target, 0)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { c.Close() })
		if err := echoed(c, payload[:64<<10]); err != nil {
			t.Fatalf("%s: %v", target, err)
		}
		if n := spliceState("spliced"); n != 2 {
			t.Errorf("%s: %v connections spliced while one is open through two proxies, want 2 (tcp: %v, pending: %v)",
				target, n, spliceState("tcp"), spliceState("pending"))
		}
		if i == 0 {
			a.kill()
			a.start(ctx)
			addr = a.metricsAddr(ctx, t)
			// Reads while no agent counted them can only have tightened
			// the bound: the connections are spliced or behind.
			if n := spliceState("spliced") + spliceState("behind"); n != 2 {
				t.Errorf("%s: %v connections spliced or behind after the agent's restart, want 2 (tcp: %v)", target, n, spliceState("tcp"))
			}
		}
		if err := echoed(c, payload); err != nil {
			t.Fatalf("%s, %d more bytes: %v", target, len(payload), err)
		}
		c.Close()
		harness.WaitFor(t, 30*time.Second, "the splice to forget closed connections", func() bool {
			return spliceState("spliced")+spliceState("behind")+spliceState("tcp")+spliceState("pending") == 0
		})
	}
}

// echoed writes payload on c while reading its echo, and checks the echo.
func echoed(c net.Conn, payload []byte) error {
	_ = c.SetDeadline(time.Now().Add(60 * time.Second))
	werr := make(chan error, 1)
	go func() {
		_, err := c.Write(payload)
		werr <- err
	}()
	got := make([]byte, len(payload))
	if _, err := io.ReadFull(c, got); err != nil {
		return fmt.Errorf("read the echo: %w (write: %v)", err, <-werr)
	}
	if err := <-werr; err != nil {
		return fmt.Errorf("write: %w", err)
	}
	if !bytes.Equal(got, payload) {
		return fmt.Errorf("the echo of %d bytes differs from what was written", len(payload))
	}
	return nil
}
