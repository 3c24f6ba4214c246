package k8s

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"net"
	"net/http"
	"net/http/httptest"
	"net/http/httputil"
	"net/netip"
	"net/url"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"go.uber.org/zap/zaptest"

	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	rbacv1 "k8s.io/api/rbac/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"

	"github.com/mesh-cni/mesh-cni/internal/agentcli"
	"github.com/mesh-cni/mesh-cni/internal/removal"
	"github.com/mesh-cni/mesh-cni/test/fixtures"
	"github.com/mesh-cni/mesh-cni/test/harness"
	"github.com/mesh-cni/mesh-cni/test/k8s/kubeenv"
)

// agentDaemonSet is the DaemonSet's name in install/kubernetes, the one name
// its Role lets the agent read.
const agentDaemonSet = "mesh-agent"

// agentDeployment is a DaemonSet named as install/kubernetes names it and the
// agent's pod it owns (its controller), as the DaemonSet controller would
// create it; no controller runs here, so neither makes the other.
type agentDeployment struct {
	ds  *appsv1.DaemonSet
	pod *corev1.Pod
}

func (d agentDeployment) ref() removal.Pod {
	return removal.Pod{Namespace: d.pod.Namespace, Name: d.pod.Name}
}

// deployAgent creates, in namespace, the agent's DaemonSet and its pod on
// node. With grant, the agent's identity may get that DaemonSet as the
// manifests' Role allows (get, that name, that namespace); it can get every
// pod by AgentRules, as the manifests' ClusterRole allows.
func (c *cluster) deployAgent(t *testing.T, namespace, node string, grant bool) agentDeployment {
	t.Helper()
	ctx := apiContext(t)
	labels := map[string]string{"app.kubernetes.io/name": "mesh-agent"}
	ds, err := c.admin.AppsV1().DaemonSets(namespace).Create(ctx, &appsv1.DaemonSet{
		ObjectMeta: metav1.ObjectMeta{Name: agentDaemonSet, Namespace: namespace},
		Spec: appsv1.DaemonSetSpec{
			Selector: &metav1.LabelSelector{MatchLabels: labels},
			Template: corev1.PodTemplateSpec{
				ObjectMeta: metav1.ObjectMeta{Labels: labels},
				Spec:       corev1.PodSpec{Containers: []corev1.Container{{Name: "agent", Image: "registry.invalid/mesh-agent:never-pulled"}}},
			},
		},
	}, metav1.CreateOptions{})
	if err != nil {
		t.Fatalf("create DaemonSet: %v", err)
	}
	pod, err := c.admin.CoreV1().Pods(namespace).Create(ctx, &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{
			Name: agentDaemonSet + "-" + fixtures.RandomHex(3), Namespace: namespace, Labels: labels,
			OwnerReferences: []metav1.OwnerReference{*metav1.NewControllerRef(ds, appsv1.SchemeGroupVersion.WithKind("DaemonSet"))},
		},
		Spec: corev1.PodSpec{
			NodeName:    node,
			HostNetwork: true,
			Containers:  []corev1.Container{{Name: "agent", Image: "registry.invalid/mesh-agent:never-pulled"}},
		},
	}, metav1.CreateOptions{})
	if err != nil {
		t.Fatalf("create the agent's pod: %v", err)
	}
	if grant {
		c.grantDaemonSetGet(t, namespace)
	}
	return agentDeployment{ds: ds, pod: pod}
}

// grantDaemonSetGet gives the agent's identity what install/kubernetes'
// Role gives it in its namespace (TestRBACLeastPrivilege holds the manifests
// to exactly this rule).
func (c *cluster) grantDaemonSetGet(t *testing.T, namespace string) {
	t.Helper()
	ctx := apiContext(t)
	_, err := c.admin.RbacV1().Roles(namespace).Create(ctx, &rbacv1.Role{
		ObjectMeta: metav1.ObjectMeta{Name: "mesh-agent", Namespace: namespace},
		Rules:      []rbacv1.PolicyRule{{APIGroups: []string{"apps"}, Resources: []string{"daemonsets"}, ResourceNames: []string{agentDaemonSet}, Verbs: []string{"get", "list", "watch"}}},
	}, metav1.CreateOptions{})
	if err != nil {
		t.Fatalf("create Role: %v", err)
	}
	_, err = c.admin.RbacV1().RoleBindings(namespace).Create(ctx, &rbacv1.RoleBinding{
		ObjectMeta: metav1.ObjectMeta{Name: "mesh-agent", Namespace: namespace},
		RoleRef:    rbacv1.RoleRef{APIGroup: rbacv1.GroupName, Kind: "Role", Name: "mesh-agent"},
		Subjects:   []rbacv1.Subject{{APIGroup: rbacv1.GroupName, Kind: rbacv1.UserKind, Name: kubeenv.AgentUser}},
	}, metav1.CreateOptions{})
	if err != nil {
		t.Fatalf("create RoleBinding: %v", err)
	}
}

