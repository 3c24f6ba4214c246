package node

import (
	"context"
	"fmt"
	"net"
	"net/http"
	"path/filepath"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/fields"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/util/intstr"
	"k8s.io/apimachinery/pkg/watch"
	"k8s.io/client-go/tools/cache"
	watchtools "k8s.io/client-go/tools/watch"
	"k8s.io/utils/ptr"

	"github.com/mesh-cni/mesh-cni/test/fixtures"
	"github.com/mesh-cni/mesh-cni/test/node/nodeenv"
)

// The enrollment label of the default selector profile, and the annotation
// the agent writes on every pod it decided on.
const (
	dataplaneLabel = "mesh-cni.io/dataplane-mode"
	redirectionAnn = "mesh-cni.io/redirection"
	serverPort     = 8080
)

// cluster is what the scenario's helpers share: the node and the images its
// pods run.
type cluster struct {
	t  *testing.T
	n  *nodeenv.Node
	im nodeenv.Images
}

// records is the directory on the host (visible on the node) where the
// test's pods append their records.
func (c *cluster) records() string { return filepath.Join(c.n.Dir, "records") }

// namespace creates a namespace, enrolled when meshed, and deletes it when
// the test ends (without waiting: the node's own cleanup removes its pods).
func (c *cluster) namespace(ctx context.Context, name string, meshed bool) {
	c.t.Helper()
	ns := &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: name}}
	if meshed {
		ns.Labels = map[string]string{dataplaneLabel: "enabled"}
	}
	if _, err := c.n.Admin.CoreV1().Namespaces().Create(ctx, ns, metav1.CreateOptions{}); err != nil {
		c.t.Fatalf("create namespace %s: %v", name, err)
	}
	// The API server refuses pods until the controller-manager has made the
	// namespace's default service account.
	fixtures.WaitFor(c.t, time.Minute, "the default service account of namespace "+name, func() bool {
		_, err := c.n.Admin.CoreV1().ServiceAccounts(name).Get(ctx, "default", metav1.GetOptions{})
		return err == nil
	})
	c.t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		err := c.n.Admin.CoreV1().Namespaces().Delete(ctx, name, metav1.DeleteOptions{})
		if err != nil && !apierrors.IsNotFound(err) {
			c.t.Logf("cleanup: delete namespace %s: %v", name, err)
		}
	})
}

// deleteNamespace deletes a namespace and waits until it is gone: its pods'
// sandboxes are then removed, their CNI DEL done.
// untilGone waits until pod ns/name no longer exists.
func (c *cluster) untilGone(ctx context.Context, ns, name string) {
	c.t.Helper()
	for {
		_, err := c.n.Admin.CoreV1().Pods(ns).Get(ctx, name, metav1.GetOptions{})
		if apierrors.IsNotFound(err) {
			return
		}
		select {
		case <-ctx.Done():
			c.t.Fatalf("pod %s/%s not gone: %v (last: %v)", ns, name, ctx.Err(), err)
		case <-time.After(250 * time.Millisecond):
		}
	}
}

func (c *cluster) deleteNamespace(ctx context.Context, name string) error {
	err := c.n.Admin.CoreV1().Namespaces().Delete(ctx, name, metav1.DeleteOptions{})
	if apierrors.IsNotFound(err) {
		return nil
	}
	if err != nil {
		return err
	}
	for {
		_, err := c.n.Admin.CoreV1().Namespaces().Get(ctx, name, metav1.GetOptions{})
		if apierrors.IsNotFound(err) {
			return nil
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("namespace %s not gone: %w", name, ctx.Err())
		case <-time.After(250 * time.Millisecond):
		}
	}
}

func (c *cluster) recordsVolume() corev1.Volume {
	return corev1.Volume{Name: "records", VolumeSource: corev1.VolumeSource{HostPath: &corev1.HostPathVolumeSource{
		Path: c.records(), Type: ptr.To(corev1.HostPathDirectory),
	}}}
}

func recordsMount() corev1.VolumeMount {
	return corev1.VolumeMount{Name: "records", MountPath: "/records"}
}

// proxySidecar is the reference proxy as a native sidecar: started, and
// listening (the startup probe), before the pod's application starts, and
// recording every connection it proxies to /records/<pod>-proxy.jsonl.
func (c *cluster) proxySidecar(pod string) corev1.Container {
	return corev1.Container{
		Name:          "proxy",
		Image:         c.im["refproxy"].Ref(),
		RestartPolicy: ptr.To(corev1.ContainerRestartPolicyAlways),
		Args:          []string{"-record", "/records/" + pod + "-proxy.jsonl"},
		// SO_MARK on its onward connections.
		SecurityContext: &corev1.SecurityContext{Capabilities: &corev1.Capabilities{Add: []corev1.Capability{"NET_ADMIN"}}},
		VolumeMounts:    []corev1.VolumeMount{recordsMount()},
		StartupProbe: &corev1.Probe{
			ProbeHandler:  corev1.ProbeHandler{TCPSocket: &corev1.TCPSocketAction{Port: intstr.FromInt32(15006)}},
			PeriodSeconds: 1, FailureThreshold: 60,
		},
	}
}

