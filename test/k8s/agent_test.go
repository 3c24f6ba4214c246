package k8s

import (
	"bytes"
	"context"
	"debug/buildinfo"
	"encoding/json"
	"fmt"
	"net/netip"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/containernetworking/cni/libcni"
	"google.golang.org/grpc"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/fields"

	"github.com/mesh-cni/mesh-cni/internal/enroll"
	"github.com/mesh-cni/mesh-cni/internal/gaterpc"
	"github.com/mesh-cni/mesh-cni/pkg/gate/gatepb"
	"github.com/mesh-cni/mesh-cni/test/fixtures"
	"github.com/mesh-cni/mesh-cni/test/harness"
	"github.com/mesh-cni/mesh-cni/test/k8s/kubeenv"
	"github.com/mesh-cni/mesh-cni/test/proxy"
)

// agent is a mesh-agent process enrolling pods by Kubernetes labels.
type agent struct {
	t          testing.TB
	dir        string
	Socket     string
	BPFFS      string
	Kubeconfig string
	Args       []string
	// Env is added to the agent's environment.
	Env  []string
	Proc *harness.Process
}

// prepareAgent prepares (but does not start) a mesh-agent with its own socket,
// state and bpffs directories (harness.NewAgentDirs). Its sidecar proxies are
// known by ztunnel's mark, the node proxy of the ZDS tests by its own cgroup.
func prepareAgent(t testing.TB, extraArgs ...string) *agent {
	t.Helper()
	d := harness.NewAgentDirs(t, "mesh-k8s-")
	a := &agent{t: t, dir: d.Dir, Socket: d.Socket, BPFFS: d.BPFFS}
	a.Args = append(d.RunArgs(), extraArgs...)
	return a
}

// newAgent prepares a mesh-agent with --enrollment=kubernetes for node, using
// the agent identity's kubeconfig (mode 0600) and a 3 s API timeout.
func newAgent(t testing.TB, api *kubeenv.APIServer, node string, extraArgs ...string) *agent {
	t.Helper()
	a := prepareAgent(t)
	a.Kubeconfig = api.WriteKubeconfig(t, kubeenv.AgentUser, filepath.Join(a.dir, "kubeconfig"))
	a.Args = append(a.Args, "--enrollment", "kubernetes", "--kubeconfig", a.Kubeconfig, "--node-name", node, "--api-timeout", "3s")
	a.Args = append(a.Args, extraArgs...)
	return a
}

// start runs the agent and waits until it is ready: its informers have synced.
func (a *agent) start(ctx context.Context) {
	a.t.Helper()
	a.Proc = harness.StartProcess(a.t, harness.ProcessOptions{Path: harness.Bins(a.t).Path("mesh-agent"), Args: a.Args, Env: a.Env, Name: "mesh-agent"})
	ctx, cancel := context.WithTimeout(ctx, time.Minute)
	defer cancel()
	if err := harness.WaitForHealthy(ctx, a.Socket); err != nil {
		a.t.Fatalf("agent did not become ready: %v\n%s", err, a.Proc.Output())
	}
}

// enrollments lists the agent's enrollments.
func (a *agent) enrollments() []*gatepb.Enrollment {
	a.t.Helper()
	conn, err := gaterpc.Dial(a.Socket)
	if err != nil {
		a.t.Fatal(err)
	}
	defer conn.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	resp, err := gatepb.NewGateClient(conn).List(ctx, &gatepb.ListRequest{}, grpc.WaitForReady(true))
	if err != nil {
		a.t.Fatalf("list enrollments: %v", err)
	}
	return resp.GetEnrollments()
}

// enrolled reports whether the agent lists the pod's attachment as enrolled.
func (a *agent) enrolled(p *harness.Pod) bool {
	a.t.Helper()
	for _, e := range a.enrollments() {
		if e.GetAttachment().GetContainerId() == p.ContainerID {
			return true
		}
	}
	return false
}

// primaryNode is a node whose CNI configuration is the primary's alone
// (bridge), as before mesh-cni is installed.
func primaryNode(t *testing.T) *harness.Node {
	t.Helper()
	node := harness.NewNode(t, harness.NodeOptions{Plugins: harness.ReferencePluginNames()})
	primary, err := node.ConflistJSON("meshnet")
	if err != nil {
		t.Fatal(err)
	}
	node.WriteConf(t, "10-meshnet.conflist", primary)
	return node
}

