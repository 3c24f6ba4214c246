package ztunnel

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/netip"
	"os"
	"slices"
	"sync"

	"go.uber.org/zap"

	"github.com/mesh-cni/mesh-cni/pkg/zds"
	"github.com/mesh-cni/mesh-cni/test/podsock"
)

// ztunnel's in-pod conventions (src/config.rs, src/inpod/config.rs): its listener
// ports and the mark it sets on every socket it makes in a pod.
const (
	OutboundPort = 15001
	InboundPort  = 15006
	HBONEPort    = 15008
	DNSPort      = 15053
	Mark         = 1337 // 0x539
)

// illegalPorts are the destinations ztunnel refuses to forward to (a loop back
// into itself): outbound.rs and inbound_passthrough.rs check them.
func illegalPorts() []uint16 { return []uint16{HBONEPort, InboundPort, OutboundPort} }

// pod is one pod's proxy, as ztunnel runs one per workload: its listeners in the
// pod's network namespace and the connections they carry.
type pod struct {
	uid  string
	info WorkloadInfo
	ns   *os.File
	id   zds.NetnsID
	dp   *Dataplane
	log  *zap.Logger

	ctx    context.Context
	cancel context.CancelFunc
	wg     sync.WaitGroup
	// transparent reports whether IP_TRANSPARENT took on the listeners: then
	// inbound connections go to the application from the client's address.
	transparent bool

	mu    sync.Mutex
	conns map[io.Closer]struct{}
}

// listenTCP opens the pod's listeners on port: the wildcard (dual-stack [::]),
// SO_REUSEPORT and the mark, IP_TRANSPARENT best effort, as ztunnel's
// maybe_set_transparent does when ENABLE_ORIG_SRC is unset.
func (p *pod) listenTCP(addr netip.AddrPort, serve func(*net.TCPConn, netip.AddrPort)) error {
	ln, transparent, err := podsock.Listen(int(p.ns.Fd()), addr, podsock.ListenOptions{Mark: Mark, ReusePort: true, Transparent: true})
	if err != nil {
		return err
	}
	if addr.Port() != DNSPort {
		p.transparent = transparent
	}
	p.track(ln)
	p.wg.Go(func() {
		for {
			c, err := ln.AcceptTCP()
			if err != nil {
				return
			}
			peer, _ := netip.ParseAddrPort(c.RemoteAddr().String())
			peer = netip.AddrPortFrom(peer.Addr().Unmap(), peer.Port())
			p.track(c)
			p.wg.Go(func() {
				defer p.untrack(c)
				defer c.Close()
				serve(c, peer)
			})
		}
	})
	return nil
}

func (p *pod) track(c io.Closer) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.ctx.Err() != nil {
		c.Close()
		return
	}
	p.conns[c] = struct{}{}
}

func (p *pod) untrack(c io.Closer) {
	p.mu.Lock()
	defer p.mu.Unlock()
	delete(p.conns, c)
}

// start opens every listener ztunnel opens in a pod.
func (p *pod) start() error {
	wildcard := netip.IPv6Unspecified()
	errs := []error{
		p.listenTCP(netip.AddrPortFrom(wildcard, OutboundPort), p.outbound),
		p.listenTCP(netip.AddrPortFrom(wildcard, InboundPort), p.inboundPlain),
		p.listenTCP(netip.AddrPortFrom(wildcard, HBONEPort), p.inboundHBONE),
	}
	// DNS on localhost only, both families (the IPv6 one only where the pod has
	// IPv6 on lo, as ztunnel checks disable_ipv6).
	for _, a := range []netip.Addr{netip.MustParseAddr("127.0.0.1"), netip.IPv6Loopback()} {
		errs = append(errs, p.serveDNS(netip.AddrPortFrom(a, DNSPort)))
	}
	if err := errors.Join(errs...); err != nil {
		p.stop()
		return fmt.Errorf("failure to start proxy: %w", err)
	}
	return nil
}

// stop closes the pod's listeners and connections and waits for them.
func (p *pod) stop() {
	p.cancel()
	p.mu.Lock()
	conns := p.conns
	p.conns = map[io.Closer]struct{}{}
	p.mu.Unlock()
	for c := range conns {
		c.Close()
	}
	p.wg.Wait()
	p.ns.Close()
}

// identity is the identity the pod is served under, as fetch_certificate
// builds it: the trust domain of its own workload in istiod's view, waited for
// as ztunnel waits for it on every connection (proxy.rs get_workload), with
// ZDS's namespace and service account. Without the workload within
// LocalWorkloadWait the connection is refused.
func (p *pod) identity() (string, error) {
	ctx, cancel := context.WithTimeout(p.ctx, LocalWorkloadWait)
	defer cancel()
	w, err := p.dp.cfg.Workloads.Local(ctx, p.dp.cfg.Node, p.info)
	if err != nil {
		return "", err
	}
	return Identity(w.TrustDomain, p.info.Namespace, p.info.ServiceAccount), nil
}

