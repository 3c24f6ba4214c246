package redirect

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/miekg/dns"

	"github.com/mesh-cni/mesh-cni/internal/netns"
	"github.com/mesh-cni/mesh-cni/test/fixtures"
)

const dnsName = "answer.test."

// serveDNS answers A and AAAA queries for dnsName with addr4/addr6 on UDP and TCP
// port `port` of every address in the pod, until the test ends or stop is called.
// For TCP it also reports, in a TXT record, the original destination the data path
// gives for the connection (SO_ORIGINAL_DST), as a proxy would read it.
func serveDNS(t *testing.T, p *pod, port uint16, addr4, addr6 netip.Addr) (stop func()) {
	t.Helper()
	var origs sync.Map // TCP client address -> the connection's SO_ORIGINAL_DST
	handler := dns.HandlerFunc(func(w dns.ResponseWriter, r *dns.Msg) {
		m := new(dns.Msg)
		m.SetReply(r)
		for _, q := range r.Question {
			switch q.Qtype {
			case dns.TypeA:
				m.Answer = append(m.Answer, &dns.A{Hdr: dns.RR_Header{Name: q.Name, Rrtype: dns.TypeA, Class: dns.ClassINET, Ttl: 1}, A: addr4.AsSlice()})
			case dns.TypeAAAA:
				m.Answer = append(m.Answer, &dns.AAAA{Hdr: dns.RR_Header{Name: q.Name, Rrtype: dns.TypeAAAA, Class: dns.ClassINET, Ttl: 1}, AAAA: addr6.AsSlice()})
			case dns.TypeTXT:
				orig := "none"
				if o, ok := origs.Load(w.RemoteAddr().String()); ok {
					orig = o.(string)
				}
				m.Answer = append(m.Answer, &dns.TXT{Hdr: dns.RR_Header{Name: q.Name, Rrtype: dns.TypeTXT, Class: dns.ClassINET, Ttl: 1}, Txt: []string{orig}})
			}
		}
		_ = w.WriteMsg(m)
	})
	var servers []*dns.Server
	for _, host := range []string{"0.0.0.0", "::"} {
		addr := net.JoinHostPort(host, fmt.Sprint(port))
		p.do(t, func() error {
			pc, err := net.ListenPacket(map[string]string{"0.0.0.0": "udp4", "::": "udp6"}[host], addr)
			if err != nil {
				return err
			}
			ln := &origListener{Listener: p.listenIn(t, map[string]string{"0.0.0.0": "tcp4", "::": "tcp6"}[host], addr), origs: &origs}
			servers = append(servers, &dns.Server{PacketConn: pc, Handler: handler}, &dns.Server{Listener: ln, Handler: handler})
			return nil
		})
	}
	for _, s := range servers {
		started := make(chan struct{})
		s.NotifyStartedFunc = func() { close(started) }
		go func() { _ = s.ActivateAndServe() }()
		<-started
	}
	stopped := false
	stop = func() {
		if stopped {
			return
		}
		stopped = true
		for _, s := range servers {
			_ = s.Shutdown()
		}
		// Shutdown returns before the sockets are released when a read is
		// in flight: wait until the port is free, so the data path has seen
		// the listener go. stop may run as a cleanup, after t's context
		// ended, so the wait has a context of its own.
		if !fixtures.Eventually(context.Background(), 10*time.Second, fixtures.WaitInterval, func() bool { return portFree(p, port) }) {
			t.Errorf("DNS port %d still bound in %s after the server stopped", port, p.name)
		}
	}
	t.Cleanup(stop)
	return stop
}

// portFree reports whether UDP and TCP port can be bound on both wildcards in
// p's namespace.
func portFree(p *pod, port uint16) bool {
	free := true
	_ = netns.Do(p.path, func() error {
		for _, nw := range []string{"udp4", "udp6", "tcp4", "tcp6"} {
			addr := fmt.Sprintf(":%d", port)
			var c io.Closer
			var err error
			if strings.HasPrefix(nw, "udp") {
				c, err = net.ListenPacket(nw, addr)
			} else {
				c, err = net.Listen(nw, addr)
			}
			if err != nil {
				free = false
				return nil
			}
			c.Close()
		}
		return nil
	})
	return free
}

// origListener records each accepted connection's SO_ORIGINAL_DST, as a proxy
// reads it, for the handler.
type origListener struct {
	net.Listener
	origs *sync.Map
}