// installArgs make the agent install the plugin and its chain entry on node,
// as the DaemonSet does.
func installArgs(t *testing.T, node *harness.Node) []string {
	return []string{"--cni-install=true",
		"--cni-conf-dir", node.ConfDir, "--cni-bin-dir", node.BinDir,
		"--install-state-dir", filepath.Join(t.TempDir(), "install"),
		"--plugin-binary", harness.Bins(t).Path("mesh-cni"), "--gate-timeout", "30s"}
}

// waitChainEntry waits until the node's CNI config (what the runtime loads)
// ends (present) or no longer ends (absent) with the mesh-cni entry, and
// returns it.
func waitChainEntry(t *testing.T, node *harness.Node, present bool) *libcni.NetworkConfigList {
	t.Helper()
	var list *libcni.NetworkConfigList
	fixtures.WaitFor(t, 30*time.Second, fmt.Sprintf("the chain entry present=%v", present), func() bool {
		l, _, err := node.LoadConflist()
		if err != nil || len(l.Plugins) == 0 {
			return false
		}
		if (l.Plugins[len(l.Plugins)-1].Network.Type == "mesh-cni") != present {
			return false
		}
		list = l
		return true
	})
	return list
}

func (a *agent) meshEntry() map[string]any {
	return map[string]any{"type": "mesh-cni", "socketPath": a.Socket, "gateTimeout": "30s", "logLevel": "debug"}
}

// cniPod makes the network namespace for an API pod, with the identity kubelet
// would pass in CNI_ARGS (the API server's uid included).
func cniPod(t *testing.T, node *harness.Node, p *corev1.Pod) *harness.Pod {
	t.Helper()
	hp := node.NewPod(t, p.Namespace, p.Name)
	hp.UID = string(p.UID)
	return hp
}

func add(ctx context.Context, t *testing.T, node *harness.Node, list *libcni.NetworkConfigList, p *harness.Pod) {
	t.Helper()
	if _, err := node.Add(ctx, p, list); err != nil {
		t.Fatalf("ADD %s/%s: %v", p.Namespace, p.Name, err)
	}
}

