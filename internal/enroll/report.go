package enroll

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"strconv"
	"sync"
	"time"

	"go.uber.org/zap"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/util/workqueue"
)

const (
	// reportRetries bounds how often one pod's write is retried after an
	// error from the API server that is not transient (e.g. forbidden), before
	// the outcome is logged and dropped. Transient errors (no answer, timeouts,
	// 5xx, 429) are retried until the API server answers. Back-off is
	// exponential from reportBaseDelay up to reportMaxDelay.
	reportRetries   = 10
	reportBaseDelay = 200 * time.Millisecond
	reportMaxDelay  = 30 * time.Second
	reportTimeout   = 10 * time.Second
	// maxQueuedEvents bounds the failure Events kept per pod while the API
	// server is unreachable; older ones are dropped first.
	maxQueuedEvents = 5
	// maxEventMessage is the API server's limit for an Event's message.
	maxEventMessage = 1024
	// eventReportingController names the agent in Events (a qualified name).
	eventReportingController = "mesh-cni.io/mesh-agent"
)

type podKey struct{ namespace, name string }

// pendingReport is what is still to be written for one pod.
type pendingReport struct {
	uid     string
	outcome string         // wanted value of the annotation; "" for none
	events  []pendingEvent // Events not yet sent
	// force writes the annotation even when this process wrote that value
	// last: someone else has changed it since (audit).
	force bool
}

// writtenOutcome is the annotation value this reporter last wrote for a pod.
type writtenOutcome struct {
	uid, outcome string
}

// pendingEvent is one Warning Event, with the uid of the pod it is about: a
// later report for a re-created pod of the same name must not lose it.
type pendingEvent struct {
	uid, reason, message string
}

// reporter writes enrollment outcomes back to the API server in the background:
// the annotation by a merge patch carrying the pod's uid (so a re-created pod of
// the same name is never marked), and a Warning Event per failure.
type reporter struct {
	log    *zap.Logger
	client kubernetes.Interface
	node   string
	// istio also keeps istiod's ambient.istio.io/redirection in step: enabled
	// while the pod is enrolled, absent otherwise.
	istio  bool
	cached func(namespace, name string) *corev1.Pod
	queue  workqueue.TypedRateLimitingInterface[podKey]
	done   chan struct{}

	mu      sync.Mutex
	pending map[podKey]*pendingReport
	// written spares patches that would change nothing. It is this process's
	// own record, not the cache's: the cache can lag behind a write made a
	// moment ago, and a quick enabled→disabled→enabled must end as enabled.
	written map[podKey]writtenOutcome
	// ignored is the opt-out last reported ignored for each pod (uid and
	// reason), so each is reported once, not on every re-decision.
	ignored map[podKey]string
	// bare holds, for each pod the source decided from an object the cache
	// did not have (a direct GET), the uid it had when that object carried
	// neither redirection annotation: such a pod outside the mesh needs no
	// write either.
	bare map[podKey]string
	// writtenRV is the resourceVersion the API server gave the pod with this
	// process's last annotation write (by uid): the audit must not take a
	// cache that has not caught up with that write for someone else's.
	writtenRV map[podKey]uidVersion
	// sidecars says which pods were decided in Istio's sidecar mode: istiod
	// must not take them for ambient pods, so they never get
	// ambient.istio.io/redirection.
	sidecars map[podKey]sidecarMark
}

// sidecarMark is whether a pod (by uid) was decided in Istio's sidecar mode.
type sidecarMark struct {
	uid     string
	sidecar bool
}

// uidVersion is a pod's uid and a resourceVersion of it.
type uidVersion struct{ uid, rv string }

func startReporter(ctx context.Context, log *zap.Logger, client kubernetes.Interface, node string, istio bool, cached func(string, string) *corev1.Pod) *reporter {
	r := &reporter{
		log:    log,
		client: client,
		node:   node,
		istio:  istio,
		cached: cached,
		queue: workqueue.NewTypedRateLimitingQueueWithConfig(
			workqueue.NewTypedItemExponentialFailureRateLimiter[podKey](reportBaseDelay, reportMaxDelay),
			workqueue.TypedRateLimitingQueueConfig[podKey]{Name: "mesh-enrollment-outcomes"}),
		done:    make(chan struct{}),
		pending: map[podKey]*pendingReport{},
		written: map[podKey]writtenOutcome{},
		ignored: map[podKey]string{},
		bare:    map[podKey]string{},

		writtenRV: map[podKey]uidVersion{},
		sidecars:  map[podKey]sidecarMark{},
	}
	go func() {
		<-ctx.Done()
		r.queue.ShutDown()
	}()
	go r.work(ctx)
	return r
}

