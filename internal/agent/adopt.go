package agent

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"net/netip"
	"os"
	"slices"
	"time"

	"go.uber.org/zap"

	"github.com/mesh-cni/mesh-cni/internal/hostproc"
	"github.com/mesh-cni/mesh-cni/internal/netns"
	"github.com/mesh-cni/mesh-cni/internal/podif"
	"github.com/mesh-cni/mesh-cni/internal/podstore"
	"github.com/mesh-cni/mesh-cni/pkg/gate/gatepb"
)

// RunningPod is a pod the enrollment source knows to be running on this node in
// a network namespace of its own.
type RunningPod struct {
	Pod *gatepb.PodIdentity
	// CgroupUID is the uid the pod's cgroups are named after: the pod's own,
	// or a static pod's manifest hash.
	CgroupUID string
	// IPs are the pod's addresses as the API server has them.
	IPs []string
}

// RunningPodLister is an enrollment source that can list the pods running on
// the node, so that the agent adopts those that started before it was
// installed (the Kubernetes source).
type RunningPodLister interface {
	RunningPods() ([]RunningPod, error)
}

// SandboxFinder finds running pods' network namespaces on the host, by the uids
// their cgroups are named after (hostproc.Procfs.Sandboxes with the node's pod
// cgroup layout and the runtime's netns directory).
type SandboxFinder func(uids []string) (hostproc.SandboxScan, error)

// AdoptNetwork is the network name of adopted records on a node whose agent
// installs no chain entry (KNI, hook): there is no CNI network to name.
const AdoptNetwork = "adopted"

// AdoptResult counts what one adoption pass did.
type AdoptResult struct {
	Enrolled, Skipped, Failed int
}

// Adopt brings running pods the agent has no record of under its policy, as
// if their ADD had just reached the gate: the ones it selects are enrolled in
// place (no restart), the others recorded as skipped so a later label change
// enrolls them, and the outcome is reported on each. Those are the pods that
// started before the agent was installed: a pod started since went through
// the gate, which recorded it. A pod of an excluded namespace, or known by uid
// or by network namespace, is left alone. find locates the namespaces; a pod it
// cannot place is reported failed and tried again on the next pass.
func (s *Service) Adopt(ctx context.Context, pods []RunningPod, find SandboxFinder, exclude []string) (AdoptResult, error) {
	s.retryRemovals()
	var res AdoptResult
	var todo []RunningPod
	var uids []string
	for _, p := range pods {
		if slices.Contains(exclude, p.Pod.GetNamespace()) || s.knownUID(p.Pod.GetUid()) {
			continue
		}
		todo = append(todo, p)
		uids = append(uids, p.CgroupUID)
	}
	if len(todo) == 0 {
		return res, nil
	}
	scan, err := find(uids)
	if err != nil {
		return res, fmt.Errorf("find running pods' network namespaces: %w", err)
	}
	s.logRefused(scan.Refused)
	found, problems := scan.Found, scan.Problems
	var errs []error
	// Not a failure of the pods: they are served as they were, their
	// annotations stay the replaced agent's, and the next pass tries again.
	proxyErr := s.waitProxyForTakeover(ctx, todo)
	if proxyErr != nil {
		s.log.Warn("pods the replaced node agent handed over are left for the next pass", zap.Error(proxyErr))
		errs = append(errs, proxyErr)
	}
	for _, p := range todo {
		if proxyErr != nil && s.takeover.HandedOver(p.Pod) {
			res.Failed++
			continue
		}
		sb, ok := found[p.CgroupUID]
		if !ok {
			err := problems[p.CgroupUID]
			if err == nil {
				err = errors.New("not found")
			}
			res.Failed++
			s.adoptFailed(ctx, p.Pod, "adopt-netns", err)
			errs = append(errs, err)
			continue
		}
		enrolled, err := s.adoptOne(ctx, p, sb)
		switch {
		case err != nil:
			res.Failed++
			errs = append(errs, err)
		case enrolled:
			res.Enrolled++
		case !enrolled:
			res.Skipped++
		}
	}
	return res, errors.Join(errs...)
}

// takeoverProxyWait bounds an adoption pass's wait for the node proxy.
const takeoverProxyWait = 30 * time.Second