// deleteDaemonSet deletes the DaemonSet with the given propagation. No
// garbage collector runs: a foreground deletion leaves it with its
// deletionTimestamp and the foregroundDeletion finalizer, as a cluster does
// while the DaemonSet's pods are still terminating.
func (c *cluster) deleteDaemonSet(t *testing.T, ds *appsv1.DaemonSet, propagation metav1.DeletionPropagation) {
	t.Helper()
	err := c.admin.AppsV1().DaemonSets(ds.Namespace).Delete(apiContext(t), ds.Name, metav1.DeleteOptions{PropagationPolicy: &propagation})
	if err != nil {
		t.Fatalf("delete DaemonSet (%s): %v", propagation, err)
	}
	if propagation == metav1.DeletePropagationForeground {
		// The finalizer would hold the namespace's teardown; nothing else
		// removes it here.
		t.Cleanup(func() {
			ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
			defer cancel()
			_, err := c.admin.AppsV1().DaemonSets(ds.Namespace).Patch(ctx, ds.Name, "application/merge-patch+json",
				[]byte(`{"metadata":{"finalizers":null}}`), metav1.PatchOptions{})
			if err != nil {
				t.Errorf("remove the DaemonSet's finalizer: %v", err)
			}
		})
	}
}

func wantVerdict(t *testing.T, what string, got removal.Verdict, uninstall bool, reason string) {
	t.Helper()
	if got.Uninstall != uninstall || !strings.Contains(got.Reason, reason) {
		t.Errorf("%s: verdict %+v, want uninstall=%v with a reason saying %q", what, got, uninstall, reason)
	} else {
		t.Logf("%s: uninstall=%v: %s", what, got.Uninstall, got.Reason)
	}
}

func checkWithin(t *testing.T, client kubernetes.Interface, pod removal.Pod) removal.Verdict {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Second)
	defer cancel()
	start := time.Now()
	v := removal.Check(ctx, client, pod)
	if took := time.Since(start); took > 4*time.Second {
		t.Errorf("Check took %s with a 3s deadline", took)
	}
	return v
}

