package enroll

import (
	"context"
	"errors"
	"fmt"
	"math"
	"math/rand/v2"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	"go.uber.org/zap"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/fields"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/apimachinery/pkg/watch"
	"k8s.io/client-go/kubernetes"
	corelisters "k8s.io/client-go/listers/core/v1"
	"k8s.io/client-go/tools/cache"

	"github.com/mesh-cni/mesh-cni/internal/agent"
	"github.com/mesh-cni/mesh-cni/internal/podstore"
	"github.com/mesh-cni/mesh-cni/pkg/gate/gatepb"
)

// Defaults of KubeConfig.
const (
	DefaultAPITimeout = 10 * time.Second
	// perAttemptTimeout bounds one GET, so a black-holed API server still gets
	// several tries within the APITimeout.
	perAttemptTimeout = 3 * time.Second
	firstRetryDelay   = 100 * time.Millisecond
	maxRetryDelay     = time.Second
	// watchGrace is how long a decision whose pod the cache lacks waits for
	// the agent's own watch to deliver it before asking the API server. The
	// kubelet calls CNI after its own watch delivered the pod, so the agent's
	// usually has it too or gets it within milliseconds; a read now would be
	// a request per pod start, and in a burst of pod starts (when the watch
	// lags because the API server is busy) it would add to what keeps the
	// server busy.
	watchGrace = 500 * time.Millisecond
	// retryJitter spreads retries by up to this fraction of their delay, so
	// that agents who missed the same object do not ask again in step.
	retryJitter = 0.5
	// DefaultStartJitter bounds the random delay before the first list and
	// watch: agents restarted together (a DaemonSet rollout, a node pool
	// coming back) do not all open their watches in the same instant.
	DefaultStartJitter = time.Second
)

// Resources a cache miss is counted by (KubeConfig.CacheMiss).
const (
	ResourcePod       = "pod"
	ResourceNamespace = "namespace"
)

// KubeConfig configures a KubeSource.
type KubeConfig struct {
	// Client talks to the API server with the agent's own credentials.
	Client kubernetes.Interface
	// NodeName scopes the pod cache to this node (field selector spec.nodeName).
	NodeName string
	// Selectors decide from the labels; see ProfileSelectors.
	Selectors Selectors
	// APITimeout bounds how long Decide waits for the API server when a pod or
	// namespace is not in the caches yet (the caller's deadline also applies).
	// Keep it below the plugin's gateTimeout so the pod's ADD gets this clear
	// error rather than a bare timeout. Default DefaultAPITimeout.
	APITimeout time.Duration
	// StartJitter bounds a random delay before the caches' first list and
	// watch (the agent is not ready meanwhile); 0 starts at once.
	StartJitter time.Duration
	Logger      *zap.Logger
}

// KubeSource is the Kubernetes enrollment source: shared informers on this
// node's pods and on namespaces, label selectors, and a direct GET with bounded
// retries for a pod the cache does not have yet. It never guesses: when the
// answer cannot be known, Decide returns an error and the agent fails the ADD.
// It implements agent.Policy and the agent's optional PolicyWatcher,
// PolicySyncer and OutcomeReporter interfaces.
type KubeSource struct {
	cfg     KubeConfig
	log     *zap.Logger
	client  kubernetes.Interface
	podInf  cache.SharedIndexInformer
	nsInf   cache.SharedIndexInformer
	pods    corelisters.PodLister
	ns      corelisters.NamespaceLister
	changed *notifier
	// podSeen is notified on every pod the watch delivers (watchGrace).
	podSeen   *notifier
	reporter  *reporter
	cancel    context.CancelFunc
	informers sync.WaitGroup

	mu       sync.Mutex
	watchErr map[string]error // by resource: the last list/watch error, for Synced's reason
	miss     func(resource string)
}

var (
	_ agent.Policy          = (*KubeSource)(nil)
	_ agent.PolicyWatcher   = (*KubeSource)(nil)
	_ agent.PolicySyncer    = (*KubeSource)(nil)
	_ agent.OutcomeReporter = (*KubeSource)(nil)
	_ agent.OutcomeAuditor  = (*KubeSource)(nil)

	_ agent.ServiceAccountSource = (*KubeSource)(nil)
	_ agent.CacheMissNotifier    = (*KubeSource)(nil)
	_ agent.RunningPodLister     = (*KubeSource)(nil)
)