// waitProxyForTakeover waits, when pods contain one the replaced node agent
// handed over, until the node proxy is connected and known. The proxy already
// runs in such a pod: captured before the agent knows the proxy's cgroup, the
// proxy's own connections there would be sent back to itself. An error
// leaves those pods to the next pass, still served under the old capture.
func (s *Service) waitProxyForTakeover(ctx context.Context, pods []RunningPod) error {
	if s.takeover == nil || !slices.ContainsFunc(pods, func(p RunningPod) bool { return s.takeover.HandedOver(p.Pod) }) {
		return nil
	}
	w, ok := s.handoff.(ProxyWaiter)
	if !ok {
		return errors.New("the node proxy runs in pods the replaced node agent handed over, and this agent hands none over")
	}
	ctx, cancel := context.WithTimeout(ctx, takeoverProxyWait)
	defer cancel()
	if err := w.WaitForProxy(ctx); err != nil {
		return fmt.Errorf("not captured before the node proxy that serves it is known: %w", err)
	}
	return nil
}

// adoptFailed reports a running pod the agent could not adopt. Passes repeat
// every reconcile interval: the same failure of the same pod is counted and
// reported (annotation, Event, warning) once, and logged at debug after that.
func (s *Service) adoptFailed(ctx context.Context, pod *gatepb.PodIdentity, step string, err error) {
	fields := []zap.Field{zap.String("pod", pod.GetNamespace()+"/"+pod.GetName()), zap.String("podUID", pod.GetUid()), zap.String("step", step), zap.Error(err)}
	s.adoptMu.Lock()
	if s.adoptFailures == nil {
		s.adoptFailures = map[string]string{}
	}
	seen := s.adoptFailures[pod.GetUid()] == err.Error()
	s.adoptFailures[pod.GetUid()] = err.Error()
	s.adoptMu.Unlock()
	if seen {
		s.log.Debug("running pod still not adopted", fields...)
		return
	}
	s.metrics.enrollFailed(step)
	s.report(ctx, pod, OutcomeFailed, err)
	s.log.Warn("running pod not adopted", fields...)
}

// logRefused warns of each process refused for its cgroup once, while it runs
// (pid and start time: pids are reused).
func (s *Service) logRefused(refused []hostproc.CgroupRefusal) {
	s.adoptMu.Lock()
	defer s.adoptMu.Unlock()
	seen := map[string]bool{}
	for _, r := range refused {
		k := fmt.Sprintf("%d %d %s", r.PID, r.StartTime, r.Cgroup)
		seen[k] = true
		if !s.adoptRefused[k] {
			s.log.Warn("a process whose cgroup looks like a pod's is not where the node's layout puts a pod's container: taken for no pod", zap.Int("pid", r.PID), zap.String("cgroup", r.Cgroup), zap.Error(r.Err))
		}
	}
	s.adoptRefused = seen
}

// adopted forgets a pod's earlier failure.
func (s *Service) adopted(uid string) {
	s.adoptMu.Lock()
	delete(s.adoptFailures, uid)
	s.adoptMu.Unlock()
}

