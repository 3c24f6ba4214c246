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

// Reevaluate asks the policy again about every pod the agent knows, enrolled or
// skipped, and enrolls or releases those whose answer changed: labelling a
// namespace after its pods started brings them into the mesh.
func (s *Service) Reevaluate(ctx context.Context) (enrolled, released int, err error) {
	var errs []error
	for _, rec := range s.store.List() {
		changed, enroll, err := s.reevaluateOne(ctx, rec.Key)
		if err != nil {
			errs = append(errs, err)
		}
		if changed && enroll {
			enrolled++
		} else if changed {
			released++
		}
	}
	return enrolled, released, errors.Join(errs...)
}

func (s *Service) reevaluateOne(ctx context.Context, key podstore.Key) (changed, enroll bool, err error) {
	unlock := s.locks.Lock(key.String())
	defer unlock()
	rec, ok := s.store.Get(key)
	if !ok {
		return false, false, nil
	}
	pod := identityOf(rec)
	fields := podFields(pod, key)
	decision, err := s.policy.Decide(ctx, pod)
	if err != nil {
		return false, false, fmt.Errorf("re-decide %s: %w", key, err)
	}
	switch {
	case decision.Enroll && rec.Skipped:
		rec.ServiceAccount, rec.Capture = decision.ServiceAccount, decision.Capture
		ns, err := netns.OpenExpected(rec.NetnsPath, rec.NetnsCookie)
		if err != nil {
			return false, false, fmt.Errorf("enroll %s after a policy change: %w", key, err)
		}
		defer ns.Close()
		if _, reason, err := s.enroll(ctx, rec, ns); err != nil {
			s.metrics.enrollFailed(reason)
			s.report(ctx, pod, OutcomeFailed, err)
			return false, true, fmt.Errorf("enroll %s after a policy change: %w", key, err)
		}
		s.report(ctx, pod, OutcomeEnabled, nil)
		s.log.Info("pod enrolled after a policy change", append(fields, zap.String("reason", decision.Reason))...)
		return true, true, nil
	case !decision.Enroll && !rec.Skipped:
		ns, err := netns.OpenExpected(rec.NetnsPath, rec.NetnsCookie)
		if err != nil {
			return false, false, fmt.Errorf("release %s after a policy change: %w", key, err)
		}
		defer ns.Close()
		if err := s.skip(ctx, rec, ns); err != nil {
			return false, false, fmt.Errorf("release %s after a policy change: %w", key, err)
		}
		s.report(ctx, pod, OutcomeDisabled, nil)
		s.log.Info("pod released after a policy change", append(fields, zap.String("reason", decision.Reason))...)
		return true, false, nil
	case decision.Enroll && rec.ServiceAccount == "" && decision.ServiceAccount != "":
		// A record written before the agent stored service accounts: keep the
		// answer, so the node proxy's next snapshot carries it.
		rec.ServiceAccount = decision.ServiceAccount
		if err := s.store.Put(rec); err != nil {
			return false, true, fmt.Errorf("record the service account of %s: %w", key, err)
		}
	}
	return false, decision.Enroll, nil
}