// StartKubeSource starts the informers; they run until ctx is cancelled or
// Close is called. It does not wait for them to sync: Synced says when they
// have (the agent stays not ready until then).
func StartKubeSource(ctx context.Context, cfg KubeConfig) (*KubeSource, error) {
	if cfg.Client == nil {
		return nil, errors.New("kubernetes enrollment source: no API client")
	}
	if cfg.NodeName == "" {
		return nil, errors.New("kubernetes enrollment source: no node name (set --node-name or $NODE_NAME, e.g. from the downward API spec.nodeName)")
	}
	if cfg.Selectors.Profile == "" {
		sel, err := ProfileSelectors("")
		if err != nil {
			return nil, err
		}
		cfg.Selectors = sel
	}
	if cfg.APITimeout <= 0 {
		cfg.APITimeout = DefaultAPITimeout
	}
	if cfg.Logger == nil {
		cfg.Logger = zap.NewNop()
	}
	k := &KubeSource{
		cfg:      cfg,
		log:      cfg.Logger.With(zap.String("node", cfg.NodeName)),
		client:   cfg.Client,
		changed:  newNotifier(),
		podSeen:  newNotifier(),
		watchErr: map[string]error{},
	}
	onNode := fields.OneTermEqualSelector("spec.nodeName", cfg.NodeName).String()
	pods := cfg.Client.CoreV1().Pods(metav1.NamespaceAll)
	k.podInf = k.informer("pods", &corev1.Pod{},
		func(ctx context.Context, o metav1.ListOptions) (runtime.Object, error) {
			o.FieldSelector = onNode
			return pods.List(ctx, o)
		},
		func(ctx context.Context, o metav1.ListOptions) (watch.Interface, error) {
			o.FieldSelector = onNode
			return pods.Watch(ctx, o)
		})
	k.pods = corelisters.NewPodLister(k.podInf.GetIndexer())
	namespaces := cfg.Client.CoreV1().Namespaces()
	k.nsInf = k.informer("namespaces", &corev1.Namespace{},
		func(ctx context.Context, o metav1.ListOptions) (runtime.Object, error) {
			return namespaces.List(ctx, o)
		},
		func(ctx context.Context, o metav1.ListOptions) (watch.Interface, error) {
			return namespaces.Watch(ctx, o)
		})
	k.ns = corelisters.NewNamespaceLister(k.nsInf.GetIndexer())
	for _, step := range []error{
		k.podInf.SetTransform(trimPod),
		k.nsInf.SetTransform(trimNamespace),
		k.podInf.SetWatchErrorHandlerWithContext(k.watchError("pods")),
		k.nsInf.SetWatchErrorHandlerWithContext(k.watchError("namespaces")),
	} {
		if step != nil {
			return nil, fmt.Errorf("kubernetes enrollment source: %w", step)
		}
	}
	if _, err := k.podInf.AddEventHandler(cache.ResourceEventHandlerDetailedFuncs{
		AddFunc: func(_ any, initial bool) {
			k.podSeen.notify()
			// A pod decided from a direct GET may have changed before the
			// watch delivered it: the agent re-decides from the cache.
			if !initial {
				k.changed.notify()
			}
		},
		UpdateFunc: func(oldObj, newObj any) {
			k.podSeen.notify()
			k.podUpdated(oldObj, newObj)
		},
		DeleteFunc: func(obj any) {
			if tomb, ok := obj.(cache.DeletedFinalStateUnknown); ok {
				obj = tomb.Obj
			}
			if p, ok := obj.(*corev1.Pod); ok {
				k.reporter.forget(p.Namespace, p.Name)
			}
		},
	}); err != nil {
		return nil, fmt.Errorf("kubernetes enrollment source: %w", err)
	}
	if _, err := k.nsInf.AddEventHandler(cache.ResourceEventHandlerDetailedFuncs{
		AddFunc: func(_ any, initial bool) {
			// A namespace made after the start may be one a pod waits on.
			if !initial {
				k.changed.notify()
			}
		},
		UpdateFunc: k.namespaceUpdated,
	}); err != nil {
		return nil, fmt.Errorf("kubernetes enrollment source: %w", err)
	}
	ctx, k.cancel = context.WithCancel(ctx)
	k.reporter = startReporter(ctx, k.log, cfg.Client, cfg.NodeName, cfg.Selectors.Profile == ProfileIstio, k.cachedPod)
	delay := time.Duration(0)
	if cfg.StartJitter > 0 {
		delay = time.Duration(rand.Int64N(int64(cfg.StartJitter)))
	}
	for _, inf := range []cache.SharedIndexInformer{k.podInf, k.nsInf} {
		k.informers.Add(1)
		go func() {
			defer k.informers.Done()
			t := time.NewTimer(delay)
			defer t.Stop()
			select {
			case <-ctx.Done():
				return
			case <-t.C:
			}
			inf.RunWithContext(ctx)
		}()
	}
	return k, nil
}

// OnCacheMiss implements agent.CacheMissNotifier: miss is called with
// ResourcePod or ResourceNamespace each time a decision has to ask the API
// server for an object its cache lacks.
func (k *KubeSource) OnCacheMiss(miss func(resource string)) {
	k.mu.Lock()
	defer k.mu.Unlock()
	k.miss = miss
}

