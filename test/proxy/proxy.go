// Package proxy is the reference L4 mesh proxy that mesh-cni's tests, benchmarks and
// demo put behind a capture (mesh-cni's eBPF redirect, or the iptables/nftables
// baselines in test/capture).
//
// It behaves like a sidecar or like the listeners ztunnel opens inside a pod's network
// namespace: an outbound listener on loopback (default port 15001) and an inbound
// listener on the wildcard address (default port 15006). For every accepted
// connection it recovers the original destination the way iptables-era proxies do
// (SO_ORIGINAL_DST), dials it with a socket mark so the capture leaves the proxy's own
// traffic alone, copies bytes both ways and records what it saw, in memory and
// optionally as JSON lines in a file that tests in other processes can read.
//
// Start runs one such proxy in one namespace. StartNode runs it the way ztunnel
// does: one process on the node that receives pods from the agent over ZDS
// (pkg/zds) and opens each pod's listeners inside that pod's namespace.
package proxy

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/netip"
	"os"
	"sync"
	"syscall"
	"time"

	"go.uber.org/zap"
	"golang.org/x/sys/unix"

	"github.com/mesh-cni/mesh-cni/internal/netns"
	"github.com/mesh-cni/mesh-cni/test/podsock"
)

// Defaults match Istio ambient / ztunnel and mesh-cni's data path.
const (
	DefaultOutboundPort = 15001
	DefaultInboundPort  = 15006
	DefaultMark         = 0x539
	DefaultDialTimeout  = 5 * time.Second
)

// loopDepth is the loop depth at which the proxy refuses a connection: its own
// onward connection, captured again, whose client was one too.
const loopDepth = 2

// ErrLoop is recorded (wrapped) when a connection would make the proxy connect to
// itself over and over: its destination is the proxy's own listener, or it comes
// from one of the proxy's own onward sockets (the capture did not exempt the mark).
var ErrLoop = errors.New("connection loops back to the proxy")

// Config says how the proxy listens, dials and records. The zero value is usable:
// every zero field takes its default.
type Config struct {
	// OutboundPort is bound on 127.0.0.1 and [::1]; 0 means DefaultOutboundPort.
	OutboundPort uint16
	// InboundPort is bound on 0.0.0.0 and [::]; 0 means DefaultInboundPort.
	InboundPort uint16
	// Mark is set with SO_MARK on every onward socket before it connects, so the
	// capture recognises and passes the proxy's own traffic; 0 means DefaultMark.
	Mark uint32
	// RecordPath, when set, is a file each finished connection's Record is appended
	// to as one JSON line (see ReadRecords and WaitForRecords).
	RecordPath string
	// Echo makes the proxy answer every connection itself (echoing what it reads)
	// instead of dialing onward: the cost of the capture and the proxy alone, the
	// upper limit for benchmarks. It echoes whether or not the original destination
	// is known, so it also serves a client that dials the proxy directly.
	Echo bool
	// ForwardTo, when valid, sends every accepted connection there instead of to
	// its original destination, with no lookup and no loop check: two proxies
	// chained explicitly, the "no capture at all" limit in benchmarks.
	ForwardTo netip.AddrPort
	// DialTimeout bounds each onward connect; 0 means DefaultDialTimeout.
	DialTimeout time.Duration
	// NetNS, when set, is the network namespace the proxy listens and dials in,
	// for running it inside a test process. Empty means the process's own
	// namespace, as when the binary is started with nsenter.
	NetNS string
	// Logger receives the proxy's logs; nil discards them.
	Logger *zap.Logger
}

func (c Config) withDefaults() Config {
	if c.OutboundPort == 0 {
		c.OutboundPort = DefaultOutboundPort
	}
	if c.InboundPort == 0 {
		c.InboundPort = DefaultInboundPort
	}
	if c.Mark == 0 {
		c.Mark = DefaultMark
	}
	if c.DialTimeout <= 0 {
		c.DialTimeout = DefaultDialTimeout
	}
	if c.Logger == nil {
		c.Logger = zap.NewNop()
	}
	return c
}

