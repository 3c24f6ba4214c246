package k8s

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/containernetworking/cni/libcni"
	"github.com/containernetworking/plugins/pkg/netlinksafe"
	"github.com/vishvananda/netlink"
	"golang.org/x/net/dns/dnsmessage"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/intstr"
	"k8s.io/client-go/kubernetes"

	"github.com/mesh-cni/mesh-cni/internal/enroll"
	"github.com/mesh-cni/mesh-cni/internal/netns"
	"github.com/mesh-cni/mesh-cni/test/fixtures"
	"github.com/mesh-cni/mesh-cni/test/harness"
	"github.com/mesh-cni/mesh-cni/test/k8s/kubeenv"
	"github.com/mesh-cni/mesh-cni/test/ztunnel"
)

// The node agents of an Istio ambient node, side by side: the real istio-cni
// (its node agent and plugin, from istio.io/istio) and mesh-cni in its place,
// each under the real istiod and with the ztunnel double (test/ztunnel) as the
// node proxy, with identical assertions. istio-cni with the double is what runs
// in production but for ztunnel itself, so whatever passes there and fails on
// mesh-cni is mesh-cni's to fix, and whatever fails there is the double's.

// Names the double answers over DNS, and the resolver the pods ask (nothing
// listens there: only a captured query gets an answer).
const (
	istioDNSName = "mesh-check.istio.test"
	podResolver  = "10.96.0.10:53"
)

var istioDNSAddr = netip.MustParseAddr("192.0.2.53")

// The cluster's resolver as ztunnel's own resolv.conf names it, on the node,
// and a name only it answers: the double forwards a pod's query for that name
// there from the pod's namespace, as ztunnel does.
var upstreamResolver = netip.MustParseAddrPort("198.51.100.10:53")

const upstreamDNSName = "upstream.istio.test"

// istioBins is the directory of pilot-discovery, install-cni and istio-cni.
func istioBins(t *testing.T) string {
	t.Helper()
	dir := os.Getenv(harness.EnvIstioBinDir)
	if dir == "" {
		t.Fatalf("$%s is not set: TestMain builds Istio with hack/build-istio.sh", harness.EnvIstioBinDir)
	}
	return dir
}

// ambientNode is one node of an Istio ambient cluster of its own: etcd, the API
// server and istiod on a link the node's namespace reaches, a harness node, the
// kubelet's cgroup, and the pods' namespaces in the API.
type ambientNode struct {
	node     *harness.Node
	api      *kubeenv.APIServer
	admin    kubernetes.Interface
	name     string
	istiod   string       // istiod's debug base URL
	xds      string       // istiod's plaintext xDS address
	injector string       // istiod's sidecar injection URL, when it injects
	kubelet  string       // the kubelet's cgroup
	dir      string       // short: sockets live here
	zds      string       // the ZDS socket the node agent serves
	records  string       // the ztunnel double's records
	upstream *resolverLog // the resolver at upstreamResolver
	ambient  string       // a namespace labelled istio.io/dataplane-mode=ambient
	plain    string       // a namespace outside the mesh
	listName string
	istioCNI *harness.Process // istio-cni's node agent, once started
	// pidNS is the node's PID namespace, whose process 1 runs in the node's
	// network namespace as a node's init does; hostProc is a procfs of it,
	// istio-cni's /host/proc (its DaemonSet runs with the host's).
	pidNS, hostProc string
	// istioCNIEnv is added to istio-cni's environment.
	istioCNIEnv []string
}

// newAmbientNode starts the cluster and the node; the node agent is the caller's.
func newAmbientNode(t *testing.T) *ambientNode {
	t.Helper()
	return newAmbientNodeWith(t, false)
}

// newAmbientNodeWith is newAmbientNode with istiod's sidecar injector on
// (inject), configured as its chart configures it with istio-cni
// (injectorConfigMaps).
func newAmbientNodeWith(t *testing.T, inject bool) *ambientNode {
	t.Helper()
	bins, err := kubeenv.FromEnv()
	if err != nil {
		t.Fatal(err)
	}
	dir, err := os.MkdirTemp("", "mesh-istio-")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	n := &ambientNode{
		node:     harness.NewNode(t, harness.NodeOptions{Plugins: append(harness.ReferencePluginNames(), "mesh-cni")}),
		name:     "ambient-" + fixtures.RandomHex(3),
		dir:      dir,
		zds:      filepath.Join(dir, "ztunnel.sock"),
		records:  filepath.Join(dir, "ztunnel.jsonl"),
		kubelet:  harness.NewCgroup(t, "kubelet"),
		listName: "ambientnet",
	}
	// Loopback up, as on a node: the node agents serve their metrics and
	// health there.
	if err := n.node.Do(func() error {
		lo, err := netlinksafe.LinkByName("lo")
		if err != nil {
			return err
		}
		return netlink.LinkSetUp(lo)
	}); err != nil {
		t.Fatalf("loopback of the node: %v", err)
	}
	n.upstream = serveResolver(t, n.node.Do, upstreamResolver, resolverAnswer)
	n.nodePIDNamespace(t)
	// The API server listens on a link between the test's namespace and the
	// node's: istiod reaches it from here, the node's agents from there.
	hostAddr := apiLink(t, n.node)
	etcd := kubeenv.StartEtcd(t, bins)
	n.api = kubeenv.StartAPIServerWith(t, bins, etcd, n.name, kubeenv.APIServerOptions{Address: hostAddr.String()})
	n.api.GrantAgent(t)
	n.admin = n.api.Client(t, kubeenv.AdminUser)
	ctx := apiContext(t)
	for _, ns := range []*corev1.Namespace{
		{ObjectMeta: metav1.ObjectMeta{Name: "istio-system"}},
		{ObjectMeta: metav1.ObjectMeta{Name: "ambient-" + fixtures.RandomHex(3), Labels: map[string]string{enroll.IstioLabelDataplaneMode: enroll.IstioValueAmbient}}},
		{ObjectMeta: metav1.ObjectMeta{Name: "plain-" + fixtures.RandomHex(3)}},
	} {
		created, err := n.admin.CoreV1().Namespaces().Create(ctx, ns, metav1.CreateOptions{})
		if err != nil {
			t.Fatalf("create namespace %s: %v", ns.Name, err)
		}
		switch {
		case strings.HasPrefix(created.Name, "ambient-"):
			n.ambient = created.Name
		case strings.HasPrefix(created.Name, "plain-"):
			n.plain = created.Name
		}
	}
	if inject {
		for _, cm := range injectorConfigMaps(t) {
			if _, err := n.admin.CoreV1().ConfigMaps("istio-system").Create(ctx, cm, metav1.CreateOptions{}); err != nil {
				t.Fatalf("create ConfigMap %s: %v", cm.Name, err)
			}
		}
	}
	n.istiod, n.xds, n.injector = startIstiod(t, n.api, inject)
	return n
}