func (k *KubeSource) cacheMiss(resource string) {
	k.mu.Lock()
	miss := k.miss
	k.mu.Unlock()
	if miss != nil {
		miss(resource)
	}
}

// Close stops the informers and the outcome reporter and waits for them.
// Outcomes still queued are dropped.
func (k *KubeSource) Close() error {
	k.cancel()
	k.informers.Wait()
	k.reporter.wait()
	return nil
}

// informer is a shared informer whose list and watch calls record their
// errors: the reflector retries a refused connection internally, without
// telling its error handler, and "not synced" should say why.
func (k *KubeSource) informer(resource string, example runtime.Object,
	list func(context.Context, metav1.ListOptions) (runtime.Object, error),
	watchFn func(context.Context, metav1.ListOptions) (watch.Interface, error)) cache.SharedIndexInformer {
	lw := &cache.ListWatch{
		ListWithContextFunc: func(ctx context.Context, o metav1.ListOptions) (runtime.Object, error) {
			obj, err := list(ctx, o)
			k.noteListWatch(resource, err)
			return obj, err
		},
		WatchFuncWithContext: func(ctx context.Context, o metav1.ListOptions) (watch.Interface, error) {
			w, err := watchFn(ctx, o)
			k.noteListWatch(resource, err)
			return w, err
		},
	}
	return cache.NewSharedIndexInformer(lw, example, 0, cache.Indexers{cache.NamespaceIndex: cache.MetaNamespaceIndexFunc})
}

func (k *KubeSource) noteListWatch(resource string, err error) {
	k.mu.Lock()
	defer k.mu.Unlock()
	if err == nil {
		delete(k.watchErr, resource)
		return
	}
	k.watchErr[resource] = fmt.Errorf("list/watch %s: %w", resource, err)
}

func (k *KubeSource) watchError(resource string) cache.WatchErrorHandlerWithContext {
	return func(_ context.Context, _ *cache.Reflector, err error) {
		k.noteListWatch(resource, err)
		// The reflector backs off between attempts, which rate-limits this.
		k.log.Warn("kubernetes enrollment source: list/watch failed, retrying", zap.String("resource", resource), zap.Error(err))
	}
}

// Synced implements agent.PolicySyncer: both caches have their first full list.
func (k *KubeSource) Synced() (bool, string) {
	if k.podInf.HasSynced() && k.nsInf.HasSynced() {
		return true, ""
	}
	why := "waiting for the pod (spec.nodeName=" + k.cfg.NodeName + ") and namespace caches to sync from the API server"
	k.mu.Lock()
	defer k.mu.Unlock()
	for _, resource := range []string{"pods", "namespaces"} {
		if err := k.watchErr[resource]; err != nil {
			why += "; " + err.Error()
		}
	}
	return false, why
}

// Changed implements agent.PolicyWatcher: the channel is closed when a pod's or
// namespace's labels change in a way that can change a decision.
func (k *KubeSource) Changed() <-chan struct{} { return k.changed.wait() }

func (k *KubeSource) podUpdated(oldObj, newObj any) {
	o, ok1 := oldObj.(*corev1.Pod)
	n, ok2 := newObj.(*corev1.Pod)
	if !ok1 || !ok2 {
		return
	}
	// Compared by outcome, not by labels: the agent's own annotation write
	// (and every status change) must not wake a re-decision of every pod.
	nsLabels := k.cachedNamespaceLabels(n.Namespace)
	before := k.cfg.Selectors.Decide(o.Namespace, nsLabels, o.Labels, o.Annotations)
	after := k.cfg.Selectors.Decide(n.Namespace, nsLabels, n.Labels, n.Annotations)
	if before.Enroll != after.Enroll || o.UID != n.UID || k.captureChanged(o, n) || terminated(o) != terminated(n) {
		k.changed.notify()
	}
	if terminated(n) && !terminated(o) && n.DeletionTimestamp == nil && n.Annotations[AnnotationRedirection] == OutcomeEnabled {
		// Re-deciding releases it if the agent still has it; if its sandbox's
		// DEL came first there is nothing left to release, and this is what
		// takes the annotations off at once rather than at the next audit.
		k.reporter.report(n.Namespace, n.Name, string(n.UID), OutcomeDisabled, nil)
	}
}

// terminated reports a pod whose containers have all exited for good (phase
// Succeeded or Failed): a Job's pod stays in the API that way. It is out of
// the mesh, as istio-cni takes it out (and off istiod's HBONE workloads): a
// pod that will never run again has nothing for ztunnel to serve.
func terminated(p *corev1.Pod) bool {
	return p.Status.Phase == corev1.PodSucceeded || p.Status.Phase == corev1.PodFailed
}

