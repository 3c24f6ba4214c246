package agent

import (
	"context"
	"errors"
	"fmt"
	"time"

	"go.uber.org/zap"

	"github.com/mesh-cni/mesh-cni/pkg/podstore"
)

// Readiness conditions. Each must hold before the gate admits a pod.
const (
	CondDatapath = "datapath"
)

// Config is what Run needs; the command line fills it.
type Config struct {
	SocketPath  string
	StateDir    string
	AllowedUIDs []int
	// OpenDatapath loads or adopts the data path. Its closer must leave the
	// data path in place (pinned): a stopping agent never removes redirection.
	OpenDatapath func(ctx context.Context) (Datapath, func() error, error)
	Policy       Policy
	// ShutdownGrace bounds how long in-flight calls may run after a stop.
	ShutdownGrace time.Duration
}

// Run runs the agent until ctx is cancelled. The gate socket is served first, so
// pods arriving during start-up wait at the gate instead of failing; they are
// admitted once every readiness condition holds.
func Run(ctx context.Context, log *zap.Logger, cfg Config) (err error) {
	store, problems, err := podstore.Open(cfg.StateDir)
	if err != nil {
		return err
	}
	for _, p := range problems {
		log.Warn("pod state problem repaired at start", zap.Error(p))
	}
	readiness := NewReadiness(CondDatapath)
	policy := cfg.Policy
	if policy == nil {
		policy = EnrollAll{}
	}
	lazy := &lazyDatapath{}
	svc := NewService(log, readiness, policy, lazy, store)
	srv, err := NewGateServer(ctx, log, cfg.SocketPath, cfg.AllowedUIDs, svc, readiness)
	if err != nil {
		return err
	}
	serveErr := make(chan error, 1)
	go func() { serveErr <- srv.Serve() }()
	grace := cfg.ShutdownGrace
	if grace == 0 {
		grace = 5 * time.Second
	}
	defer func() {
		srv.Stop(grace)
		if e := <-serveErr; e != nil {
			err = errors.Join(err, e)
		}
	}()

	dp, closeDatapath, err := cfg.OpenDatapath(ctx)
	if err != nil {
		return fmt.Errorf("open data path: %w", err)
	}
	defer func() {
		if e := closeDatapath(); e != nil {
			err = errors.Join(err, fmt.Errorf("close data path: %w", e))
		}
	}()
	lazy.set(dp)
	readiness.Set(CondDatapath, true, "")
	log.Info("agent ready", zap.Int("enrolledPods", store.Len()))

	select {
	case <-ctx.Done():
		log.Info("agent stopping; data path and pod records stay in place")
		return nil
	case e := <-serveErr:
		serveErr <- e
		return e
	}
}