// nodePIDNamespace gives the node a PID namespace of its own, its process 1
// in the node's network namespace, and a procfs of it: istio-cni finds the
// host's network namespace at /host/proc/1 and the running pods' namespaces
// through their processes there, which runContainer starts in it.
func (n *ambientNode) nodePIDNamespace(t *testing.T) {
	t.Helper()
	sleep, err := exec.LookPath("sleep")
	if err != nil {
		t.Fatal(err)
	}
	init := harness.StartProcess(t, harness.ProcessOptions{Path: "unshare", Args: []string{"--pid", "--fork", "--kill-child", "--", sleep, "infinity"},
		NetNSPath: n.node.NetNSPath, Name: "node-init", Launcher: true})
	var pid int
	fixtures.WaitFor(t, 30*time.Second, "the node's init", func() bool {
		kids := init.Children()
		if len(kids) != 1 {
			return false
		}
		pid = kids[0]
		return true
	})
	n.pidNS = fmt.Sprintf("/proc/%d/ns/pid", pid)
	n.hostProc = filepath.Join(n.dir, "hostproc")
	if err := os.Mkdir(n.hostProc, 0o755); err != nil {
		t.Fatal(err)
	}
	// Mounted by a process of that namespace: a procfs shows the PID
	// namespace of the process that mounts it.
	if out, err := exec.Command("nsenter", "--pid="+n.pidNS, "--", "mount", "-t", "proc", "proc", n.hostProc).CombinedOutput(); err != nil {
		t.Fatalf("the node's procfs: %v\n%s", err, out)
	}
	t.Cleanup(func() {
		if err := syscall.Unmount(n.hostProc, syscall.MNT_DETACH); err != nil {
			t.Errorf("unmount the node's procfs: %v", err)
		}
	})
}

// apiLink makes a veth pair between the test's network namespace and the node's
// with a random /30 of 169.254.0.0/16 and returns the test side's address.
func apiLink(t *testing.T, node *harness.Node) netip.Addr {
	t.Helper()
	r := fixtures.RandomHex(2)
	b, _ := strconv.ParseUint(r, 16, 16)
	base := netip.AddrFrom4([4]byte{169, 254, byte(64 + b%128), byte(b>>7) &^ 3})
	host, peer := base.Next(), base.Next().Next()
	name := "mcapi" + r
	nodeNS, err := os.Open(node.NetNSPath)
	if err != nil {
		t.Fatal(err)
	}
	defer nodeNS.Close()
	veth := &netlink.Veth{LinkAttrs: netlink.LinkAttrs{Name: name}, PeerName: name + "n", PeerNamespace: netlink.NsFd(int(nodeNS.Fd()))}
	if err := netlink.LinkAdd(veth); err != nil {
		t.Fatalf("API link: %v", err)
	}
	t.Cleanup(func() {
		if l, err := netlinksafe.LinkByName(name); err == nil {
			_ = netlink.LinkDel(l)
		}
	})
	setUp := func(ifname string, a netip.Addr) error {
		l, err := netlinksafe.LinkByName(ifname)
		if err != nil {
			return err
		}
		ipn := &net.IPNet{IP: a.AsSlice(), Mask: net.CIDRMask(30, 32)}
		if err := netlink.AddrAdd(l, &netlink.Addr{IPNet: ipn}); err != nil {
			return err
		}
		return netlink.LinkSetUp(l)
	}
	if err := setUp(name, host); err != nil {
		t.Fatalf("API link: %v", err)
	}
	if err := node.Do(func() error { return setUp(name+"n", peer) }); err != nil {
		t.Fatalf("API link in the node: %v", err)
	}
	return host
}

// startIstiod runs pilot-discovery against the API server with ambient on, as
// Istio's ambient profile does, every listener on loopback, and returns its debug
// base URL, its plaintext xDS address and, with inject, its sidecar injection
// URL once /ready answers.
func startIstiod(t *testing.T, api *kubeenv.APIServer, inject bool) (debug, xds, injector string) {
	t.Helper()
	cwd := t.TempDir()
	kubeconfig := api.WriteKubeconfig(t, kubeenv.AdminUser, filepath.Join(cwd, "kubeconfig"))
	ports := map[string]int{}
	for _, name := range []string{"http", "https", "grpc", "securegrpc", "monitoring", "ctrlz"} {
		ports[name] = freeLoopbackPort(t)
	}
	addr := func(name string) string { return fmt.Sprintf("127.0.0.1:%d", ports[name]) }
	proc := harness.StartProcess(t, harness.ProcessOptions{
		Path: filepath.Join(istioBins(t), "pilot-discovery"),
		Name: "istiod",
		Dir:  cwd,
		Args: []string{"discovery", "--kubeconfig", kubeconfig,
			"--httpAddr", addr("http"), "--httpsAddr", addr("https"), "--grpcAddr", addr("grpc"),
			"--secureGRPCAddr", addr("securegrpc"), "--monitoringAddr", addr("monitoring"),
			"--ctrlz_port", strconv.Itoa(ports["ctrlz"]), "--log_output_level", "default:warn"},
		Env: []string{"POD_NAMESPACE=istio-system", "PILOT_ENABLE_AMBIENT=true", "INJECT_ENABLED=" + strconv.FormatBool(inject),
			"PILOT_ENABLE_GATEWAY_API=false", "REVISION=default", "KUBECONFIG=" + kubeconfig},
	})
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	err := harness.PollUntil(ctx, proc, 200*time.Millisecond, func(ctx context.Context) error {
		return harness.GetOK(ctx, "http://"+addr("http")+"/ready")
	})
	if err != nil {
		t.Fatalf("istiod did not become ready: %v", err)
	}
	if inject {
		injector = "https://" + addr("https") + "/inject"
	}
	return "http://" + addr("monitoring"), addr("grpc"), injector
}

func freeLoopbackPort(t *testing.T) int {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	return ln.Addr().(*net.TCPAddr).Port
}

// impostor is the pod whose service account the double takes to be
// misreportedSA, as if the node agent had sent that one over ZDS.
const (
	impostor      = "impostor"
	misreportedSA = "not-" + impostor + "-sa"
)