func (r *reporter) wait() { <-r.done }

func (r *reporter) report(namespace, name, uid, outcome string, err error) {
	r.queueReport(namespace, name, uid, outcome, err, false)
}

// correct queues outcome to be written even if this process wrote it last:
// the pod's annotations were changed by someone else since.
func (r *reporter) correct(namespace, name, uid, outcome string) {
	r.queueReport(namespace, name, uid, outcome, nil, true)
}

func (r *reporter) queueReport(namespace, name, uid, outcome string, err error, force bool) {
	if namespace == "" || name == "" {
		return
	}
	key := podKey{namespace, name}
	r.mu.Lock()
	p := r.pendingFor(key)
	if p.uid != uid {
		// A report for another pod of that name: what was forced is not.
		p.force = false
	}
	p.uid, p.outcome, p.force = uid, outcome, p.force || force
	if outcome == OutcomeFailed {
		msg := "mesh enrollment failed"
		if err != nil {
			msg = "mesh enrollment failed: " + err.Error()
		}
		p.addEvent(pendingEvent{uid: uid, reason: EventReasonEnrollFailed, message: msg})
	}
	r.mu.Unlock()
	r.queue.Add(key)
}

// pendingFor returns key's pending record, made if there is none; r.mu is held.
func (r *reporter) pendingFor(key podKey) *pendingReport {
	p := r.pending[key]
	if p == nil {
		p = &pendingReport{}
		r.pending[key] = p
	}
	return p
}

func (p *pendingReport) addEvent(ev pendingEvent) {
	p.events = append(p.events, ev)
	if len(p.events) > maxQueuedEvents {
		p.events = p.events[len(p.events)-maxQueuedEvents:]
	}
}

// optOutIgnored reports, once per pod and reason, that the pod's opt-out was
// ignored: a Warning Event on the pod (which whoever set the opt-out can
// see) and a log line.
func (r *reporter) optOutIgnored(namespace, name, uid, why string) {
	key := podKey{namespace, name}
	r.mu.Lock()
	if r.ignored[key] == uid+"\x00"+why {
		r.mu.Unlock()
		return
	}
	r.ignored[key] = uid + "\x00" + why
	p := r.pendingFor(key)
	if p.outcome == "" {
		p.uid = uid
	}
	p.addEvent(pendingEvent{uid: uid, reason: EventReasonOptOutIgnored, message: "pod " + why})
	r.mu.Unlock()
	r.log.Info("pod opt-out ignored", zap.String("namespace", namespace), zap.String("pod", name), zap.String("podUID", uid), zap.String("reason", why))
	r.queue.Add(key)
}

func (r *reporter) work(ctx context.Context) {
	defer close(r.done)
	for {
		key, quit := r.queue.Get()
		if quit {
			return
		}
		r.process(ctx, key)
		r.queue.Done(key)
	}
}

func (r *reporter) process(ctx context.Context, key podKey) {
	err := r.write(ctx, key)
	log := r.log.With(zap.String("namespace", key.namespace), zap.String("pod", key.name))
	switch {
	case err == nil:
		r.queue.Forget(key)
	case apierrors.IsNotFound(err) || apierrors.IsConflict(err) || apierrors.IsInvalid(err):
		// The pod is gone, or its name now belongs to another pod.
		log.Debug("enrollment outcome not written: the pod is gone", zap.Error(err))
		r.drop(key)
	case ctx.Err() != nil:
		r.drop(key)
	case transient(err):
		// The API server is away or overloaded: keep trying (at most every
		// reportMaxDelay) for as long as it takes; an outage must not lose the
		// record of what happened meanwhile.
		log.Debug("writing enrollment outcome failed, retrying", zap.Error(err))
		r.queue.AddRateLimited(key)
	case r.queue.NumRequeues(key) < reportRetries:
		log.Debug("writing enrollment outcome failed, retrying", zap.Error(err))
		r.queue.AddRateLimited(key)
	default:
		log.Error("enrollment outcome not written to the pod after retries", zap.Error(err))
		r.drop(key)
	}
}

// transient reports errors that say nothing about the request itself: no
// answer, a timeout, an overloaded or failing server.
func transient(err error) bool {
	var status apierrors.APIStatus
	if !errors.As(err, &status) {
		return true // no answer from the API server at all
	}
	return apierrors.IsServerTimeout(err) || apierrors.IsTimeout(err) || apierrors.IsTooManyRequests(err) ||
		apierrors.IsServiceUnavailable(err) || apierrors.IsInternalError(err) || apierrors.IsUnexpectedServerError(err)
}

