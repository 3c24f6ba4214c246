package agent

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"time"

	"go.uber.org/zap"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/mesh-cni/mesh-cni/internal/keylock"
	"github.com/mesh-cni/mesh-cni/internal/netns"
	"github.com/mesh-cni/mesh-cni/internal/podstore"
	"github.com/mesh-cni/mesh-cni/internal/redirect"
	"github.com/mesh-cni/mesh-cni/pkg/gate"
	"github.com/mesh-cni/mesh-cni/pkg/gate/gatepb"
)

// Service implements the gate API: it admits pods once the agent is ready, asks
// the policy whether each joins the mesh, has the data path redirect the ones that
// do, and keeps the records that say so.
type Service struct {
	gatepb.UnimplementedGateServer

	log          *zap.Logger
	readiness    *Readiness
	policy       Policy
	datapath     Datapath
	store        *podstore.Store
	locks        *keylock.Map[string]
	now          func() time.Time
	metrics      *Metrics
	cni          atomic.Pointer[CNIStatus]
	handoff      Handoff
	datapathName string
	// enrolling is held for reading by an Add from putting redirection in
	// place until its record is written, and for writing by reconcile while it
	// releases an orphan: a fresh enrollment whose record is still being
	// written is not an orphan.
	enrolling sync.RWMutex

	refusalsMu sync.Mutex
	refusals   map[redirect.Refusal]bool // proxy listeners already reported

	// takeover and handedOver (its pods not adopted yet) are set when the
	// agent replaces another node agent on a running node, before Run
	// starts anything.
	takeover   *Takeover
	handedOver func() ([]string, error)

	adoptMu       sync.Mutex
	adoptFailures map[string]string   // by pod uid: the last reported adoption failure
	adoptRefused  map[string]bool     // processes refused for their cgroup, logged once
	takeoverLeft  map[string]leftover // by pod uid: the replaced capture left for later
}

// NewService wires the gate to its collaborators.
func NewService(log *zap.Logger, readiness *Readiness, policy Policy, datapath Datapath, store *podstore.Store) *Service {
	return &Service{
		log:       log,
		readiness: readiness,
		policy:    policy,
		datapath:  datapath,
		store:     store,
		locks:     &keylock.Map[string]{},
		now:       time.Now,
	}
}

func keyOf(a *gatepb.Attachment) podstore.Key {
	return podstore.Key{Network: a.GetNetwork(), ContainerID: a.GetContainerId(), Ifname: a.GetIfname()}
}

func podFields(pod *gatepb.PodIdentity, key podstore.Key) []zap.Field {
	return []zap.Field{
		zap.String("pod", pod.GetNamespace()+"/"+pod.GetName()),
		zap.String("podUID", pod.GetUid()),
		zap.String("attachment", key.String()),
	}
}