// startZtunnel runs the double against the node agent's ZDS socket, in a cgroup
// of its own (mesh-cni knows the node proxy by it), as the ztunnel of the node
// with istiod's workloads over WDS.
func (n *ambientNode) startZtunnel(t *testing.T) *harness.Process {
	t.Helper()
	return harness.StartProcess(t, harness.ProcessOptions{
		Path: harness.Bins(t).Path("ztunnel"), Name: "ztunnel", OwnCgroup: true,
		Args: []string{"-zds", n.zds, "-xds", n.xds, "-node", n.name, "-record", n.records,
			"-dns", istioDNSName + "=" + istioDNSAddr.String(), "-dns-forward", upstreamResolver.String(), "-require-service-account",
			"-misreport-service-account", n.ambient + "/" + impostor + "=" + misreportedSA, "-log-level", "debug"},
	})
}

// startIstioCNI runs istio-cni's node agent (install-cni) on the node as its
// DaemonSet runs it: in the node's network namespace, with the host paths it
// expects under /host and its service account's files (in a PID namespace of its
// own, its /host/proc the node's: it reads the host's namespace from
// /host/proc/1 and finds running pods through their processes there), ambient on
// with DNS capture and IPv6, and the chart's enablement selector. It installs its
// plugin into the node's bin dir and chains it into the node's conflist (the
// primary's alone unless another entry is there already), which it returns once
// it is there.
func (n *ambientNode) startIstioCNI(t *testing.T) *libcni.NetworkConfigList {
	t.Helper()
	primary, err := n.node.ConflistJSON(n.listName)
	if err != nil {
		t.Fatal(err)
	}
	conf := filepath.Join(n.node.ConfDir, "10-"+n.listName+".conflist")
	if _, err := os.Stat(conf); errors.Is(err, os.ErrNotExist) {
		if err := os.WriteFile(conf, primary, 0o644); err != nil {
			t.Fatal(err)
		}
	} else if err != nil {
		t.Fatal(err)
	}
	// The files of its service account, and the plugin alone in its image's
	// /opt/cni/bin.
	sa := filepath.Join(n.dir, "sa")
	src := filepath.Join(n.dir, "cnibin")
	run := filepath.Join(n.dir, "run")
	for _, d := range []string{sa, src, run} {
		if err := os.MkdirAll(d, 0o755); err != nil {
			t.Fatal(err)
		}
	}
	if err := os.WriteFile(filepath.Join(sa, "token"), []byte(n.api.Token(kubeenv.AdminUser)), 0o600); err != nil {
		t.Fatal(err)
	}
	ca, err := os.ReadFile(n.api.CAFile())
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(sa, "ca.crt"), ca, 0o644); err != nil {
		t.Fatal(err)
	}
	plugin, err := os.ReadFile(filepath.Join(istioBins(t), "istio-cni"))
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(src, "istio-cni"), plugin, 0o755); err != nil {
		t.Fatal(err)
	}
	root := filepath.Join(n.dir, "root")
	apiURL := strings.TrimPrefix(n.api.URL, "https://")
	host, port, _ := net.SplitHostPort(apiURL)
	n.istioCNI = harness.StartProcess(t, harness.ProcessOptions{
		Path:      "unshare",
		Args:      kubeenv.IstioCNIArgs(root, sa, src, n.node.BinDir, istioBins(t), n.hostProc),
		Name:      "istio-cni",
		NetNSPath: n.node.NetNSPath,
		Env: append([]string{
			"KUBERNETES_SERVICE_HOST=" + host, "KUBERNETES_SERVICE_PORT=" + port, "KUBECONFIG=",
			"NODE_NAME=" + n.name, "KUBERNETES_NODE_NAME=" + n.name, "POD_NAMESPACE=istio-system",
			"MOUNTED_CNI_NET_DIR=" + n.node.ConfDir, "CNI_AGENT_RUN_DIR=" + run, "ZTUNNEL_UDS_ADDRESS=" + n.zds,
			"AMBIENT_ENABLED=true", "AMBIENT_DNS_CAPTURE=true", "AMBIENT_IPV6=true",
			"AMBIENT_ENABLEMENT_SELECTOR=" + kubeenv.IstioAmbientSelector, "EXCLUDE_NAMESPACES=kube-system,istio-system",
			"REPAIR_ENABLED=false", "MONITORING_PORT=15014", "PLUGIN_LOG_LEVEL=debug",
		}, n.istioCNIEnv...),
	})
	var list *libcni.NetworkConfigList
	fixtures.WaitFor(t, time.Minute, "istio-cni chained into the primary's conflist", func() bool {
		l, err := libcni.ConfListFromFile(conf)
		if err != nil {
			return false
		}
		if _, err := os.Stat(n.zds); err != nil {
			return false
		}
		for _, p := range l.Plugins {
			if p.Network.Type == "istio-cni" {
				list = l
				return true
			}
		}
		return false
	})
	return list
}

// startMeshAgent runs mesh-agent in istio-cni's place: the Kubernetes source
// with the istio profile, ZDS on the socket the double connects to, the kubelet
// by its cgroup, in the node's network namespace (as the DaemonSet runs it on the
// host network). The node proxy is known by its cgroup only (no mark).
func (n *ambientNode) startMeshAgent(t *testing.T) *libcni.NetworkConfigList {
	t.Helper()
	a := n.runMeshAgent(t)
	return n.node.Conflist(t, n.listName, a.meshEntry())
}

// runMeshAgent starts mesh-agent as startMeshAgent describes, with extra
// arguments, and returns it once ready.
func (n *ambientNode) runMeshAgent(t *testing.T, extra ...string) *agent {
	t.Helper()
	a := prepareAgent(t)
	// Metrics and health on their default address, in the node's namespace.
	a.Args = slices.DeleteFunc(a.Args, func(arg string) bool { return arg == "--metrics-addr=" })
	a.Kubeconfig = n.api.WriteKubeconfig(t, kubeenv.AgentUser, filepath.Join(a.dir, "kubeconfig"))
	a.Args = append(a.Args, "--enrollment", "kubernetes", "--kubeconfig", a.Kubeconfig, "--node-name", n.name,
		"--selector-profile", "istio", "--zds-socket", n.zds, "--proxy-mark", "0", "--probe-cgroups", n.kubelet)
	a.Args = append(a.Args, extra...)
	a.Proc = harness.StartProcess(t, harness.ProcessOptions{Path: harness.Bins(t).Path("mesh-agent"), Args: a.Args, Name: "mesh-agent", NetNSPath: n.node.NetNSPath})
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	if err := harness.WaitForHealthy(ctx, a.Socket); err != nil {
		t.Fatalf("agent did not become ready: %v\n%s", err, a.Proc.Output())
	}
	return a
}

