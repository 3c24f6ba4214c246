package agent

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"time"

	"go.uber.org/zap"
	"k8s.io/apimachinery/pkg/util/wait"

	"github.com/mesh-cni/mesh-cni/internal/netns"
	"github.com/mesh-cni/mesh-cni/internal/podstore"
	"github.com/mesh-cni/mesh-cni/pkg/zds"
)

// Handoff tells a node proxy about enrolled pods (the ZDS protocol ztunnel
// speaks), so it can open its listeners inside each pod's namespace.
type Handoff interface {
	// PodAdded is called after the pod is enrolled and recorded, with its
	// namespace as the request opened it. When it returns an error the pod is
	// not admitted.
	PodAdded(ctx context.Context, rec podstore.Record, ns *netns.Handle) error
	// PodDeleted is called after the pod's record is gone; it never fails the
	// caller.
	PodDeleted(ctx context.Context, rec podstore.Record)
}

// ProxyWaiter is a Handoff that can wait for a node proxy: connected, told
// apart from the pods (its cgroup) and past its snapshot.
type ProxyWaiter interface {
	WaitForProxy(ctx context.Context) error
}

// WaitMode says when gate Add waits for the node proxy's ack.
type WaitMode string

const (
	// WaitAuto waits once a proxy has ever connected to this node's agent (the
	// fact is remembered across agent restarts): a mesh that runs a node proxy
	// never starts a pod before its listeners exist, and a node without one is
	// not blocked.
	WaitAuto WaitMode = "auto"
	// WaitAlways waits for a proxy on every Add.
	WaitAlways WaitMode = "always"
	// WaitNever hands pods over without waiting.
	WaitNever WaitMode = "never"
)

// ZDSHandoff serves the ZDS socket and hands pods over.
type ZDSHandoff struct {
	log      *zap.Logger
	srv      *zds.Server
	mode     WaitMode
	seenFile string
	metrics  *Metrics
}

// proxySeenFile records that a node proxy has connected, for WaitAuto.
const proxySeenFile = "zds-proxy-seen"

// NewZDSHandoff creates the ZDS server; enrolled lists the enrolled pods, keep
// (when not nil) the uids of pods a proxy connecting is to keep serving
// though they are not enrolled yet (see Takeover). It does not serve until
// Serve.
// proxies, when not nil, is told the process ids of the connected node proxies.
func NewZDSHandoff(ctx context.Context, log *zap.Logger, socketPath string, allowedUIDs []int, mode WaitMode, stateDir string, enrolled func() []podstore.Record, keep func(context.Context) []string, metrics *Metrics, proxies func([]int32) error) (*ZDSHandoff, error) {
	switch mode {
	case WaitAuto, WaitAlways, WaitNever:
	default:
		return nil, fmt.Errorf("zds wait mode %q: want auto, always or never", mode)
	}
	h := &ZDSHandoff{log: log, mode: mode, seenFile: filepath.Join(stateDir, proxySeenFile), metrics: metrics}
	srv, err := zds.NewServer(ctx, zds.Config{
		SocketPath:     socketPath,
		AllowedUIDs:    allowedUIDs,
		Logger:         log,
		ProxiesChanged: proxies,
		Snapshot: zds.SnapshotFunc(func(ctx context.Context) ([]zds.Pod, error) {
			h.markSeen()
			var kept []string
			if keep != nil {
				kept = keep(ctx) // first: it may wait, and the records are read after it
			}
			pods := zdsPods(enrolled())
			for _, uid := range kept {
				if !slices.ContainsFunc(pods, func(p zds.Pod) bool { return p.UID == uid }) {
					pods = append(pods, zds.Pod{UID: uid, Keep: true})
				}
			}
			return pods, nil
		}),
	})
	if err != nil {
		return nil, err
	}
	h.srv = srv
	return h, nil
}

// zdsPods turns records into the proxy's view: one workload per pod uid.
func zdsPods(recs []podstore.Record) []zds.Pod {
	seen := map[string]bool{}
	var out []zds.Pod
	for _, r := range recs {
		if !forNodeProxy(r) || seen[r.UID] {
			continue
		}
		seen[r.UID] = true
		out = append(out, zdsPod(r))
	}
	return out
}

