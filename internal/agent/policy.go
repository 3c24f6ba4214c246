package agent

import (
	"context"
	"time"

	"go.uber.org/zap"

	"github.com/mesh-cni/mesh-cni/internal/podstore"
	"github.com/mesh-cni/mesh-cni/pkg/gate/gatepb"
)

// Decision is the enrollment policy's answer for one pod.
type Decision struct {
	Enroll bool
	Reason string
	// ServiceAccount is the pod's Kubernetes service account when the policy
	// read the pod from the API server; empty when it cannot know it. It is
	// stored in the pod's record and handed to the node proxy over ZDS.
	ServiceAccount string
	// Capture is how this pod's redirection differs from the node's settings.
	Capture podstore.Capture
}

// ServiceAccountSource is a policy that reads each pod's service account
// (the Kubernetes source). A node proxy that derives identities from it
// (ztunnel) can only be served when the policy is one.
type ServiceAccountSource interface {
	KnowsServiceAccounts() bool
}

// Policy decides which pods join the mesh. Decide runs inside gate Add, bounded
// by the caller's deadline: when the answer cannot be known yet it returns an
// error, never a guess, and the ADD fails with it.
type Policy interface {
	Decide(ctx context.Context, pod *gatepb.PodIdentity) (Decision, error)
}

// PolicyWatcher is a policy whose answers can change after a pod started (a
// reloaded policy file, a namespace labelled later). Changed returns a channel
// closed (and replaced) on every change; the agent then re-decides every pod it
// knows.
type PolicyWatcher interface {
	Changed() <-chan struct{}
}

// CacheMissNotifier is an enrollment source that decides from a cache and
// asks its API server when the cache lacks an object: the agent counts each
// such ask (meshcni_enrollment_cache_misses_total), the cost a decision put on
// the API server.
type CacheMissNotifier interface {
	OnCacheMiss(miss func(resource string))
}

// PolicySyncer is a policy that needs to catch up before it can answer (informer
// caches): the agent is not ready until Synced.
type PolicySyncer interface {
	Synced() (bool, string)
}

// OutcomeReporter is told each decision's outcome, to record it where operators
// look (a pod annotation, an Event). Report must not block for long.
type OutcomeReporter interface {
	Report(ctx context.Context, pod *gatepb.PodIdentity, outcome string, err error)
}

// OutcomeAuditor is an OutcomeReporter whose reports others can overwrite
// (pod annotations): on every reconcile pass it is handed captured, which
// says whether the agent has the pod of a uid redirected, and rewrites what
// disagrees. captured waits for an Add or DEL of the pod in progress, so it
// never answers from a state whose outcome is still being reported.
//
// pending says which pods are the adoption's to decide, not the audit's: a
// running pod the replaced node agent handed to the node proxy (see
// Takeover), which the agent has no record of yet. Its annotations are the
// replaced agent's, and true: the node proxy serves it under the old capture.
type OutcomeAuditor interface {
	AuditOutcomes(ctx context.Context, captured, pending func(uid string) bool)
}

// Outcomes passed to OutcomeReporter: what became of a pod's enrollment. The
// Kubernetes source writes them as they are into the pod's
// mesh-cni.io/redirection annotation, so they are part of the interface
// operators read.
const (
	OutcomeEnabled  = "enabled"
	OutcomeDisabled = "disabled"
	OutcomeFailed   = "failed"
)

// report tells the policy a decision's outcome when it wants to know.
func (s *Service) report(ctx context.Context, pod *gatepb.PodIdentity, outcome string, err error) {
	if r, ok := s.policy.(OutcomeReporter); ok {
		r.Report(ctx, pod, outcome, err)
	}
}

// EnrollAll admits every pod that reaches the agent. The plugin's own
// excludeNamespaces list is then the only scope.
type EnrollAll struct{}

// Decide implements Policy.
func (EnrollAll) Decide(context.Context, *gatepb.PodIdentity) (Decision, error) {
	return Decision{
		Enroll: true,
		Reason: "every pod that reaches the agent is enrolled (no enrollment policy configured)",
	}, nil
}

// followSync keeps the enrollment-source condition up to date.
func followSync(ctx context.Context, syncer PolicySyncer, readiness *Readiness) {
	t := time.NewTicker(100 * time.Millisecond)
	defer t.Stop()
	for {
		ok, why := syncer.Synced()
		readiness.Set(CondEnrollmentSource, ok, why)
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
	}
}

// followPolicy re-decides every known pod once the source is synced (what
// changed while the agent was away: a namespace label, a pod's capture, a
// record written by an earlier build), then whenever the policy changes.
// syncer is nil for a source that is always synced.
func followPolicy(ctx context.Context, log *zap.Logger, w PolicyWatcher, syncer PolicySyncer, svc *Service) {
	if syncer != nil {
		t := time.NewTicker(100 * time.Millisecond)
		defer t.Stop()
		for ok, _ := syncer.Synced(); !ok; ok, _ = syncer.Synced() {
			select {
			case <-ctx.Done():
				return
			case <-t.C:
			}
		}
	}
	for {
		// Taken before re-deciding: a change during Reevaluate closes it.
		changed := w.Changed()
		res, err := svc.Reevaluate(ctx)
		fields := []zap.Field{zap.Int("enrolled", res.Enrolled), zap.Int("released", res.Released), zap.Int("updated", res.Updated)}
		if err != nil {
			log.Warn("policy change applied with errors", append(fields, zap.Error(err))...)
		} else if res.Enrolled+res.Released+res.Updated > 0 {
			log.Info("policy change applied", fields...)
		}
		select {
		case <-ctx.Done():
			return
		case <-changed:
		}
	}
}