// ambientPod is a pod in the API and on the node.
type ambientPod struct {
	api *corev1.Pod
	cni *harness.Pod
	app *peerServer
}

// addPod creates the pod in the API (as the scheduler leaves it), ADDs it on the
// node through list, and reports its addresses and readiness as kubelet would:
// istiod indexes pods by their status.
func (n *ambientNode) addPod(t *testing.T, list *libcni.NetworkConfigList, namespace, name string) *ambientPod {
	t.Helper()
	ctx := apiContext(t)
	p, err := n.admin.CoreV1().Pods(namespace).Create(ctx, &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: namespace, Labels: map[string]string{"app": name}},
		Spec: corev1.PodSpec{
			NodeName:           n.name,
			ServiceAccountName: name + "-sa",
			// The kubelet's probe below connects to 8080: mesh-cni lets the
			// kubelet past the capture only to the ports the pod's probes name.
			Containers: []corev1.Container{{Name: "app", Image: "registry.invalid/app:never-pulled",
				ReadinessProbe: &corev1.Probe{ProbeHandler: corev1.ProbeHandler{TCPSocket: &corev1.TCPSocketAction{Port: intstr.FromInt32(8080)}}}}},
			TerminationGracePeriodSeconds: new(int64),
		},
	}, metav1.CreateOptions{})
	if err != nil {
		t.Fatal(err)
	}
	hp := cniPod(t, n.node, p)
	addAsKubelet(ctx, t, n.node, list, hp)
	p = updatePodStatus(ctx, t, n.admin, namespace, name, func(st *corev1.PodStatus) {
		st.Phase = corev1.PodRunning
		st.Conditions = []corev1.PodCondition{{Type: corev1.PodReady, Status: corev1.ConditionTrue}}
		st.PodIPs = nil
		for _, a := range []netip.Addr{hp.IPv4(t), hp.IPv6(t)} {
			st.PodIPs = append(st.PodIPs, corev1.PodIP{IP: a.String()})
		}
		st.PodIP = st.PodIPs[0].IP
	})
	ap := &ambientPod{api: p, cni: hp, app: &peerServer{}}
	ap.app.serve(t, hp, 8080)
	return ap
}

// addAsKubelet runs ADD the way kubelet creates a sandbox: a failed ADD is
// torn down with DEL and tried again. istio-cni's plugin fails ADD while its
// node agent's informer has not yet seen the pod, which kubelet rides out
// with this retry.
func addAsKubelet(ctx context.Context, t *testing.T, node *harness.Node, list *libcni.NetworkConfigList, p *harness.Pod) {
	t.Helper()
	deadline := time.Now().Add(30 * time.Second)
	for {
		_, err := node.Add(ctx, p, list)
		if err == nil {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("ADD %s/%s: %v", p.Namespace, p.Name, err)
		}
		t.Logf("ADD %s/%s failed, retrying as kubelet would: %v", p.Namespace, p.Name, err)
		if err := node.Del(ctx, p, list); err != nil {
			t.Logf("DEL after the failed ADD: %v", err)
		}
		// kubelet's spacing of sandbox retries (far longer there), not a wait.
		time.Sleep(time.Second)
	}
}

// peerServer answers each connection with the address it came from.
type peerServer struct {
	mu    sync.Mutex
	peers []netip.Addr
}

func (s *peerServer) serve(t *testing.T, p *harness.Pod, port int) {
	t.Helper()
	ln := p.Listen(t, "tcp", fmt.Sprintf("[::]:%d", port))
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			peer := netip.MustParseAddrPort(c.RemoteAddr().String()).Addr().Unmap()
			s.mu.Lock()
			s.peers = append(s.peers, peer)
			s.mu.Unlock()
			go func() {
				defer c.Close()
				fmt.Fprintf(c, "FROM %s\n", peer)
			}()
		}
	}()
}

func (s *peerServer) count() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return len(s.peers)
}

// ask connects from p to target and returns the address the server saw.
func ask(t *testing.T, p *harness.Pod, target netip.AddrPort) (netip.Addr, error) {
	t.Helper()
	// Longer than ztunnel waits for a pod's workload before it refuses.
	limit := 2 * ztunnel.LocalWorkloadWait
	ctx, cancel := context.WithTimeout(context.Background(), limit)
	defer cancel()
	c, err := p.Dial(ctx, "tcp", target.String())
	if err != nil {
		return netip.Addr{}, err
	}
	defer c.Close()
	_ = c.SetDeadline(time.Now().Add(limit))
	line, err := bufio.NewReader(c).ReadString('\n')
	if err != nil {
		return netip.Addr{}, fmt.Errorf("read from %s: %w", target, err)
	}
	return netip.ParseAddr(strings.TrimSpace(strings.TrimPrefix(line, "FROM ")))
}

// askRefused asks target from p and fails unless the connection is refused
// before app, the application at target, sees it.
func askRefused(t *testing.T, what string, p *harness.Pod, target netip.AddrPort, app *peerServer) {
	t.Helper()
	before := app.count()
	if got, err := ask(t, p, target); err == nil {
		t.Errorf("%s: the application saw %s, want the connection refused", what, got)
	}
	if app.count() != before {
		t.Errorf("%s reached the application", what)
	}
}

// probe connects to target from the node's namespace in the kubelet's cgroup and
// returns the address the server saw.
func (n *ambientNode) probe(t *testing.T, target netip.AddrPort) (netip.Addr, error) {
	t.Helper()
	cg, err := os.Open(n.kubelet)
	if err != nil {
		t.Fatal(err)
	}
	defer cg.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	cmd := exec.CommandContext(ctx, os.Args[0], "-test.run=^TestHelperAsk$", "-test.v=false")
	cmd.Env = append(os.Environ(), "MESH_ASK_TARGET="+target.String())
	cmd.SysProcAttr = &syscall.SysProcAttr{UseCgroupFD: true, CgroupFD: int(cg.Fd())}
	cmd.WaitDelay = 5 * time.Second
	var out strings.Builder
	cmd.Stdout = &out
	if err := netns.Do(n.node.NetNSPath, cmd.Start); err != nil {
		t.Fatal(err)
	}
	if err := cmd.Wait(); err != nil {
		return netip.Addr{}, fmt.Errorf("prober: %w (%s)", err, out.String())
	}
	line := strings.TrimSpace(strings.TrimSuffix(strings.TrimSpace(out.String()), "PASS"))
	if rest, ok := strings.CutPrefix(line, "FROM "); ok {
		return netip.ParseAddr(rest)
	}
	return netip.Addr{}, errors.New(line)
}

