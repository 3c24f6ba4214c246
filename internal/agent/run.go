package agent

import (
	"context"
	"errors"
	"fmt"
	"os"
	"slices"
	"sync"
	"time"

	"go.uber.org/zap"
	"k8s.io/apimachinery/pkg/util/wait"

	"github.com/mesh-cni/mesh-cni/internal/podstore"
	"github.com/mesh-cni/mesh-cni/pkg/gate/gatepb"
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
	// InstallCNIConfig, when set, runs for the agent's whole life; the agent is
	// not ready while it reports the entry missing.
	InstallCNIConfig CNIConfigInstaller
	// ReconcileInterval is the period of the reconcile pass after the first one
	// at start; zero means the default of 30s.
	ReconcileInterval time.Duration
	// ShutdownGrace bounds how long in-flight calls may run after a stop.
	ShutdownGrace time.Duration
	// MetricsAddr serves /metrics, /healthz and /readyz; empty turns it off.
	MetricsAddr string
	// DatapathName is shown by status ("ebpf", "none").
	DatapathName string
	// ZDSSocket serves the ZDS proxy handoff there; empty turns it off.
	ZDSSocket string
	// ZDSAllowedUIDs may connect as node proxies (each is handed every pod's
	// network namespace); empty means root only.
	ZDSAllowedUIDs []int
	// ZDSWait says when Add waits for the node proxy's ack.
	ZDSWait WaitMode
	// EntryPoints are the other ways pods reach the gate in process (the KNI
	// interposer; the containerd hook is a process of its own on the gate
	// socket). Each starts once the gate is serving and stops with it.
	EntryPoints []EntryPoint
	// Adopt, when set and the policy can list the node's running pods,
	// enrolls the pods that were running before the agent was installed
	// (Service.Adopt): once the agent is ready, then on every reconcile
	// interval.
	Adopt *AdoptConfig
	// StartupTaint, when set, is removed from the node once the agent is
	// ready, and again whenever a check finds it while ready.
	StartupTaint *StartupTaintConfig
}

// AdoptConfig configures adopting running pods.
type AdoptConfig struct {
	Find SandboxFinder
	// ExcludeNamespaces are the namespaces whose pods never reach the gate:
	// they are not adopted either.
	ExcludeNamespaces []string
	// Takeover, when set, is the node agent this one replaces on a running
	// node (istio-cni under the istio profile).
	Takeover *Takeover
}

// Takeover is what the agent needs to know of the node agent it replaces on
// a running node, whose pods it adopts.
type Takeover struct {
	// HandedOver reports whether the replaced agent captured the pod and
	// handed it to the node proxy. The first snapshot a proxy gets lists each
	// such running pod the agent has not adopted yet as one to keep, so the
	// proxy goes on serving it until the adoption hands it over again.
	HandedOver func(pod *gatepb.PodIdentity) bool
	// Remove removes the replaced agent's capture from such a pod's network
	// namespace, once the agent has captured the pod and handed it over; it
	// says what it removed, and whether something is left that it will
	// remove when called again (what connections made before the switch
	// still need): it is then called again on each adoption pass while the
	// pod is enrolled. Its failure is logged: the pod stays captured.
	Remove func(ns *os.File) (removed string, again bool, err error)
}