// adoptOne records and, if the policy says so, enrolls one running pod found
// in sb.
func (s *Service) adoptOne(ctx context.Context, p RunningPod, sb hostproc.Sandbox) (enrolled bool, err error) {
	network := AdoptNetwork
	if st := s.cni.Load(); st != nil && st.Network != "" {
		network = st.Network
	}
	ifs, err := podInterfaces(sb.NetnsPath)
	if err != nil {
		s.adoptFailed(ctx, p.Pod, "adopt-netns", err)
		return false, err
	}
	key := podstore.Key{Network: network, ContainerID: sb.ContainerID, Ifname: ifnameOf(ifs, p.IPs)}
	unlock := s.locks.Lock(key.String())
	defer unlock()
	ns, err := netns.OpenHandle(sb.NetnsPath)
	if err != nil {
		s.adoptFailed(ctx, p.Pod, "adopt-netns", err)
		return false, err
	}
	defer ns.Close()
	// Looked at again under the lock: an ADD or a pass may have recorded it.
	if _, ok := s.store.Get(key); ok || s.knownUID(p.Pod.GetUid()) || s.knownCookie(ns.Cookie) {
		return false, nil
	}
	fields := podFields(p.Pod, key)
	decision, err := s.policy.Decide(ctx, p.Pod)
	if err != nil {
		s.adoptFailed(ctx, p.Pod, "policy", err)
		return false, err
	}
	rec := podstore.Record{
		Key:            key,
		Namespace:      p.Pod.GetNamespace(),
		Name:           p.Pod.GetName(),
		UID:            p.Pod.GetUid(),
		NetnsPath:      sb.NetnsPath,
		ServiceAccount: decision.ServiceAccount,
		Capture:        decision.Capture,
		Interfaces:     ifs,
		Source:         podstore.SourceAdopted,
		Labels:         p.Pod.GetLabels(),
		Annotations:    p.Pod.GetAnnotations(),
	}
	if leftToItsRules(rec, decision) {
		decision.Enroll = false
		decision.Reason = "a running pod with its own sidecar keeps the in-pod rules its CNI plugin wrote (istio-cni's); it is captured for its sidecar when its sandbox is made again"
	}
	if !decision.Enroll {
		if err := s.skip(ctx, rec, ns); err != nil {
			s.adoptFailed(ctx, p.Pod, "record", err)
			return false, err
		}
		s.adopted(p.Pod.GetUid())
		s.releaseReplaced(ctx, p.Pod, rec, ns, fields)
		s.report(ctx, p.Pod, OutcomeDisabled, nil)
		s.log.Info("running pod recorded, not enrolled", append(fields, zap.String("reason", decision.Reason))...)
		return false, nil
	}
	rec, reason, err := s.enroll(ctx, rec, ns)
	if err != nil {
		s.adoptFailed(ctx, p.Pod, reason, err)
		return false, fmt.Errorf("adopt pod %s/%s: %w", p.Pod.GetNamespace(), p.Pod.GetName(), err)
	}
	s.adopted(p.Pod.GetUid())
	s.report(ctx, p.Pod, OutcomeEnabled, nil)
	s.log.Info("running pod enrolled in place", append(fields,
		zap.Uint64("netnsCookie", rec.NetnsCookie), zap.String("netns", rec.NetnsPath), zap.Ints("pids", sb.PIDs))...)
	s.removeReplaced(p.Pod, ns, fields)
	return true, nil
}

// removeReplaced removes the replaced node agent's capture from an adopted
// pod's namespace. It runs only once the pod is captured and handed over, so
// a connection the old rules still redirect meets the new capture first
// (docs/istio.md, "Switching a cluster"), and what the namespace holds never
// decides whether the pod is captured: a failure is logged, the pod stays
// enrolled. What is left for later is tried again on each adoption pass.
func (s *Service) removeReplaced(pod *gatepb.PodIdentity, ns *netns.Handle, fields []zap.Field) {
	t := s.takeover
	if t == nil || t.Remove == nil || !t.HandedOver(pod) {
		return
	}
	again, _ := s.runRemove(ns.File, fields)
	s.adoptMu.Lock()
	defer s.adoptMu.Unlock()
	if !again {
		delete(s.takeoverLeft, pod.GetUid())
		return
	}
	if s.takeoverLeft == nil {
		s.takeoverLeft = map[string]leftover{}
	}
	s.takeoverLeft[pod.GetUid()] = leftover{path: ns.Path, cookie: ns.Cookie, fields: fields}
}

// releaseReplaced takes a pod the replaced node agent handed over, and which
// the policy now leaves out of the mesh, out of it as that agent would have:
// its capture removed first (new connections go directly), then the node
// proxy told to drop it. Otherwise the proxy would go on serving it only
// until its next snapshot, which no longer keeps it, while the old rules still
// sent the pod's traffic there. When the capture cannot all be removed the
// proxy keeps the pod: the rules left still send its traffic there.
func (s *Service) releaseReplaced(ctx context.Context, pod *gatepb.PodIdentity, rec podstore.Record, ns *netns.Handle, fields []zap.Field) {
	t := s.takeover
	if t == nil || t.Remove == nil || !t.HandedOver(pod) {
		return
	}
	if _, err := s.runRemove(ns.File, fields); err != nil {
		s.log.Warn("a pod the replaced node agent handed over, left out of the mesh, keeps what is left of its capture, and the node proxy keeps serving it", append(fields, zap.Error(err))...)
		return
	}
	if s.handoff != nil {
		s.handoff.PodDeleted(ctx, rec)
		s.log.Info("a pod the replaced node agent handed over, left out of the mesh: its capture removed, the node proxy told to drop it", fields...)
	}
}

