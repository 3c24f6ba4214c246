package k8s

import (
	"context"
	"encoding/json"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/util/retry"

	"github.com/mesh-cni/mesh-cni/test/fixtures"
	"github.com/mesh-cni/mesh-cni/test/k8s/kubeenv"
)

// cluster is what the tests share: one etcd and one API server (tests that stop
// an API server start their own on the same etcd).
type cluster struct {
	bins  kubeenv.Binaries
	etcd  *kubeenv.Etcd
	api   *kubeenv.APIServer
	admin kubernetes.Interface
}

// TestKubernetes starts the shared cluster once and runs every test against it
// as parallel subtests; it is torn down when the last one finished.
func TestKubernetes(t *testing.T) {
	bins, err := kubeenv.FromEnv()
	if err != nil {
		t.Fatal(err)
	}
	etcd := kubeenv.StartEtcd(t, bins)
	// The audit log lets a test count what its agent asked (by its user agent).
	api := kubeenv.StartAPIServerWith(t, bins, etcd, "shared-"+fixtures.RandomHex(3), kubeenv.APIServerOptions{Audit: true})
	api.GrantAgent(t)
	c := &cluster{bins: bins, etcd: etcd, api: api, admin: api.Client(t, kubeenv.AdminUser)}

	for _, tc := range []struct {
		name string
		fn   func(*testing.T, *cluster)
	}{
		{"SourceFollowsLabels", testSourceFollowsLabels},
		{"SourceIstioProfile", testSourceIstioProfile},
		{"SourceDirectGet", testSourceDirectGet},
		{"SourceReportsOutcome", testSourceReportsOutcome},
		{"SourceAPIServerDown", testSourceAPIServerDown},
		{"SourceLeastPrivilege", testSourceLeastPrivilege},
		{"AgentEnrollmentFollowsLabels", testAgentEnrollmentFollowsLabels},
		{"AgentPluginGetsNoCredential", testAgentPluginGetsNoCredential},
		{"AgentAddWithAPIServerDown", testAgentAddWithAPIServerDown},
		{"AgentZDSEntryPoints", testAgentZDSEntryPoints},
		{"AgentAdoptsRunningPods", testAgentAdoptsRunningPods},
		{"AgentCorrectsForgedAnnotations", testAgentCorrectsForgedAnnotations},
		{"AgentReleasesTerminatedPods", testAgentReleasesTerminatedPods},
		{"AgentEnforcedNamespace", testAgentEnforcedNamespace},
		{"AgentPodStartRequests", testAgentPodStartRequests},
		{"RemovalDecision", testRemovalDecision},
		{"RemovalWatch", testRemovalWatch},
		{"RemovalDecisionAPIServerDown", testRemovalDecisionAPIServerDown},
		{"AgentStopOnRemoval", testAgentStopOnRemoval},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			tc.fn(t, c)
		})
	}
}

// Label sets used throughout.
var (
	enabled  = map[string]string{"mesh-cni.io/dataplane-mode": "enabled"}
	disabled = map[string]string{"mesh-cni.io/dataplane-mode": "disabled"}
)

func apiContext(t *testing.T) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	t.Cleanup(cancel)
	return ctx
}

// namespace creates a namespace with a unique name and labels. Without a
// namespace controller a deleted namespace would stay Terminating, so it is
// left for the cluster's teardown.
func (c *cluster) namespace(t *testing.T, prefix string, labels map[string]string) string {
	t.Helper()
	ns, err := c.admin.CoreV1().Namespaces().Create(apiContext(t), &corev1.Namespace{
		ObjectMeta: metav1.ObjectMeta{Name: prefix + "-" + fixtures.RandomHex(3), Labels: labels},
	}, metav1.CreateOptions{})
	if err != nil {
		t.Fatalf("create namespace: %v", err)
	}
	return ns.Name
}

// pod creates a pod bound to node, the way the scheduler leaves it for the
// kubelet (which never comes: the test drives CNI itself).
func (c *cluster) pod(t *testing.T, namespace, name, node string, labels, annotations map[string]string) *corev1.Pod {
	t.Helper()
	p, err := createPod(apiContext(t), c.admin, namespace, name, node, labels, annotations)
	if err != nil {
		t.Fatalf("create pod %s/%s: %v", namespace, name, err)
	}
	return p
}

// createPod creates, as client, the pod c.pod makes.
func createPod(ctx context.Context, client kubernetes.Interface, namespace, name, node string, labels, annotations map[string]string) (*corev1.Pod, error) {
	return client.CoreV1().Pods(namespace).Create(ctx, &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: namespace, Labels: labels, Annotations: annotations},
		Spec: corev1.PodSpec{
			NodeName:                      node,
			Containers:                    []corev1.Container{{Name: "app", Image: "registry.invalid/app:never-pulled"}},
			TerminationGracePeriodSeconds: new(int64),
		},
	}, metav1.CreateOptions{})
}

// updatePodStatus changes the pod's status as the kubelet reports it,
// retrying on a conflict with another writer.
func updatePodStatus(ctx context.Context, t *testing.T, client kubernetes.Interface, namespace, name string, change func(*corev1.PodStatus)) *corev1.Pod {
	t.Helper()
	var p *corev1.Pod
	err := retry.RetryOnConflict(retry.DefaultRetry, func() error {
		cur, err := client.CoreV1().Pods(namespace).Get(ctx, name, metav1.GetOptions{})
		if err != nil {
			return err
		}
		change(&cur.Status)
		p, err = client.CoreV1().Pods(namespace).UpdateStatus(ctx, cur, metav1.UpdateOptions{})
		return err
	})
	if err != nil {
		t.Fatalf("status of pod %s/%s: %v", namespace, name, err)
	}
	return p
}

// setLabel sets (value != "") or removes (value == "") one label with a merge
// patch, on a namespace (podName "") or a pod.
func (c *cluster) setLabel(t *testing.T, namespace, podName, key, value string) {
	t.Helper()
	c.setMeta(t, namespace, podName, "labels", key, value)
}

// setMeta is setLabel for field "labels" or "annotations".
func (c *cluster) setMeta(t *testing.T, namespace, podName, field, key, value string) {
	t.Helper()
	var v any = value
	if value == "" {
		v = nil
	}
	body, err := json.Marshal(map[string]any{"metadata": map[string]any{field: map[string]any{key: v}}})
	if err != nil {
		t.Fatal(err)
	}
	ctx := apiContext(t)
	if podName == "" {
		_, err = c.admin.CoreV1().Namespaces().Patch(ctx, namespace, types.MergePatchType, body, metav1.PatchOptions{})
	} else {
		_, err = c.admin.CoreV1().Pods(namespace).Patch(ctx, podName, types.MergePatchType, body, metav1.PatchOptions{})
	}
	if err != nil {
		t.Fatalf("%s of %s/%s: %s=%q: %v", field, namespace, podName, key, value, err)
	}
}