// Add implements gatepb.GateServer.
func (s *Service) Add(ctx context.Context, req *gatepb.AddRequest) (*gatepb.AddResponse, error) {
	start := s.now()
	ns, err := openAddNetns(req)
	if err != nil {
		s.metrics.enrollFailed("invalid-request")
		s.log.Warn("rejected add", zap.Error(err))
		return nil, status.Error(codes.InvalidArgument, err.Error())
	}
	defer ns.Close()
	key := keyOf(req.GetAttachment())
	fields := podFields(req.GetPod(), key)

	if err := s.readiness.Wait(ctx); err != nil {
		s.metrics.enrollFailed("not-ready")
		s.log.Warn("add gave up waiting for readiness", append(fields, zap.Error(err))...)
		return nil, status.Error(codes.Unavailable, err.Error())
	}
	waited := s.now().Sub(start)

	unlock := s.locks.Lock(key.String())
	defer unlock()

	locked := s.now()
	decision, err := s.policy.Decide(ctx, req.GetPod())
	decided := s.now()
	if err != nil {
		s.metrics.enrollFailed("policy")
		s.report(ctx, req.GetPod(), OutcomeFailed, err)
		s.log.Error("enrollment policy failed", append(fields, zap.Error(err))...)
		return nil, status.Errorf(codes.Aborted, "enrollment policy could not decide for pod %s/%s: %v", req.GetPod().GetNamespace(), req.GetPod().GetName(), err)
	}
	rec := podstore.Record{
		Key:            key,
		Namespace:      req.GetPod().GetNamespace(),
		Name:           req.GetPod().GetName(),
		UID:            req.GetPod().GetUid(),
		NetnsPath:      req.GetNetnsPath(),
		ServiceAccount: decision.ServiceAccount,
		Capture:        decision.Capture,
		Interfaces:     toRecordInterfaces(req.GetInterfaces()),
		Source:         req.GetSource().String(),
		Labels:         req.GetPod().GetLabels(),
		Annotations:    req.GetPod().GetAnnotations(),
	}
	if !decision.Enroll {
		if err := s.skip(ctx, rec, ns); err != nil {
			s.metrics.enrollFailed("record")
			return nil, status.Error(codes.Internal, err.Error())
		}
		s.report(ctx, req.GetPod(), OutcomeDisabled, nil)
		s.log.Info("pod skipped", append(fields, zap.String("reason", decision.Reason), zap.Duration("waited", waited))...)
		return &gatepb.AddResponse{Decision: gatepb.Decision_DECISION_SKIPPED, Reason: decision.Reason}, nil
	}
	rec, reason, err := s.enroll(ctx, rec, ns)
	if err != nil {
		s.metrics.enrollFailed(reason)
		s.report(ctx, req.GetPod(), OutcomeFailed, err)
		s.log.Error("enrollment failed", append(fields, zap.String("step", reason), zap.Error(err))...)
		code := codes.Internal
		if reason == "proxy-handoff" {
			// Aborted: the node proxy, not the agent, is what is missing.
			code = codes.Aborted
		}
		return nil, status.Errorf(code, "enroll pod %s/%s: %v", req.GetPod().GetNamespace(), req.GetPod().GetName(), err)
	}
	s.report(ctx, req.GetPod(), OutcomeEnabled, nil)
	if ce := s.log.Check(zap.DebugLevel, "add timing"); ce != nil {
		ce.Write(append(fields,
			zap.Duration("readiness", waited),
			zap.Duration("lock", locked.Sub(start)-waited),
			zap.Duration("policy", decided.Sub(locked)),
			zap.Duration("enroll", s.now().Sub(decided)))...)
	}
	s.log.Info("pod enrolled", append(fields,
		zap.String("reason", decision.Reason),
		zap.Uint64("netnsCookie", rec.NetnsCookie),
		zap.Strings("interfaces", recordIfnames(rec)),
		zap.Duration("waited", waited),
		zap.Duration("took", s.now().Sub(start)))...)
	return &gatepb.AddResponse{Decision: gatepb.Decision_DECISION_ENROLLED, Reason: decision.Reason, NetnsCookie: rec.NetnsCookie}, nil
}

// openAddNetns validates req and opens the pod's namespace, once: every step
// of the Add (the data path, the record's cookie, the node proxy's handoff)
// uses this descriptor, so the path is read once.
func openAddNetns(req *gatepb.AddRequest) (*netns.Handle, error) {
	if err := gate.ValidateAddFields(req); err != nil {
		return nil, err
	}
	ns, err := netns.OpenHandle(req.GetNetnsPath())
	if err != nil {
		return nil, fmt.Errorf("%w: %w", gate.ErrInvalidRequest, err)
	}
	return ns, nil
}