// admit fills in the identity rec's connection is served under, or records
// the connection refused and reports false when the pod has none.
func (p *pod) admit(rec *Record) bool {
	id, err := p.identity()
	if err != nil {
		refused := *rec
		refused.Proto = "refused"
		p.record(refused.failed(err))
		return false
	}
	rec.Identity = id
	return true
}

// destination is the original destination of an accepted connection:
// SO_ORIGINAL_DST, else the accepted socket's local address (src/socket.rs).
func destination(c *net.TCPConn) netip.AddrPort {
	if d, err := podsock.OriginalDst(c); err == nil {
		return d
	}
	l, _ := netip.ParseAddrPort(c.LocalAddr().String())
	return netip.AddrPortFrom(l.Addr().Unmap(), l.Port())
}

func (p *pod) dial(dst netip.AddrPort, src netip.Addr) (*net.TCPConn, error) {
	return podsock.Dial(p.ctx, int(p.ns.Fd()), dst, podsock.DialOptions{Mark: Mark, Source: src})
}

// outbound is the 15001 listener: the source is the accepted socket's peer (its
// address goes into the record, as ztunnel puts it into its logs, metrics,
// Forwarded header and waypoint checks); a connection from a pod whose workload
// istiod does not have is refused; a destination istiod calls HBONE gets a
// CONNECT to its 15008, which must answer as the destination workload's
// identity, anything else a plain connection to the original destination
// (outbound.rs proxy, build_request).
func (p *pod) outbound(c *net.TCPConn, src netip.AddrPort) {
	dst := destination(c)
	if dst.Addr().IsLoopback() && slices.Contains(illegalPorts(), dst.Port()) {
		p.record(Record{Dir: "outbound", Proto: "refused", Src: src, Dst: dst, Err: "self call"})
		return
	}
	rec := Record{Dir: "outbound", Src: src, Dst: dst}
	if !p.admit(&rec) {
		return
	}
	if w, ok := p.dp.cfg.Workloads.Lookup(dst.Addr()); ok && w.HBONE {
		rec.Proto = "hbone"
		up, err := p.dial(netip.AddrPortFrom(dst.Addr(), HBONEPort), netip.Addr{})
		if err != nil {
			p.record(rec.failed(err))
			return
		}
		defer up.Close()
		tunnel, err := connectHBONE(p.ctx, up, dst, src, p.info, rec.Identity, w.Identity())
		if err != nil {
			p.record(rec.failed(err))
			return
		}
		defer tunnel.Close()
		rec.Peer = tunnel.peer
		p.record(rec)
		pipe(c, tunnel)
		return
	}
	rec.Proto = "tcp"
	p.carry(c, rec, dst, netip.Addr{})
}

// inboundPlain is the 15006 listener: plaintext from a peer without HBONE, carried
// to the original destination with the client's address as source when the
// listener is transparent, for a pod whose workload istiod has
// (inbound_passthrough.rs).
func (p *pod) inboundPlain(c *net.TCPConn, src netip.AddrPort) {
	dst := destination(c)
	rec := Record{Dir: "inbound", Proto: "tcp", Src: src, Dst: dst}
	if slices.Contains(illegalPorts(), dst.Port()) {
		p.record(rec.failed(errors.New("illegal port")))
		return
	}
	if !p.admit(&rec) {
		return
	}
	p.carry(c, rec, dst, p.sourceFor(src.Addr(), dst.Addr()))
}

// carry connects to dst from src (any address when unset) and pipes c to it
// in plaintext, recording rec once connected, or as failed.
func (p *pod) carry(c *net.TCPConn, rec Record, dst netip.AddrPort, src netip.Addr) {
	up, err := p.dial(dst, src)
	if err != nil {
		p.record(rec.failed(err))
		return
	}
	defer up.Close()
	p.record(rec)
	pipe(c, up)
}

// sourceFor is the source of a connection to the application: the client's
// address when the listener is transparent (and it is not the destination
// itself), else none (freebind_connect, proxy.rs).
func (p *pod) sourceFor(client, dst netip.Addr) netip.Addr {
	if !p.transparent || client == dst {
		return netip.Addr{}
	}
	return client
}

// pipe copies both ways until both directions end, passing a half-close on.
func pipe(a, b io.ReadWriteCloser) {
	var wg sync.WaitGroup
	half := func(dst, src io.ReadWriteCloser) {
		defer wg.Done()
		_, err := io.Copy(dst, src)
		if cw, ok := dst.(interface{ CloseWrite() error }); ok && err == nil {
			_ = cw.CloseWrite()
			return
		}
		dst.Close()
	}
	wg.Add(2)
	go half(a, b)
	go half(b, a)
	wg.Wait()
}

func (p *pod) record(r Record) {
	r.Pod = p.info.Namespace + "/" + p.info.Name
	p.dp.rec.add(r)
	p.log.Debug("connection", zap.Any("record", r))
}