// Proxy is a running proxy. Its methods are safe for concurrent use.
type Proxy struct {
	cfg       Config
	log       *zap.Logger
	rec       *recorder
	ownRec    bool     // the record file is this proxy's to close (not a node's)
	pod       string   // the pod uid records carry, in node mode
	ns        *os.File // open while the proxy runs when it serves another namespace
	listeners []*listener

	ctx    context.Context
	cancel context.CancelFunc
	wg     sync.WaitGroup

	// onward holds the local addresses of the proxy's open onward connections,
	// to recognise one of them arriving back at a listener, each with its
	// loop depth: how many of the proxy's own connections, captured again,
	// lead to it.
	onwardMu sync.Mutex
	onward   map[netip.AddrPort]int

	closeOnce sync.Once
	closeErr  error
}

type listener struct {
	net.Listener
	dir  Direction
	port uint16
}

// Start binds the proxy's listeners and starts serving. It returns once every
// listener is bound. The proxy serves until Close is called or ctx is done; Close
// must be called in either case to wait for connections and release the record
// file. An [::1] or [::] listener is skipped (with a warning) only when the
// namespace has no IPv6.
func Start(ctx context.Context, cfg Config) (*Proxy, error) {
	cfg = cfg.withDefaults()
	if cfg.OutboundPort == cfg.InboundPort {
		return nil, fmt.Errorf("outbound and inbound port are both %d", cfg.OutboundPort)
	}
	rec, err := newRecorder(cfg.RecordPath)
	if err != nil {
		return nil, err
	}
	var ns *os.File
	if cfg.NetNS != "" {
		if err := netns.Validate(cfg.NetNS); err != nil {
			return nil, errors.Join(err, rec.close())
		}
		if ns, err = os.Open(cfg.NetNS); err != nil {
			return nil, errors.Join(fmt.Errorf("open netns: %w", err), rec.close())
		}
	}
	return start(ctx, cfg, ns, rec, true, "")
}

// start binds and serves in the namespace ns (nil: the calling thread's), which the
// proxy owns from here on, also on error. cfg has its defaults applied.
func start(ctx context.Context, cfg Config, ns *os.File, rec *recorder, ownRec bool, pod string) (*Proxy, error) {
	p := &Proxy{cfg: cfg, log: cfg.Logger, rec: rec, ownRec: ownRec, pod: pod, ns: ns, onward: map[netip.AddrPort]int{}}
	if pod != "" {
		p.log = p.log.With(zap.String("pod", pod))
	}
	p.ctx, p.cancel = context.WithCancel(ctx)

	fail := func(err error) (*Proxy, error) {
		return nil, errors.Join(err, p.Close())
	}
	binds := []struct {
		network, host string
		dir           Direction
		port          uint16
	}{
		{"tcp4", "127.0.0.1", Outbound, cfg.OutboundPort},
		{"tcp6", "::1", Outbound, cfg.OutboundPort},
		{"tcp4", "0.0.0.0", Inbound, cfg.InboundPort},
		// "tcp6" on the wildcard sets IPV6_V6ONLY, so IPv4 goes to the socket above
		// and every accepted connection has addresses of one family.
		{"tcp6", "::", Inbound, cfg.InboundPort},
	}
	for _, b := range binds {
		addr := net.JoinHostPort(b.host, fmt.Sprint(b.port))
		ln, err := p.listen(p.ctx, b.network, addr)
		if err != nil {
			if b.network == "tcp6" && (errors.Is(err, unix.EADDRNOTAVAIL) || errors.Is(err, unix.EAFNOSUPPORT)) {
				p.log.Warn("no IPv6 in this network namespace, skipping listener", zap.String("addr", addr), zap.Error(err))
				continue
			}
			return fail(fmt.Errorf("listen on %s (%s): %w", addr, b.dir, err))
		}
		p.listeners = append(p.listeners, &listener{Listener: ln, dir: b.dir, port: b.port})
	}
	// Cancelling ctx stops accepting; Close closes them again, harmlessly.
	context.AfterFunc(p.ctx, p.closeListeners)
	for _, ln := range p.listeners {
		p.wg.Add(1)
		go p.serve(ln)
	}
	p.log.Info("proxy listening", zap.Stringers("addrs", p.Addrs()), zap.Bool("echo", cfg.Echo),
		zap.String("mark", fmt.Sprintf("%#x", cfg.Mark)), zap.String("records", cfg.RecordPath))
	return p, nil
}