// forNodeProxy reports whether the node proxy serves the pod: ZDS names
// workloads by pod uid, and a pod captured for its own sidecar is its
// sidecar's.
func forNodeProxy(r podstore.Record) bool {
	return r.UID != "" && r.Capture.Sidecar == nil
}

func zdsPod(r podstore.Record) zds.Pod {
	return zds.Pod{UID: r.UID, Name: r.Name, Namespace: r.Namespace, ServiceAccount: r.ServiceAccount, NetnsPath: r.NetnsPath, NetnsCookie: r.NetnsCookie}
}

func (h *ZDSHandoff) markSeen() {
	if _, err := os.Stat(h.seenFile); err == nil {
		return
	}
	if err := os.WriteFile(h.seenFile, []byte(time.Now().UTC().Format(time.RFC3339)+"\n"), 0o600); err != nil {
		h.log.Warn("cannot remember that a node proxy connected", zap.Error(err))
	}
}

func (h *ZDSHandoff) shouldWait() bool {
	switch h.mode {
	case WaitAlways:
		return true
	case WaitNever:
		return false
	}
	if h.srv.EverConnected() {
		return true
	}
	_, err := os.Stat(h.seenFile)
	return err == nil
}

// Serve serves proxies until ctx ends.
func (h *ZDSHandoff) Serve(ctx context.Context) error {
	if h.metrics != nil {
		go wait.UntilWithContext(ctx, func(context.Context) {
			h.metrics.ZDSConnections.Set(float64(h.srv.Connected()))
		}, time.Second)
	}
	return h.srv.Serve(ctx)
}

// WaitForProxy implements ProxyWaiter.
func (h *ZDSHandoff) WaitForProxy(ctx context.Context) error { return h.srv.WaitForProxy(ctx) }

// Close stops serving and removes the socket.
func (h *ZDSHandoff) Close() error { return h.srv.Close() }

// PodAdded implements Handoff.
func (h *ZDSHandoff) PodAdded(ctx context.Context, rec podstore.Record, ns *netns.Handle) error {
	if !forNodeProxy(rec) {
		return nil
	}
	pod := zdsPod(rec)
	pod.Netns = ns.File
	waitCtx, cancel := withAnswerMargin(ctx)
	defer cancel()
	var err error
	if h.shouldWait() {
		err = h.srv.AddPodWait(waitCtx, pod)
	} else {
		err = h.srv.AddPod(waitCtx, pod)
		if errors.Is(err, zds.ErrNoProxy) {
			return nil // the proxy gets the pod in its snapshot when it connects
		}
	}
	h.countAck(err)
	if err != nil {
		return fmt.Errorf("node proxy did not take pod %s/%s over ZDS: %w", rec.Namespace, rec.Name, err)
	}
	return nil
}

// maxAnswerMargin bounds what PodAdded keeps back from the caller's deadline.
const maxAnswerMargin = time.Second

// withAnswerMargin ends the wait for the node proxy a little before the
// caller's deadline (a fifth of the time left, at most maxAnswerMargin): a pod
// the proxy did not take must still be released and the caller told why while
// it listens. Waiting to the deadline itself leaves the caller a bare
// "deadline exceeded" and the release no time to run.
func withAnswerMargin(ctx context.Context) (context.Context, context.CancelFunc) {
	deadline, ok := ctx.Deadline()
	if !ok {
		return context.WithCancel(ctx)
	}
	margin := min(time.Until(deadline)/5, maxAnswerMargin)
	return context.WithDeadline(ctx, deadline.Add(-margin))
}

// PodDeleted implements Handoff.
func (h *ZDSHandoff) PodDeleted(ctx context.Context, rec podstore.Record) {
	if !forNodeProxy(rec) {
		return
	}
	err := h.srv.DelPod(ctx, rec.UID)
	h.countAck(err)
	if err != nil {
		h.log.Warn("node proxy did not ack a pod's removal", zap.String("pod", rec.Namespace+"/"+rec.Name), zap.Error(err))
	}
}

func (h *ZDSHandoff) countAck(err error) {
	if h.metrics == nil {
		return
	}
	result := "ok"
	if err != nil {
		result = "error"
	}
	h.metrics.ZDSAcks.WithLabelValues(result).Inc()
}
