// Package removal decides, when the agent is told to stop, whether its
// DaemonSet is being removed (an uninstall) or the pod merely goes away for a
// while (a rolling update, a drain, an eviction, a node shutdown).
//
// Only an uninstall may take the chain entry out: while it is in place a new
// pod waits for the next agent instead of starting unmeshed. So the decision
// fails toward keeping it: only what the API server positively answers about
// the DaemonSet counts, and any error, timeout or refusal keeps everything.
package removal

import (
	"context"
	"errors"
	"fmt"
	"math"
	"sync"
	"time"

	"go.uber.org/zap"

	appsv1 "k8s.io/api/apps/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/fields"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/apimachinery/pkg/watch"
	"k8s.io/client-go/kubernetes"
)

// Verdict is the outcome of Check.
type Verdict struct {
	// Uninstall is true only when the API server said the DaemonSet that
	// owns the pod is gone, replaced or being deleted.
	Uninstall bool
	// Reason says why, for the log.
	Reason string
	// inPlace: the API server answered that the DaemonSet is as it was.
	inPlace bool
}

// Pod names the agent's own pod.
type Pod struct {
	Namespace, Name string
}

var daemonSets = schema.GroupResource{Group: appsv1.GroupName, Resource: "daemonsets"}

// Check reads the pod's controller and then that DaemonSet. It says uninstall
// when the API server answers that the DaemonSet is not found, that the one of
// that name has another uid (deleted and created again), or that it carries a
// deletionTimestamp (a foreground deletion waiting for its pods). Everything
// else keeps: the DaemonSet as it was (a rolling update, a drain), no
// DaemonSet controller, and every error (the pod unreadable, a refusal, a
// timeout, an API server that cannot be reached, a not-found that is not the
// API server's own answer about that DaemonSet). ctx bounds the calls.
func Check(ctx context.Context, client kubernetes.Interface, pod Pod) Verdict {
	if pod.Namespace == "" || pod.Name == "" {
		return keep("the agent's pod is not known")
	}
	p, err := client.CoreV1().Pods(pod.Namespace).Get(ctx, pod.Name, metav1.GetOptions{})
	if err != nil {
		return keep(fmt.Sprintf("the agent's pod %s/%s could not be read: %v", pod.Namespace, pod.Name, err))
	}
	ref := metav1.GetControllerOfNoCopy(p)
	if ref == nil || ref.Kind != "DaemonSet" || groupOf(ref.APIVersion) != appsv1.GroupName {
		return keep(fmt.Sprintf("the agent's pod %s/%s is not run by a DaemonSet", pod.Namespace, pod.Name))
	}
	ds, err := client.AppsV1().DaemonSets(pod.Namespace).Get(ctx, ref.Name, metav1.GetOptions{})
	switch {
	case err != nil && notFoundAnswer(err, ref.Name):
		return Verdict{Uninstall: true, Reason: fmt.Sprintf("DaemonSet %s/%s is gone (the API server answers not found)", pod.Namespace, ref.Name)}
	case err != nil:
		return keep(fmt.Sprintf("DaemonSet %s/%s could not be read: %v", pod.Namespace, ref.Name, err))
	case ds.DeletionTimestamp != nil:
		return Verdict{Uninstall: true, Reason: fmt.Sprintf("DaemonSet %s/%s is being deleted (since %s)", pod.Namespace, ref.Name, ds.DeletionTimestamp.UTC())}
	case ds.UID != ref.UID:
		// Deleted and made again under its name (kubectl replace --force,
		// an orphaning delete and a new apply): the next agent takes over.
		return Verdict{inPlace: true, Reason: fmt.Sprintf("DaemonSet %s/%s was replaced (uid %s is now %s): its agent takes over", pod.Namespace, ref.Name, ref.UID, ds.UID)}
	default:
		return Verdict{inPlace: true, Reason: fmt.Sprintf("DaemonSet %s/%s is in place (a rolling update, a drain or an eviction)", pod.Namespace, ref.Name)}
	}
}