// TestHelperAsk is not a test: it is the kubelet's probe in probe, run in the
// kubelet's cgroup in the node's namespace.
func TestHelperAsk(t *testing.T) {
	target := os.Getenv("MESH_ASK_TARGET")
	if target == "" {
		t.Skip("helper process of probe")
	}
	c, err := net.DialTimeout("tcp", target, 10*time.Second)
	if err != nil {
		fmt.Println("ERR", err)
		return
	}
	defer c.Close()
	_ = c.SetDeadline(time.Now().Add(10 * time.Second))
	line, err := bufio.NewReader(c).ReadString('\n')
	if err != nil {
		fmt.Println("ERR", err)
		return
	}
	fmt.Print(line)
}

// resolve sends an A query for name from p to the resolver address server,
// over UDP, and returns the answers.
func resolve(t *testing.T, p *harness.Pod, server, name string) ([]netip.Addr, error) {
	t.Helper()
	var c net.Conn
	err := p.Do(func() error {
		var err error
		c, err = net.Dial("udp", server)
		return err
	})
	if err != nil {
		return nil, err
	}
	defer c.Close()
	b := dnsmessage.NewBuilder(nil, dnsmessage.Header{ID: 0x4d43, RecursionDesired: true})
	_ = b.StartQuestions()
	_ = b.Question(dnsmessage.Question{Name: dnsmessage.MustNewName(name + "."), Type: dnsmessage.TypeA, Class: dnsmessage.ClassINET})
	q, err := b.Finish()
	if err != nil {
		return nil, err
	}
	// Longer than ztunnel waits for a pod's workload before it answers.
	_ = c.SetDeadline(time.Now().Add(2 * ztunnel.LocalWorkloadWait))
	if _, err := c.Write(q); err != nil {
		return nil, err
	}
	buf := make([]byte, 1500)
	m, err := c.Read(buf)
	if err != nil {
		return nil, err
	}
	var msg dnsmessage.Message
	if err := msg.Unpack(buf[:m]); err != nil {
		return nil, err
	}
	var out []netip.Addr
	for _, a := range msg.Answers {
		if r, ok := a.Body.(*dnsmessage.AResource); ok {
			out = append(out, netip.AddrFrom4(r.A))
		}
	}
	return out, nil
}

// waitRecord waits until the double has a record matching ok and returns it.
func (n *ambientNode) waitRecord(t *testing.T, what string, ok func(ztunnel.Record) bool) ztunnel.Record {
	t.Helper()
	var found ztunnel.Record
	fixtures.WaitFor(t, 20*time.Second, what, func() bool {
		recs, _ := ztunnel.ReadRecords(n.records)
		i := slices.IndexFunc(recs, ok)
		if i >= 0 {
			found = recs[i]
		}
		return i >= 0
	})
	return found
}

func (n *ambientNode) recordCount(t *testing.T) int {
	t.Helper()
	recs, err := ztunnel.ReadRecords(n.records)
	if err != nil && !errors.Is(err, os.ErrNotExist) {
		t.Fatal(err)
	}
	return len(recs)
}

// TestIstioAmbient runs one ambient node with istio-cni and one with mesh-cni in
// its place, with the same assertions.
func TestIstioAmbient(t *testing.T) {
	for _, variant := range []struct {
		name  string
		agent func(*ambientNode, *testing.T) *libcni.NetworkConfigList
		view  agentView
	}{
		{"istio-cni", (*ambientNode).startIstioCNI, agentView{
			metrics: "http://127.0.0.1:15014/metrics", ready: "http://127.0.0.1:8000/readyz",
			zdsConnections: "ztunnel_connected", pluginRequests: "istio_cni_plugin_requests_total", ready1: "istio_cni_install_ready",
		}},
		{"mesh-cni", (*ambientNode).startMeshAgent, agentView{
			metrics: "http://127.0.0.1:15099/metrics", ready: "http://127.0.0.1:15099/readyz",
			zdsConnections: "meshcni_zds_connections", pluginRequests: "meshcni_gate_requests_total", ready1: "meshcni_ready",
		}},
	} {
		t.Run(variant.name, func(t *testing.T) {
			t.Parallel()
			n := newAmbientNode(t)
			list := variant.agent(n, t)
			zt := n.startZtunnel(t)
			testAmbientNode(t, n, list, zt, variant.view)
		})
	}
}

// agentView is where an operator finds a node agent, in the node's network
// namespace: its metrics, its readiness endpoint, and the metrics that say
// the same things, as docs/istio.md maps them.
type agentView struct {
	metrics, ready string // URLs
	// zdsConnections is a gauge of the node proxies connected (1 here),
	// pluginRequests a counter of the plugin's calls to the agent (istio-cni's
	// plugin calls it for ambient pods alone, mesh-cni's for every pod),
	// ready1 a gauge that is 1 once the agent is ready.
	zdsConnections, pluginRequests, ready1 string
}

// check fails t unless the view holds on n's node: readiness answers 200,
// one node proxy connected, plugin calls counted, ready.
func (v agentView) check(t *testing.T, n *ambientNode) {
	t.Helper()
	get := func(url string) (int, string, error) {
		ns := &fixtures.Netns{Path: n.node.NetNSPath}
		client := &http.Client{Timeout: 10 * time.Second, Transport: &http.Transport{
			DialContext: func(ctx context.Context, network, addr string) (net.Conn, error) {
				return ns.Dial(ctx, &net.Dialer{}, network, addr)
			},
		}}
		resp, err := client.Get(url)
		if err != nil {
			return 0, "", err
		}
		defer resp.Body.Close()
		body, err := io.ReadAll(resp.Body)
		return resp.StatusCode, string(body), err
	}
	if code, body, err := get(v.ready); err != nil || code != http.StatusOK {
		t.Errorf("readiness %s: %d %q (%v), want 200", v.ready, code, body, err)
	}
	_, body, err := get(v.metrics)
	if err != nil {
		t.Fatalf("metrics %s: %v", v.metrics, err)
	}
	sum := func(name string) (float64, bool) {
		var total float64
		found := false
		for _, m := range regexp.MustCompile(`(?m)^`+regexp.QuoteMeta(name)+`(?:\{[^}]*\})? (\S+)$`).FindAllStringSubmatch(body, -1) {
			f, err := strconv.ParseFloat(m[1], 64)
			if err == nil {
				total, found = total+f, true
			}
		}
		return total, found
	}
	for _, want := range []struct {
		name string
		ok   func(float64) bool
		says string
	}{
		{v.zdsConnections, func(f float64) bool { return f == 1 }, "1 (the one ztunnel)"},
		{v.pluginRequests, func(f float64) bool { return f >= 3 }, "at least one per meshed pod's ADD"},
		{v.ready1, func(f float64) bool { return f == 1 }, "1"},
	} {
		if got, ok := sum(want.name); !ok || !want.ok(got) {
			t.Errorf("%s at %s: %v (present %v), want %s", want.name, v.metrics, got, ok, want.says)
		}
	}
}