// enroll puts redirection in place for rec, in the namespace ns (rec's, opened
// by the caller), records it and hands it to the node proxy; on failure nothing
// is left enrolled. The caller holds the key's lock. reason names the failing
// step for metrics.
func (s *Service) enroll(ctx context.Context, rec podstore.Record, ns *netns.Handle) (podstore.Record, string, error) {
	s.enrolling.RLock()
	cookie, err := s.datapath.Enroll(ctx, ns, rec.Capture)
	if err != nil {
		s.enrolling.RUnlock()
		return rec, "datapath", err
	}
	if prev, ok := s.store.Get(rec.Key); ok && prev.NetnsCookie != cookie {
		// Same attachment, new network namespace (a sandbox re-created under the
		// same id): the old namespace's redirection is stale.
		if err := s.datapath.Release(ctx, prev.NetnsCookie, prev.NetnsPath); err != nil {
			s.log.Warn("release of replaced namespace failed", zap.String("attachment", rec.Key.String()), zap.Error(err))
		}
	}
	rec.NetnsCookie, rec.Skipped, rec.EnrolledAt = cookie, false, s.now()
	if err := s.store.Put(rec); err != nil {
		// Without a record the agent would forget the pod on restart; undo so the
		// caller can retry from a clean state.
		if rerr := s.datapath.Release(ctx, cookie, rec.NetnsPath); rerr != nil {
			err = errors.Join(err, rerr)
		}
		s.enrolling.RUnlock()
		return rec, "record", err
	}
	s.enrolling.RUnlock()
	if s.handoff != nil {
		if err := s.handoff.PodAdded(ctx, rec, ns); err != nil {
			// No pod starts before its node proxy's listeners exist: undo, so a
			// retried ADD starts clean. The caller's deadline may be spent by now.
			undoCtx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 10*time.Second)
			_, rerr := s.release(undoCtx, rec.Key)
			cancel()
			if rerr != nil {
				err = errors.Join(err, rerr)
			}
			return rec, "proxy-handoff", err
		}
	}
	return rec, "", nil
}

// skip records rec as out of the mesh, releasing an earlier redirection of the
// same attachment; ns is rec's namespace, opened by the caller. The caller
// holds the key's lock.
func (s *Service) skip(ctx context.Context, rec podstore.Record, ns *netns.Handle) error {
	if prev, ok := s.store.Get(rec.Key); ok && !prev.Skipped {
		if err := s.datapath.Release(ctx, prev.NetnsCookie, prev.NetnsPath); err != nil {
			return fmt.Errorf("release %s: %w", rec.Key, err)
		}
		if s.handoff != nil && !s.uidStillEnrolled(prev.UID, prev.Key) {
			s.handoff.PodDeleted(ctx, prev)
		}
	}
	rec.NetnsCookie, rec.Skipped, rec.EnrolledAt = ns.Cookie, true, s.now()
	return s.store.Put(rec)
}

func recordIfnames(rec podstore.Record) []string {
	names := make([]string, 0, len(rec.Interfaces))
	for _, i := range rec.Interfaces {
		names = append(names, i.Name)
	}
	if len(names) == 0 {
		names = append(names, rec.Key.Ifname)
	}
	return names
}

func toRecordInterfaces(ifs []*gatepb.Interface) []podstore.Interface {
	out := make([]podstore.Interface, 0, len(ifs))
	for _, i := range ifs {
		out = append(out, podstore.Interface{Name: i.GetName(), MAC: i.GetMac(), Addresses: i.GetAddresses()})
	}
	return out
}

// Del implements gatepb.GateServer. It does not wait for readiness: releasing
// needs only the records and the pinned data path.
func (s *Service) Del(ctx context.Context, req *gatepb.DelRequest) (*gatepb.DelResponse, error) {
	if err := gate.ValidateDel(req); err != nil {
		s.log.Warn("rejected del", zap.Error(err))
		return nil, status.Error(codes.InvalidArgument, err.Error())
	}
	key := keyOf(req.GetAttachment())
	released, err := s.releaseLocked(ctx, key)
	if err != nil {
		return nil, releaseStatus(err)
	}
	if released {
		s.log.Info("pod released", podFields(req.GetPod(), key)...)
		return &gatepb.DelResponse{Released: true}, nil
	}
	// A pod adopted while running is recorded under the agent's reading of
	// its attachment, which the runtime may name differently. Each record is
	// released under its own key's lock, one at a time.
	for _, k := range s.adoptedFor(req.GetPod().GetUid(), req.GetNetnsPath()) {
		ok, err := s.releaseLocked(ctx, k)
		if err != nil {
			return nil, releaseStatus(err)
		}
		if ok {
			released = true
			s.log.Info("pod released", podFields(req.GetPod(), k)...)
		}
	}
	return &gatepb.DelResponse{Released: released}, nil
}