// testRemovalDecision: what the API server answers about the agent's
// DaemonSet decides, and only a positive answer uninstalls: present keeps;
// deleted, or being deleted in the foreground uninstalls; deleted and made
// again under its name keeps (its agent takes over); a get RBAC refuses keeps.
func testRemovalDecision(t *testing.T, c *cluster) {
	agent := c.api.Client(t, kubeenv.AgentUser)
	node := "node-" + fixtures.RandomHex(4)

	t.Run("present", func(t *testing.T) {
		d := c.deployAgent(t, c.namespace(t, "rm-present", nil), node, true)
		wantVerdict(t, "DaemonSet in place", checkWithin(t, agent, d.ref()), false, "in place")
	})
	t.Run("deleted", func(t *testing.T) {
		d := c.deployAgent(t, c.namespace(t, "rm-deleted", nil), node, true)
		c.deleteDaemonSet(t, d.ds, metav1.DeletePropagationBackground)
		wantVerdict(t, "DaemonSet deleted", checkWithin(t, agent, d.ref()), true, "not found")
	})
	t.Run("recreated", func(t *testing.T) {
		d := c.deployAgent(t, c.namespace(t, "rm-recreated", nil), node, true)
		c.deleteDaemonSet(t, d.ds, metav1.DeletePropagationBackground)
		again := d.ds.DeepCopy()
		again.ObjectMeta = metav1.ObjectMeta{Name: d.ds.Name, Namespace: d.ds.Namespace}
		if _, err := c.admin.AppsV1().DaemonSets(again.Namespace).Create(apiContext(t), again, metav1.CreateOptions{}); err != nil {
			t.Fatalf("create the DaemonSet again: %v", err)
		}
		// kubectl replace --force, or an orphaning delete and a new apply:
		// the DaemonSet of that name runs the next agent, which takes over.
		wantVerdict(t, "DaemonSet replaced", checkWithin(t, agent, d.ref()), false, "replaced")
	})
	t.Run("deleting", func(t *testing.T) {
		d := c.deployAgent(t, c.namespace(t, "rm-deleting", nil), node, true)
		c.deleteDaemonSet(t, d.ds, metav1.DeletePropagationForeground)
		ds, err := c.admin.AppsV1().DaemonSets(d.ds.Namespace).Get(apiContext(t), d.ds.Name, metav1.GetOptions{})
		if err != nil || ds.DeletionTimestamp == nil {
			t.Fatalf("the DaemonSet deleted in the foreground: %v, deletionTimestamp %v: want it kept, being deleted", err, ds.GetDeletionTimestamp())
		}
		wantVerdict(t, "DaemonSet being deleted", checkWithin(t, agent, d.ref()), true, "being deleted")
	})
	t.Run("forbidden", func(t *testing.T) {
		// The DaemonSet is gone, but the agent may not ask: no answer, keep.
		d := c.deployAgent(t, c.namespace(t, "rm-forbidden", nil), node, false)
		c.deleteDaemonSet(t, d.ds, metav1.DeletePropagationBackground)
		wantVerdict(t, "get forbidden", checkWithin(t, agent, d.ref()), false, "forbidden")
	})
	t.Run("not-found-from-elsewhere", func(t *testing.T) {
		// Something between the agent and the API server answers 404 for
		// the DaemonSet (a proxy, a wrong path): not the API server's word.
		d := c.deployAgent(t, c.namespace(t, "rm-proxy", nil), node, true)
		client := throughProxy(t, c.api, func(w http.ResponseWriter, r *http.Request) bool {
			if strings.Contains(r.URL.Path, "/daemonsets/") {
				http.NotFound(w, r)
				return true
			}
			return false
		})
		wantVerdict(t, "404 not from the API server", checkWithin(t, client, d.ref()), false, "could not be read")
	})
	t.Run("no-answer", func(t *testing.T) {
		// An API server that accepts connections and never answers: the
		// deadline ends the check, which keeps.
		d := c.deployAgent(t, c.namespace(t, "rm-silent", nil), node, true)
		c.deleteDaemonSet(t, d.ds, metav1.DeletePropagationBackground)
		client := throughProxy(t, c.api, func(w http.ResponseWriter, r *http.Request) bool {
			<-r.Context().Done()
			return true
		})
		wantVerdict(t, "API server silent", checkWithin(t, client, d.ref()), false, "deadline")
	})
}

