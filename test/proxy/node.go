package proxy

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"net/netip"
	"os"
	"slices"
	"sync"
	"time"

	"go.uber.org/zap"

	"github.com/mesh-cni/mesh-cni/pkg/zds"
	"github.com/mesh-cni/mesh-cni/test/ztunnel"
)

// Node-mode defaults (ztunnel's reconnect backoff starts small and caps at 15 s;
// tests want a shorter cap).
const (
	DefaultReconnectMin = 10 * time.Millisecond
	DefaultReconnectMax = 5 * time.Second
)

// NodeConfig configures a node proxy (StartNode).
type NodeConfig struct {
	// Proxy applies to every pod: ports, mark, echo, dial timeout, logger, and the
	// record file, which is shared (each record names its pod). Its NetNS must be
	// empty: the pods' namespaces arrive over ZDS.
	Proxy Config
	// ZDSPath is the agent's ZDS socket; empty means zds.DefaultSocketPath.
	ZDSPath string
	// ReconnectMin and ReconnectMax bound the wait before connecting again, which
	// doubles after every attempt that fails; 0 means the defaults.
	ReconnectMin, ReconnectMax time.Duration
	// RequireServiceAccount refuses (and hangs up on) an AddWorkload without a
	// service account, as a conformance check: ztunnel would take it and then
	// fail to serve it.
	RequireServiceAccount bool
}

// PodInfo is a pod a node proxy serves.
type PodInfo struct {
	UID, Name, Namespace, ServiceAccount string
	// Netns identifies the namespace the listeners are in.
	Netns zds.NetnsID
	// Addrs are the pod's listeners.
	Addrs []netip.AddrPort
}

// NodeStatus is a node proxy's view of its agent connection and pods.
type NodeStatus struct {
	// Connected is true while a connection to the agent is up.
	Connected bool
	// Snapshots counts the snapshots received over all connections.
	Snapshots int
	// Pods are the pods served, by UID.
	Pods []PodInfo
}

// Node is a running node proxy: like ztunnel, one process for every pod on the
// node. It connects to the agent's ZDS socket, says hello and serves each pod it
// is handed by opening that pod's listeners inside the pod's network namespace
// (from the fd that came with the pod) and dialing onward from there with its
// mark. Its ZDS side is test/ztunnel, the client written from ztunnel's
// source, so it follows ztunnel's rules: a pod re-added with the same namespace is
// kept, with a new one replaced; after SnapshotSent every pod the snapshot did
// not name is dropped; a pod it cannot start is refused (the connection stays);
// a packet it cannot make sense of is refused and the connection dropped. When
// the agent goes away the pods keep running and the proxy reconnects with
// backoff to take the next snapshot.
type Node struct {
	cfg NodeConfig
	log *zap.Logger
	rec *recorder

	ctx    context.Context
	cancel context.CancelFunc
	done   chan struct{}

	mu        sync.Mutex
	pods      map[string]*nodePod
	connected bool
	snapshots int
	changed   chan struct{}

	closeOnce sync.Once
	closeErr  error
}

type nodePod struct {
	info  PodInfo
	proxy *Proxy
}

// StartNode starts a node proxy and returns at once; it connects to the agent
// in the background. Close stops it.
func StartNode(ctx context.Context, cfg NodeConfig) (*Node, error) {
	if cfg.Proxy.NetNS != "" {
		return nil, errors.New("a node proxy takes its namespaces from ZDS: Proxy.NetNS must be empty")
	}
	cfg.Proxy = cfg.Proxy.withDefaults()
	if cfg.Proxy.OutboundPort == cfg.Proxy.InboundPort {
		return nil, fmt.Errorf("outbound and inbound port are both %d", cfg.Proxy.OutboundPort)
	}
	if cfg.ZDSPath == "" {
		cfg.ZDSPath = zds.DefaultSocketPath
	}
	if cfg.ReconnectMin <= 0 {
		cfg.ReconnectMin = DefaultReconnectMin
	}
	if cfg.ReconnectMax < cfg.ReconnectMin {
		cfg.ReconnectMax = max(DefaultReconnectMax, cfg.ReconnectMin)
	}
	rec, err := newRecorder(cfg.Proxy.RecordPath)
	if err != nil {
		return nil, err
	}
	n := &Node{
		cfg:     cfg,
		log:     cfg.Proxy.Logger.With(zap.String("zds", cfg.ZDSPath)),
		rec:     rec,
		done:    make(chan struct{}),
		pods:    map[string]*nodePod{},
		changed: make(chan struct{}),
	}
	n.ctx, n.cancel = context.WithCancel(ctx)
	go n.run()
	return n, nil
}

// Status returns the current status.
func (n *Node) Status() NodeStatus {
	n.mu.Lock()
	defer n.mu.Unlock()
	return n.statusLocked()
}

func (n *Node) statusLocked() NodeStatus {
	st := NodeStatus{Connected: n.connected, Snapshots: n.snapshots}
	for _, p := range n.pods {
		st.Pods = append(st.Pods, p.info)
	}
	slices.SortFunc(st.Pods, func(a, b PodInfo) int { return cmp.Compare(a.UID, b.UID) })
	return st
}

// WaitStatus waits until done returns true for the status and returns that
// status, or the last one with ctx's error.
func (n *Node) WaitStatus(ctx context.Context, done func(NodeStatus) bool) (NodeStatus, error) {
	for {
		n.mu.Lock()
		st, changed := n.statusLocked(), n.changed
		n.mu.Unlock()
		if done(st) {
			return st, nil
		}
		select {
		case <-ctx.Done():
			return st, fmt.Errorf("waiting for node proxy status (have %+v): %w", st, ctx.Err())
		case <-n.done:
			return st, errors.New("node proxy stopped")
		case <-changed:
		}
	}
}