// Addrs returns the addresses the proxy listens on.
func (p *Proxy) Addrs() []netip.AddrPort {
	addrs := make([]netip.AddrPort, 0, len(p.listeners))
	for _, ln := range p.listeners {
		addrs = append(addrs, addrPortOf(ln.Addr()))
	}
	return addrs
}

// Records returns a copy of the records of every connection finished so far.
func (p *Proxy) Records() []Record {
	return p.rec.snapshot()
}

// Close stops the listeners, ends open connections, waits for their records and
// closes the record file. It is safe to call more than once.
func (p *Proxy) Close() error {
	p.closeOnce.Do(func() {
		p.cancel()
		p.closeListeners()
		p.wg.Wait()
		var errs []error
		if p.ownRec {
			errs = append(errs, p.rec.close())
		}
		if p.ns != nil {
			errs = append(errs, p.ns.Close())
		}
		p.closeErr = errors.Join(errs...)
	})
	return p.closeErr
}

func (p *Proxy) closeListeners() {
	for _, ln := range p.listeners {
		if err := ln.Close(); err != nil && !errors.Is(err, net.ErrClosed) {
			p.log.Warn("close listener", zap.Error(err))
		}
	}
}

// listen binds in the proxy's namespace when it has one, otherwise in the calling
// thread's. MPTCP is off: Go listens with MPTCP by default, and the data path can
// only capture plain TCP listeners (a SOCKHASH refuses MPTCP ones), as the proxy
// contract says.
func (p *Proxy) listen(ctx context.Context, network, addr string) (net.Listener, error) {
	var lc net.ListenConfig
	lc.SetMultipathTCP(false)
	if p.ns == nil {
		return lc.Listen(ctx, network, addr)
	}
	var ln net.Listener
	err := netns.DoFd(int(p.ns.Fd()), func() error {
		var err error
		ln, err = lc.Listen(ctx, network, addr)
		return err
	})
	return ln, err
}

// dial connects to dst with the proxy's mark, from the proxy's namespace.
func (p *Proxy) dial(dst netip.AddrPort) (*net.TCPConn, error) {
	if p.ns != nil {
		return podsock.Dial(p.ctx, int(p.ns.Fd()), dst, podsock.DialOptions{Mark: p.cfg.Mark, Timeout: p.cfg.DialTimeout})
	}
	d := net.Dialer{Timeout: p.cfg.DialTimeout, Control: markControl(p.cfg.Mark)}
	network := "tcp4"
	if dst.Addr().Is6() {
		network = "tcp6"
	}
	c, err := d.DialContext(p.ctx, network, dst.String())
	if err != nil {
		return nil, err
	}
	return c.(*net.TCPConn), nil
}

// markControl sets SO_MARK on a socket after it is created and before it connects,
// so even the SYN carries the mark the capture rules skip.
func markControl(mark uint32) func(network, address string, c syscall.RawConn) error {
	return func(_, _ string, c syscall.RawConn) error {
		var setErr error
		if err := c.Control(func(fd uintptr) {
			setErr = unix.SetsockoptInt(int(fd), unix.SOL_SOCKET, unix.SO_MARK, int(mark))
		}); err != nil {
			return err
		}
		if setErr != nil {
			return fmt.Errorf("set SO_MARK %#x: %w", mark, setErr)
		}
		return nil
	}
}