// pod is a pod of the test: no service-account token, the records volume.
func (c *cluster) pod(ns, name string, containers ...corev1.Container) *corev1.Pod {
	return &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: name, Labels: map[string]string{"app": name}},
		Spec: corev1.PodSpec{
			AutomountServiceAccountToken:  ptr.To(false),
			TerminationGracePeriodSeconds: ptr.To[int64](2),
			Volumes:                       []corev1.Volume{c.recordsVolume()},
			Containers:                    containers,
		},
	}
}

// server is the echo server, recording each accepted connection's client.
func (c *cluster) server(ns, name string, meshed bool) *corev1.Pod {
	p := c.pod(ns, name, corev1.Container{
		Name: "app", Image: c.im["echoserver"].Ref(),
		Args:         []string{"-listen", fmt.Sprintf(":%d", serverPort), "-record", "/records/" + name + ".jsonl"},
		VolumeMounts: []corev1.VolumeMount{recordsMount()},
	})
	if meshed {
		p.Spec.InitContainers = []corev1.Container{c.proxySidecar(name)}
	}
	return p
}

// client connects to target every interval until stopped, recording each
// round trip.
func (c *cluster) client(ns, name, target string, meshed bool) *corev1.Pod {
	p := c.pod(ns, name, corev1.Container{
		Name: "app", Image: c.im["echoclient"].Ref(),
		Args:         []string{"-connect", target, "-n", "0", "-interval", "100ms", "-timeout", "5s", "-record", "/records/" + name + ".jsonl"},
		VolumeMounts: []corev1.VolumeMount{recordsMount()},
	})
	if meshed {
		p.Spec.InitContainers = []corev1.Container{c.proxySidecar(name)}
	}
	return p
}

// create creates a pod and returns when the API server has it.
func (c *cluster) create(ctx context.Context, p *corev1.Pod) time.Time {
	c.t.Helper()
	start := time.Now()
	if _, err := c.n.Admin.CoreV1().Pods(p.Namespace).Create(ctx, p, metav1.CreateOptions{}); err != nil {
		c.t.Fatalf("create pod %s/%s: %v", p.Namespace, p.Name, err)
	}
	return start
}

// until watches pod ns/name until cond holds and returns the pod and when the
// watch saw it.
func (c *cluster) until(ctx context.Context, ns, name string, what string, cond func(*corev1.Pod) bool) (*corev1.Pod, time.Time) {
	c.t.Helper()
	sel := fields.OneTermEqualSelector("metadata.name", name).String()
	lw := &cache.ListWatch{
		ListWithContextFunc: func(ctx context.Context, o metav1.ListOptions) (runtime.Object, error) {
			o.FieldSelector = sel
			return c.n.Admin.CoreV1().Pods(ns).List(ctx, o)
		},
		WatchFuncWithContext: func(ctx context.Context, o metav1.ListOptions) (watch.Interface, error) {
			o.FieldSelector = sel
			return c.n.Admin.CoreV1().Pods(ns).Watch(ctx, o)
		},
	}
	var seen time.Time
	var last *corev1.Pod
	ev, err := watchtools.UntilWithSync(ctx, lw, &corev1.Pod{}, nil, func(e watch.Event) (bool, error) {
		p, ok := e.Object.(*corev1.Pod)
		if !ok {
			return false, nil
		}
		last = p
		if cond(p) {
			seen = time.Now()
			return true, nil
		}
		return false, nil
	})
	if err != nil {
		c.t.Fatalf("pod %s/%s never %s: %v (last status: %s)", ns, name, what, err, describe(last))
	}
	return ev.Object.(*corev1.Pod), seen
}

func running(p *corev1.Pod) bool { return p.Status.Phase == corev1.PodRunning }