func keep(reason string) Verdict { return Verdict{Reason: reason} }

func groupOf(apiVersion string) string {
	gv, err := schema.ParseGroupVersion(apiVersion)
	if err != nil {
		return ""
	}
	return gv.Group
}

// notFoundAnswer is true for the Status the API server itself returns for a
// missing DaemonSet name: reason NotFound about exactly that resource and
// name. client-go makes a not-found of its own from any 404 whose body is not
// a Status (a proxy, a wrong path), marked as an unexpected server response:
// that is no answer about the DaemonSet and keeps.
func notFoundAnswer(err error, name string) bool {
	var status apierrors.APIStatus
	if !errors.As(err, &status) || !apierrors.IsNotFound(err) || apierrors.IsUnexpectedServerError(err) {
		return false
	}
	d := status.Status().Details
	return d != nil && d.Name == name && d.Group == daemonSets.Group && d.Kind == daemonSets.Resource
}

// Watcher follows the agent's DaemonSet from the agent's start. `helm
// uninstall` deletes the agent's Role, RoleBinding and service account right
// after the DaemonSet, before the DaemonSet's pods get their SIGTERM, so a
// read made then is refused and keeps everything. A watch opened before that
// was authorized when it opened and still delivers the DaemonSet's deletion.
type Watcher struct {
	client kubernetes.Interface
	pod    Pod
	log    *zap.Logger

	mu       sync.Mutex
	removed  string        // why the DaemonSet counts as removed, as last seen; "" while it does not
	changed  chan struct{} // closed and replaced whenever removed changes
	watching chan struct{} // closed once a watch of the DaemonSet first opened
}

// NewWatcher returns a watcher of pod's DaemonSet; Run starts it. It logs
// what it follows and each change of what it saw to log.
func NewWatcher(client kubernetes.Interface, pod Pod, log *zap.Logger) *Watcher {
	return &Watcher{client: client, pod: pod, log: log, changed: make(chan struct{}), watching: make(chan struct{})}
}

// Watching is closed once the watcher first had a watch of the DaemonSet open.
func (w *Watcher) Watching() <-chan struct{} { return w.watching }

// Run finds the pod's DaemonSet and follows it until ctx ends, with jittered
// retries: a list that does not find it (the API server's own answer), its
// deletion or a deletionTimestamp mark it removed; a DaemonSet of its name
// seen again, not being deleted (one made again in its place), marks it
// present.
func (w *Watcher) Run(ctx context.Context) {
	var ref *metav1.OwnerReference
	fresh := wait.Backoff{Duration: 500 * time.Millisecond, Factor: 2, Jitter: 0.5, Steps: math.MaxInt32, Cap: 30 * time.Second}
	backoff := fresh
	for ctx.Err() == nil {
		if ref == nil {
			p, err := w.client.CoreV1().Pods(w.pod.Namespace).Get(ctx, w.pod.Name, metav1.GetOptions{})
			if err == nil {
				if ref = metav1.GetControllerOfNoCopy(p); ref == nil || ref.Kind != "DaemonSet" || groupOf(ref.APIVersion) != appsv1.GroupName {
					w.log.Info("the agent's pod is not a DaemonSet's: a stop keeps the chain entry and the data path", zap.String("pod", w.pod.Namespace+"/"+w.pod.Name))
					return // no DaemonSet to follow: Check keeps
				}
			} else {
				w.log.Debug("the agent's own pod, to find its DaemonSet", zap.Error(err))
			}
		}
		if ref != nil && w.follow(ctx, *ref) {
			backoff = fresh // a watch that ran until the server ended it
		}
		select {
		case <-ctx.Done():
		case <-time.After(backoff.Step()):
		}
	}
}

