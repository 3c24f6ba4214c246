package bench

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"sync/atomic"
	"testing"
	"time"

	"github.com/containernetworking/cni/libcni"
	"github.com/miekg/dns"

	"github.com/mesh-cni/mesh-cni/internal/netns"
	"github.com/mesh-cni/mesh-cni/test/bench/results"
	"github.com/mesh-cni/mesh-cni/test/capture"
	"github.com/mesh-cni/mesh-cni/test/fixtures"
	"github.com/mesh-cni/mesh-cni/test/harness"
)

// Variants of the DNS benchmark beyond the capture benchmark's.
const (
	// varEBPFNoListener: an enrolled pod with DNS capture on and no DNS
	// listener, so each query goes to the resolver as sent (fail-open).
	varEBPFNoListener = "ebpf-no-listener"
)

// dnsProxyPort is the proxy's DNS listener inside a pod (ztunnel's, and the
// agent's --dns-port default).
const dnsProxyPort = 15053

// dnsQueryName is what every query asks for; the resolver answers any name.
const dnsQueryName = "bench.mesh.test."

// dnsClient asks a resolver from inside a pod, the way glibc's resolver does:
// per query a new UDP socket, connect, send, receive the answer, close.
type dnsClient struct {
	netns  string
	target netip.AddrPort
}

// queries makes n queries one after another and returns each one's duration.
func (c dnsClient) queries(ctx context.Context, n int) (lat []time.Duration, err error) {
	err = netns.Do(c.netns, func() error {
		q := new(dns.Msg)
		q.SetQuestion(dnsQueryName, dns.TypeA)
		var d net.Dialer
		buf := make([]byte, dns.MaxMsgSize)
		lat = make([]time.Duration, 0, n)
		for i := range n {
			q.Id = dns.Id()
			wire, err := q.Pack()
			if err != nil {
				return err
			}
			start := time.Now()
			conn, err := d.DialContext(ctx, "udp", c.target.String())
			if err != nil {
				return fmt.Errorf("query %d of %d: dial %s: %w", i+1, n, c.target, err)
			}
			err = exchange(conn, wire, q.Id, buf)
			conn.Close()
			if err != nil {
				return fmt.Errorf("query %d of %d to %s: %w", i+1, n, c.target, err)
			}
			lat = append(lat, time.Since(start))
		}
		return nil
	})
	return lat, err
}

// exchange sends one query on a connected UDP socket and reads until the
// answer with its id arrives.
func exchange(conn net.Conn, wire []byte, id uint16, buf []byte) error {
	if err := conn.SetDeadline(time.Now().Add(2 * time.Second)); err != nil {
		return err
	}
	if _, err := conn.Write(wire); err != nil {
		return err
	}
	for {
		n, err := conn.Read(buf)
		if err != nil {
			return err
		}
		var m dns.Msg
		if m.Unpack(buf[:n]) == nil && m.Id == id {
			if len(m.Answer) == 0 {
				return errors.New("answer without records")
			}
			return nil
		}
	}
}

// serveResolver runs a DNS server on UDP port 53 of every IPv4 address in
// pod, answering every A query with one record, until the benchmark ends.
func serveResolver(tb testing.TB, pod *harness.Pod) {
	tb.Helper()
	answer := netip.MustParseAddr("192.0.2.53").AsSlice()
	handler := dns.HandlerFunc(func(w dns.ResponseWriter, r *dns.Msg) {
		m := new(dns.Msg)
		m.SetReply(r)
		for _, q := range r.Question {
			if q.Qtype == dns.TypeA {
				m.Answer = append(m.Answer, &dns.A{Hdr: dns.RR_Header{Name: q.Name, Rrtype: dns.TypeA, Class: dns.ClassINET, Ttl: 30}, A: answer})
			}
		}
		_ = w.WriteMsg(m)
	})
	var pc net.PacketConn
	if err := netns.Do(pod.NetNSPath, func() error {
		var err error
		pc, err = net.ListenPacket("udp4", "0.0.0.0:53")
		return err
	}); err != nil {
		tb.Fatalf("resolver in %s: %v", pod.Name, err)
	}
	srv := &dns.Server{PacketConn: pc, Handler: handler}
	started := make(chan struct{})
	srv.NotifyStartedFunc = func() { close(started) }
	go func() { _ = srv.ActivateAndServe() }()
	<-started
	tb.Cleanup(func() { _ = srv.Shutdown() })
}