// captureChanged: the pod's own capture annotations changed, or its sidecar
// container's id (a sidecar started or restarted), which the agent applies to
// a running pod in place.
func (k *KubeSource) captureChanged(o, n *corev1.Pod) bool {
	if k.cfg.Selectors.Profile != ProfileIstio {
		return false
	}
	if !IstioCapture(o.Annotations).Equal(IstioCapture(n.Annotations)) {
		return true
	}
	sidecar, _ := IstioSidecarPod(n)
	return sidecar && IstioProxyContainerID(o) != IstioProxyContainerID(n)
}

// istioSidecarDecision enrolls a pod Istio injected with a sidecar
// (IstioSidecarPod) in sidecar mode, as istio-cni captures it: for its own
// proxy, never the node proxy's. Annotations that do not parse fail it.
func istioSidecarDecision(p *corev1.Pod, serviceAccount string) (agent.Decision, error) {
	sc, err := IstioSidecarCapture(p)
	if err != nil {
		return agent.Decision{}, err
	}
	sc.ProxyContainer = IstioProxyContainerID(p)
	ports := KubeletPorts(p)
	return agent.Decision{
		Enroll:         true,
		Reason:         fmt.Sprintf("Istio sidecar injected (%s): captured for the pod's own %s container, as istio-cni's sidecar mode", IstioAnnotationSidecar, IstioProxyContainer),
		ServiceAccount: serviceAccount,
		Capture:        podstore.Capture{Sidecar: sc, KubeletPorts: &ports},
	}, nil
}

func (k *KubeSource) namespaceUpdated(oldObj, newObj any) {
	o, ok1 := oldObj.(*corev1.Namespace)
	n, ok2 := newObj.(*corev1.Namespace)
	if !ok1 || !ok2 {
		return
	}
	_, before := k.cfg.Selectors.NamespaceEnabled(o.Name, o.Labels)
	_, after := k.cfg.Selectors.NamespaceEnabled(n.Name, n.Labels)
	if before != after || Enforced(o.Labels) != Enforced(n.Labels) {
		k.changed.notify()
	}
}

// Decide implements agent.Policy. Labels come from the caches (or a direct
// GET), never from the request: only the API server's copy is authoritative.
func (k *KubeSource) Decide(ctx context.Context, pod *gatepb.PodIdentity) (agent.Decision, error) {
	ns, name, uid := pod.GetNamespace(), pod.GetName(), pod.GetUid()
	if ns == "" || name == "" {
		return agent.Decision{}, fmt.Errorf("the request names no pod (namespace %q, name %q; CNI_ARGS K8S_POD_NAMESPACE and K8S_POD_NAME): the Kubernetes enrollment source cannot look it up", ns, name)
	}
	if ok, why := k.Synced(); !ok {
		return agent.Decision{}, fmt.Errorf("kubernetes enrollment source not synced: %s", why)
	}
	p, err := k.lookupPod(ctx, ns, name, uid)
	if err != nil {
		return agent.Decision{}, err
	}
	nsObj, err := k.lookupNamespace(ctx, ns)
	if err != nil {
		return agent.Decision{}, err
	}
	k.reporter.observe(ns, name, string(p.UID), p.Annotations)
	d, ignored := k.cfg.Selectors.decide(ns, nsObj.Labels, p.Labels, p.Annotations)
	d.ServiceAccount = serviceAccountOf(p)
	if terminated(p) {
		d.Enroll = false
		d.Reason = fmt.Sprintf("the pod has terminated (phase %s)", p.Status.Phase)
		return d, nil
	}
	if k.cfg.Selectors.Profile == ProfileIstio {
		// A namespace that enforces the mesh overrules a sidecar as it does
		// any opt-out: its pods are the node proxy's, and a pod cannot make
		// itself its own proxy there.
		sidecar, _ := IstioSidecarPod(p)
		sidecar = sidecar && !Enforced(nsObj.Labels)
		k.reporter.markSidecar(ns, name, string(p.UID), sidecar)
		if sidecar {
			return istioSidecarDecision(p, d.ServiceAccount)
		}
		d.Capture = IstioCapture(p.Annotations)
		// Leaving inbound uncaptured, or DNS to the node's resolver, opts out
		// of part of the mesh: where the namespace enforces it, ignored and said.
		overrule := func(annotation string) {
			why := fmt.Sprintf("annotation %s=%s, ignored: namespace %s enforces the mesh (%s=%s)",
				annotation, p.Annotations[annotation], ns, LabelEnforce, ValueEnforce)
			d.Reason += "; " + why
			ignored = strings.TrimPrefix(ignored+"; "+why, "; ")
		}
		if d.Enroll && Enforced(nsObj.Labels) {
			if d.Capture.BypassInbound {
				d.Capture.BypassInbound = false
				overrule(IstioAnnotationBypassInbound)
			}
			if d.Capture.DNS != nil && !*d.Capture.DNS {
				d.Capture.DNS = nil
				overrule(IstioAnnotationDNSCapture)
			}
		}
	}
	if d.Enroll {
		ports := KubeletPorts(p)
		d.Capture.KubeletPorts = &ports
	}
	if ignored != "" {
		k.reporter.optOutIgnored(ns, name, string(p.UID), ignored)
	}
	return d, nil
}