// releaseStatus is the gRPC status of a failed release: Unavailable while the
// data path is still loading at start (retryable; the plugin's DEL treats it as
// the agent being away and reconcile or GC releases later), Internal otherwise.
func releaseStatus(err error) error {
	if errors.Is(err, errDatapathLoading) {
		return status.Error(codes.Unavailable, err.Error())
	}
	return status.Error(codes.Internal, err.Error())
}

// release undoes an enrollment; the caller holds the key's lock.
func (s *Service) release(ctx context.Context, key podstore.Key) (bool, error) {
	rec, ok := s.store.Get(key)
	if !ok {
		return false, nil
	}
	if !rec.Skipped {
		if err := s.datapath.Release(ctx, rec.NetnsCookie, rec.NetnsPath); err != nil {
			return false, fmt.Errorf("release %s (netns cookie %d): %w", key, rec.NetnsCookie, err)
		}
	}
	if err := s.store.Delete(key); err != nil {
		return false, err
	}
	if !rec.Skipped && s.handoff != nil && !s.uidStillEnrolled(rec.UID, key) {
		s.handoff.PodDeleted(ctx, rec)
	}
	return true, nil
}

// uidStillEnrolled: another attachment of the same pod is still enrolled, so
// the node proxy must keep the pod.
func (s *Service) uidStillEnrolled(uid string, except podstore.Key) bool {
	if uid == "" {
		return false
	}
	for _, r := range s.store.List() {
		if r.UID == uid && !r.Skipped && r.Key != except {
			return true
		}
	}
	return false
}

// enrolled returns the records of pods with redirection in place.
func (s *Service) enrolled() []podstore.Record {
	all := s.store.List()
	out := all[:0]
	for _, r := range all {
		if !r.Skipped {
			out = append(out, r)
		}
	}
	return out
}

// Check implements gatepb.GateServer.
func (s *Service) Check(ctx context.Context, req *gatepb.CheckRequest) (*gatepb.CheckResponse, error) {
	if err := gate.ValidateCheck(req); err != nil {
		return nil, status.Error(codes.InvalidArgument, err.Error())
	}
	if ready, why := s.readiness.Ready(); !ready {
		return nil, status.Errorf(codes.Unavailable, "mesh-agent is not ready (%s)", why)
	}
	key := keyOf(req.GetAttachment())
	unlock := s.locks.Lock(key.String())
	defer unlock()

	decision, err := s.policy.Decide(ctx, req.GetPod())
	if err != nil {
		return nil, status.Errorf(codes.Unavailable, "enrollment policy could not decide: %v", err)
	}
	rec, known := s.store.Get(key)
	enrolled := known && !rec.Skipped
	if !decision.Enroll {
		if enrolled {
			return nil, status.Errorf(codes.FailedPrecondition, "pod %s/%s is enrolled but the policy says it should not be: %s", req.GetPod().GetNamespace(), req.GetPod().GetName(), decision.Reason)
		}
		return &gatepb.CheckResponse{Decision: gatepb.Decision_DECISION_SKIPPED, Reason: decision.Reason}, nil
	}
	if !enrolled {
		return nil, status.Errorf(codes.FailedPrecondition, "pod %s/%s should be enrolled but the agent has no record of attachment %s", req.GetPod().GetNamespace(), req.GetPod().GetName(), key)
	}
	if err := s.datapath.Check(ctx, rec.NetnsCookie); err != nil {
		return nil, status.Errorf(codes.FailedPrecondition, "redirection of pod %s/%s is not intact: %v", req.GetPod().GetNamespace(), req.GetPod().GetName(), err)
	}
	return &gatepb.CheckResponse{Decision: gatepb.Decision_DECISION_ENROLLED, Reason: decision.Reason}, nil
}