// trustDomain is istiod's default: the mesh's identities are
// spiffe://cluster.local/ns/<namespace>/sa/<service account>.
const trustDomain = "cluster.local"

// spiffeOf is the identity istiod gives the pod.
func spiffeOf(p *ambientPod) string {
	return ztunnel.Identity(trustDomain, p.api.Namespace, p.api.Spec.ServiceAccountName)
}

func testAmbientNode(t *testing.T, n *ambientNode, list *libcni.NetworkConfigList, zt *harness.Process, view agentView) {
	client := n.addPod(t, list, n.ambient, "client")
	server := n.addPod(t, list, n.ambient, "server")
	outsider := n.addPod(t, list, n.plain, "outsider")
	// The node agent hands it over as any other meshed pod; the double takes
	// its service account to be misreportedSA.
	imp := n.addPod(t, list, n.ambient, impostor)

	// istiod: the meshed pods are HBONE workloads of this node with their
	// service accounts and both their addresses (the impostor too: istiod
	// goes by the node agent's annotation), the one outside the mesh is not;
	// the node agent said so on the pods.
	ctx, cancel := context.WithTimeout(apiContext(t), 30*time.Second)
	err := harness.PollUntil(ctx, nil, 200*time.Millisecond, func(ctx context.Context) error {
		ws, err := ztunnel.FetchAmbient(ctx, n.istiod)
		if err != nil {
			return err
		}
		byName := map[string]ztunnel.Workload{}
		for _, w := range ws {
			byName[w.Namespace+"/"+w.Name] = w
		}
		for _, p := range []*ambientPod{client, server, imp, outsider} {
			w, ok := byName[p.api.Namespace+"/"+p.api.Name]
			switch {
			case !ok:
				return fmt.Errorf("no workload %s/%s", p.api.Namespace, p.api.Name)
			case w.HBONE != (p != outsider):
				return fmt.Errorf("%s: HBONE %v", p.api.Name, w.HBONE)
			case w.ServiceAccount != p.api.Spec.ServiceAccountName || w.Node != n.name:
				return fmt.Errorf("%s: service account %q on node %q", p.api.Name, w.ServiceAccount, w.Node)
			case !slices.Contains(w.Addresses, p.cni.IPv4(t)) || !slices.Contains(w.Addresses, p.cni.IPv6(t)):
				return fmt.Errorf("%s: addresses %v, want %s and %s", p.api.Name, w.Addresses, p.cni.IPv4(t), p.cni.IPv6(t))
			}
		}
		return nil
	})
	cancel()
	if err != nil {
		t.Fatalf("istiod's ambient index: %v", err)
	}
	for _, p := range []*ambientPod{client, server, outsider, imp} {
		got, err := n.admin.CoreV1().Pods(p.api.Namespace).Get(apiContext(t), p.api.Name, metav1.GetOptions{})
		if err != nil {
			t.Fatal(err)
		}
		want := ""
		if p != outsider {
			want = "enabled"
		}
		if v := got.Annotations[enroll.IstioAnnotationRedirection]; v != want {
			t.Errorf("%s: %s=%q, want %q", p.api.Name, enroll.IstioAnnotationRedirection, v, want)
		}
	}

	n.node.WaitAddressesUsable(apiContext(t), t)
	for _, fam := range []struct {
		name string
		addr func(*harness.Pod, testing.TB) netip.Addr
	}{{"ipv4", (*harness.Pod).IPv4}, {"ipv6", (*harness.Pod).IPv6}} {
		t.Run(fam.name, func(t *testing.T) {
			clientIP, serverIP, outsiderIP, impIP := fam.addr(client.cni, t), fam.addr(server.cni, t), fam.addr(outsider.cni, t), fam.addr(imp.cni, t)
			serverApp := netip.AddrPortFrom(serverIP, 8080)

			// Meshed to meshed: HBONE through the server's 15008; the server's
			// application sees the client's address, the client's ztunnel the
			// client's address as the source, with the original destination.
			// Each ztunnel serves its pod as the identity istiod has for it,
			// and each end knows the other's.
			if got, err := ask(t, client.cni, serverApp); err != nil || got != clientIP {
				t.Errorf("client -> server: the application saw %s (%v), want the client's %s", got, err, clientIP)
			}
			n.waitRecord(t, "the client's outbound HBONE as the client, to the server", func(r ztunnel.Record) bool {
				return r.Pod == client.api.Namespace+"/client" && r.Dir == "outbound" && r.Proto == "hbone" &&
					r.Dst == serverApp && r.Src.Addr() == clientIP && r.Err == "" &&
					r.Identity == spiffeOf(client) && r.Peer == spiffeOf(server)
			})
			n.waitRecord(t, "the server's inbound HBONE as the server, from the client", func(r ztunnel.Record) bool {
				return r.Pod == server.api.Namespace+"/server" && r.Dir == "inbound" && r.Proto == "hbone" &&
					r.Dst == serverApp && r.Src.Addr() == clientIP && r.Err == "" &&
					r.Identity == spiffeOf(server) && r.Peer == spiffeOf(client)
			})

			// From outside the mesh: plaintext through the server's 15006, the
			// application still sees the client's address.
			if got, err := ask(t, outsider.cni, serverApp); err != nil || got != outsiderIP {
				t.Errorf("outsider -> server: the application saw %s (%v), want the outsider's %s", got, err, outsiderIP)
			}
			n.waitRecord(t, "the server's inbound plaintext", func(r ztunnel.Record) bool {
				return r.Pod == server.api.Namespace+"/server" && r.Dir == "inbound" && r.Proto == "tcp" &&
					r.Dst == serverApp && r.Src.Addr() == outsiderIP && r.Err == "" && r.Identity == spiffeOf(server)
			})

			// To outside the mesh: plain TCP from the client's ztunnel, with the
			// original destination and the client's address as the source.
			outsiderApp := netip.AddrPortFrom(outsiderIP, 8080)
			if got, err := ask(t, client.cni, outsiderApp); err != nil || got != clientIP {
				t.Errorf("client -> outsider: the application saw %s (%v), want the client's %s", got, err, clientIP)
			}
			n.waitRecord(t, "the client's outbound plaintext", func(r ztunnel.Record) bool {
				return r.Pod == client.api.Namespace+"/client" && r.Dir == "outbound" && r.Proto == "tcp" &&
					r.Dst == outsiderApp && r.Src.Addr() == clientIP && r.Err == "" && r.Identity == spiffeOf(client)
			})

			// A service account istiod does not have for the pod: its ztunnel
			// finds no workload of its own and refuses its connections both
			// ways, though istiod sends it HBONE.
			askRefused(t, "impostor -> server", imp.cni, serverApp, server.app)
			n.waitRecord(t, "the impostor's outbound refused", func(r ztunnel.Record) bool {
				return r.Pod == imp.api.Namespace+"/"+impostor && r.Dir == "outbound" && r.Proto == "refused" &&
					r.Dst == serverApp && strings.Contains(r.Err, ztunnel.ErrUnknownWorkload.Error()) &&
					strings.Contains(r.Err, misreportedSA)
			})
			impApp := netip.AddrPortFrom(impIP, 8080)
			askRefused(t, "client -> impostor", client.cni, impApp, imp.app)
			n.waitRecord(t, "the impostor's inbound HBONE refused", func(r ztunnel.Record) bool {
				return r.Pod == imp.api.Namespace+"/"+impostor && r.Dir == "inbound" && r.Proto == "refused" &&
					r.Src.Addr() == clientIP && strings.Contains(r.Err, ztunnel.ErrUnknownWorkload.Error())
			})
			n.waitRecord(t, "the client's outbound HBONE to the impostor failed", func(r ztunnel.Record) bool {
				return r.Pod == client.api.Namespace+"/client" && r.Dir == "outbound" && r.Proto == "hbone" &&
					r.Dst == impApp && r.Err != ""
			})

			// The kubelet's probe: answered by the application, past the server's
			// ztunnel.
			before, recs := server.app.count(), n.recordCount(t)
			if _, err := n.probe(t, serverApp); err != nil {
				t.Errorf("kubelet probe of %s: %v", serverApp, err)
				if os.Getenv("MESH_ISTIO_DEBUG") != "" {
					for _, c := range [][]string{{"ip6tables-save"}, {"ipset", "list"}, {"ip", "-6", "route"}, {"ip", "-6", "addr"}} {
						out, _ := exec.Command("ip", append([]string{"netns", "exec", filepath.Base(n.node.NetNSPath)}, c...)...).CombinedOutput()
						t.Logf("node %v:\n%s", c, out)
						out, _ = exec.Command("ip", append([]string{"netns", "exec", filepath.Base(server.cni.NetNSPath)}, c...)...).CombinedOutput()
						t.Logf("server %v:\n%s", c, out)
					}
				}
			}
			if server.app.count() != before+1 || n.recordCount(t) != recs {
				t.Errorf("kubelet probe of %s: the application answered %d, ztunnel handled %d: want the application directly",
					serverApp, server.app.count()-before, n.recordCount(t)-recs)
			}
		})
	}

	// DNS through the pod's ztunnel, as the pod's identity; none for the
	// impostor.
	got, err := resolve(t, client.cni, podResolver, istioDNSName)
	if err != nil || !slices.Contains(got, istioDNSAddr) {
		t.Errorf("DNS from the client: %v (%v), want the client's ztunnel's answer %s", got, err, istioDNSAddr)
	}
	n.waitRecord(t, "the client's DNS query", func(r ztunnel.Record) bool {
		return r.Pod == client.api.Namespace+"/client" && r.Dir == "dns" && r.Name == istioDNSName && r.Err == "" &&
			r.Identity == spiffeOf(client)
	})
	// A name ztunnel does not know: forwarded from the client's own namespace
	// on ztunnel's marked socket, which the capture lets through to the
	// resolver (sent back to ztunnel, it would never be answered).
	got, err = resolve(t, client.cni, podResolver, upstreamDNSName)
	if err != nil || !slices.Contains(got, resolverAnswer) {
		t.Errorf("DNS from the client for %s: %v (%v), want the resolver's answer %s through ztunnel", upstreamDNSName, got, err, resolverAnswer)
	}
	n.waitRecord(t, "the client's query forwarded", func(r ztunnel.Record) bool {
		return r.Pod == client.api.Namespace+"/client" && r.Dir == "dns" && r.Name == upstreamDNSName &&
			r.Forwarded == upstreamResolver.String() && r.Err == ""
	})
	if from := n.upstream.sources(); !slices.Contains(from, client.cni.IPv4(t)) {
		t.Errorf("the resolver was asked from %v, want the client's own address %s (ztunnel's socket in its namespace)", from, client.cni.IPv4(t))
	}
	if got, err := resolve(t, imp.cni, podResolver, istioDNSName); len(got) > 0 {
		t.Errorf("DNS from the impostor: %v (%v), want no answer", got, err)
	}
	n.waitRecord(t, "the impostor's DNS query refused", func(r ztunnel.Record) bool {
		return r.Pod == imp.api.Namespace+"/"+impostor && r.Dir == "dns" && strings.Contains(r.Err, ztunnel.ErrUnknownWorkload.Error())
	})

	// What an operator reads off the node agent.
	view.check(t, n)

	// A pod whose containers have all exited for good leaves the mesh:
	// ztunnel is told, istiod is no longer told HBONE.
	job := n.addPod(t, list, n.ambient, "job")
	fixtures.WaitFor(t, 20*time.Second, "the job's "+enroll.IstioAnnotationRedirection, func() bool {
		got, err := n.admin.CoreV1().Pods(n.ambient).Get(apiContext(t), "job", metav1.GetOptions{})
		return err == nil && got.Annotations[enroll.IstioAnnotationRedirection] == "enabled"
	})
	updatePodStatus(apiContext(t), t, n.admin, n.ambient, "job", func(st *corev1.PodStatus) { st.Phase = corev1.PodSucceeded })
	fixtures.WaitFor(t, 10*time.Second, "the completed job's "+enroll.IstioAnnotationRedirection+" removed", func() bool {
		got, err := n.admin.CoreV1().Pods(n.ambient).Get(apiContext(t), "job", metav1.GetOptions{})
		if err != nil {
			return false
		}
		_, ok := got.Annotations[enroll.IstioAnnotationRedirection]
		return !ok
	})
	fixtures.WaitFor(t, 10*time.Second, "ztunnel to stop the completed job's proxy", func() bool {
		for line := range strings.Lines(zt.Output()) {
			if strings.Contains(line, "pod proxy stopped") && strings.Contains(line, string(job.api.UID)) {
				return true
			}
		}
		return false
	})

	// ztunnel restarted while a port of the server's proxy is taken in its
	// namespace: the pod is refused in the new connection's snapshot, stays
	// pending, and is served once the port is free, by ztunnel's own retry:
	// the node agent neither drops the connection nor the pod.
	zt = n.restartZtunnelWithPortTaken(t, zt, server, ztunnel.HBONEPort)
	before := n.recordCount(t)
	if got, err := ask(t, client.cni, netip.AddrPortFrom(server.cni.IPv4(t), 8080)); err != nil || got != client.cni.IPv4(t) {
		t.Errorf("client -> server once its proxy started late: the application saw %s (%v), want the client's %s", got, err, client.cni.IPv4(t))
	}
	fixtures.WaitFor(t, 20*time.Second, "the server's inbound HBONE through its late proxy", func() bool {
		recs, _ := ztunnel.ReadRecords(n.records)
		return len(recs) > before && slices.ContainsFunc(recs[before:], func(r ztunnel.Record) bool {
			return r.Pod == server.api.Namespace+"/server" && r.Dir == "inbound" && r.Proto == "hbone" && r.Err == ""
		})
	})

	// ztunnel gone: a meshed pod's DNS fails closed; it never reaches the
	// resolver it asked, which answers the pod outside the mesh, but the
	// closed port of ztunnel's listener (the pod's socket is refused, where
	// a lost query would time out).
	resolver := netip.AddrPortFrom(outsider.cni.IPv4(t), 53)
	serveResolver(t, outsider.cni.Do, netip.AddrPortFrom(netip.IPv6Unspecified(), 53), resolverAnswer)
	if got, err := resolve(t, outsider.cni, resolver.String(), istioDNSName); err != nil || !slices.Contains(got, resolverAnswer) {
		t.Fatalf("the outsider's own resolver: %v (%v), want %s", got, err, resolverAnswer)
	}
	stopCtx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if err := zt.Stop(stopCtx); err != nil {
		t.Fatalf("stop the ztunnel double: %v", err)
	}
	if got, err := resolve(t, client.cni, resolver.String(), istioDNSName); !errors.Is(err, syscall.ECONNREFUSED) {
		t.Errorf("DNS from the client with ztunnel down: %v (%v), want the query refused (failing closed)", got, err)
	}
}