// leftover is an adopted pod whose replaced capture is not all removed yet.
type leftover struct {
	path   string
	cookie uint64
	fields []zap.Field
}

func (s *Service) runRemove(ns *os.File, fields []zap.Field) (again bool, err error) {
	removed, again, err := s.takeover.Remove(ns)
	fields = append(fields, zap.String("removed", removed), zap.Bool("more later", again))
	if err != nil {
		s.log.Warn("the replaced node agent's capture not fully removed from an adopted pod",
			append(fields, zap.Error(err))...)
		return again, err
	}
	s.log.Info("the replaced node agent's capture removed from an adopted pod", fields...)
	return again, nil
}

// retryRemovals tries again what removeReplaced left, for the pods still
// enrolled in the same namespace.
func (s *Service) retryRemovals() {
	s.adoptMu.Lock()
	left := maps.Clone(s.takeoverLeft)
	s.adoptMu.Unlock()
	for uid, l := range left {
		again := false
		if s.captured(uid) {
			if ns, err := netns.OpenExpected(l.path, l.cookie); err == nil {
				again, _ = s.runRemove(ns.File, l.fields)
				ns.Close()
			}
		}
		if !again {
			s.adoptMu.Lock()
			delete(s.takeoverLeft, uid)
			s.adoptMu.Unlock()
		}
	}
}

// knownUID: a record of the pod exists, enrolled or skipped.
func (s *Service) knownUID(uid string) bool {
	return uid != "" && slices.ContainsFunc(s.store.List(), func(r podstore.Record) bool { return r.UID == uid })
}

// knownCookie: a record of the network namespace exists.
func (s *Service) knownCookie(cookie uint64) bool {
	return slices.ContainsFunc(s.store.List(), func(r podstore.Record) bool { return r.NetnsCookie == cookie })
}

// adoptedFor returns the adopted records that a DEL of the pod with uid, for
// the namespace at netnsPath, must release: their key was read from the host
// and may not be the runtime's, so they are matched by pod and namespace.
func (s *Service) adoptedFor(uid, netnsPath string) []podstore.Key {
	if uid == "" {
		return nil
	}
	var keys []podstore.Key
	for _, r := range s.store.List() {
		if r.Source == podstore.SourceAdopted && r.UID == uid && (r.NetnsPath == netnsPath || !s.namespaceAlive(r)) {
			keys = append(keys, r.Key)
		}
	}
	return keys
}

// podInterfaces lists the namespace's interfaces but loopback, with their
// addresses, for the record.
func podInterfaces(netnsPath string) ([]podstore.Interface, error) {
	var ifs []podif.Interface
	err := netns.Do(netnsPath, func() error {
		var err error
		ifs, err = podif.List()
		return err
	})
	if err != nil {
		return nil, fmt.Errorf("interfaces of %s: %w", netnsPath, err)
	}
	out := make([]podstore.Interface, 0, len(ifs))
	for _, i := range ifs {
		r := podstore.Interface{Name: i.Name, MAC: i.MAC.String()}
		for _, a := range i.Addrs {
			r.Addresses = append(r.Addresses, a.String())
		}
		out = append(out, r)
	}
	return out, nil
}

// ifnameOf is the interface holding one of the pod's addresses, else eth0,
// the name runtimes give CNI.
func ifnameOf(ifs []podstore.Interface, ips []string) string {
	for _, i := range ifs {
		for _, a := range i.Addresses {
			p, err := netip.ParsePrefix(a)
			if err == nil && slices.Contains(ips, p.Addr().String()) {
				return i.Name
			}
		}
	}
	return "eth0"
}

// leftToItsRules reports a pod the agent does not take over in place although
// the policy enrolls it: one captured for its own sidecar that was already
// running when the agent found it (an adopted record). Its sidecar's capture
// was set up by the CNI plugin before mesh-cni, istio-cni's iptables rules in
// the pod's namespace, which would stay beside mesh-cni's and answer the
// sidecar's SO_ORIGINAL_DST for inbound connections differently: the pod keeps
// its rules until it is started again, and its next sandbox's ADD enrolls it.
func leftToItsRules(rec podstore.Record, d Decision) bool {
	return d.Enroll && d.Capture.Sidecar != nil && rec.Source == podstore.SourceAdopted
}
