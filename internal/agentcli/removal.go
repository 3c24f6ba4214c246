package agentcli

import (
	"context"
	"fmt"
	"os"
	"time"

	"go.uber.org/zap"
	"k8s.io/client-go/kubernetes"

	"github.com/mesh-cni/mesh-cni/internal/removal"
)

// Environment variables naming the agent's own pod: the downward API's
// metadata.name and metadata.namespace in the DaemonSet.
const (
	EnvPodName      = "POD_NAME"
	EnvPodNamespace = "POD_NAMESPACE"
)

// Bounds of the uninstall on stop, inside the DaemonSet's
// terminationGracePeriodSeconds next to --shutdown-grace: the API server's
// answer is awaited at most removalCheckTimeout (it runs while the gate
// drains), and the uninstall itself at most removalUninstallTimeout.
const (
	removalCheckTimeout     = 3 * time.Second
	removalUninstallTimeout = 5 * time.Second
)

// removalWatcher returns the watcher of the agent's DaemonSet whose Check runs
// on SIGTERM, or nil when the agent keeps everything on every stop:
// --uninstall-on-delete=false, or no pod of its own to ask about (not run by
// Kubernetes, or the downward API's variables missing), or no client to ask
// with.
func (o options) removalWatcher(log *zap.Logger) *removal.Watcher {
	if !o.uninstallOnDelete {
		return nil
	}
	pod := removal.Pod{Name: os.Getenv(EnvPodName), Namespace: os.Getenv(EnvPodNamespace)}
	if pod.Name == "" || pod.Namespace == "" {
		log.Info("the node keeps the chain entry whenever the agent stops: --uninstall-on-delete needs $" + EnvPodName + " and $" + EnvPodNamespace + " (the downward API) to find the agent's DaemonSet")
		return nil
	}
	cfg, err := o.enroll.restConfig(log, "--uninstall-on-delete")
	if err != nil {
		log.Warn("the node keeps the chain entry whenever the agent stops: --uninstall-on-delete has no API server to ask", zap.Error(err))
		return nil
	}
	// No client timeout: it would end the watch too. The check's reads are
	// bounded by their context.
	cfg.UserAgent = "mesh-agent/" + pod.Name
	client, err := kubernetes.NewForConfig(cfg)
	if err != nil {
		log.Warn("the node keeps the chain entry whenever the agent stops: --uninstall-on-delete has no API client", zap.Error(err))
		return nil
	}
	return removal.NewWatcher(client, pod, log.Named("removal"))
}

// removeIfDaemonSetGone runs once the agent has stopped on a signal: when the
// check found its DaemonSet removed, the node is uninstalled as `mesh-agent
// uninstall` does; otherwise (a rolling update, a drain, any doubt) everything
// stays for the next agent.
func removeIfDaemonSetGone(ctx context.Context, opts options, log *zap.Logger, verdict <-chan removal.Verdict) error {
	v := <-verdict
	if !v.Uninstall {
		log.Info("agent stopped; data path, chain entry and pod records stay in place", zap.String("reason", v.Reason))
		return nil
	}
	log.Info("the agent's DaemonSet is being removed: uninstalling mesh-cni from this node", zap.String("reason", v.Reason))
	ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), removalUninstallTimeout)
	defer cancel()
	if err := uninstallNode(ctx, opts, log); err != nil {
		return fmt.Errorf("uninstall on removal: %w", err)
	}
	log.Info("mesh-cni uninstalled from this node: the chain entry is gone and running pods are released")
	return nil
}

// checkOnStop starts the check as soon as ctx ends (the signal), while the
// agent still drains its gate calls, and delivers its verdict; done ends the
// wait when the agent stops without a signal.
func checkOnStop(ctx context.Context, check func(context.Context) removal.Verdict, done <-chan struct{}) <-chan removal.Verdict {
	out := make(chan removal.Verdict, 1)
	go func() {
		select {
		case <-done:
		case <-ctx.Done():
		}
		if ctx.Err() == nil {
			out <- removal.Verdict{Reason: "the agent stopped without a signal"}
			return
		}
		cctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), removalCheckTimeout)
		defer cancel()
		out <- check(cctx)
	}()
	return out
}