func (l *origListener) Accept() (net.Conn, error) {
	c, err := l.Listener.Accept()
	if err != nil {
		return nil, err
	}
	if o, err := originalDst(c); err == nil {
		l.origs.Store(c.RemoteAddr().String(), o.String())
	}
	return c, nil
}

// listenIn is listen with an explicit network, in the calling thread (already in
// the pod).
func (p *pod) listenIn(t *testing.T, network, addr string) net.Listener {
	t.Helper()
	var lc net.ListenConfig
	lc.SetMultipathTCP(false)
	ln, err := lc.Listen(context.Background(), network, addr)
	if err != nil {
		t.Fatal(err)
	}
	return ln
}

// queryFrom asks server for dnsName (qtype) from inside pod p with miekg's client
// over net ("udp" connected, "udp-unconnected" with sendto, or "tcp"), marking the
// socket with mark (0: none). It returns the first answer's data and the address the
// answer came from.
func queryFrom(p *pod, server netip.AddrPort, network string, qtype uint16, mark uint32) (string, string, error) {
	var (
		answer, from string
		qerr         error
	)
	err := netns.Do(p.path, func() error {
		q := new(dns.Msg)
		q.SetQuestion(dnsName, qtype)
		var (
			r   *dns.Msg
			err error
		)
		control := fixtures.MarkControl(int(mark))
		switch network {
		case "udp-unconnected":
			lc := net.ListenConfig{Control: control}
			pc, err := lc.ListenPacket(context.Background(), "udp", ":0")
			if err != nil {
				return err
			}
			defer pc.Close()
			buf, err := q.Pack()
			if err != nil {
				return err
			}
			if _, err := pc.WriteTo(buf, net.UDPAddrFromAddrPort(server)); err != nil {
				return err
			}
			_ = pc.SetReadDeadline(time.Now().Add(2 * time.Second))
			in := make([]byte, 1500)
			n, addr, err := pc.ReadFrom(in)
			if err != nil {
				return err
			}
			from = unmapAddrPort(addr).String()
			r = new(dns.Msg)
			if err := r.Unpack(in[:n]); err != nil {
				return err
			}
		default:
			c := &dns.Client{Net: network, Timeout: 2 * time.Second, Dialer: &net.Dialer{Control: control, Timeout: 2 * time.Second}}
			conn, err := c.Dial(server.String())
			if err != nil {
				return err
			}
			defer conn.Close()
			from = unmapAddrPort(conn.RemoteAddr()).String()
			r, _, err = c.ExchangeWithConn(q, conn)
			if err != nil {
				return err
			}
		}
		if len(r.Answer) == 0 {
			qerr = fmt.Errorf("no answer (rcode %d)", r.Rcode)
			return nil
		}
		switch rr := r.Answer[0].(type) {
		case *dns.A:
			answer = rr.A.String()
		case *dns.AAAA:
			answer = rr.AAAA.String()
		case *dns.TXT:
			answer = strings.Join(rr.Txt, "")
		}
		return err
	})
	return answer, from, errors.Join(err, qerr)
}