func (p *Proxy) serve(ln *listener) {
	defer p.wg.Done()
	for {
		c, err := ln.Accept()
		if err != nil {
			if p.ctx.Err() != nil || errors.Is(err, net.ErrClosed) {
				return
			}
			// Out of descriptors and the like: back off briefly rather than spin.
			p.log.Warn("accept", zap.Stringer("addr", ln.Addr()), zap.Error(err))
			select {
			case <-p.ctx.Done():
				return
			case <-time.After(10 * time.Millisecond):
			}
			continue
		}
		p.wg.Add(1)
		go func() {
			defer p.wg.Done()
			p.handle(c.(*net.TCPConn), ln)
		}()
	}
}

func (p *Proxy) handle(client *net.TCPConn, ln *listener) {
	rec := Record{
		Time:      time.Now(),
		Pod:       p.pod,
		Direction: ln.dir,
		Client:    addrPortOf(client.RemoteAddr()),
		Local:     addrPortOf(client.LocalAddr()),
	}
	defer client.Close()
	stop := context.AfterFunc(p.ctx, func() { client.Close() })
	defer stop()

	err := p.proxy(client, ln, &rec)
	if err != nil {
		rec.Error = err.Error()
	}
	rec.Duration = time.Since(rec.Time)
	log := p.log.With(zap.String("direction", string(rec.Direction)), zap.Stringer("client", rec.Client),
		zap.Stringer("dst", rec.OriginalDst), zap.String("dst_source", string(rec.DstSource)))
	if err != nil {
		log.Info("connection failed", zap.Error(err))
	} else {
		log.Debug("connection done", zap.Int64("bytes_to_dst", rec.BytesToDst), zap.Int64("bytes_to_client", rec.BytesToClient))
	}
	if err := p.rec.add(rec); err != nil {
		p.log.Error("record connection", zap.Error(err))
	}
}

// proxy serves one accepted connection and fills in rec; it returns the first error.
func (p *Proxy) proxy(client *net.TCPConn, ln *listener, rec *Record) error {
	if p.cfg.ForwardTo.IsValid() {
		rec.OriginalDst, rec.DstSource = p.cfg.ForwardTo, SourceForwarded
		return p.forward(client, p.cfg.ForwardTo, rec, 0)
	}
	// An address does not prove a loop: an application's connection to the
	// same destination may get the local port an onward connection has (the
	// kernel's port choice sees the capture's destination, not the original
	// one), and look exactly like that onward connection come back. A loop
	// repeats, a coincidence hardly twice in a row: the proxy refuses a
	// connection that is its own onward connection's once removed. Best effort
	// too: an onward connect completes at about the time its looped copy is
	// accepted, so a loop's first hops may slip through; a later one is caught.
	depth := p.onwardDepth(rec.Client)
	if depth >= loopDepth {
		return fmt.Errorf("client %s is the proxy's own onward connection, captured again %d times (is mark %#x exempt?): %w",
			rec.Client, depth, p.cfg.Mark, ErrLoop)
	}
	dst, src, err := p.destination(client, ln.dir, rec.Local)
	rec.OriginalDst, rec.DstSource = dst, src
	if p.cfg.Echo {
		if err != nil {
			p.log.Debug("echo without original destination", zap.Error(err))
		}
		n, err := copyConn(client, client)
		rec.BytesToDst, rec.BytesToClient = n, n
		if err != nil {
			return fmt.Errorf("echo: %w", err)
		}
		// The client may already be gone entirely; its half-close was clean.
		_ = client.CloseWrite()
		return nil
	}
	if err != nil {
		return err
	}
	// A destination equal to the listener itself means nothing redirected this
	// connection (a client dialed the proxy port directly).
	if dst.Port() == ln.port && (dst.Addr() == rec.Local.Addr() || dst.Addr().IsLoopback() || dst.Addr().IsUnspecified()) {
		return fmt.Errorf("%s: %w", dst, ErrLoop)
	}
	return p.forward(client, dst, rec, depth)
}

