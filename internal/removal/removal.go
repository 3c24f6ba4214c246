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

	appsv1 "k8s.io/api/apps/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/client-go/kubernetes"
)

// Verdict is the outcome of Check.
type Verdict struct {
	// Uninstall is true only when the API server said the DaemonSet that
	// owns the pod is gone, replaced or being deleted.
	Uninstall bool
	// Reason says why, for the log.
	Reason string
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
	case ds.UID != ref.UID:
		return Verdict{Uninstall: true, Reason: fmt.Sprintf("DaemonSet %s/%s was deleted: uid %s is now %s", pod.Namespace, ref.Name, ref.UID, ds.UID)}
	case ds.DeletionTimestamp != nil:
		return Verdict{Uninstall: true, Reason: fmt.Sprintf("DaemonSet %s/%s is being deleted (since %s)", pod.Namespace, ref.Name, ds.DeletionTimestamp.UTC())}
	default:
		return keep(fmt.Sprintf("DaemonSet %s/%s is in place (a rolling update, a drain or an eviction)", pod.Namespace, ref.Name))
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