// AuditOutcomes implements agent.OutcomeAuditor: each pod of this node whose
// redirection annotations say other than captured(uid) has them rewritten,
// and the disagreement is logged. mesh-cni.io/redirection=enabled on a pod
// not captured becomes disabled (failed and disabled both say "not
// captured", and stay); on a captured pod it must be enabled. Under the
// istio profile ambient.istio.io/redirection must be enabled on a captured
// pod and absent on any other: istiod sends HBONE to a pod that has it.
// Pods being deleted are left alone: their records go with their DEL; so are
// terminated pods the agent still has, which re-deciding releases, and pods
// pending(uid), which the adoption decides and reports.
func (k *KubeSource) AuditOutcomes(_ context.Context, captured, pending func(uid string) bool) {
	if ok, _ := k.Synced(); !ok {
		return
	}
	pods, err := k.pods.List(labels.Everything())
	if err != nil {
		k.log.Warn("audit redirection annotations: list this node's pods", zap.Error(err))
		return
	}
	for _, p := range pods {
		if p.Spec.NodeName != k.cfg.NodeName || p.DeletionTimestamp != nil || k.reporter.behind(p) || pending(string(p.UID)) {
			continue
		}
		outcome := p.Annotations[AnnotationRedirection]
		istioValue, istio := p.Annotations[IstioAnnotationRedirection]
		istio = istio && k.reporter.istio // the istio profile's only
		in := captured(string(p.UID))
		if hash := p.Annotations[corev1.MirrorPodAnnotationKey]; hash != "" {
			// A static pod reaches the gate under its manifest's uid.
			in = in || captured(hash)
		}
		if in && terminated(p) {
			// Being released (the phase change woke a re-decision), which
			// reports it; rewriting enabled now would only flap.
			continue
		}
		var want string
		disagree := false
		switch {
		case in:
			want = OutcomeEnabled
			// A sidecar pod is not ambient: istiod must not see it enabled.
			ambient := k.reporter.istio && !k.reporter.sidecar(podKey{p.Namespace, p.Name}, string(p.UID))
			disagree = outcome != OutcomeEnabled || (ambient && istioValue != OutcomeEnabled) || (!ambient && istio)
		case outcome == OutcomeDisabled || outcome == OutcomeFailed:
			want = outcome
			disagree = istio
		default:
			want = OutcomeDisabled
			disagree = outcome == OutcomeEnabled || istio
		}
		if !disagree {
			continue
		}
		fields := []zap.Field{zap.String("namespace", p.Namespace), zap.String("pod", p.Name), zap.String("podUID", string(p.UID)),
			zap.Bool("captured", in), zap.String(AnnotationRedirection, outcome), zap.String("rewrittenTo", want)}
		if k.reporter.istio {
			fields = append(fields, zap.String(IstioAnnotationRedirection, istioValue))
		}
		k.log.Warn("pod's redirection annotations disagree with its data path; rewriting them", fields...)
		k.reporter.correct(p.Namespace, p.Name, string(p.UID), want)
	}
}

// RunningPods implements agent.RunningPodLister: the pods of this node that
// run in a network namespace of their own, as the cache has them. Pods being
// deleted are left out: they are on their way out of the mesh anyway.
func (k *KubeSource) RunningPods() ([]agent.RunningPod, error) {
	if ok, why := k.Synced(); !ok {
		return nil, fmt.Errorf("kubernetes enrollment source not synced: %s", why)
	}
	pods, err := k.pods.List(labels.Everything())
	if err != nil {
		return nil, fmt.Errorf("list this node's pods: %w", err)
	}
	var out []agent.RunningPod
	for _, p := range pods {
		if p.Spec.NodeName != k.cfg.NodeName || p.Spec.HostNetwork || p.Status.Phase != corev1.PodRunning || p.DeletionTimestamp != nil {
			continue
		}
		rp := agent.RunningPod{
			Pod:       &gatepb.PodIdentity{Namespace: p.Namespace, Name: p.Name, Uid: string(p.UID), Labels: p.Labels, Annotations: p.Annotations},
			CgroupUID: string(p.UID),
		}
		// A static pod's containers run under the uid of its manifest (the
		// hash its mirror pod carries), not the mirror pod's.
		if hash := p.Annotations[corev1.MirrorPodAnnotationKey]; hash != "" {
			rp.CgroupUID = hash
		}
		for _, ip := range p.Status.PodIPs {
			rp.IPs = append(rp.IPs, ip.IP)
		}
		out = append(out, rp)
	}
	return out, nil
}