func (r *reporter) drop(key podKey) {
	r.queue.Forget(key)
	r.mu.Lock()
	delete(r.pending, key)
	delete(r.written, key)
	delete(r.ignored, key)
	delete(r.bare, key)
	delete(r.writtenRV, key)
	r.mu.Unlock()
}

// write sends the pod's queued Events, then its annotation; each step that
// succeeds is taken off the pending record, so a retry repeats only what failed.
func (r *reporter) write(ctx context.Context, key podKey) error {
	r.mu.Lock()
	p := r.pending[key]
	if p == nil {
		r.mu.Unlock()
		return nil
	}
	uid, outcome, force := p.uid, p.outcome, p.force
	last, known := r.written[key]
	events := append([]pendingEvent(nil), p.events...)
	r.mu.Unlock()

	for _, ev := range events {
		if err := r.event(ctx, key, ev); err != nil {
			return fmt.Errorf("event for pod %s/%s: %w", key.namespace, key.name, err)
		}
		r.mu.Lock()
		if cur := r.pending[key]; cur == p && len(p.events) > 0 && p.events[0] == ev {
			p.events = p.events[1:]
		}
		r.mu.Unlock()
	}
	want := writtenOutcome{uid: uid, outcome: outcome}
	skip := outcome == "" || (last == want && !force) || (!force && r.unmarked(key, uid, outcome, last, known))
	if !skip && (!known || force) {
		// Nothing written by this process yet (e.g. after a restart), or a
		// correction of a value someone else wrote: the cache showing the
		// wanted value is good enough (it was put back meanwhile).
		c := r.cached(key.namespace, key.name)
		skip = c != nil && (uid == "" || string(c.UID) == uid) && c.Annotations[AnnotationRedirection] == outcome
		if r.istio && c != nil {
			v, ok := c.Annotations[IstioAnnotationRedirection]
			ambient := outcome == OutcomeEnabled && !r.sidecar(key, uid)
			skip = skip && ambient == ok && (!ok || v == OutcomeEnabled)
		}
	}
	if !skip {
		rv, err := r.annotate(ctx, key, uid, outcome)
		if err != nil {
			return fmt.Errorf("annotate pod %s/%s: %w", key.namespace, key.name, err)
		}
		r.mu.Lock()
		r.writtenRV[key] = uidVersion{uid: uid, rv: rv}
		r.mu.Unlock()
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	if outcome != "" {
		r.written[key] = want
	}
	if cur := r.pending[key]; cur == p && p.outcome == outcome && p.uid == uid {
		p.force = false
	}
	// Done unless a newer report came in meanwhile (it queued the key again).
	if cur := r.pending[key]; cur == p && p.outcome == outcome && p.uid == uid && len(p.events) == 0 {
		delete(r.pending, key)
	}
	return nil
}

// unmarked reports whether outcome needs no write because the pod outside
// the mesh carries no redirection annotation to correct: nothing reads
// "disabled" that the annotation's absence does not say as well (istiod
// looks for ambient.istio.io/redirection=enabled; the gate's List and the
// agent's status show every skipped pod), and a write per pod start outside
// the mesh is an API write and a watch event for every pod watcher in the
// cluster. What this process wrote last for the pod counts first (the cache
// can lag behind it), then the cache, then the object a direct GET returned.
// When nothing tells, the write is made.
func (r *reporter) unmarked(key podKey, uid, outcome string, last writtenOutcome, known bool) bool {
	if outcome != OutcomeDisabled {
		return false
	}
	if known && last.uid == uid {
		return last.outcome == OutcomeDisabled
	}
	if c := r.cached(key.namespace, key.name); c != nil && (uid == "" || string(c.UID) == uid) {
		return !hasRedirection(c.Annotations)
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	return uid != "" && r.bare[key] == uid
}

// hasRedirection reports whether annotations carry either redirection
// annotation, whatever its value.
func hasRedirection(annotations map[string]string) bool {
	_, ours := annotations[AnnotationRedirection]
	_, istio := annotations[IstioAnnotationRedirection]
	return ours || istio
}

// observe records what a pod decided from a direct GET carried, for
// unmarked.
func (r *reporter) observe(namespace, name, uid string, annotations map[string]string) {
	key := podKey{namespace, name}
	r.mu.Lock()
	defer r.mu.Unlock()
	if hasRedirection(annotations) {
		delete(r.bare, key)
		return
	}
	r.bare[key] = uid
}

// markSidecar records whether the pod was decided in Istio's sidecar mode.
func (r *reporter) markSidecar(namespace, name, uid string, sidecar bool) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.sidecars[podKey{namespace, name}] = sidecarMark{uid: uid, sidecar: sidecar}
}

// sidecar reports whether the pod runs Istio's sidecar: as this process
// decided it, or, for a pod it has not decided yet (after a restart), as its
// cached object says, so that a sidecar pod is never taken for ambient.
func (r *reporter) sidecar(key podKey, uid string) bool {
	r.mu.Lock()
	m, ok := r.sidecars[key]
	r.mu.Unlock()
	if ok && m.uid == uid {
		return m.sidecar
	}
	if c := r.cached(key.namespace, key.name); c != nil && (uid == "" || string(c.UID) == uid) {
		in, _ := IstioSidecarPod(c)
		return in
	}
	return false
}

// forget drops what is remembered of a pod that was deleted.
func (r *reporter) forget(namespace, name string) {
	r.mu.Lock()
	defer r.mu.Unlock()
	delete(r.sidecars, podKey{namespace, name})
	delete(r.written, podKey{namespace, name})
	delete(r.ignored, podKey{namespace, name})
	delete(r.bare, podKey{namespace, name})
	delete(r.writtenRV, podKey{namespace, name})
}

// behind reports whether the cached pod p predates this process's last
// annotation write to it: the cache has not caught up with that write yet
// (the watch lags in a burst of pod starts), so what it shows is no
// disagreement to correct. resourceVersions are compared as etcd's
// revisions; one that does not parse as such is never taken as behind.
func (r *reporter) behind(p *corev1.Pod) bool {
	r.mu.Lock()
	w, ok := r.writtenRV[podKey{p.Namespace, p.Name}]
	r.mu.Unlock()
	if !ok || w.uid != string(p.UID) {
		return false
	}
	cached, err1 := strconv.ParseUint(p.ResourceVersion, 10, 64)
	written, err2 := strconv.ParseUint(w.rv, 10, 64)
	return err1 == nil && err2 == nil && cached < written
}

// annotate writes the outcome and returns the pod's resourceVersion after it.
func (r *reporter) annotate(ctx context.Context, key podKey, uid, outcome string) (string, error) {
	annotations := map[string]any{AnnotationRedirection: outcome}
	if r.istio {
		// null removes it (a merge patch).
		annotations[IstioAnnotationRedirection] = nil
		if outcome == OutcomeEnabled && !r.sidecar(key, uid) {
			annotations[IstioAnnotationRedirection] = OutcomeEnabled
		}
	}
	meta := map[string]any{"annotations": annotations}
	if uid != "" {
		// The API server refuses a patch whose uid differs from the stored
		// pod's: the outcome never lands on a re-created pod of the same name.
		meta["uid"] = uid
	}
	body, err := json.Marshal(map[string]any{"metadata": meta})
	if err != nil {
		return "", err
	}
	ctx, cancel := context.WithTimeout(ctx, reportTimeout)
	defer cancel()
	p, err := r.client.CoreV1().Pods(key.namespace).Patch(ctx, key.name, types.MergePatchType, body, metav1.PatchOptions{FieldManager: "mesh-agent"})
	if err != nil {
		return "", err
	}
	return p.ResourceVersion, nil
}

func (r *reporter) event(ctx context.Context, key podKey, pe pendingEvent) error {
	uid, msg := pe.uid, pe.message
	if len(msg) > maxEventMessage {
		msg = msg[:maxEventMessage-3] + "..."
	}
	now := metav1.Now()
	ev := &corev1.Event{
		ObjectMeta: metav1.ObjectMeta{
			// kubelet's convention: the object's name and a unique suffix.
			Name:      fmt.Sprintf("%s.%x", key.name, time.Now().UnixNano()),
			Namespace: key.namespace,
		},
		InvolvedObject: corev1.ObjectReference{
			Kind: "Pod", APIVersion: "v1", Namespace: key.namespace, Name: key.name, UID: types.UID(uid),
		},
		Reason:              pe.reason,
		Message:             msg,
		Type:                corev1.EventTypeWarning,
		Source:              corev1.EventSource{Component: eventSourceComponent, Host: r.node},
		FirstTimestamp:      now,
		LastTimestamp:       now,
		Count:               1,
		ReportingController: eventReportingController,
		ReportingInstance:   eventSourceComponent + "-" + r.node,
	}
	ctx, cancel := context.WithTimeout(ctx, reportTimeout)
	defer cancel()
	_, err := r.client.CoreV1().Events(key.namespace).Create(ctx, ev, metav1.CreateOptions{})
	switch {
	case apierrors.IsAlreadyExists(err):
		return nil
	case apierrors.IsInvalid(err):
		// Retrying cannot help, and the annotation must still be written.
		r.log.Error("enrollment Event refused by the API server", zap.String("namespace", key.namespace), zap.String("pod", key.name), zap.Error(err))
		return nil
	}
	return err
}