// GC implements gatepb.GateServer: every attachment of the network that the
// runtime no longer lists is released, but an adopted pod's while its
// namespace lives.
func (s *Service) GC(ctx context.Context, req *gatepb.GCRequest) (*gatepb.GCResponse, error) {
	if err := gate.ValidateGC(req); err != nil {
		return nil, status.Error(codes.InvalidArgument, err.Error())
	}
	valid := make(map[podstore.Key]bool, len(req.GetValid()))
	for _, a := range req.GetValid() {
		valid[podstore.Key{Network: req.GetNetwork(), ContainerID: a.GetContainerId(), Ifname: a.GetIfname()}] = true
	}
	resp := &gatepb.GCResponse{}
	var errs []error
	for _, rec := range s.store.List() {
		if rec.Key.Network != req.GetNetwork() || valid[rec.Key] {
			continue
		}
		if rec.Source == podstore.SourceAdopted && s.namespaceAlive(rec) {
			// Its key is the agent's reading of the host, not necessarily
			// the runtime's: only a namespace that is gone says it is stale.
			continue
		}
		released, err := s.releaseLocked(ctx, rec.Key)
		if err != nil {
			errs = append(errs, err)
			continue
		}
		if released && !rec.Skipped {
			s.log.Info("pod released by gc", zap.String("pod", rec.Namespace+"/"+rec.Name), zap.String("podUID", rec.UID), zap.String("attachment", rec.Key.String()))
			resp.Released = append(resp.Released, &gatepb.Attachment{ContainerId: rec.Key.ContainerID, Ifname: rec.Key.Ifname, Network: rec.Key.Network})
		}
	}
	if err := errors.Join(errs...); err != nil {
		code := codes.Internal
		if errors.Is(err, errDatapathLoading) {
			code = codes.Unavailable
		}
		return resp, status.Errorf(code, "gc released %d attachments, failed on others: %v", len(resp.Released), err)
	}
	return resp, nil
}

func (s *Service) releaseLocked(ctx context.Context, key podstore.Key) (bool, error) {
	unlock := s.locks.Lock(key.String())
	defer unlock()
	return s.release(ctx, key)
}

// List implements gatepb.GateServer.
func (s *Service) List(context.Context, *gatepb.ListRequest) (*gatepb.ListResponse, error) {
	ready, _ := s.readiness.Ready()
	resp := &gatepb.ListResponse{Ready: ready}
	for _, rec := range s.enrolled() {
		ifs := make([]*gatepb.Interface, 0, len(rec.Interfaces))
		for _, i := range rec.Interfaces {
			ifs = append(ifs, &gatepb.Interface{Name: i.Name, Mac: i.MAC, Addresses: i.Addresses})
		}
		resp.Enrollments = append(resp.Enrollments, &gatepb.Enrollment{
			Pod:                &gatepb.PodIdentity{Namespace: rec.Namespace, Name: rec.Name, Uid: rec.UID},
			Attachment:         &gatepb.Attachment{ContainerId: rec.Key.ContainerID, Ifname: rec.Key.Ifname, Network: rec.Key.Network},
			NetnsPath:          rec.NetnsPath,
			NetnsCookie:        rec.NetnsCookie,
			Interfaces:         ifs,
			Source:             gatepb.Source(gatepb.Source_value[rec.Source]),
			EnrolledAtUnixNano: rec.EnrolledAt.UnixNano(),
		})
	}
	return resp, nil
}