// IstioCapture reads the per-pod capture annotations istio-cni honours: a
// boolean (strconv.ParseBool) ambient.istio.io/dns-capture overrides the node's
// DNS capture, ambient.istio.io/bypass-inbound-capture=true leaves the pod's
// inbound connections uncaptured. A value that does not parse is ignored, as
// istio-cni ignores it.
func IstioCapture(annotations map[string]string) podstore.Capture {
	var c podstore.Capture
	if v, err := strconv.ParseBool(annotations[IstioAnnotationDNSCapture]); err == nil {
		c.DNS = &v
	}
	if v, err := strconv.ParseBool(annotations[IstioAnnotationBypassInbound]); err == nil {
		c.BypassInbound = v
	}
	return c
}

// serviceAccountOf is the pod's service account as the API server admitted it:
// its ServiceAccount admission sets "default" when the pod names none, so an
// empty name means an object that did not pass admission.
func serviceAccountOf(p *corev1.Pod) string {
	return p.Spec.ServiceAccountName
}

// KnowsServiceAccounts implements agent.ServiceAccountSource.
func (k *KubeSource) KnowsServiceAccounts() bool { return true }

func (k *KubeSource) cachedPod(ns, name string) *corev1.Pod {
	p, err := k.pods.Pods(ns).Get(name)
	if err != nil {
		return nil
	}
	return p
}

func (k *KubeSource) cachedNamespaceLabels(ns string) map[string]string {
	n, err := k.ns.Get(ns)
	if err != nil {
		return nil
	}
	return n.Labels
}

func (k *KubeSource) lookupPod(ctx context.Context, ns, name, uid string) (*corev1.Pod, error) {
	fromCache := func() (*corev1.Pod, bool) {
		p := k.cachedPod(ns, name)
		// A cached pod with another uid is the previous pod of that name (a
		// StatefulSet re-creating it) and the watch has not caught up.
		return p, p != nil && (uid == "" || string(p.UID) == uid)
	}
	if p, ok := fromCache(); ok {
		return p, nil
	}
	// The grace comes out of the API timeout: the ADD's wait stays bounded
	// by it, as documented.
	grace := min(watchGrace, k.cfg.APITimeout/4)
	if p, ok := k.awaitWatch(ctx, grace, fromCache); ok {
		return p, nil
	}
	k.cacheMiss(ResourcePod)
	what := fmt.Sprintf("pod %s/%s", ns, name)
	return getWithRetry(ctx, k.cfg.APITimeout-grace, what, fromCache, func(ctx context.Context) (*corev1.Pod, error) {
		return cacheFirst(ctx, func(ctx context.Context, o metav1.GetOptions) (*corev1.Pod, error) {
			p, err := k.client.CoreV1().Pods(ns).Get(ctx, name, o)
			if err != nil {
				return nil, err
			}
			if uid != "" && string(p.UID) != uid {
				err := fmt.Errorf("%s has uid %s in the API server, not %s: the pod being added was deleted", what, p.UID, uid)
				if o.ResourceVersion == "" {
					return nil, permanent(err)
				}
				// The watch cache may still hold the previous pod of that
				// name; only a quorum read says the new one is gone.
				return nil, staleError{err}
			}
			return p, nil
		})
	})
}

// awaitWatch waits up to grace (and the caller's deadline) for the pod watch
// to deliver what cached looks for.
func (k *KubeSource) awaitWatch(ctx context.Context, grace time.Duration, cached func() (*corev1.Pod, bool)) (*corev1.Pod, bool) {
	t := time.NewTimer(grace)
	defer t.Stop()
	for {
		seen := k.podSeen.wait()
		// Taken before the look, so a delivery in between is not missed.
		if p, ok := cached(); ok {
			return p, true
		}
		select {
		case <-ctx.Done():
			return nil, false
		case <-t.C:
			return nil, false
		case <-seen:
		}
	}
}

func (k *KubeSource) lookupNamespace(ctx context.Context, ns string) (*corev1.Namespace, error) {
	fromCache := func() (*corev1.Namespace, bool) {
		n, err := k.ns.Get(ns)
		return n, err == nil
	}
	if n, ok := fromCache(); ok {
		return n, nil
	}
	k.cacheMiss(ResourceNamespace)
	return getWithRetry(ctx, k.cfg.APITimeout, "namespace "+ns, fromCache, func(ctx context.Context) (*corev1.Namespace, error) {
		return cacheFirst(ctx, func(ctx context.Context, o metav1.GetOptions) (*corev1.Namespace, error) {
			return k.client.CoreV1().Namespaces().Get(ctx, ns, o)
		})
	})
}

