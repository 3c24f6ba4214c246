package ztunnel

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/netip"
	"net/url"
	"slices"
	"sync"
)

// HBONE as ztunnel speaks it, without its mTLS: an HTTP/2 CONNECT to the
// destination's 15008 naming the original destination as :authority, with the
// client's address in a Forwarded header and its workload in baggage
// (outbound.rs, baggage.rs); the server answers 200 once it has connected to the
// application, 400 for a request that is not a CONNECT or names another address
// than the one it was reached at, 503 when the application cannot be reached
// (inbound.rs). ztunnel always wraps it in mTLS with certificates istiod issues;
// the double carries it in cleartext (h2 with prior knowledge), so a test reads
// the request as ztunnel writes it. In place of the certificates each side
// names the identity its certificate would carry in a header (the client in
// its request, the server in its answer), and each does what ztunnel's TLS
// does with the other's: the client refuses a server that is not the
// destination workload istiod named, the server records the client's. A
// server whose pod istiod has no workload for has no certificate: it hangs up
// before any request.

// Headers standing in for the certificates.
const (
	headerClientIdentity = "Double-Client-Identity"
	headerServerIdentity = "Double-Server-Identity"
)

// tunnel is one CONNECT stream: what is written goes in the request body, what is
// read comes from the response body.
type tunnel struct {
	w    *io.PipeWriter
	body io.ReadCloser
	cc   *http.ClientConn
	peer string // the server's identity
}

func (t *tunnel) Read(b []byte) (int, error)  { return t.body.Read(b) }
func (t *tunnel) Write(b []byte) (int, error) { return t.w.Write(b) }
func (t *tunnel) CloseWrite() error           { return t.w.Close() }
func (t *tunnel) Close() error {
	return errors.Join(t.w.Close(), t.body.Close(), t.cc.Close())
}

// connectHBONE opens a CONNECT stream to dst over conn (a connection to the
// destination's HBONE port) as the client identity id, to a server that must
// answer as the identity want.
func connectHBONE(ctx context.Context, conn net.Conn, dst, src netip.AddrPort, from WorkloadInfo, id, want string) (*tunnel, error) {
	var protocols http.Protocols
	protocols.SetUnencryptedHTTP2(true)
	tr := &http.Transport{
		Protocols:   &protocols,
		DialContext: func(context.Context, string, string) (net.Conn, error) { return conn, nil },
	}
	cc, err := tr.NewClientConn(ctx, "http", conn.RemoteAddr().String())
	if err != nil {
		return nil, fmt.Errorf("hbone: %w", err)
	}
	pr, pw := io.Pipe()
	req := (&http.Request{
		Method: http.MethodConnect,
		URL:    &url.URL{Host: dst.String()},
		Host:   dst.String(),
		Header: http.Header{
			"Forwarded": {fmt.Sprintf("for=%q", src.String())},
			"Baggage":   {fmt.Sprintf("k8s.namespace.name=%s,k8s.pod.name=%s", from.Namespace, from.Name)},
			// The client certificate's identity.
			headerClientIdentity: {id},
		},
		Body: pr,
	}).WithContext(ctx)
	resp, err := cc.RoundTrip(req)
	if err != nil {
		pw.Close()
		cc.Close()
		return nil, fmt.Errorf("hbone CONNECT %s: %w", dst, err)
	}
	fail := func(err error) (*tunnel, error) {
		resp.Body.Close()
		pw.Close()
		cc.Close()
		return nil, err
	}
	if resp.StatusCode != http.StatusOK {
		return fail(fmt.Errorf("hbone CONNECT %s: %s", dst, resp.Status))
	}
	peer := resp.Header.Get(headerServerIdentity)
	if peer != want {
		return fail(fmt.Errorf("hbone CONNECT %s: the server is %q, want %q", dst, peer, want))
	}
	return &tunnel{w: pw, body: resp.Body, cc: cc, peer: peer}, nil
}