// serveDNSProxy runs a node proxy's DNS listener in pod: UDP on
// 127.0.0.1:dnsProxyPort, each query forwarded to upstream from a socket
// carrying the proxy's mark (so no capture takes it again) and the answer sent
// back, as ztunnel's DNS proxy does for names it does not serve itself.
// It returns the count of answers it sent back.
func serveDNSProxy(tb testing.TB, pod *harness.Pod, upstream netip.AddrPort) *atomic.Int64 {
	tb.Helper()
	var up net.Conn
	var pc net.PacketConn
	if err := netns.Do(pod.NetNSPath, func() error {
		var err error
		if pc, err = net.ListenPacket("udp4", fmt.Sprintf("127.0.0.1:%d", dnsProxyPort)); err != nil {
			return err
		}
		d := net.Dialer{Control: fixtures.MarkControl(capture.DefaultMark)}
		up, err = d.Dial("udp4", upstream.String())
		return err
	}); err != nil {
		if pc != nil {
			pc.Close()
		}
		tb.Fatalf("DNS proxy in %s: %v", pod.Name, err)
	}
	answered := new(atomic.Int64)
	done := make(chan struct{})
	go func() {
		defer close(done)
		query := make([]byte, dns.MaxMsgSize)
		answer := make([]byte, dns.MaxMsgSize)
		for {
			n, from, err := pc.ReadFrom(query)
			if err != nil {
				return
			}
			if _, err := up.Write(query[:n]); err != nil {
				continue
			}
			_ = up.SetReadDeadline(time.Now().Add(2 * time.Second))
			m, err := up.Read(answer)
			if err != nil {
				continue
			}
			if _, err := pc.WriteTo(answer[:m], from); err == nil {
				answered.Add(1)
			}
		}
	}()
	tb.Cleanup(func() {
		pc.Close()
		up.Close()
		<-done
	})
	return answered
}

// BenchmarkDNS measures DNS query latency from a pod to a resolver in another
// pod: straight to the resolver, and through the node proxy's DNS listener in
// the pod, reached by mesh-cni's DNS capture, by Istio ambient's in-pod
// iptables REDIRECT, or addressed explicitly (no capture).
func BenchmarkDNS(b *testing.B) {
	requireRoot(b)
	ctx := fixtures.Context(b, 20*time.Minute)
	setups := newDNSEnv(ctx, b)
	res := newResult(b, "dns", "DNS capture: query latency through the pod's DNS proxy", "BenchmarkDNS", dnsDescription())
	rounds := size(20, 3)
	perRound := size(1000, 200)

	m := results.Metric{Name: "query", Title: "DNS query latency (UDP: new socket, connect, query, answer, close)", Unit: "µs",
		Baseline: varDirect, Series: make([]results.Series, len(setups))}
	for j, s := range setups {
		m.Series[j] = results.Series{Variant: s.variant, Label: dnsVariantLabels[s.variant]}
	}
	for r := -1; r < rounds; r++ {
		for k := range setups {
			j := (max(r, 0) + k) % len(setups)
			lat, err := setups[j].client.queries(ctx, perRound)
			if err != nil {
				b.Fatalf("%s: %v", setups[j].variant, err)
			}
			if r < 0 {
				continue // warm-up
			}
			round := make([]float64, 0, len(lat))
			for _, d := range lat {
				round = append(round, us(d))
			}
			m.Series[j].Samples = append(m.Series[j].Samples, round...)
			m.Series[j].Rounds = append(m.Series[j].Rounds, results.Median(round))
		}
	}
	// A variant with a proxy measured nothing if its queries went around it.
	for _, s := range setups {
		if want := int64((rounds + 1) * perRound); s.proxied != nil && s.proxied.Load() != want {
			b.Fatalf("%s: the pod's DNS proxy answered %d of %d queries", s.variant, s.proxied.Load(), want)
		}
	}
	res.Metrics = append(res.Metrics, m)
	for _, v := range []string{varEBPF, varLimit, varIPTables, varEBPFNoListener} {
		reportRatio(b, &m, "", v, varDirect)
	}
	reportRatio(b, &m, "", varEBPF, varLimit)
	reportRatio(b, &m, "", varEBPF, varIPTables)
	report(b, &m, varEBPF, 0, "us")
	b.ReportMetric(0, "ns/op")
	finish(b, res)
}

