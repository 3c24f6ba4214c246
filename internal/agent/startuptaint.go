package agent

import (
	"context"
	"time"

	"go.uber.org/zap"
	"k8s.io/apimachinery/pkg/util/wait"
)

// StartupTaint is the taint a node is registered with so that nothing is
// scheduled there before its agent is ready: pods started before the chain
// entry is written never reach the gate, and the connections they open before
// adoption enrolls them never go through the proxy. The agent removes it once
// ready (internal/nodetaint does it against the API server).
type StartupTaint interface {
	// Present reports how many taints with the key the node carries, from a
	// cheap (possibly stale) read.
	Present(ctx context.Context) (int, error)
	// Remove removes every taint with the key and reports how many the node
	// carried; fresh asks for a read past any cache. On an error after the
	// read, the count says the taints are still there.
	Remove(ctx context.Context, fresh bool) (int, error)
}

// StartupTaintConfig names the taint and the node, for the logs.
type StartupTaintConfig struct {
	Key   string
	Node  string
	Taint StartupTaint
}

// startupTaintRemover removes the startup taint whenever the agent is ready:
// first when it becomes ready, then on each check while it stays ready (a
// taint re-added by an operator or a node pool's template goes again). It
// never runs while the agent is not ready, and nothing waits for it: readiness
// and the gate do not depend on the API server.
type startupTaintRemover struct {
	cfg       StartupTaintConfig
	log       *zap.Logger
	readiness *Readiness
	metrics   *Metrics
	// interval between checks while ready.
	interval time.Duration
	// retry paces the attempts of one removal; its Steps bound them, after
	// which the next check tries again.
	retry wait.Backoff
}

func newStartupTaintRemover(log *zap.Logger, cfg StartupTaintConfig, readiness *Readiness, metrics *Metrics, interval time.Duration) *startupTaintRemover {
	return &startupTaintRemover{
		cfg: cfg, log: log.With(zap.String("taint", cfg.Key), zap.String("node", cfg.Node)),
		readiness: readiness, metrics: metrics, interval: interval,
		retry: wait.Backoff{Duration: 500 * time.Millisecond, Factor: 2, Jitter: 0.5, Steps: 6, Cap: 30 * time.Second},
	}
}

// run follows readiness until ctx ends; the metric is registered before.
func (s *startupTaintRemover) run(ctx context.Context) {
	switch n, err := s.cfg.Taint.Present(ctx); {
	case err != nil:
		s.log.Warn("cannot read the node for its startup taint; removing it once ready", zap.Error(err))
	case n > 0:
		s.log.Info("the node carries the startup taint; it is removed once the agent is ready")
	default:
		s.metrics.setStartupTaint(false)
	}
	t := time.NewTimer(0)
	defer t.Stop()
	for {
		if s.readiness.Wait(ctx) != nil {
			return
		}
		s.removeOnce(ctx)
		t.Reset(s.interval)
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
	}
}

// removeOnce removes the taint while the agent is ready, retrying a bounded
// number of times with jittered backoff (a failed attempt may be a taint
// changed concurrently, which the patch's test refuses; the next read is past
// the cache).
func (s *startupTaintRemover) removeOnce(ctx context.Context) {
	retry := s.retry
	for attempt := 0; ; attempt++ {
		if ready, _ := s.readiness.Ready(); !ready {
			return
		}
		found, err := s.cfg.Taint.Remove(ctx, attempt > 0)
		if err == nil {
			s.metrics.setStartupTaint(false)
			if found > 0 {
				s.log.Info("startup taint removed: the agent is ready, pods may be scheduled to the node", zap.Int("taints", found))
			}
			return
		}
		if found > 0 {
			s.metrics.setStartupTaint(true)
		}
		if ctx.Err() != nil {
			return
		}
		if retry.Steps <= 1 {
			s.log.Error("startup taint not removed; trying again at the next check", zap.Int("attempts", attempt+1), zap.Duration("next", s.interval), zap.Error(err))
			return
		}
		delay := retry.Step()
		s.log.Warn("startup taint not removed; retrying", zap.Int("attempt", attempt+1), zap.Duration("delay", delay), zap.Error(err))
		select {
		case <-ctx.Done():
			return
		case <-time.After(delay):
		}
	}
}
