package agent

import (
	"context"
	"errors"
	"fmt"

	"go.uber.org/zap"

	"github.com/mesh-cni/mesh-cni/internal/netns"
	"github.com/mesh-cni/mesh-cni/internal/podstore"
	"github.com/mesh-cni/mesh-cni/pkg/gate/gatepb"
)

func identityOf(rec podstore.Record) *gatepb.PodIdentity {
	return &gatepb.PodIdentity{Namespace: rec.Namespace, Name: rec.Name, Uid: rec.UID, Labels: rec.Labels, Annotations: rec.Annotations}
}

// ReevaluateResult counts what a Reevaluate pass changed.
type ReevaluateResult struct {
	// Enrolled and Released are pods whose answer changed; Updated are
	// enrolled pods whose capture changed and was applied in place.
	Enrolled, Released, Updated int
}

// Reevaluate asks the policy again about every pod the agent knows, enrolled or
// skipped, and enrolls or releases those whose answer changed: labelling a
// namespace after its pods started brings them into the mesh. An enrolled pod
// whose capture changed (its annotations, or the ports of its probes where the
// record predates them) gets it in place.
func (s *Service) Reevaluate(ctx context.Context) (ReevaluateResult, error) {
	var (
		res  ReevaluateResult
		errs []error
	)
	for _, rec := range s.store.List() {
		outcome, err := s.reevaluateOne(ctx, rec.Key)
		if err != nil {
			errs = append(errs, err)
		}
		switch outcome {
		case reevaluateEnrolled:
			res.Enrolled++
		case reevaluateReleased:
			res.Released++
		case reevaluateUpdated:
			res.Updated++
		}
	}
	return res, errors.Join(errs...)
}

type reevaluateOutcome int

const (
	reevaluateSame reevaluateOutcome = iota
	reevaluateEnrolled
	reevaluateReleased
	reevaluateUpdated
)

func (s *Service) reevaluateOne(ctx context.Context, key podstore.Key) (reevaluateOutcome, error) {
	unlock := s.locks.Lock(key.String())
	defer unlock()
	rec, ok := s.store.Get(key)
	if !ok {
		return reevaluateSame, nil
	}
	pod := identityOf(rec)
	fields := podFields(pod, key)
	decision, err := s.policy.Decide(ctx, pod)
	if err != nil {
		return reevaluateSame, fmt.Errorf("re-decide %s: %w", key, err)
	}
	switch {
	case decision.Enroll && rec.Skipped:
		rec.ServiceAccount, rec.Capture = decision.ServiceAccount, decision.Capture
		ns, err := netns.OpenExpected(rec.NetnsPath, rec.NetnsCookie)
		if err != nil {
			return reevaluateSame, fmt.Errorf("enroll %s after a policy change: %w", key, err)
		}
		defer ns.Close()
		if _, reason, err := s.enroll(ctx, rec, ns); err != nil {
			s.metrics.enrollFailed(reason)
			s.report(ctx, pod, OutcomeFailed, err)
			return reevaluateSame, fmt.Errorf("enroll %s after a policy change: %w", key, err)
		}
		s.report(ctx, pod, OutcomeEnabled, nil)
		s.log.Info("pod enrolled after a policy change", append(fields, zap.String("reason", decision.Reason))...)
		return reevaluateEnrolled, nil
	case !decision.Enroll && !rec.Skipped:
		ns, err := netns.OpenExpected(rec.NetnsPath, rec.NetnsCookie)
		if err != nil {
			return reevaluateSame, fmt.Errorf("release %s after a policy change: %w", key, err)
		}
		defer ns.Close()
		if err := s.skip(ctx, rec, ns); err != nil {
			return reevaluateSame, fmt.Errorf("release %s after a policy change: %w", key, err)
		}
		s.report(ctx, pod, OutcomeDisabled, nil)
		s.log.Info("pod released after a policy change", append(fields, zap.String("reason", decision.Reason))...)
		return reevaluateReleased, nil
	case decision.Enroll && !rec.Skipped && !rec.Capture.Equal(decision.Capture):
		// Applied in place: Enroll updates an enrolled pod's entry, and the
		// record follows once the data path has it.
		ns, err := netns.OpenExpected(rec.NetnsPath, rec.NetnsCookie)
		if err != nil {
			return reevaluateSame, fmt.Errorf("update the capture of %s: %w", key, err)
		}
		defer ns.Close()
		if _, err := s.datapath.Enroll(ctx, ns, decision.Capture); err != nil {
			return reevaluateSame, fmt.Errorf("update the capture of %s: %w", key, err)
		}
		rec.Capture = decision.Capture
		if rec.ServiceAccount == "" {
			rec.ServiceAccount = decision.ServiceAccount
		}
		if err := s.store.Put(rec); err != nil {
			return reevaluateSame, fmt.Errorf("record the capture of %s: %w", key, err)
		}
		s.log.Info("pod's capture updated", append(fields, zap.String("reason", decision.Reason))...)
		return reevaluateUpdated, nil
	case decision.Enroll && rec.ServiceAccount == "" && decision.ServiceAccount != "":
		// A record written before the agent stored service accounts: keep the
		// answer, so the node proxy's next snapshot carries it.
		rec.ServiceAccount = decision.ServiceAccount
		if err := s.store.Put(rec); err != nil {
			return reevaluateSame, fmt.Errorf("record the service account of %s: %w", key, err)
		}
	}
	return reevaluateSame, nil
}