// staleError is a read from the API server's watch cache that a quorum read
// may contradict.
type staleError struct{ error }

func (e staleError) Unwrap() error { return e.error }

// cacheFirst reads an object from the API server's watch cache
// (resourceVersion=0: no etcd round trip, the same source and freshness as
// the agent's own watch, which every other decision reads), and only when
// that has no such object, or a stale one, from etcd with a quorum read. A
// cache miss of a brand-new pod (the agent's watch not there yet) is then
// usually answered without touching etcd, and a thousand agents missing at
// once do not become a thousand etcd reads.
func cacheFirst[T any](ctx context.Context, get func(context.Context, metav1.GetOptions) (T, error)) (T, error) {
	obj, err := get(ctx, metav1.GetOptions{ResourceVersion: "0"})
	var stale staleError
	if err == nil || !(apierrors.IsNotFound(err) || errors.As(err, &stale)) {
		return obj, err
	}
	return get(ctx, metav1.GetOptions{})
}

type permanentError struct{ error }

func (e permanentError) Unwrap() error { return e.error }

func permanent(err error) error { return permanentError{err} }

// getWithRetry asks the API server for an object the cache lacks, retrying
// (and looking in the cache again between tries, where the watch may have put
// it meanwhile) until it answers or timeout passes. Not found is retried too:
// an object can reach this node's runtime before the API server's answer
// settles for a brand-new pod, and a wrong "no" would be a guess.
func getWithRetry[T any](ctx context.Context, timeout time.Duration, what string, cached func() (T, bool), get func(context.Context) (T, error)) (T, error) {
	start := time.Now()
	ctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	var (
		obj      T
		attempts int
		lastErr  error
	)
	// The delay runs from the end of one try to the start of the next
	// (sliding), as a try can take up to perAttemptTimeout.
	retry := wait.Backoff{Duration: firstRetryDelay, Factor: 2, Jitter: retryJitter, Cap: maxRetryDelay, Steps: math.MaxInt32}
	err := retry.DelayFunc().Until(ctx, true, true, func(ctx context.Context) (bool, error) {
		if attempts > 0 {
			if o, ok := cached(); ok {
				obj = o
				return true, nil
			}
		}
		attempts++
		actx, acancel := context.WithTimeout(ctx, perAttemptTimeout)
		o, err := get(actx)
		acancel()
		if err == nil {
			obj = o
			return true, nil
		}
		var perm permanentError
		if errors.As(err, &perm) {
			return false, perm.error
		}
		lastErr = err
		return false, nil
	})
	var zero T
	switch {
	case err == nil:
		return obj, nil
	case lastErr != nil && errors.Is(err, ctx.Err()):
		return zero, unknownError(what, start, attempts, lastErr)
	default:
		return zero, err
	}
}

func unknownError(what string, start time.Time, attempts int, lastErr error) error {
	waited := time.Since(start).Round(10 * time.Millisecond)
	if apierrors.IsNotFound(lastErr) {
		return fmt.Errorf("cannot decide enrollment: %s is not in the agent's cache and the API server does not know it (asked %d times over %s); refusing to start the pod unmeshed: %w",
			what, attempts, waited, lastErr)
	}
	return fmt.Errorf("cannot decide enrollment: %s is not in the agent's cache and the API server did not answer (asked %d times over %s); refusing to start the pod unmeshed: %w",
		what, attempts, waited, lastErr)
}

// Report implements agent.OutcomeReporter: the outcome is written to the pod's
// mesh-cni.io/redirection annotation, and a failure also becomes a Warning
// Event on the pod. It only queues: the writes happen in the background, with
// retries.
func (k *KubeSource) Report(_ context.Context, pod *gatepb.PodIdentity, outcome string, err error) {
	k.reporter.report(pod.GetNamespace(), pod.GetName(), pod.GetUid(), outcome, err)
}

// trimPod keeps what decisions, the proxy handoff and adopting running pods
// need: the cache then holds a small fraction of each pod (no containers, no
// status but phase and addresses, no managed fields).
func trimPod(obj any) (any, error) {
	p, ok := obj.(*corev1.Pod)
	if !ok {
		return obj, nil
	}
	return &corev1.Pod{
		TypeMeta:   p.TypeMeta,
		ObjectMeta: trimMeta(p.ObjectMeta),
		// The service account goes to the node proxy with the pod (ZDS).
		Spec: corev1.PodSpec{NodeName: p.Spec.NodeName, ServiceAccountName: p.Spec.ServiceAccountName, HostNetwork: p.Spec.HostNetwork,
			InitContainers: trimContainers(p.Spec.InitContainers), Containers: trimContainers(p.Spec.Containers)},
		Status: corev1.PodStatus{Phase: p.Status.Phase, PodIPs: p.Status.PodIPs,
			InitContainerStatuses: trimStatuses(p.Status.InitContainerStatuses), ContainerStatuses: trimStatuses(p.Status.ContainerStatuses)},
	}, nil
}

