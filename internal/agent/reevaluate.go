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
		if err := s.reevaluateOne(ctx, rec.Key, &res); err != nil {
			errs = append(errs, err)
		}
	}
	return res, errors.Join(errs...)
}

// reevaluateOne asks the policy again about key's pod and counts in res what
// it changed.
func (s *Service) reevaluateOne(ctx context.Context, key podstore.Key, res *ReevaluateResult) error {
	rec, ok, unlock := s.lockRecord(key)
	defer unlock()
	if !ok {
		return nil
	}
	pod := identityOf(rec)
	fields := podFields(pod, key)
	decision, err := s.policy.Decide(ctx, pod)
	if err != nil {
		return fmt.Errorf("re-decide %s: %w", key, err)
	}
	switch {
	case decision.Enroll && rec.Skipped && leftToItsRules(rec, decision):
		// Adopted with its own sidecar's rules in place: left to them.
	case decision.Enroll && rec.Skipped:
		rec.ServiceAccount, rec.Capture = decision.ServiceAccount, decision.Capture
		ns, err := netns.OpenExpected(rec.NetnsPath, rec.NetnsCookie)
		if err != nil {
			return fmt.Errorf("enroll %s after a policy change: %w", key, err)
		}
		defer ns.Close()
		if _, reason, err := s.enroll(ctx, rec, ns); err != nil {
			s.metrics.enrollFailed(reason)
			s.report(ctx, pod, OutcomeFailed, err)
			return fmt.Errorf("enroll %s after a policy change: %w", key, err)
		}
		s.report(ctx, pod, OutcomeEnabled, nil)
		s.log.Info("pod enrolled after a policy change", append(fields, zap.String("reason", decision.Reason))...)
		res.Enrolled++
		return nil
	case !decision.Enroll && !rec.Skipped:
		ns, err := netns.OpenExpected(rec.NetnsPath, rec.NetnsCookie)
		if err != nil {
			return fmt.Errorf("release %s after a policy change: %w", key, err)
		}
		defer ns.Close()
		if err := s.skip(ctx, rec, ns); err != nil {
			return fmt.Errorf("release %s after a policy change: %w", key, err)
		}
		s.report(ctx, pod, OutcomeDisabled, nil)
		s.log.Info("pod released after a policy change", append(fields, zap.String("reason", decision.Reason))...)
		res.Released++
		return nil
	case decision.Enroll && !rec.Skipped && !rec.Capture.Equal(decision.Capture):
		// Applied in place: Enroll updates an enrolled pod's entry, and the
		// record follows once the data path has it.
		ns, err := netns.OpenExpected(rec.NetnsPath, rec.NetnsCookie)
		if err != nil {
			return fmt.Errorf("update the capture of %s: %w", key, err)
		}
		defer ns.Close()
		if _, err := s.datapath.Enroll(ctx, ns, decision.Capture); err != nil {
			return fmt.Errorf("update the capture of %s: %w", key, err)
		}
		rec.Capture = decision.Capture
		if rec.ServiceAccount == "" {
			rec.ServiceAccount = decision.ServiceAccount
		}
		if err := s.store.Put(rec); err != nil {
			return fmt.Errorf("record the capture of %s: %w", key, err)
		}
		s.log.Info("pod's capture updated", append(fields, zap.String("reason", decision.Reason))...)
		res.Updated++
		return nil
	case decision.Enroll && rec.ServiceAccount == "" && decision.ServiceAccount != "":
		// A record written before the agent stored service accounts: keep the
		// answer, so the node proxy's next snapshot carries it.
		rec.ServiceAccount = decision.ServiceAccount
		if err := s.store.Put(rec); err != nil {
			return fmt.Errorf("record the service account of %s: %w", key, err)
		}
	}
	return nil
}
