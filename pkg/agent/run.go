package agent

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"time"

	"go.uber.org/zap"

	"github.com/mesh-cni/mesh-cni/pkg/podstore"
)

// Readiness conditions. Each must hold before the gate admits a pod.
const (
	CondDatapath  = "datapath"
	CondReconcile = "reconcile"
	CondCNIConfig = "cni-config"
)

// CNIConfigInstaller installs the chain entry and keeps it in place until ctx
// ends, reporting through report whether the entry is in place.
type CNIConfigInstaller func(ctx context.Context, report func(ready bool, reason string)) error

// Config is what Run needs; the command line fills it.
type Config struct {
	SocketPath  string
	StateDir    string
	AllowedUIDs []int
	// OpenDatapath loads or adopts the data path. Its closer must leave the
	// data path in place (pinned): a stopping agent never removes redirection.
	OpenDatapath func(ctx context.Context) (Datapath, func() error, error)
	Policy       Policy
	// InstallCNIConfig, when set, runs for the agent's whole life; the agent is
	// not ready while it reports the entry missing.
	InstallCNIConfig CNIConfigInstaller
	// ReconcileInterval is the period of the reconcile pass after the first one
	// at start; zero means the default of 30s.
	ReconcileInterval time.Duration
	// ShutdownGrace bounds how long in-flight calls may run after a stop.
	ShutdownGrace time.Duration
}

// Run runs the agent until ctx is cancelled. The gate socket is served first, so
// pods arriving during start-up wait at the gate instead of failing. Then, in
// order: the data path is loaded or adopted, records are reconciled against it
// and the live namespaces, the chain entry is installed; once all hold the agent
// is ready and waiting pods are admitted.
func Run(ctx context.Context, log *zap.Logger, cfg Config) (err error) {
	store, problems, err := podstore.Open(cfg.StateDir)
	if err != nil {
		return err
	}
	for _, p := range problems {
		log.Warn("pod state problem repaired at start", zap.Error(p))
	}
	conds := []string{CondDatapath, CondReconcile}
	if cfg.InstallCNIConfig != nil {
		conds = append(conds, CondCNIConfig)
	}
	readiness := NewReadiness(conds...)
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
	var background sync.WaitGroup
	bgCtx, stopBackground := context.WithCancel(ctx)
	defer func() {
		stopBackground()
		srv.Stop(grace)
		background.Wait()
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

	res, rerr := svc.Reconcile(ctx)
	logReconcile(log, "start", res, rerr)
	readiness.Set(CondReconcile, true, "")

	installErr := make(chan error, 1)
	if cfg.InstallCNIConfig != nil {
		background.Add(1)
		go func() {
			defer background.Done()
			installErr <- cfg.InstallCNIConfig(bgCtx, func(ready bool, reason string) {
				readiness.Set(CondCNIConfig, ready, reason)
			})
		}()
	}
	interval := cfg.ReconcileInterval
	if interval == 0 {
		interval = 30 * time.Second
	}
	background.Add(1)
	go func() {
		defer background.Done()
		t := time.NewTicker(interval)
		defer t.Stop()
		for {
			select {
			case <-bgCtx.Done():
				return
			case <-t.C:
				res, err := svc.Reconcile(bgCtx)
				logReconcile(log, "periodic", res, err)
			}
		}
	}()

	go func() {
		if readiness.Wait(bgCtx) == nil {
			log.Info("agent ready", zap.Int("enrolledPods", store.Len()))
		}
	}()
	select {
	case <-ctx.Done():
		log.Info("agent stopping; data path, chain entry and pod records stay in place")
		return nil
	case e := <-installErr:
		if ctx.Err() != nil {
			return nil
		}
		if e == nil {
			e = errors.New("stopped unexpectedly")
		}
		return fmt.Errorf("cni config installer: %w", e)
	case e := <-serveErr:
		serveErr <- e
		return e
	}
}

func logReconcile(log *zap.Logger, when string, res ReconcileResult, err error) {
	fields := []zap.Field{zap.String("pass", when), zap.Int("released", res.Released), zap.Int("repaired", res.Repaired),
		zap.Int("orphans", res.Orphans), zap.Int("kept", res.Kept)}
	if err != nil {
		log.Warn("reconcile finished with errors", append(fields, zap.Error(err))...)
		return
	}
	if res.Released+res.Repaired+res.Orphans > 0 || when == "start" {
		log.Info("reconcile", fields...)
	}
}
