package agent

import (
	"context"
	"errors"
	"fmt"
	"slices"

	"go.uber.org/zap"

	"github.com/mesh-cni/mesh-cni/internal/netns"
	"github.com/mesh-cni/mesh-cni/internal/podstore"
	"github.com/mesh-cni/mesh-cni/internal/redirect"
)

// ReconcileResult counts what one reconcile pass did.
type ReconcileResult struct {
	// Released: pods whose network namespace is gone (deleted without DEL).
	Released int
	// Repaired: pods whose redirection was broken and was put back.
	Repaired int
	// Orphans: data path entries no record claims, removed.
	Orphans int
	// Kept: pods found intact.
	Kept int
}

// Reconcile makes the data path match the records and the live namespaces: the
// records say which pods the agent enrolled, the data path what is redirected,
// and the namespaces which pods still exist. It holds each pod's lock while it
// looks at that pod, so it never races an ADD or DEL for it.
func (s *Service) Reconcile(ctx context.Context) (ReconcileResult, error) {
	var res ReconcileResult
	var errs []error
	claimed := map[uint64]bool{}
	for _, rec := range s.store.List() {
		outcome, err := s.reconcileOne(ctx, rec.Key)
		if err != nil {
			errs = append(errs, err)
		}
		switch outcome {
		case outcomeReleased:
			res.Released++
		case outcomeRepaired:
			res.Repaired++
			claimed[rec.NetnsCookie] = true
		case outcomeKept:
			res.Kept++
			if !rec.Skipped {
				claimed[rec.NetnsCookie] = true
			}
		}
	}
	cookies, err := s.datapath.Enrolled(ctx)
	if err != nil {
		errs = append(errs, err)
	}
	for _, c := range cookies {
		if claimed[c] {
			continue
		}
		released, err := s.releaseOrphan(ctx, c)
		if err != nil {
			errs = append(errs, fmt.Errorf("release orphan netns cookie %d: %w", c, err))
			continue
		}
		if released {
			res.Orphans++
			s.log.Info("orphan redirection released", zap.Uint64("netnsCookie", c))
		}
	}
	s.reportRefusals(ctx)
	if a, ok := s.policy.(OutcomeAuditor); ok {
		a.AuditOutcomes(ctx, s.captured, s.pendingTakeover())
	}
	s.metrics.reconciled(res)
	return res, errors.Join(errs...)
}

// RefusalReader is a data path that reports proxy listeners it could not capture.
type RefusalReader interface {
	Refusals() ([]redirect.Refusal, error)
}

// ListenerRecollector is a data path that can try again to collect a pod's
// proxy listeners it refused (every slot taken), once there may be room.
type ListenerRecollector interface {
	Recollect(ctx context.Context, netnsPath string) error
}

// reportRefusals logs each proxy listener the data path could not capture once,
// and again when it is refused again, naming the pod: its inbound connections fail
// closed until the proxy listens with plain TCP. Pods with a refusal have their
// listeners collected again first: a listener refused while every slot was taken
// is captured once one is free.
func (s *Service) reportRefusals(ctx context.Context) {
	r, ok := s.datapath.(RefusalReader)
	if !ok {
		return
	}
	refusals, err := r.Refusals()
	if err != nil {
		s.log.Warn("read refused proxy listeners", zap.Error(err))
		return
	}
	byCookie := map[uint64]podstore.Record{}
	for _, rec := range s.store.List() {
		byCookie[rec.NetnsCookie] = rec
	}
	if rc, ok := s.datapath.(ListenerRecollector); ok && len(refusals) > 0 {
		for _, ref := range refusals {
			if rec, ok := byCookie[ref.Cookie]; ok && !rec.Skipped {
				if err := rc.Recollect(ctx, rec.NetnsPath); err != nil {
					s.log.Debug("recollect proxy listeners", zap.String("pod", rec.Namespace+"/"+rec.Name), zap.Error(err))
				}
			}
		}
		if refusals, err = r.Refusals(); err != nil {
			s.log.Warn("read refused proxy listeners", zap.Error(err))
			return
		}
	}
	s.refusalsMu.Lock()
	defer s.refusalsMu.Unlock()
	if s.refusals == nil {
		s.refusals = map[redirect.Refusal]bool{}
	}
	for _, ref := range refusals {
		if s.refusals[ref] {
			continue
		}
		s.refusals[ref] = true
		fields := []zap.Field{zap.Uint64("netnsCookie", ref.Cookie), zap.Uint16("port", ref.Port),
			zap.String("family", ref.Family), zap.String("reason", ref.Reason), zap.Uint32("times", ref.Count)}
		if rec, ok := byCookie[ref.Cookie]; ok {
			fields = append(fields, zap.String("pod", rec.Namespace+"/"+rec.Name), zap.String("podUID", rec.UID))
		}
		s.log.Warn("proxy listener not captured: the pod's inbound connections fail closed (an MPTCP listener? the proxy must listen with plain TCP)", fields...)
	}
}