// DNS capture: a pod's queries to any resolver go to its proxy's DNS listener on
// loopback, over UDP (connected or not) and TCP, IPv4 and IPv6; the answers look as
// if they came from the resolver asked (resolver libraries drop others); the proxy
// reads a TCP query's original destination with SO_ORIGINAL_DST; the proxy's own
// queries reach the resolver; with the proxy's listener down queries reach the
// resolver (fail open) unless the pod is DNS fail-closed.
func TestDNSCapture(t *testing.T) {
	d, a, b := parallelRig(t)
	resolverAnswer4, resolverAnswer6 := netip.MustParseAddr("10.53.0.1"), netip.MustParseAddr("fd53::1")
	proxyAnswer4, proxyAnswer6 := netip.MustParseAddr("10.53.0.2"), netip.MustParseAddr("fd53::2")
	serveDNS(t, b, 53, resolverAnswer4, resolverAnswer6)
	stopProxyDNS := serveDNS(t, a, 15053, proxyAnswer4, proxyAnswer6)
	s := testSettings()
	s.DNSCapture = true
	enroll(t, d, a, s)

	for _, server := range []netip.AddrPort{netip.AddrPortFrom(b.addr4, 53), netip.AddrPortFrom(b.addr6, 53)} {
		for _, network := range []string{"udp", "udp-unconnected", "tcp"} {
			for _, qt := range []struct {
				qtype uint16
				want  string
			}{{dns.TypeA, proxyAnswer4.String()}, {dns.TypeAAAA, proxyAnswer6.String()}} {
				answer, from, err := queryFrom(a, server, network, qt.qtype, 0)
				if err != nil || answer != qt.want || from != server.String() {
					t.Errorf("%s query to %s over %s: answer %q from %s (%v), want %q from the resolver's address",
						dns.TypeToString[qt.qtype], server, network, answer, from, err, qt.want)
				}
			}
		}
		// Over TCP the proxy learns the resolver asked, as for any connection.
		if orig, _, err := queryFrom(a, server, "tcp", dns.TypeTXT, 0); err != nil || orig != server.String() {
			t.Errorf("TCP query to %s: the proxy read original destination %q (%v)", server, orig, err)
		}
		// The proxy's own queries (marked here) go to the resolver.
		if answer, _, err := queryFrom(a, server, "udp", dns.TypeA, testMark); err != nil || answer != resolverAnswer4.String() {
			t.Errorf("the proxy's query to %s: %q, %v; want the resolver's answer", server, answer, err)
		}
	}
	if c, err := d.Counters(); err != nil || c.DNS.Redirected == 0 {
		t.Errorf("DNS counters %+v, %v", c.DNS, err)
	}

	// Go's own resolver, as a Go application in the pod uses it.
	for _, server := range []netip.AddrPort{netip.AddrPortFrom(b.addr4, 53), netip.AddrPortFrom(b.addr6, 53)} {
		// The resolver dials from goroutines of its own: each dial enters the pod.
		r := &net.Resolver{PreferGo: true, Dial: func(ctx context.Context, network, _ string) (net.Conn, error) {
			var (
				c   net.Conn
				err error
			)
			nerr := netns.Do(a.path, func() error {
				var dl net.Dialer
				c, err = dl.DialContext(ctx, network, server.String())
				return nil
			})
			return c, errors.Join(nerr, err)
		}}
		addrs, err := r.LookupHost(context.Background(), dnsName)
		if err != nil || !slices.Contains(addrs, proxyAnswer4.String()) {
			t.Errorf("Go resolver with %s: %v, %v; want the proxy's answers", server, addrs, err)
		}
	}

	// Glibc's resolver, as an application uses it, with the pod's resolv.conf
	// naming the resolver.
	for _, server := range []netip.Addr{b.addr4, b.addr6} {
		if got := getentHosts(t, a, server); !strings.HasPrefix(got, proxyAnswer6.String()) && !strings.HasPrefix(got, proxyAnswer4.String()) {
			t.Errorf("getent hosts with nameserver %s: %q, want the proxy's answer", server, got)
		}
	}

	// The proxy's DNS listener down: queries reach the resolver (fail open)...
	stopProxyDNS()
	for _, network := range []string{"udp", "udp-unconnected", "tcp"} {
		server := netip.AddrPortFrom(b.addr4, 53)
		if answer, _, err := queryFrom(a, server, network, dns.TypeA, 0); err != nil || answer != resolverAnswer4.String() {
			t.Errorf("with no DNS listener, %s query: %q, %v; want the resolver's answer", network, answer, err)
		}
	}
	// ...unless the pod is DNS fail-closed.
	s.DNSFailClosed = true
	enroll(t, d, a, s)
	for _, network := range []string{"udp", "tcp"} {
		if answer, _, err := queryFrom(a, netip.AddrPortFrom(b.addr4, 53), network, dns.TypeA, 0); err == nil {
			t.Errorf("DNS fail-closed with no DNS listener, %s query answered %q", network, answer)
		}
	}
}

// getentHosts runs glibc's resolver (getent hosts) in pod p with a resolv.conf that
// names server, in a mount namespace of its own, and returns its output.
func getentHosts(t *testing.T, p *pod, server netip.Addr) string {
	t.Helper()
	conf := filepath.Join(t.TempDir(), "resolv.conf")
	if err := os.WriteFile(conf, []byte("nameserver "+server.String()+"\noptions timeout:2 attempts:1\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command("unshare", "--mount", "--propagation", "private", "sh", "-c",
		`mount --bind "$0" /etc/resolv.conf && exec getent hosts `+strings.TrimSuffix(dnsName, "."), conf)
	var out []byte
	err := netns.Do(p.path, func() error {
		var err error
		out, err = cmd.Output()
		return err
	})
	if err != nil {
		t.Logf("getent hosts: %v (%s)", err, out)
	}
	return strings.TrimSpace(string(out))
}