// inboundHBONE is the 15008 listener: CONNECT streams from peers' ztunnels, each
// carried to the application at this address and the :authority's port, from the
// peer's address when the listener is transparent, for a pod whose workload
// istiod has.
func (p *pod) inboundHBONE(c *net.TCPConn, src netip.AddrPort) {
	conn := Record{Dir: "inbound", Src: src}
	if !p.admit(&conn) {
		return
	}
	local, _ := netip.ParseAddrPort(c.LocalAddr().String())
	local = netip.AddrPortFrom(local.Addr().Unmap(), local.Port())
	var protocols http.Protocols
	protocols.SetUnencryptedHTTP2(true)
	srv := &http.Server{Protocols: &protocols, BaseContext: func(net.Listener) context.Context { return p.ctx }}
	ln := &oneConn{conn: c, done: make(chan struct{})}
	srv.Handler = http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		rec := Record{Dir: "inbound", Proto: "hbone", Src: src, Forwarded: r.Header.Get("Forwarded"),
			Identity: conn.Identity, Peer: r.Header.Get(headerClientIdentity)}
		w.Header().Set(headerServerIdentity, conn.Identity)
		if r.Method != http.MethodConnect {
			w.WriteHeader(http.StatusBadRequest)
			p.record(rec.failed(fmt.Errorf("method %s", r.Method)))
			return
		}
		authority, err := netip.ParseAddrPort(r.Host)
		if err != nil || authority.Addr().Unmap() != local.Addr() {
			w.WriteHeader(http.StatusBadRequest)
			p.record(rec.failed(fmt.Errorf("authority %q is not this pod's address %s", r.Host, local.Addr())))
			return
		}
		rec.Dst = netip.AddrPortFrom(local.Addr(), authority.Port())
		if slices.Contains(illegalPorts(), rec.Dst.Port()) {
			w.WriteHeader(http.StatusServiceUnavailable)
			p.record(rec.failed(errors.New("illegal port")))
			return
		}
		up, err := p.dial(rec.Dst, p.sourceFor(src.Addr(), rec.Dst.Addr()))
		if err != nil {
			w.WriteHeader(http.StatusServiceUnavailable)
			p.record(rec.failed(err))
			return
		}
		defer up.Close()
		w.WriteHeader(http.StatusOK)
		rc := http.NewResponseController(w)
		_ = rc.Flush()
		p.record(rec)
		var wg sync.WaitGroup
		wg.Go(func() {
			_, _ = io.Copy(up, r.Body)
			_ = up.CloseWrite()
		})
		buf := make([]byte, 32<<10)
		for {
			n, err := up.Read(buf)
			if n > 0 {
				if _, werr := w.Write(buf[:n]); werr != nil {
					break
				}
				_ = rc.Flush()
			}
			if err != nil {
				break
			}
		}
		wg.Wait()
	})
	// The connection's end (or the pod's) ends the server.
	srv.ConnState = func(_ net.Conn, st http.ConnState) {
		if st == http.StateClosed {
			ln.close()
		}
	}
	stop := context.AfterFunc(p.ctx, func() { srv.Close() })
	defer stop()
	_ = srv.Serve(ln)
}

// oneConn is a listener that accepts one connection, then blocks until closed.
type oneConn struct {
	conn net.Conn
	once sync.Once
	done chan struct{}
	used bool
	mu   sync.Mutex
}

func (l *oneConn) Accept() (net.Conn, error) {
	l.mu.Lock()
	if !l.used {
		l.used = true
		l.mu.Unlock()
		return l.conn, nil
	}
	l.mu.Unlock()
	<-l.done
	return nil, net.ErrClosed
}

func (l *oneConn) close()         { l.once.Do(func() { close(l.done) }) }
func (l *oneConn) Close() error   { l.close(); return nil }
func (l *oneConn) Addr() net.Addr { return l.conn.LocalAddr() }