// restartZtunnelWithPortTaken stops the double, takes port in p's namespace
// (a listener without SO_REUSEPORT, which the proxy's cannot share), starts
// a new double, waits until p's proxy failed to start in its snapshot, frees
// the port and waits until the double's retry started it. It returns the new
// double.
func (n *ambientNode) restartZtunnelWithPortTaken(t *testing.T, zt *harness.Process, p *ambientPod, port uint16) *harness.Process {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if err := zt.Stop(ctx); err != nil {
		t.Fatalf("stop the ztunnel double: %v", err)
	}
	var taken net.Listener
	if err := p.cni.Do(func() error {
		var err error
		taken, err = net.Listen("tcp", netip.AddrPortFrom(netip.IPv6Unspecified(), port).String())
		return err
	}); err != nil {
		t.Fatalf("take port %d in %s: %v", port, p.api.Name, err)
	}
	defer taken.Close()
	zt = n.startZtunnel(t)
	uid := string(p.api.UID)
	logged := func(msg string) func() bool {
		return func() bool {
			for line := range strings.Lines(zt.Output()) {
				if strings.Contains(line, msg) && strings.Contains(line, uid) {
					return true
				}
			}
			return false
		}
	}
	fixtures.WaitFor(t, 30*time.Second, p.api.Name+"'s proxy refused in the snapshot", logged("pod proxy failed to start"))
	if logged("pod proxy started")() {
		t.Fatalf("%s's proxy started with port %d taken", p.api.Name, port)
	}
	taken.Close()
	fixtures.WaitFor(t, 3*ztunnel.RetryInterval, p.api.Name+"'s proxy started by the retry", logged("pod proxy started"))
	return zt
}

