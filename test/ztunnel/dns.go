package ztunnel

import (
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"net"
	"net/netip"
	"strings"
	"time"

	"golang.org/x/net/dns/dnsmessage"

	"github.com/mesh-cni/mesh-cni/test/podsock"
)

// serveDNS is ztunnel's DNS proxy on one localhost address of the pod, UDP and
// TCP (dns/server.rs): it answers A and AAAA queries for the names it knows
// (ztunnel's come from istiod; the double's from its configuration) and
// forwards the rest, as ztunnel does to the resolvers of its own resolv.conf
// (dns/forwarder.rs), from a socket of the pod's own namespace marked as its
// in-pod sockets are (Config.DNSForward; SERVFAIL without one). The client is
// the pod the listener belongs to, never the source address; a pod whose
// workload istiod does not have gets SERVFAIL for every query (Store::lookup).
func (p *pod) serveDNS(addr netip.AddrPort) error {
	uc, err := podsock.ListenUDP(int(p.ns.Fd()), addr, podsock.ListenOptions{Mark: Mark, ReusePort: true})
	if err != nil {
		if addr.Addr().Is6() {
			return nil // no IPv6 on the pod's lo
		}
		return err
	}
	p.track(uc)
	p.wg.Go(func() {
		for {
			buf := make([]byte, 4096)
			n, from, err := uc.ReadFromUDPAddrPort(buf)
			if err != nil {
				return
			}
			// Each query on its own: one waiting for the pod's workload
			// holds up no other.
			p.wg.Go(func() {
				if answer := p.answer(buf[:n], from); answer != nil {
					_, _ = uc.WriteToUDPAddrPort(answer, from)
				}
			})
		}
	})
	return p.listenTCP(addr, func(c *net.TCPConn, peer netip.AddrPort) {
		for {
			var size [2]byte
			if _, err := io.ReadFull(c, size[:]); err != nil {
				return
			}
			q := make([]byte, binary.BigEndian.Uint16(size[:]))
			if _, err := io.ReadFull(c, q); err != nil {
				return
			}
			answer := p.answer(q, peer)
			if answer == nil {
				return
			}
			out := binary.BigEndian.AppendUint16(nil, uint16(len(answer)))
			if _, err := c.Write(append(out, answer...)); err != nil {
				return
			}
		}
	})
}

// answer builds the reply to one query, or nil for a packet that is not one.
func (p *pod) answer(query []byte, from netip.AddrPort) []byte {
	var parser dnsmessage.Parser
	h, err := parser.Start(query)
	if err != nil {
		return nil
	}
	q, err := parser.Question()
	if err != nil {
		return nil
	}
	name := strings.TrimSuffix(strings.ToLower(q.Name.String()), ".")
	rcode := dnsmessage.RCodeServerFailure
	var answers []netip.Addr
	rec := Record{Dir: "dns", Proto: "dns", Src: from, Name: name}
	id, err := p.identity()
	rec.Identity = id
	if addrs, ok := p.dp.cfg.DNS[name]; ok && err == nil {
		rcode = dnsmessage.RCodeSuccess
		for _, a := range addrs {
			if (q.Type == dnsmessage.TypeA && a.Is4()) || (q.Type == dnsmessage.TypeAAAA && a.Is6()) {
				answers = append(answers, a)
			}
		}
	}
	fwd := p.dp.cfg.DNSForward
	switch {
	case err != nil:
		p.record(rec.failed(err))
	case rcode != dnsmessage.RCodeSuccess && fwd.IsValid():
		rec.Dst, rec.Forwarded = fwd, fwd.String()
		reply, ferr := p.forwardDNS(query, h.ID, fwd)
		if ferr == nil {
			p.record(rec)
			return reply
		}
		p.record(rec.failed(ferr))
	case rcode != dnsmessage.RCodeSuccess:
		p.record(rec.failed(errors.New("not answered")))
	default:
		p.record(rec)
	}
	b := dnsmessage.NewBuilder(nil, dnsmessage.Header{ID: h.ID, Response: true, RecursionDesired: h.RecursionDesired, RecursionAvailable: true, RCode: rcode})
	b.EnableCompression()
	if b.StartQuestions() != nil || b.Question(q) != nil || b.StartAnswers() != nil {
		return nil
	}
	rh := dnsmessage.ResourceHeader{Name: q.Name, Class: dnsmessage.ClassINET, TTL: 30}
	for _, a := range answers {
		if a.Is4() {
			_ = b.AResource(rh, dnsmessage.AResource{A: a.As4()})
		} else {
			_ = b.AAAAResource(rh, dnsmessage.AAAAResource{AAAA: a.As16()})
		}
	}
	out, err := b.Finish()
	if err != nil {
		return nil
	}
	return out
}

// forwardTimeout bounds a forwarded query's wait for the upstream's answer.
const forwardTimeout = 3 * time.Second

// forwardDNS sends query to upstream over UDP from the pod's network namespace,
// on a socket marked Mark (the node agent's capture must let it through to the
// resolver, not back to this proxy), and returns the upstream's answer to the
// same id.
func (p *pod) forwardDNS(query []byte, id uint16, upstream netip.AddrPort) ([]byte, error) {
	unspec := netip.IPv4Unspecified()
	if upstream.Addr().Is6() {
		unspec = netip.IPv6Unspecified()
	}
	c, err := podsock.ListenUDP(int(p.ns.Fd()), netip.AddrPortFrom(unspec, 0), podsock.ListenOptions{Mark: Mark})
	if err != nil {
		return nil, fmt.Errorf("forward to %s: %w", upstream, err)
	}
	defer c.Close()
	if err := c.SetDeadline(time.Now().Add(forwardTimeout)); err != nil {
		return nil, err
	}
	if _, err := c.WriteToUDPAddrPort(query, upstream); err != nil {
		return nil, fmt.Errorf("forward to %s: %w", upstream, err)
	}
	buf := make([]byte, 4096)
	for {
		n, from, err := c.ReadFromUDPAddrPort(buf)
		if err != nil {
			return nil, fmt.Errorf("forward to %s: %w", upstream, err)
		}
		var parser dnsmessage.Parser
		h, err := parser.Start(buf[:n])
		if from != upstream || err != nil || h.ID != id || !h.Response {
			continue // not the answer to this query
		}
		return buf[:n], nil
	}
}