var dnsVariantLabels = map[string]string{
	varDirect:         "straight to the resolver, no proxy",
	varLimit:          "the pod's DNS proxy dialed, no capture",
	varEBPF:           "eBPF DNS capture (mesh-cni) → the pod's DNS proxy",
	varIPTables:       "iptables REDIRECT → the pod's DNS proxy",
	varEBPFNoListener: "eBPF DNS capture, no DNS proxy listening: straight to the resolver",
}

// dnsSetup is one variant's client.
type dnsSetup struct {
	variant string
	client  dnsClient
	// proxied counts the answers of the pod's DNS proxy (nil: none runs); every
	// query of a variant with a proxy must have gone through it.
	proxied *atomic.Int64
}

func dnsDescription() string {
	return "A client in a pod asks a resolver in another pod on the same node (the reference bridge), over IPv4 UDP, one query at a time, " +
		"as glibc's resolver does: per query a new socket, connect, send, wait for the answer, close (a miekg/dns server answers every name at once). " +
		"Variants: `direct` = straight to the resolver, no proxy (the floor, and the baseline); " +
		"`ebpf` = the pod added through [bridge, mesh-cni] to a `mesh-agent --dns-capture`, which sends the query to the pod's DNS proxy on 127.0.0.1:15053 " +
		"(the benchmark's own forwarder: each query sent on to the resolver from a socket with the proxy's mark, the answer sent back) and shows the answer as coming from the resolver; " +
		"`limit` = the same DNS proxy addressed explicitly at 127.0.0.1:15053 in a pod without capture, so `ebpf ÷ limit` is the capture's own cost; " +
		"`iptables` = the same DNS proxy behind in-pod nat REDIRECT rules for port 53, like Istio ambient's; " +
		"`ebpf-no-listener` = an enrolled pod with DNS capture and no DNS proxy, where the capture lets the query go to the resolver as sent (its fail-open default). " +
		"In every round each variant makes one batch of queries, in rotating order, after a warm-up round; ratios are paired: the median over rounds of variant ÷ `direct` in the same round."
}

func newDNSEnv(ctx context.Context, b *testing.B) []dnsSetup {
	a := newAgent(b, agentOptions{Args: []string{"--dns-capture"}})
	if _, _, err := a.start(ctx); err != nil {
		b.Fatal(err)
	}
	node := harness.NewNode(b, harness.NodeOptions{Plugins: append(harness.ReferencePluginNames(), "mesh-cni")})
	bridgeOnly := node.Conflist(b, benchNet)
	withMesh := node.Conflist(b, benchNet, a.meshEntry("mesh-cni"))
	addPod := func(list *libcni.NetworkConfigList, name string) *harness.Pod {
		p := node.NewPod(b, "bench", name)
		if _, err := node.Add(ctx, p, list); err != nil {
			b.Fatal(err)
		}
		return p
	}
	resolverPod := addPod(bridgeOnly, "resolver")
	serveResolver(b, resolverPod)
	resolver := netip.AddrPortFrom(resolverPod.IPv4(b), 53)
	proxyAddr := netip.AddrPortFrom(netip.MustParseAddr("127.0.0.1"), dnsProxyPort)

	var setups []dnsSetup
	for _, v := range []string{varDirect, varLimit, varEBPF, varIPTables, varEBPFNoListener} {
		list := bridgeOnly
		if v == varEBPF || v == varEBPFNoListener {
			list = withMesh
		}
		p := addPod(list, "dns-"+v)
		target := resolver
		var proxied *atomic.Int64
		switch v {
		case varLimit:
			proxied = serveDNSProxy(b, p, resolver)
			target = proxyAddr
		case varEBPF:
			proxied = serveDNSProxy(b, p, resolver)
		case varIPTables:
			proxied = serveDNSProxy(b, p, resolver)
			rules := capture.DefaultRules()
			rules.DNSPort = dnsProxyPort
			cleanup, err := capture.InstallIPTables(ctx, p.NetNSPath, rules)
			if err != nil {
				b.Fatal(err)
			}
			b.Cleanup(func() {
				if err := cleanup(context.Background()); err != nil {
					b.Errorf("remove iptables capture: %v", err)
				}
			})
		}
		setups = append(setups, dnsSetup{variant: v, client: dnsClient{netns: p.NetNSPath, target: target}, proxied: proxied})
	}
	return setups
}