// testRemovalWatch: helm uninstall deletes the agent's Role and RoleBinding
// right after its DaemonSet, before the agent's pod is told to stop, so a
// read at the stop is refused. The watch the agent opened at its start still
// sees the deletion, and the stop uninstalls; without it, the read alone keeps.
func testRemovalWatch(t *testing.T, c *cluster) {
	agent := c.api.Client(t, kubeenv.AgentUser)
	ns := c.namespace(t, "rm-watch", nil)
	d := c.deployAgent(t, ns, "node-"+fixtures.RandomHex(4), true)
	w := removal.NewWatcher(agent, d.ref(), zaptest.NewLogger(t))
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	go w.Run(ctx)
	select {
	case <-w.Watching():
	case <-time.After(30 * time.Second):
		t.Fatal("the watcher never opened a watch of its DaemonSet")
	}
	if r := w.Removed(); r != "" {
		t.Fatalf("the DaemonSet in place counts as removed: %s", r)
	}
	// As helm uninstall orders it: the DaemonSet, then the RBAC.
	c.deleteDaemonSet(t, d.ds, metav1.DeletePropagationBackground)
	for _, del := range []func() error{
		func() error {
			return c.admin.RbacV1().RoleBindings(ns).Delete(apiContext(t), "mesh-agent", metav1.DeleteOptions{})
		},
		func() error {
			return c.admin.RbacV1().Roles(ns).Delete(apiContext(t), "mesh-agent", metav1.DeleteOptions{})
		},
	} {
		if err := del(); err != nil {
			t.Fatal(err)
		}
	}
	wantVerdict(t, "the read alone, RBAC gone", checkWithin(t, agent, d.ref()), false, "forbidden")
	cctx, ccancel := context.WithTimeout(context.Background(), 3*time.Second)
	defer ccancel()
	wantVerdict(t, "with the watch", w.Check(cctx), true, "seen on its watch")

	// The DaemonSet deleted and made again under its name (kubectl replace
	// --force; an orphaning delete and a new apply once the collector has
	// let it go): the watch sees it gone, then back; the read at the stop
	// answers that it is in place, and the node keeps everything.
	ns2 := c.namespace(t, "rm-watch-again", nil)
	d2 := c.deployAgent(t, ns2, "node-"+fixtures.RandomHex(4), true)
	w2 := removal.NewWatcher(agent, d2.ref(), zaptest.NewLogger(t))
	go w2.Run(ctx)
	select {
	case <-w2.Watching():
	case <-time.After(30 * time.Second):
		t.Fatal("the watcher never opened a watch of its DaemonSet")
	}
	c.deleteDaemonSet(t, d2.ds, metav1.DeletePropagationBackground)
	if !fixtures.Eventually(ctx, 10*time.Second, fixtures.WaitInterval, func() bool { return w2.Removed() != "" }) {
		t.Fatal("the watch never saw the DaemonSet deleted")
	}
	again := d2.ds.DeepCopy()
	again.ObjectMeta = metav1.ObjectMeta{Name: d2.ds.Name, Namespace: ns2}
	if _, err := c.admin.AppsV1().DaemonSets(ns2).Create(apiContext(t), again, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	if !fixtures.Eventually(ctx, 10*time.Second, fixtures.WaitInterval, func() bool { return w2.Removed() == "" }) {
		t.Errorf("the watch still counts the DaemonSet removed after it was made again: %s", w2.Removed())
	}
	cctx2, ccancel2 := context.WithTimeout(context.Background(), 3*time.Second)
	defer ccancel2()
	wantVerdict(t, "deleted and applied again", w2.Check(cctx2), false, "replaced")
}

// testRemovalDecisionAPIServerDown: an API server that cannot be reached is
// no answer: the check keeps, although the DaemonSet is gone.
func testRemovalDecisionAPIServerDown(t *testing.T, c *cluster) {
	api := kubeenv.StartAPIServer(t, c.bins, c.etcd, "rm-down-"+fixtures.RandomHex(3))
	api.GrantAgent(t)
	own := &cluster{bins: c.bins, etcd: c.etcd, api: api, admin: api.Client(t, kubeenv.AdminUser)}
	d := own.deployAgent(t, own.namespace(t, "rm-down", nil), "node-"+fixtures.RandomHex(4), true)
	agent := api.Client(t, kubeenv.AgentUser)
	wantVerdict(t, "API server up, DaemonSet in place", checkWithin(t, agent, d.ref()), false, "in place")
	own.deleteDaemonSet(t, d.ds, metav1.DeletePropagationBackground)
	api.Stop(t)
	wantVerdict(t, "API server down, DaemonSet deleted", checkWithin(t, agent, d.ref()), false, "connection refused")
	api.Start(t)
}

// throughProxy is the agent's client reaching api through a plain-HTTP
// reverse proxy whose intercept answers the requests it claims (returning
// true); the others reach the API server with the agent's token.
func throughProxy(t *testing.T, api *kubeenv.APIServer, intercept func(http.ResponseWriter, *http.Request) bool) kubernetes.Interface {
	t.Helper()
	cfg := api.RestConfig(kubeenv.AgentUser)
	target, err := url.Parse(cfg.Host)
	if err != nil {
		t.Fatal(err)
	}
	pool := x509.NewCertPool()
	if !pool.AppendCertsFromPEM(cfg.CAData) {
		t.Fatal("the API server's CA does not parse")
	}
	proxy := httputil.NewSingleHostReverseProxy(target)
	proxy.Transport = &http.Transport{TLSClientConfig: &tls.Config{RootCAs: pool}, DialContext: (&net.Dialer{}).DialContext}
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if intercept(w, r) {
			return
		}
		r.Header.Set("Authorization", "Bearer "+cfg.BearerToken)
		proxy.ServeHTTP(w, r)
	}))
	t.Cleanup(srv.Close)
	client, err := kubernetes.NewForConfig(&rest.Config{Host: srv.URL, UserAgent: cfg.UserAgent})
	if err != nil {
		t.Fatal(err)
	}
	return client
}