// annotation reads the pod's mesh-cni.io/redirection annotation.
func (c *cluster) annotation(t *testing.T, namespace, name string) string {
	t.Helper()
	p, err := c.admin.CoreV1().Pods(namespace).Get(apiContext(t), name, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	return p.Annotations[enroll.AnnotationRedirection]
}

func (c *cluster) waitAnnotation(t *testing.T, namespace, name, want string) {
	t.Helper()
	fixtures.WaitFor(t, 30*time.Second, fmt.Sprintf("%s=%s on %s/%s", enroll.AnnotationRedirection, want, namespace, name), func() bool {
		return c.annotation(t, namespace, name) == want
	})
}

// noRedirection fails the test if the pod carries either redirection
// annotation: a pod that was never in the mesh is not written to.
func (c *cluster) noRedirection(t *testing.T, namespace, name string) {
	t.Helper()
	if o, v, ok := c.redirectionOf(t, namespace, name); o != "" || ok {
		t.Errorf("%s/%s, never in the mesh, carries %s=%q, %s=%q: want neither", namespace, name, enroll.AnnotationRedirection, o, enroll.IstioAnnotationRedirection, v)
	}
}

// waitEnrolled waits until the agent lists (want) or no longer lists the pod,
// reporting an error past the design's one second and failing past 30 s.
func waitEnrolled(t *testing.T, a *agent, p *harness.Pod, want bool, what string) {
	t.Helper()
	start := time.Now()
	cond := func() bool { return a.enrolled(p) == want }
	if !fixtures.Eventually(t.Context(), changeLimit, fixtures.WaitInterval, cond) {
		t.Errorf("%s: pod %s/%s enrolled=%v not reached within %s", what, p.Namespace, p.Name, want, changeLimit)
		fixtures.WaitFor(t, 30*time.Second, what, cond)
	}
	t.Logf("%s: %s/%s enrolled=%v after %s", what, p.Namespace, p.Name, want, time.Since(start).Round(time.Millisecond))
}

// testAgentEnrollmentFollowsLabels: the real agent and the real chain follow
// labels: a pod created in a labelled namespace is enrolled, an opted-out pod
// is not, a namespace labelled after its pods started enrolls them within a
// second and their traffic then goes through the proxy, unlabelling releases
// them; each outcome is written back on the pod.
func testAgentEnrollmentFollowsLabels(t *testing.T, c *cluster) {
	ctx := apiContext(t)
	kubeNode := "node-" + fixtures.RandomHex(4)
	lab := c.namespace(t, "lab", enabled)
	plain := c.namespace(t, "plain", nil)
	clientPod := c.pod(t, lab, "client", kubeNode, nil, nil)
	optOutPod := c.pod(t, lab, "opt-out", kubeNode, disabled, nil)
	latePod := c.pod(t, plain, "late", kubeNode, nil, nil)
	serverPod := c.pod(t, plain, "server", kubeNode, disabled, nil)

	a := newAgent(t, c.api, kubeNode)
	a.start(ctx)
	node := harness.NewNode(t, harness.NodeOptions{Plugins: append(harness.ReferencePluginNames(), "mesh-cni")})
	list := node.Conflist(t, "meshnet", a.meshEntry())
	client, optOut, late, srv := cniPod(t, node, clientPod), cniPod(t, node, optOutPod), cniPod(t, node, latePod), cniPod(t, node, serverPod)
	for _, p := range []*harness.Pod{client, optOut, late, srv} {
		add(ctx, t, node, list, p)
	}
	if !a.enrolled(client) {
		t.Error("a pod created in a labelled namespace is not enrolled")
	}
	if a.enrolled(optOut) {
		t.Error("a pod labelled disabled in a labelled namespace was enrolled")
	}
	if a.enrolled(late) || a.enrolled(srv) {
		t.Error("a pod in an unlabelled namespace was enrolled")
	}
	c.waitAnnotation(t, lab, "client", enroll.OutcomeEnabled)
	// Pods outside the mesh get no write at all (testAgentPodStartRequests
	// counts them in the audit log).
	c.noRedirection(t, lab, "opt-out")
	c.noRedirection(t, plain, "late")

	srv.ServeEcho(t, 8080)
	_, records := late.StartRefproxy(ctx, t)
	target := netip.AddrPortFrom(srv.IPv4(t), 8080)
	if err := late.EchoRoundTrip(ctx, target, []byte("mesh-cni k8s")); err != nil {
		t.Fatalf("late -> server before enrollment: %v", err)
	}
	if n := len(proxy.MustReadRecords(t, records)); n != 0 {
		t.Fatalf("the proxy of a pod not yet enrolled saw %d connections", n)
	}

	// Label the namespace: the running pod is enrolled, its traffic proxied.
	c.setLabel(t, plain, "", "mesh-cni.io/dataplane-mode", "enabled")
	waitEnrolled(t, a, late, true, "namespace labelled")
	if a.enrolled(srv) {
		t.Error("the opted-out server pod was enrolled with its namespace")
	}
	if err := late.EchoRoundTrip(ctx, target, []byte("mesh-cni k8s")); err != nil {
		t.Fatalf("late -> server after enrollment: %v", err)
	}
	recs := proxy.AwaitRecords(ctx, t, records, 1)
	if r := recs[0]; r.Direction != "outbound" || r.OriginalDst.Addr().Unmap() != target.Addr() || r.OriginalDst.Port() != target.Port() || r.Error != "" {
		t.Fatalf("proxy record %+v, want outbound to %s", r, target)
	}
	c.waitAnnotation(t, plain, "late", enroll.OutcomeEnabled)

	// Unlabel it: released, traffic direct again.
	c.setLabel(t, plain, "", "mesh-cni.io/dataplane-mode", "")
	waitEnrolled(t, a, late, false, "namespace unlabelled")
	if err := late.EchoRoundTrip(ctx, target, []byte("mesh-cni k8s")); err != nil {
		t.Fatalf("late -> server after release: %v", err)
	}
	if n := len(proxy.MustReadRecords(t, records)); n != 1 {
		t.Fatalf("the proxy saw %d connections, want only the one made while enrolled", n)
	}
	c.waitAnnotation(t, plain, "late", enroll.OutcomeDisabled)
	if !a.enrolled(client) {
		t.Error("a pod in the still-labelled namespace was released")
	}
}

// testAgentPluginGetsNoCredential: the agent installs the chain entry itself;
// the entry, the conf dir and the installed plugin carry no credential, the
// plugin links no Kubernetes client, the agent's kubeconfig is 0600, and a pod
// is still enrolled by labels through that chain.
func testAgentPluginGetsNoCredential(t *testing.T, c *cluster) {
	ctx := apiContext(t)
	kubeNode := "node-" + fixtures.RandomHex(4)
	ns := c.namespace(t, "cred", enabled)
	apiPod := c.pod(t, ns, "web", kubeNode, nil, nil)
	node := primaryNode(t)
	a := newAgent(t, c.api, kubeNode, append(installArgs(t, node), "--owned-config=false")...)
	a.start(ctx)
	list := waitChainEntry(t, node, true)

	// The entry: only the plugin's own settings, nothing that is or points at
	// a credential.
	var entry map[string]any
	if err := json.Unmarshal(list.Plugins[len(list.Plugins)-1].Bytes, &entry); err != nil {
		t.Fatal(err)
	}
	for key := range entry {
		lower := strings.ToLower(key)
		for _, bad := range []string{"kube", "token", "cert", "key", "password", "secret", "credential", "auth"} {
			if strings.Contains(lower, bad) {
				t.Errorf("the chain entry has a field %q (%v): the plugin must be given no credential", key, entry[key])
			}
		}
	}
	kubeconfig, err := os.ReadFile(a.Kubeconfig)
	if err != nil {
		t.Fatal(err)
	}
	secrets := map[string][]byte{
		"the kubeconfig path": []byte(a.Kubeconfig),
		"the agent's token":   []byte(c.api.Token(kubeenv.AgentUser)),
		"the kubeconfig":      kubeconfig,
	}
	// Everything the runtime hands the plugin or runs: the conf dir and the
	// bin dir the agent installed into. A certificate or key in a config file
	// would be a credential too (the binary holds "-----BEGIN" as code).
	for _, dir := range []string{node.ConfDir, node.BinDir} {
		err = filepath.Walk(dir, func(path string, info os.FileInfo, err error) error {
			if err != nil || !info.Mode().IsRegular() {
				return err
			}
			data, err := os.ReadFile(path)
			if err != nil {
				return err
			}
			for what, s := range secrets {
				if bytes.Contains(data, s) {
					t.Errorf("%s holds %s", path, what)
				}
			}
			if dir == node.ConfDir && bytes.Contains(data, []byte("-----BEGIN")) {
				t.Errorf("%s holds a PEM block", path)
			}
			return nil
		})
		if err != nil {
			t.Fatal(err)
		}
	}

	// The installed plugin cannot talk to the API server: it links no
	// Kubernetes client library.
	info, err := buildinfo.ReadFile(filepath.Join(node.BinDir, "mesh-cni"))
	if err != nil {
		t.Fatal(err)
	}
	for _, dep := range info.Deps {
		if strings.HasPrefix(dep.Path, "k8s.io/") {
			t.Errorf("the installed mesh-cni links %s %s: the plugin must not be able to call the API server", dep.Path, dep.Version)
		}
	}
	st, err := os.Stat(a.Kubeconfig)
	if err != nil {
		t.Fatal(err)
	}
	if st.Mode().Perm() != 0o600 {
		t.Errorf("the agent's kubeconfig has mode %v, want 0600", st.Mode().Perm())
	}

	// The chain the agent installed still enrolls by labels: the decision is
	// the agent's.
	p := cniPod(t, node, apiPod)
	add(ctx, t, node, list, p)
	if !a.enrolled(p) {
		t.Fatal("a pod in a labelled namespace was not enrolled through the installed chain")
	}
}

// testAgentAddWithAPIServerDown: with the API server stopped, a pod the agent
// has cached is still decided, and an ADD for a pod it has not seen waits for
// the API timeout and fails with the reason; no pod is admitted unenrolled.
// Once the API server is back, the same pod is enrolled, and the failure is on
// record as an Event on it.
func testAgentAddWithAPIServerDown(t *testing.T, c *cluster) {
	ctx := apiContext(t)
	api := kubeenv.StartAPIServer(t, c.bins, c.etcd, "agent-down-"+fixtures.RandomHex(3))
	api.GrantAgent(t)
	own := &cluster{bins: c.bins, etcd: c.etcd, api: api, admin: api.Client(t, kubeenv.AdminUser)}
	kubeNode := "node-" + fixtures.RandomHex(4)
	ns := own.namespace(t, "down", enabled)
	cachedPod := own.pod(t, ns, "cached", kubeNode, nil, nil)

	a := newAgent(t, api, kubeNode)
	a.start(ctx)
	node := harness.NewNode(t, harness.NodeOptions{Plugins: append(harness.ReferencePluginNames(), "mesh-cni")})
	list := node.Conflist(t, "meshnet", a.meshEntry())

	// The scheduler has not bound this pod yet, so the agent's cache (this
	// node's pods) does not hold it.
	pendingPod := own.pod(t, ns, "unseen", "", nil, nil)

	api.Stop(t)
	cached := cniPod(t, node, cachedPod)
	add(ctx, t, node, list, cached)
	if !a.enrolled(cached) {
		t.Fatal("a cached pod in a labelled namespace was not enrolled while the API server was down")
	}

	// Meanwhile the pod was bound to this node and kubelet saw it, but the
	// agent's watch had not delivered it: the agent cannot know its labels and
	// must not guess.
	unseen := cniPod(t, node, pendingPod)
	start := time.Now()
	_, err := node.Add(ctx, unseen, list)
	waited := time.Since(start)
	if err == nil {
		t.Fatal("ADD succeeded for a pod the agent could not look up: it may have started unmeshed")
	}
	for _, want := range []string{"did not answer", "refusing to start the pod unmeshed", ns + "/unseen"} {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("ADD error does not say %q: %v", want, err)
		}
	}
	if waited < 3*time.Second {
		t.Errorf("ADD failed after %s, before the agent's --api-timeout of 3s", waited)
	}
	t.Logf("ADD with the API server down failed after %s: %v", waited.Round(time.Millisecond), err)
	if a.enrolled(unseen) {
		t.Fatal("the agent holds an enrollment for the pod whose ADD failed")
	}

	// Back up: the binding is visible. The runtime DELs the failed attempt
	// and tries again, and the ADD enrolls the pod.
	api.Start(t)
	err = own.admin.CoreV1().Pods(ns).Bind(ctx, &corev1.Binding{
		ObjectMeta: metav1.ObjectMeta{Name: "unseen", Namespace: ns},
		Target:     corev1.ObjectReference{Kind: "Node", Name: kubeNode},
	}, metav1.CreateOptions{})
	if err != nil {
		t.Fatalf("bind pod: %v", err)
	}
	if err := node.Del(ctx, unseen, list); err != nil {
		t.Fatal(err)
	}
	add(ctx, t, node, list, unseen)
	if !a.enrolled(unseen) {
		t.Fatal("the pod was not enrolled once the API server was back")
	}
	own.waitAnnotation(t, ns, "unseen", enroll.OutcomeEnabled)
	// The failed attempt was queued while the API server was down and is
	// written once it is back (the reporter backs off up to 30 s).
	fixtures.WaitFor(t, 2*time.Minute, "the Warning Event for the failed ADD", func() bool {
		evs, err := own.admin.CoreV1().Events(ns).List(ctx, metav1.ListOptions{
			FieldSelector: fields.OneTermEqualSelector("involvedObject.name", "unseen").String(),
		})
		if err != nil {
			return false
		}
		for _, e := range evs.Items {
			if e.Reason == enroll.EventReasonEnrollFailed && strings.Contains(e.Message, "did not answer") && e.InvolvedObject.UID == pendingPod.UID {
				return true
			}
		}
		return false
	})
}