// describe summarizes a pod's status for failure messages.
func describe(p *corev1.Pod) string {
	if p == nil {
		return "none seen"
	}
	var b strings.Builder
	fmt.Fprintf(&b, "phase %s", p.Status.Phase)
	for _, cs := range append(p.Status.InitContainerStatuses, p.Status.ContainerStatuses...) {
		switch {
		case cs.State.Waiting != nil:
			fmt.Fprintf(&b, "; %s waiting (%s: %s)", cs.Name, cs.State.Waiting.Reason, cs.State.Waiting.Message)
		case cs.State.Running != nil:
			fmt.Fprintf(&b, "; %s running", cs.Name)
		case cs.State.Terminated != nil:
			fmt.Fprintf(&b, "; %s terminated (%s)", cs.Name, cs.State.Terminated.Reason)
		}
	}
	return b.String()
}

// lastEnd says how a container's previous run ended, for failure messages:
// an exit of its own, or the kubelet's kill after a failed probe.
func lastEnd(cs corev1.ContainerStatus) string {
	t := cs.LastTerminationState.Terminated
	if t == nil {
		return "unknown"
	}
	return fmt.Sprintf("exit %d (%s) after %s, %q", t.ExitCode, t.Reason, t.FinishedAt.Sub(t.StartedAt.Time).Round(time.Second), t.Message)
}

// warnings joins the Warning events about pod ns/name (failed probes, kills),
// for failure messages.
func (c *cluster) warnings(ctx context.Context, ns, name string) string {
	c.t.Helper()
	var w []string
	for _, e := range c.events(ctx, ns, name) {
		if e.Type == corev1.EventTypeWarning {
			w = append(w, fmt.Sprintf("%s x%d: %s", e.Reason, max(e.Count, 1), e.Message))
		}
	}
	if len(w) == 0 {
		return "none"
	}
	return strings.Join(w, "; ")
}

// events lists the events about pod ns/name.
func (c *cluster) events(ctx context.Context, ns, name string) []corev1.Event {
	c.t.Helper()
	list, err := c.n.Admin.CoreV1().Events(ns).List(ctx, metav1.ListOptions{
		FieldSelector: fields.OneTermEqualSelector("involvedObject.name", name).String(),
	})
	if err != nil {
		c.t.Fatalf("events of %s/%s: %v", ns, name, err)
	}
	return list.Items
}

// podIP waits for the pod to run and returns its address.
func (c *cluster) podIP(ctx context.Context, ns, name string) string {
	c.t.Helper()
	p, _ := c.until(ctx, ns, name, "running", running)
	if p.Status.PodIP == "" {
		c.t.Fatalf("pod %s/%s runs without an IP", ns, name)
	}
	return p.Status.PodIP
}

// readLines reads a record file of the node's pods (fixtures.MustReadJSONL).
func readLines[T any](t *testing.T, path string) []T { return fixtures.MustReadJSONL[T](t, path) }

// agentReadyLater starts agentReady now, for a step that makes the agent ready
// meanwhile; what it returns waits for its answer.
func (c *cluster) agentReadyLater(ctx context.Context) func() (time.Time, error) {
	type answer struct {
		at  time.Time
		err error
	}
	ch := make(chan answer, 1)
	go func() {
		at, err := c.agentReady(ctx)
		ch <- answer{at, err}
	}()
	return func() (time.Time, error) {
		a := <-ch
		return a.at, a.err
	}
}

// agentReady polls the agent's /readyz from inside the node every 20 ms and
// returns when it first answers 200.
func (c *cluster) agentReady(ctx context.Context) (time.Time, error) {
	client := &http.Client{
		Timeout: time.Second,
		Transport: &http.Transport{
			DialContext:       func(ctx context.Context, network, addr string) (net.Conn, error) { return c.n.Dial(ctx, network, addr) },
			DisableKeepAlives: true,
		},
	}
	for {
		req, err := http.NewRequestWithContext(ctx, http.MethodGet, "http://127.0.0.1:15099/readyz", nil)
		if err != nil {
			return time.Time{}, err
		}
		resp, err := client.Do(req)
		if err == nil {
			resp.Body.Close()
			if resp.StatusCode == http.StatusOK {
				return time.Now(), nil
			}
		}
		select {
		case <-ctx.Done():
			return time.Time{}, fmt.Errorf("the agent never answered /readyz: %w", ctx.Err())
		case <-time.After(20 * time.Millisecond):
		}
	}
}

// importTestImages puts the test's own images (proxy, echo server and
// client, pause) into the node's containerd; the agent's come with the steps
// of docs/install.md.
func importTestImages(t *testing.T, ctx context.Context, n *nodeenv.Node, im nodeenv.Images) {
	t.Helper()
	var tars []string
	for _, name := range []string{"refproxy", "echoserver", "echoclient", "pause"} {
		tars = append(tars, im[name].Tar)
	}
	if err := n.Containerd.Import(ctx, tars...); err != nil {
		t.Fatal(err)
	}
}