// pendingTakeover reports the running pods the replaced node agent handed
// over that the agent has not adopted yet; with no takeover, or while they
// cannot be listed, none.
func (s *Service) pendingTakeover() func(uid string) bool {
	var uids []string
	if s.handedOver != nil {
		uids, _ = s.handedOver()
	}
	return func(uid string) bool { return slices.Contains(uids, uid) }
}

// captured reports whether a record of the pod with this uid has its traffic
// redirected. Each record is read under its key's lock: an Add holds it until
// it has reported its outcome, so a record is never taken for the truth before
// its outcome was reported (the node proxy's ack comes first).
func (s *Service) captured(uid string) bool {
	if uid == "" {
		return false
	}
	for _, r := range s.store.List() {
		if r.UID != uid {
			continue
		}
		cur, ok, unlock := s.lockRecord(r.Key)
		unlock()
		if ok && cur.UID == uid && !cur.Skipped {
			return true
		}
	}
	return false
}

// releaseOrphan releases cookie's redirection unless a record claims it. An Add
// puts redirection in place before it writes the record; holding enrolling for
// writing waits out any Add in between, so its enrollment is never taken for
// an orphan (the pod would start unredirected).
func (s *Service) releaseOrphan(ctx context.Context, cookie uint64) (bool, error) {
	s.enrolling.Lock()
	defer s.enrolling.Unlock()
	if s.cookieClaimed(cookie) {
		return false, nil
	}
	return true, s.datapath.Release(ctx, cookie, "")
}

// lockRecord locks key and reads its record, there or not; unlock when done.
// Passes over the records read each again under its lock: an Add or a Del may
// have changed it since the list.
func (s *Service) lockRecord(key podstore.Key) (rec podstore.Record, ok bool, unlock func()) {
	unlock = s.locks.Lock(key.String())
	rec, ok = s.store.Get(key)
	return rec, ok, unlock
}

// cookieClaimed reports whether a record (possibly written since the pass began)
// holds cookie.
func (s *Service) cookieClaimed(cookie uint64) bool {
	return slices.ContainsFunc(s.store.List(), func(r podstore.Record) bool { return !r.Skipped && r.NetnsCookie == cookie })
}

type reconcileOutcome int

const (
	outcomeGone reconcileOutcome = iota
	outcomeReleased
	outcomeRepaired
	outcomeKept
)

func (s *Service) reconcileOne(ctx context.Context, key podstore.Key) (reconcileOutcome, error) {
	rec, ok, unlock := s.lockRecord(key)
	defer unlock()
	if !ok {
		return outcomeGone, nil // deleted meanwhile
	}
	fields := podFields(identityOf(rec), key)
	ns, err := netns.OpenExpected(rec.NetnsPath, rec.NetnsCookie)
	if err != nil {
		if _, err := s.release(ctx, key); err != nil {
			return outcomeGone, err
		}
		s.log.Info("pod released: its network namespace is gone", fields...)
		return outcomeReleased, nil
	}
	defer ns.Close()
	if rec.Skipped {
		return outcomeKept, nil
	}
	if err := s.datapath.Check(ctx, rec.NetnsCookie); err == nil {
		return outcomeKept, nil
	} else {
		s.log.Warn("pod redirection broken; repairing", append(fields, zap.Error(err))...)
	}
	if _, err := s.datapath.Enroll(ctx, ns, rec.Capture); err != nil {
		return outcomeGone, fmt.Errorf("repair %s: %w", key, err)
	}
	return outcomeRepaired, nil
}

// namespaceAlive: the record's namespace path still names a network namespace,
// and the same one (a path can be reused by a new pod after a node crash).
func (s *Service) namespaceAlive(rec podstore.Record) bool {
	ns, err := netns.OpenExpected(rec.NetnsPath, rec.NetnsCookie)
	if err != nil {
		return false
	}
	ns.Close()
	return true
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