// Records returns a copy of the records of every connection finished so far, of
// every pod.
func (n *Node) Records() []Record {
	return n.rec.snapshot()
}

// Close disconnects from the agent, stops every pod's listeners and connections
// and closes the record file. It is safe to call more than once.
func (n *Node) Close() error {
	n.closeOnce.Do(func() {
		n.cancel()
		<-n.done
		n.mu.Lock()
		pods := n.pods
		n.pods = map[string]*nodePod{}
		n.notifyLocked()
		n.mu.Unlock()
		var errs []error
		for uid, p := range pods {
			if err := p.proxy.Close(); err != nil {
				errs = append(errs, fmt.Errorf("pod %s: %w", uid, err))
			}
		}
		errs = append(errs, n.rec.close())
		n.closeErr = errors.Join(errs...)
	})
	return n.closeErr
}

func (n *Node) notifyLocked() {
	close(n.changed)
	n.changed = make(chan struct{})
}

func (n *Node) setConnected(v bool) {
	n.mu.Lock()
	defer n.mu.Unlock()
	n.connected = v
	n.notifyLocked()
}

// run connects, serves a session, and reconnects, until the node is closed.
func (n *Node) run() {
	defer close(n.done)
	backoff := n.cfg.ReconnectMin
	for n.ctx.Err() == nil {
		synced, err := n.connectOnce()
		if n.ctx.Err() != nil {
			return
		}
		if synced {
			// The agent was there and in sync: come back quickly.
			backoff = n.cfg.ReconnectMin
		}
		n.log.Info("no connection to the agent, retrying", zap.Duration("in", backoff), zap.Error(err))
		select {
		case <-n.ctx.Done():
			return
		case <-time.After(backoff):
		}
		backoff = min(2*backoff, n.cfg.ReconnectMax)
	}
}

// connectOnce runs one connection through the ztunnel-behaving ZDS client, so
// the node proxy takes pods exactly as ztunnel would (and refuses what ztunnel
// would refuse). synced reports whether a snapshot completed.
func (n *Node) connectOnce() (synced bool, err error) {
	c, err := ztunnel.Dial(n.ctx, n.cfg.ZDSPath)
	if err != nil {
		return false, err
	}
	defer c.Close()
	n.setConnected(true)
	defer n.setConnected(false)
	n.log.Info("connected to the agent")
	s := ztunnel.NewSession(nodeHandler{n}, ztunnel.Options{RequireServiceAccount: n.cfg.RequireServiceAccount})
	err = s.Serve(n.ctx, c)
	if err != nil {
		n.log.Warn("connection to the agent ended", zap.Error(err))
	}
	return s.Synced(), err
}

// nodeHandler is what the ZDS client does with each workload.
type nodeHandler struct{ n *Node }

func (h nodeHandler) Start(uid string, info ztunnel.WorkloadInfo, netns *os.File) error {
	return h.n.addPod(uid, info, netns)
}

func (h nodeHandler) Stop(uid string) { h.n.delPod(uid) }

func (h nodeHandler) Reconcile(keep map[string]bool) { h.n.reconcile(keep) }

// addPod starts the pod's listeners in the namespace nsFile, which it takes over.
func (n *Node) addPod(uid string, info ztunnel.WorkloadInfo, nsFile *os.File) error {
	id, err := zds.FdNetnsID(int(nsFile.Fd()))
	if err != nil {
		nsFile.Close()
		return err
	}
	n.mu.Lock()
	old := n.pods[uid]
	n.mu.Unlock()
	if old != nil {
		if old.info.Netns == id {
			nsFile.Close()
			n.log.Debug("pod already served", zap.String("pod", uid))
			return nil
		}
		// Same pod, new namespace: its sandbox was recreated.
		n.log.Info("pod has a new network namespace, replacing its listeners", zap.String("pod", uid))
		n.delPod(uid)
	}
	cfg := n.cfg.Proxy
	cfg.Logger = cfg.Logger.With(zap.String("workload", info.Namespace+"/"+info.Name), zap.String("serviceAccount", info.ServiceAccount))
	p, err := start(n.ctx, cfg, nsFile, n.rec, false, uid)
	if err != nil {
		return err
	}
	n.mu.Lock()
	defer n.mu.Unlock()
	n.pods[uid] = &nodePod{proxy: p, info: PodInfo{
		UID:            uid,
		Name:           info.Name,
		Namespace:      info.Namespace,
		ServiceAccount: info.ServiceAccount,
		Netns:          id,
		Addrs:          p.Addrs(),
	}}
	n.notifyLocked()
	return nil
}

// delPod stops a pod's listeners and connections; an unknown pod is fine.
func (n *Node) delPod(uid string) {
	n.mu.Lock()
	p := n.pods[uid]
	delete(n.pods, uid)
	n.notifyLocked()
	n.mu.Unlock()
	if p == nil {
		return
	}
	if err := p.proxy.Close(); err != nil {
		n.log.Warn("stop pod", zap.String("pod", uid), zap.Error(err))
	}
	n.log.Info("pod released", zap.String("pod", uid))
}

// reconcile drops every pod the snapshot did not name and counts the snapshot.
func (n *Node) reconcile(keep map[string]bool) {
	n.mu.Lock()
	var drop []string
	for uid := range n.pods {
		if !keep[uid] {
			drop = append(drop, uid)
		}
	}
	n.mu.Unlock()
	for _, uid := range drop {
		n.log.Info("pod not in the agent's snapshot, dropping it", zap.String("pod", uid))
		n.delPod(uid)
	}
	n.mu.Lock()
	defer n.mu.Unlock()
	n.snapshots++
	n.notifyLocked()
	n.log.Info("snapshot received", zap.Int("pods", len(n.pods)))
}