// resolverAnswer is what the resolver of serveResolver answers.
var resolverAnswer = netip.MustParseAddr("198.51.100.53")

// resolverLog is the source addresses a resolver was asked from.
type resolverLog struct {
	mu   sync.Mutex
	from []netip.Addr
}

func (l *resolverLog) sources() []netip.Addr {
	l.mu.Lock()
	defer l.mu.Unlock()
	return slices.Clone(l.from)
}

// serveResolver answers every A query sent to addr over UDP with answer, in
// the network namespace do runs in; an unspecified addr listens on every
// address, any other is first added to the namespace's loopback (up).
func serveResolver(t *testing.T, do func(func() error) error, addr netip.AddrPort, answer netip.Addr) *resolverLog {
	t.Helper()
	var pc *net.UDPConn
	if err := do(func() error {
		if !addr.Addr().IsUnspecified() {
			lo, err := netlinksafe.LinkByName("lo")
			if err != nil {
				return err
			}
			if err := netlink.AddrAdd(lo, &netlink.Addr{IPNet: netlink.NewIPNet(addr.Addr().AsSlice())}); err != nil {
				return fmt.Errorf("the resolver's address on lo: %w", err)
			}
		}
		var err error
		pc, err = net.ListenUDP("udp", net.UDPAddrFromAddrPort(addr))
		return err
	}); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { pc.Close() })
	log := &resolverLog{}
	go func() {
		buf := make([]byte, 1500)
		for {
			n, from, err := pc.ReadFromUDPAddrPort(buf)
			if err != nil {
				return
			}
			log.mu.Lock()
			log.from = append(log.from, from.Addr().Unmap())
			log.mu.Unlock()
			var parser dnsmessage.Parser
			h, err := parser.Start(buf[:n])
			if err != nil {
				continue
			}
			q, err := parser.Question()
			if err != nil {
				continue
			}
			b := dnsmessage.NewBuilder(nil, dnsmessage.Header{ID: h.ID, Response: true, RecursionDesired: h.RecursionDesired})
			_ = b.StartQuestions()
			_ = b.Question(q)
			_ = b.StartAnswers()
			_ = b.AResource(dnsmessage.ResourceHeader{Name: q.Name, Class: dnsmessage.ClassINET, TTL: 30}, dnsmessage.AResource{A: answer.As4()})
			if out, err := b.Finish(); err == nil {
				_, _ = pc.WriteToUDPAddrPort(out, from)
			}
		}
	}()
	return log
}