// follow lists the DaemonSet by name and watches it from there until the
// watch ends; it says whether the watch was open.
func (w *Watcher) follow(ctx context.Context, ref metav1.OwnerReference) bool {
	byName := metav1.ListOptions{FieldSelector: fields.OneTermEqualSelector("metadata.name", ref.Name).String()}
	list, err := w.client.AppsV1().DaemonSets(w.pod.Namespace).List(ctx, byName)
	if err != nil {
		w.log.Debug("list the agent's DaemonSet", zap.String("daemonset", ref.Name), zap.Error(err))
		return false
	}
	if len(list.Items) == 0 {
		w.set(fmt.Sprintf("DaemonSet %s/%s is gone (the API server lists none of that name)", w.pod.Namespace, ref.Name))
	}
	for i := range list.Items {
		w.judge(&list.Items[i], ref)
	}
	byName.ResourceVersion = list.ResourceVersion
	byName.AllowWatchBookmarks = true
	wi, err := w.client.AppsV1().DaemonSets(w.pod.Namespace).Watch(ctx, byName)
	if err != nil {
		w.log.Debug("watch the agent's DaemonSet", zap.String("daemonset", ref.Name), zap.Error(err))
		return false
	}
	defer wi.Stop()
	w.mu.Lock()
	select {
	case <-w.watching:
	default:
		close(w.watching)
		w.log.Info("following the agent's DaemonSet: its deletion uninstalls at the agent's stop", zap.String("daemonset", w.pod.Namespace+"/"+ref.Name))
	}
	w.mu.Unlock()
	for ev := range wi.ResultChan() {
		ds, ok := ev.Object.(*appsv1.DaemonSet)
		if !ok {
			return true // an error event (its resource version expired, say): list again
		}
		switch ev.Type {
		case watch.Deleted:
			w.set(fmt.Sprintf("DaemonSet %s/%s was deleted (seen on its watch)", w.pod.Namespace, ref.Name))
		case watch.Added, watch.Modified:
			w.judge(ds, ref)
		}
	}
	return true
}

// judge records what a DaemonSet of the watched name says: removed while it
// is being deleted, present otherwise (whatever its uid: one made again in
// its place runs the next agent).
func (w *Watcher) judge(ds *appsv1.DaemonSet, ref metav1.OwnerReference) {
	if ds.DeletionTimestamp != nil {
		w.set(fmt.Sprintf("DaemonSet %s/%s is being deleted (since %s)", w.pod.Namespace, ref.Name, ds.DeletionTimestamp.UTC()))
		return
	}
	w.set("")
}

// set records why the DaemonSet counts as removed ("" for present) and wakes
// the waiters when that changed.
func (w *Watcher) set(reason string) {
	w.mu.Lock()
	defer w.mu.Unlock()
	if (reason == "") == (w.removed == "") {
		return
	}
	w.removed = reason
	if reason != "" {
		w.log.Info("the agent's DaemonSet counts as removed: the agent's stop uninstalls", zap.String("why", reason))
	} else {
		w.log.Info("the agent's DaemonSet is in place again: the agent's stop keeps everything")
	}
	close(w.changed)
	w.changed = make(chan struct{})
}

// Removed says why the DaemonSet counts as removed, or "" while it does not.
func (w *Watcher) Removed() string {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.removed
}

// Check decides at the agent's stop. A read now decides when the API server
// answers it (Check). Only when it does not (helm uninstall removed the
// agent's Role in the same pass, the API server is unreachable) does what the
// watch last saw decide: removed uninstalls, at once or when the watch sees it
// before ctx ends. Anything else keeps.
func (w *Watcher) Check(ctx context.Context) Verdict {
	v := Check(ctx, w.client, w.pod)
	if v.Uninstall || v.inPlace {
		return v
	}
	for {
		w.mu.Lock()
		removed, changed := w.removed, w.changed
		w.mu.Unlock()
		if removed != "" {
			return Verdict{Uninstall: true, Reason: removed + "; a read now got no answer: " + v.Reason}
		}
		select {
		case <-changed:
		case <-ctx.Done():
			return v
		}
	}
}