// testAgentStopOnRemoval runs the real agent as the DaemonSet does (the
// chain entry in an owned conflist, --uninstall-on-delete by default, its
// pod named by $POD_NAME and $POD_NAMESPACE) with an enrolled pod and no
// proxy, so the pod's connects are refused while it is redirected. SIGTERM
// with the DaemonSet deleted uninstalls: the chain entry and the plugin go,
// the pod reaches its server directly, a new pod starts without the gate.
// SIGTERM with the DaemonSet in place (a rolling update, a drain) and SIGKILL
// with it deleted (a crash) leave the entry, the plugin and the redirection.
func testAgentStopOnRemoval(t *testing.T, c *cluster) {
	for _, tc := range []struct {
		name        string
		deleteDS    bool
		signal      syscall.Signal
		uninstalled bool
	}{
		{"sigterm-daemonset-deleted", true, syscall.SIGTERM, true},
		{"sigterm-daemonset-present", false, syscall.SIGTERM, false},
		{"sigkill-daemonset-deleted", true, syscall.SIGKILL, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			ctx := apiContext(t)
			kubeNode := "node-" + fixtures.RandomHex(4)
			d := c.deployAgent(t, c.namespace(t, "stop-sys", nil), kubeNode, true)
			lab := c.namespace(t, "stop-lab", enabled)
			plain := c.namespace(t, "stop-plain", nil)

			node := primaryNode(t)
			a := newAgent(t, c.api, kubeNode, installArgs(t, node)...)
			a.Env = []string{agentcli.EnvPodName + "=" + d.pod.Name, agentcli.EnvPodNamespace + "=" + d.pod.Namespace}
			a.start(ctx)
			meshed := waitChainEntry(t, node, true)

			client := cniPod(t, node, c.pod(t, lab, "client", kubeNode, nil, nil))
			srv := cniPod(t, node, c.pod(t, plain, "server", kubeNode, nil, nil))
			add(ctx, t, node, meshed, client)
			add(ctx, t, node, meshed, srv)
			if !a.enrolled(client) {
				t.Fatal("the client in a labelled namespace is not enrolled")
			}
			srv.ServeEcho(t, 8080)
			target := netip.AddrPortFrom(srv.IPv4(t), 8080)
			if err := client.EchoRoundTrip(ctx, target, []byte("mesh-cni k8s")); err == nil {
				t.Fatal("the enrolled client reached the server with no proxy listening: its connects are not redirected")
			}

			if tc.deleteDS {
				c.deleteDaemonSet(t, d.ds, metav1.DeletePropagationBackground)
			}
			start := time.Now()
			if err := a.Proc.Signal(tc.signal); err != nil {
				t.Fatal(err)
			}
			// Within the DaemonSet's terminationGracePeriodSeconds.
			waitCtx, cancel := context.WithTimeout(ctx, 15*time.Second)
			err := a.Proc.Wait(waitCtx)
			cancel()
			took := time.Since(start)
			if tc.signal == syscall.SIGTERM && err != nil {
				t.Fatalf("the agent did not exit cleanly within 15s of SIGTERM (%s): %v\n%s", took, err, a.Proc.Output())
			}
			t.Logf("agent gone %s after %s", took.Round(time.Millisecond), tc.signal)

			after := waitChainEntry(t, node, !tc.uninstalled)
			_, binErr := os.Stat(filepath.Join(node.BinDir, "mesh-cni"))
			reached := client.EchoRoundTrip(ctx, target, []byte("mesh-cni k8s"))
			if !tc.uninstalled {
				if binErr != nil {
					t.Errorf("the plugin binary is gone: %v", binErr)
				}
				if reached == nil {
					t.Error("the enrolled client reached the server directly: the agent's stop released it")
				}
				if tc.signal == syscall.SIGTERM && !strings.Contains(a.Proc.Output(), "stay in place") {
					t.Errorf("the agent did not say why it kept everything:\n%s", a.Proc.Output())
				}
				return
			}
			if !errors.Is(binErr, os.ErrNotExist) {
				t.Errorf("the plugin binary is still installed: %v", binErr)
			}
			if reached != nil {
				t.Errorf("the released client does not reach the server directly: %v", reached)
			}
			if !strings.Contains(a.Proc.Output(), "uninstalling mesh-cni from this node") {
				t.Errorf("the agent did not say it uninstalled:\n%s", a.Proc.Output())
			}
			// The runtime's next pod: the primary alone, no gate to wait at.
			late := cniPod(t, node, c.pod(t, lab, "late", kubeNode, nil, nil))
			addCtx, cancel := context.WithTimeout(ctx, 10*time.Second)
			defer cancel()
			if _, err := node.Add(addCtx, late, after); err != nil {
				t.Errorf("a new pod's ADD after the uninstall: %v", err)
			}
			for _, p := range []*harness.Pod{late, client, srv} {
				if err := node.Del(ctx, p, after); err != nil {
					t.Errorf("DEL %s after the uninstall: %v", p.Name, err)
				}
			}
		})
	}
}