// forward dials dst with the mark and copies both ways; depth is the loop
// depth of the connection it serves.
func (p *Proxy) forward(client *net.TCPConn, dst netip.AddrPort, rec *Record, depth int) error {
	upstream, err := p.dial(dst)
	if err != nil {
		return fmt.Errorf("dial original destination %s: %w", dst, err)
	}
	defer upstream.Close()
	self := addrPortOf(upstream.LocalAddr())
	p.addOnward(self, depth)
	defer p.removeOnward(self)
	stop := context.AfterFunc(p.ctx, func() { upstream.Close() })
	defer stop()
	rec.BytesToDst, rec.BytesToClient, err = pipe(client, upstream, copyConn)
	return err
}

func (p *Proxy) addOnward(a netip.AddrPort, depth int) {
	p.onwardMu.Lock()
	defer p.onwardMu.Unlock()
	p.onward[a] = depth
}

func (p *Proxy) removeOnward(a netip.AddrPort) {
	p.onwardMu.Lock()
	defer p.onwardMu.Unlock()
	delete(p.onward, a)
}

// onwardDepth is the loop depth of a connection from client: 0 unless client
// is one of the proxy's open onward connections, else one more than that
// connection's.
func (p *Proxy) onwardDepth(client netip.AddrPort) int {
	p.onwardMu.Lock()
	defer p.onwardMu.Unlock()
	if d, ok := p.onward[client]; ok {
		return d + 1
	}
	return 0
}

// destination finds where the client meant to connect. Outbound connections have
// only getsockopt; inbound ones fall back to the socket's local address, which is the
// original destination when the capture assigns the connection without rewriting it.
func (p *Proxy) destination(c *net.TCPConn, dir Direction, local netip.AddrPort) (netip.AddrPort, DstSource, error) {
	dst, err := podsock.OriginalDst(c)
	if err == nil {
		return dst, SourceGetsockopt, nil
	}
	if dir == Inbound && local.IsValid() {
		return local, SourceLocalAddr, nil
	}
	return netip.AddrPort{}, SourceNone, fmt.Errorf("original destination: %w", err)
}

// copyConn copies src to dst until src ends (io.Copy between two
// *net.TCPConn: the kernel moves the bytes, they never reach user space).
func copyConn(dst, src *net.TCPConn) (int64, error) { return io.Copy(dst, src) }

// pipe copies both ways with cp until both directions end. A direction that ends
// cleanly passes the client's or server's FIN on with CloseWrite so the other
// direction keeps flowing (half-close); one that fails resets both sides.
func pipe(client, upstream *net.TCPConn, cp func(dst, src *net.TCPConn) (int64, error)) (toDst, toClient int64, err error) {
	var (
		wg    sync.WaitGroup
		upErr error
	)
	wg.Add(1)
	go func() {
		defer wg.Done()
		toDst, upErr = cp(upstream, client)
		endHalf(upstream, client, upErr)
	}()
	toClient, downErr := cp(client, upstream)
	endHalf(client, upstream, downErr)
	wg.Wait()
	if upErr != nil {
		upErr = fmt.Errorf("client to destination: %w", upErr)
	}
	if downErr != nil {
		downErr = fmt.Errorf("destination to client: %w", downErr)
	}
	return toDst, toClient, firstCause(upErr, downErr)
}

// endHalf ends the direction src→dst.
func endHalf(dst, src *net.TCPConn, err error) {
	if err == nil {
		_ = dst.CloseWrite()
		return
	}
	// Linger 0 makes close send a reset, so the peer learns of the failure.
	_ = dst.SetLinger(0)
	_ = dst.Close()
	_ = src.Close()
}

// firstCause prefers a real failure over the net.ErrClosed it caused in the other
// direction.
func firstCause(errs ...error) error {
	for _, err := range errs {
		if err != nil && !errors.Is(err, net.ErrClosed) {
			return err
		}
	}
	for _, err := range errs {
		if err != nil {
			return err
		}
	}
	return nil
}

// addrPortOf returns a TCP address with IPv4-mapped IPv6 addresses unmapped, so
// records show one form per family.
func addrPortOf(a net.Addr) netip.AddrPort {
	ta, ok := a.(*net.TCPAddr)
	if !ok {
		return netip.AddrPort{}
	}
	ap := ta.AddrPort()
	return netip.AddrPortFrom(ap.Addr().Unmap(), ap.Port())
}
