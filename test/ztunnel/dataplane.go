package ztunnel

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/netip"
	"os"
	"sync"
	"time"

	"go.uber.org/zap"

	"github.com/mesh-cni/mesh-cni/pkg/zds"
)

// Config configures the ztunnel double (Run).
type Config struct {
	// ZDSPath is the node agent's ZDS socket (zds.DefaultSocketPath when empty).
	ZDSPath string
	// Workloads is istiod's view of the workloads: the destinations, and each
	// pod's own workload, which it must find there to be served.
	Workloads Directory
	// Node is the node the double serves, whose workloads it takes its pods'
	// to be (ztunnel's NODE_NAME).
	Node string
	// DNS are the names the DNS proxy answers (lower case, no final dot).
	DNS map[string][]netip.Addr
	// DNSForward, when valid, is the resolver a query for any other name is
	// forwarded to (ztunnel's: the nameserver of its own resolv.conf), from
	// the pod's network namespace on a socket marked Mark; otherwise such a
	// query gets SERVFAIL.
	DNSForward netip.AddrPort
	// RecordPath, when set, gets one JSON line per connection and DNS query.
	RecordPath string
	Log        *zap.Logger
	Options    Options
}

// Record is one connection or DNS query the double handled.
type Record struct {
	Pod string `json:"pod"`
	// Dir is outbound, inbound or dns; Proto hbone, tcp, dns or refused.
	Dir       string         `json:"dir"`
	Proto     string         `json:"proto"`
	Src       netip.AddrPort `json:"src"`
	Dst       netip.AddrPort `json:"dst,omitzero"`
	Forwarded string         `json:"forwarded,omitempty"`
	Name      string         `json:"name,omitempty"`
	// Identity is the SPIFFE identity the pod's proxy served it under (its
	// certificate's, for ztunnel): the trust domain of the workload istiod
	// has for the pod, the namespace and service account ZDS gave. Peer is
	// the other end's over HBONE.
	Identity string `json:"identity,omitempty"`
	Peer     string `json:"peer,omitempty"`
	Err      string `json:"err,omitempty"`
}

func (r Record) failed(err error) Record {
	r.Err = err.Error()
	return r
}

// ReadRecords reads a record file.
func ReadRecords(path string) ([]Record, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	var out []Record
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		var r Record
		if err := json.Unmarshal(sc.Bytes(), &r); err != nil {
			return nil, fmt.Errorf("record %q: %w", sc.Text(), err)
		}
		out = append(out, r)
	}
	return out, sc.Err()
}

type recorder struct {
	mu sync.Mutex
	f  *os.File
}

func (r *recorder) add(rec Record) {
	if r.f == nil {
		return
	}
	b, _ := json.Marshal(rec)
	r.mu.Lock()
	defer r.mu.Unlock()
	_, _ = r.f.Write(append(b, '\n'))
}

// Dataplane is what ztunnel runs for the workloads ZDS hands it: one proxy per
// pod, listening inside the pod's network namespace.
type Dataplane struct {
	cfg Config
	rec *recorder

	mu   sync.Mutex
	pods map[string]*pod
}

// Start implements Handler: a pod re-added with the same namespace (device and
// inode) is kept, with another one replaced (statemanager.rs).
func (d *Dataplane) Start(uid string, info WorkloadInfo, ns *os.File) error {
	id, err := zds.FdNetnsID(int(ns.Fd()))
	if err != nil {
		ns.Close()
		return err
	}
	d.mu.Lock()
	old := d.pods[uid]
	d.mu.Unlock()
	if old != nil {
		if old.id == id {
			ns.Close()
			return nil
		}
		d.Stop(uid)
	}
	ctx, cancel := context.WithCancel(context.Background())
	p := &pod{uid: uid, info: info, ns: ns, id: id, dp: d, ctx: ctx, cancel: cancel,
		conns: map[io.Closer]struct{}{}, log: d.cfg.Log.With(zap.String("pod", info.Namespace+"/"+info.Name))}
	if err := p.start(); err != nil {
		p.log.Warn("pod proxy failed to start", zap.String("uid", uid), zap.Error(err))
		return err
	}
	d.mu.Lock()
	d.pods[uid] = p
	d.mu.Unlock()
	p.log.Info("pod proxy started", zap.String("uid", uid), zap.String("serviceAccount", info.ServiceAccount), zap.Bool("transparent", p.transparent))
	return nil
}

// Stop implements Handler.
func (d *Dataplane) Stop(uid string) {
	d.mu.Lock()
	p := d.pods[uid]
	delete(d.pods, uid)
	d.mu.Unlock()
	if p != nil {
		p.stop()
		p.log.Info("pod proxy stopped", zap.String("uid", uid))
	}
}

// Reconcile implements Handler.
func (d *Dataplane) Reconcile(keep map[string]bool) {
	d.mu.Lock()
	var drop []string
	for uid := range d.pods {
		if !keep[uid] {
			drop = append(drop, uid)
		}
	}
	d.mu.Unlock()
	for _, uid := range drop {
		d.Stop(uid)
	}
}

// Run connects to the node agent's ZDS socket and serves the pods it hands over,
// reconnecting with ztunnel's back-off (10 ms doubling to 15 s) whenever the
// connection ends, until ctx ends or the agent makes a protocol error (returned,
// wrapping ErrProtocol); then every pod's proxy stops.
func Run(ctx context.Context, cfg Config) error {
	if cfg.ZDSPath == "" {
		cfg.ZDSPath = zds.DefaultSocketPath
	}
	if cfg.Log == nil {
		cfg.Log = zap.NewNop()
	}
	d := &Dataplane{cfg: cfg, rec: &recorder{}, pods: map[string]*pod{}}
	if cfg.RecordPath != "" {
		f, err := os.OpenFile(cfg.RecordPath, os.O_CREATE|os.O_APPEND|os.O_WRONLY, 0o644)
		if err != nil {
			return err
		}
		defer f.Close()
		d.rec.f = f
	}
	defer d.Reconcile(nil)
	backoff := 10 * time.Millisecond
	for ctx.Err() == nil {
		synced, err := d.connectOnce(ctx)
		if ctx.Err() != nil {
			return nil
		}
		if errors.Is(err, ErrProtocol) {
			// ztunnel stops its workload manager (and its pods' proxies)
			// rather than connect again to an agent it cannot speak to.
			return fmt.Errorf("stopped: %w", err)
		}
		if synced {
			backoff = 10 * time.Millisecond
		}
		cfg.Log.Info("no connection to the node agent, retrying", zap.Duration("in", backoff), zap.Error(err))
		select {
		case <-ctx.Done():
			return nil
		case <-time.After(backoff):
		}
		backoff = min(2*backoff, 15*time.Second)
	}
	return nil
}

func (d *Dataplane) connectOnce(ctx context.Context) (bool, error) {
	c, err := Dial(ctx, d.cfg.ZDSPath)
	if err != nil {
		return false, err
	}
	defer c.Close()
	d.cfg.Log.Info("connected to the node agent", zap.String("zds", d.cfg.ZDSPath))
	s := NewSession(d, d.cfg.Options)
	err = s.Serve(ctx, c)
	if err != nil && !errors.Is(err, context.Canceled) {
		d.cfg.Log.Warn("connection to the node agent ended", zap.Error(err))
	}
	return s.Synced(), err
}