// istioProxyEnv are the variables of Istio's proxy container its sidecar
// capture reads (IstioSidecarPod, IstioSidecarCapture).
var istioProxyEnv = []string{"DISABLE_ENVOY", "ISTIO_META_DNS_CAPTURE"}

// trimStatuses keeps Istio's proxy container's id and whether it runs
// (IstioProxyContainerID); the other containers' statuses are dropped.
func trimStatuses(sts []corev1.ContainerStatus) []corev1.ContainerStatus {
	var out []corev1.ContainerStatus
	for _, st := range sts {
		if st.Name != IstioProxyContainer {
			continue
		}
		t := corev1.ContainerStatus{Name: st.Name, ContainerID: st.ContainerID}
		if st.State.Running != nil {
			t.State.Running = &corev1.ContainerStateRunning{}
		}
		out = append(out, t)
	}
	return out
}

// trimContainers keeps what KubeletPorts reads: each container's probes and
// hooks, only where they connect, and its named ports they may refer to.
func trimContainers(cs []corev1.Container) []corev1.Container {
	if len(cs) == 0 {
		return nil
	}
	out := make([]corev1.Container, len(cs))
	for i, c := range cs {
		t := corev1.Container{Name: c.Name, LivenessProbe: trimProbe(c.LivenessProbe),
			ReadinessProbe: trimProbe(c.ReadinessProbe), StartupProbe: trimProbe(c.StartupProbe)}
		for _, p := range c.Ports {
			if p.Name != "" {
				t.Ports = append(t.Ports, corev1.ContainerPort{Name: p.Name, ContainerPort: p.ContainerPort})
			}
		}
		if l := c.Lifecycle; l != nil && (l.PostStart != nil || l.PreStop != nil) {
			t.Lifecycle = &corev1.Lifecycle{PostStart: trimHook(l.PostStart), PreStop: trimHook(l.PreStop)}
		}
		if c.Name == IstioProxyContainer {
			// What its sidecar capture reads: the proxy's type, its uid and
			// the variables that turn it off or capture DNS.
			t.Args = slices.Clone(c.Args[:min(len(c.Args), 2)])
			for _, e := range c.Env {
				if slices.Contains(istioProxyEnv, e.Name) {
					t.Env = append(t.Env, corev1.EnvVar{Name: e.Name, Value: e.Value})
				}
			}
			if c.SecurityContext != nil && c.SecurityContext.RunAsUser != nil {
				uid := *c.SecurityContext.RunAsUser
				t.SecurityContext = &corev1.SecurityContext{RunAsUser: &uid}
			}
		}
		out[i] = t
	}
	return out
}

func trimProbe(p *corev1.Probe) *corev1.Probe {
	if p == nil {
		return nil
	}
	h := p.ProbeHandler
	t := &corev1.Probe{}
	switch {
	case h.HTTPGet != nil:
		t.HTTPGet = &corev1.HTTPGetAction{Host: h.HTTPGet.Host, Port: h.HTTPGet.Port}
	case h.TCPSocket != nil:
		t.TCPSocket = &corev1.TCPSocketAction{Host: h.TCPSocket.Host, Port: h.TCPSocket.Port}
	case h.GRPC != nil:
		t.GRPC = &corev1.GRPCAction{Port: h.GRPC.Port}
	default:
		return nil
	}
	return t
}

func trimHook(h *corev1.LifecycleHandler) *corev1.LifecycleHandler {
	switch {
	case h == nil:
		return nil
	case h.HTTPGet != nil:
		return &corev1.LifecycleHandler{HTTPGet: &corev1.HTTPGetAction{Host: h.HTTPGet.Host, Port: h.HTTPGet.Port}}
	case h.TCPSocket != nil:
		return &corev1.LifecycleHandler{TCPSocket: &corev1.TCPSocketAction{Host: h.TCPSocket.Host, Port: h.TCPSocket.Port}}
	}
	return nil
}

func trimNamespace(obj any) (any, error) {
	n, ok := obj.(*corev1.Namespace)
	if !ok {
		return obj, nil
	}
	return &corev1.Namespace{TypeMeta: n.TypeMeta, ObjectMeta: trimMeta(n.ObjectMeta)}, nil
}

func trimMeta(m metav1.ObjectMeta) metav1.ObjectMeta {
	return metav1.ObjectMeta{
		Name:              m.Name,
		Namespace:         m.Namespace,
		UID:               m.UID,
		ResourceVersion:   m.ResourceVersion,
		DeletionTimestamp: m.DeletionTimestamp,
		Labels:            m.Labels,
		Annotations:       m.Annotations,
	}
}