// EntryPoint starts a server that admits pods through gate; the returned func
// stops it.
type EntryPoint func(ctx context.Context, gate gatepb.GateServer, ready func() (bool, string)) (stop func(), err error)

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
	policy := cfg.Policy
	if policy == nil {
		policy = EnrollAll{}
	}
	conds := []string{CondDatapath, CondReconcile}
	if cfg.InstallCNIConfig != nil {
		conds = append(conds, CondCNIConfig)
	}
	syncer, needsSync := policy.(PolicySyncer)
	if needsSync {
		conds = append(conds, CondEnrollmentSource)
	}
	readiness := NewReadiness(conds...)
	lazy := &lazyDatapath{}
	svc := NewService(log, readiness, policy, lazy, store)
	svc.datapathName = cfg.DatapathName
	if cfg.Adopt != nil && cfg.Adopt.Takeover != nil {
		if lister, ok := policy.(RunningPodLister); ok {
			svc.takeover = cfg.Adopt.Takeover
			svc.handedOver = handedOver(lister, *cfg.Adopt, svc)
		}
	}
	metrics := NewMetrics(func() int { return len(svc.enrolled()) }, func() bool { ok, _ := readiness.Ready(); return ok }, func() CounterReader {
		dp, err := lazy.get()
		if err != nil {
			return nil
		}
		r, _ := dp.(CounterReader)
		return r
	})
	svc.metrics = metrics
	if n, ok := policy.(CacheMissNotifier); ok {
		n.OnCacheMiss(metrics.CacheMiss)
	}
	if cfg.MetricsAddr != "" {
		stopHTTP, err := serveHTTP(ctx, log, cfg.MetricsAddr, metrics, readiness)
		if err != nil {
			return err
		}
		defer stopHTTP()
	}
	srv, err := NewGateServer(ctx, log, cfg.SocketPath, cfg.AllowedUIDs, svc, readiness, metrics)
	if err != nil {
		return err
	}
	serveErr := make(chan error, 1)
	go func() { serveErr <- srv.Serve() }()
	for _, start := range cfg.EntryPoints {
		stop, err := start(ctx, svc, readiness.Ready)
		if err != nil {
			srv.Stop(0)
			<-serveErr
			return err
		}
		defer stop()
	}
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

	// The proxy handoff starts only now: its first snapshot must list every pod
	// the records and the data path agree on, or a connected proxy would drop
	// them. It is in place before the agent is ready, so no Add skips it.
	if cfg.ZDSSocket != "" {
		// The node proxy is told apart from the pods by its cgroup, learned
		// from its connection before it is handed any pod.
		var proxies func([]int32) error
		if pi, ok := dp.(ProxyIdentifier); ok {
			proxies = pi.SetProxyProcesses
		}
		var keep func(context.Context) []string
		if svc.handedOver != nil {
			keep = svc.waitHandedOver
		}
		h, err := NewZDSHandoff(ctx, log.Named("zds"), cfg.ZDSSocket, cfg.ZDSAllowedUIDs, cfg.ZDSWait, cfg.StateDir, svc.enrolled, keep, metrics, proxies)
		if err != nil {
			return err
		}
		svc.handoff = h
		background.Add(1)
		go func() {
			defer background.Done()
			if err := h.Serve(bgCtx); err != nil && bgCtx.Err() == nil {
				log.Error("zds server stopped", zap.Error(err))
			}
		}()
		defer h.Close()
	}
	readiness.Set(CondReconcile, true, "")

	installErr := make(chan error, 1)
	if cfg.InstallCNIConfig != nil {
		background.Add(1)
		go func() {
			defer background.Done()
			installErr <- cfg.InstallCNIConfig(bgCtx, func(st CNIStatus) {
				svc.setCNIStatus(st)
				readiness.Set(CondCNIConfig, st.InPlace, st.Reason)
			})
		}()
	}
	if needsSync {
		background.Add(1)
		go func() {
			defer background.Done()
			followSync(bgCtx, syncer, readiness)
		}()
	}
	if w, ok := policy.(PolicyWatcher); ok {
		var ws PolicySyncer
		if needsSync {
			ws = syncer
		}
		background.Add(1)
		go func() {
			defer background.Done()
			followPolicy(bgCtx, log, w, ws, svc)
		}()
	}
	interval := cfg.ReconcileInterval
	if interval <= 0 {
		interval = 30 * time.Second
	}
	background.Add(1)
	go func() {
		defer background.Done()
		// The first pass is an interval after the start's own reconcile;
		// the condition never holds, so only the agent's stop ends it.
		_ = wait.PollUntilContextCancel(bgCtx, interval, false, func(ctx context.Context) (bool, error) {
			res, err := svc.Reconcile(ctx)
			logReconcile(log, "periodic", res, err)
			return false, nil
		})
	}()

	go func() {
		if readiness.Wait(bgCtx) == nil {
			log.Info("agent ready", zap.Int("enrolledPods", len(svc.enrolled())))
		}
	}()
	if cfg.StartupTaint != nil {
		metrics.trackStartupTaint()
		remover := newStartupTaintRemover(log.Named("startup-taint"), *cfg.StartupTaint, readiness, metrics, interval)
		background.Add(1)
		go func() {
			defer background.Done()
			remover.run(bgCtx)
		}()
	}
	if cfg.Adopt != nil {
		if lister, ok := policy.(RunningPodLister); ok {
			background.Add(1)
			go func() {
				defer background.Done()
				adoptLoop(bgCtx, log, svc, lister, *cfg.Adopt, readiness, interval)
			}()
		} else {
			log.Info("pods running before the agent started are not adopted: the enrollment source cannot list the node's pods")
		}
	}
	select {
	case <-ctx.Done():
		log.Info("agent stopping")
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

// adoptLoop adopts running pods once the agent is ready, and again every
// interval: a pod the host could not place yet is tried again.
func adoptLoop(ctx context.Context, log *zap.Logger, svc *Service, lister RunningPodLister, cfg AdoptConfig, readiness *Readiness, interval time.Duration) {
	if readiness.Wait(ctx) != nil {
		return
	}
	t := time.NewTicker(interval)
	defer t.Stop()
	for {
		pods, err := lister.RunningPods()
		if err != nil {
			log.Debug("running pods not listed; adopting them later", zap.Error(err))
		} else {
			res, err := svc.Adopt(ctx, pods, cfg.Find, cfg.ExcludeNamespaces)
			if res != (AdoptResult{}) {
				log.Info("running pods adopted", zap.Int("enrolled", res.Enrolled), zap.Int("skipped", res.Skipped), zap.Int("failed", res.Failed))
			}
			if err != nil {
				log.Debug("adopting running pods", zap.Error(err))
			}
		}
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
	}
}

// handedOver lists the uids of the running pods the replaced node agent
// handed to the node proxy and this one has no record of yet: the adoption's
// to decide. It fails while the enrollment source cannot list them.
func handedOver(lister RunningPodLister, cfg AdoptConfig, svc *Service) func() ([]string, error) {
	return func() ([]string, error) {
		pods, err := lister.RunningPods()
		if err != nil {
			return nil, err
		}
		var uids []string
		for _, p := range pods {
			if slices.Contains(cfg.ExcludeNamespaces, p.Pod.GetNamespace()) || !cfg.Takeover.HandedOver(p.Pod) || svc.knownUID(p.Pod.GetUid()) {
				continue
			}
			uids = append(uids, p.Pod.GetUid())
		}
		return uids, nil
	}
}

// waitHandedOver is handedOver once the enrollment source can list the pods:
// until then a proxy's snapshot waits, and the proxy keeps serving what it
// has. It is nil when ctx ends first.
func (s *Service) waitHandedOver(ctx context.Context) []string {
	var uids []string
	err := wait.PollUntilContextCancel(ctx, 100*time.Millisecond, true, func(context.Context) (bool, error) {
		var err error
		uids, err = s.handedOver()
		return err == nil, nil
	})
	if err != nil {
		return nil
	}
	return uids
}
