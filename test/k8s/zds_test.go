package k8s

import (
	"context"
	"encoding/json"
	"net/netip"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/mesh-cni/mesh-cni/internal/kni"
	"github.com/mesh-cni/mesh-cni/internal/kni/knipb"
	"github.com/mesh-cni/mesh-cni/test/containerdhook"
	"github.com/mesh-cni/mesh-cni/test/fixtures"
	"github.com/mesh-cni/mesh-cni/test/harness"
	"github.com/mesh-cni/mesh-cni/test/k8s/kubeenv"
	"github.com/mesh-cni/mesh-cni/test/kniruntime"
	"github.com/mesh-cni/mesh-cni/test/proxy"
)

// podWithSA creates a pod bound to node that runs as serviceAccount. The test
// API server runs without the ServiceAccount admission plugin (no token
// controller), so the name is set here as that plugin would leave it.
func (c *cluster) podWithSA(t *testing.T, namespace, name, node, serviceAccount string) *corev1.Pod {
	t.Helper()
	p, err := c.admin.CoreV1().Pods(namespace).Create(apiContext(t), &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: namespace},
		Spec: corev1.PodSpec{
			NodeName:                      node,
			ServiceAccountName:            serviceAccount,
			Containers:                    []corev1.Container{{Name: "app", Image: "registry.invalid/app:never-pulled"}},
			TerminationGracePeriodSeconds: new(int64),
		},
	}, metav1.CreateOptions{})
	if err != nil {
		t.Fatalf("create pod %s/%s: %v", namespace, name, err)
	}
	return p
}

// nodeProxyLine is a node proxy's log line about one pod's listeners.
type nodeProxyLine struct {
	Msg            string   `json:"msg"`
	Pod            string   `json:"pod"`
	Workload       string   `json:"workload"`
	ServiceAccount string   `json:"serviceAccount"`
	Addrs          []string `json:"addrs"`
}

// testAgentZDSEntryPoints (peers as read: ztunnel commit
// 62d826530e5ce85764e309170205b293efcbc80b through test/ztunnel; libkni v0.3.0
// commit 81fe78d04cf748697e9cf8adf5461cbea9386d4b through kniruntime.StartLibkni;
// the containerd fork at commit b5dc60445dc9537d5e473bec6b1aef9b3c487be1 through
// test/containerdhook): with the Kubernetes source, a pod enrolled through
// each entry point (the CNI chain, the KNI interposer in front of a runtime
// that serves only libkni's method names, the containerd network-plugin hook
// called as containerd's chain calls it) is handed over ZDS with the service
// account from its spec to a node proxy whose ZDS side is test/ztunnel (the
// client written from ztunnel's source, which refuses an empty service
// account); the node proxy opens its listeners inside each pod from that
// handoff, and each pod's outbound traffic goes through them. The hook's
// merged result gives each pod IP once. After an agent restart the node proxy's
// new snapshot carries the same service accounts, from the agent's records.
func testAgentZDSEntryPoints(t *testing.T, c *cluster) {
	ctx := apiContext(t)
	kubeNode := "node-" + fixtures.RandomHex(4)
	mesh := c.namespace(t, "zds", enabled)
	plain := c.namespace(t, "zds-plain", nil)
	serverPod := c.podWithSA(t, plain, "server", kubeNode, "server-sa")
	viaCNI := c.podWithSA(t, mesh, "via-cni", kubeNode, "cni-sa")
	viaKNI := c.podWithSA(t, mesh, "via-kni", kubeNode, "kni-sa")
	viaHook := c.podWithSA(t, mesh, "via-hook", kubeNode, "hook-sa")

	node := harness.NewNode(t, harness.NodeOptions{Plugins: append(harness.ReferencePluginNames(), "mesh-cni")})
	// One network name for the plain primary and the chain with mesh-cni, so
	// host-local hands out every address from one pool.
	primary := node.Conflist(t, "zdsnet")
	runtime := kniruntime.StartLibkni(t, node, primary)

	a := prepareAgent(t)
	a.Kubeconfig = c.api.WriteKubeconfig(t, kubeenv.AgentUser, filepath.Join(a.dir, "kubeconfig"))
	zdsSocket := filepath.Join(a.dir, "zds", "ztunnel.sock")
	kniSocket := filepath.Join(a.dir, "kni", "kni.sock")
	pluginDir := filepath.Join(a.dir, "containerd", "net.d")
	a.Args = append(a.Args, "--enrollment", "kubernetes", "--kubeconfig", a.Kubeconfig, "--node-name", kubeNode, "--api-timeout", "3s",
		"--zds-socket", zdsSocket, "--zds-wait", "always",
		"--kni-socket", kniSocket, "--kni-upstream", runtime.Socket)
	a.start(ctx)
	containerdhook.StartHook(t, a.Socket, pluginDir)

	records := filepath.Join(t.TempDir(), "node-proxy.jsonl")
	np := harness.StartProcess(t, harness.ProcessOptions{
		Path: harness.Bins(t).Path("refproxy"),
		Args: []string{"-zds", zdsSocket, "-require-service-account", "-record", records},
		Name: "node-proxy",
		// Its own cgroup, as ztunnel's container: how the agent knows it.
		OwnCgroup: true,
	})
	readyCtx, cancel := context.WithTimeout(ctx, 30*time.Second)
	_, err := np.WaitForLine(readyCtx, "ready")
	cancel()
	if err != nil {
		t.Fatalf("node proxy: %v\n%s", err, np.Output())
	}

	meshList := node.Conflist(t, "zdsnet", a.meshEntry())
	srv := cniPod(t, node, serverPod)
	add(ctx, t, node, meshList, srv)
	if a.enrolled(srv) {
		t.Fatal("the server in an unlabelled namespace was enrolled")
	}
	srv.ServeEcho(t, 8080)
	target := netip.AddrPortFrom(srv.IPv4(t), 8080)

	// CNI: the chain's ADD returns once the node proxy acked the pod.
	cniP := cniPod(t, node, viaCNI)
	add(ctx, t, node, meshList, cniP)

	// KNI: kubelet's fork calls AttachNetwork; the runtime knows only
	// AttachInterface.
	kniP := cniPod(t, node, viaKNI)
	kconn, err := grpc.NewClient("unix://"+kniSocket, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { kconn.Close() }) // after the detach below
	attachCtx, cancel := context.WithTimeout(ctx, 30*time.Second)
	_, err = knipb.NewKNIClient(kconn).AttachNetwork(attachCtx, &knipb.AttachInterfaceRequest{
		Id: kniP.ContainerID, Name: kniP.Name, Namespace: kniP.Namespace,
		Isolation: &knipb.Isolation{Path: kniP.NetNSPath, Type: "namespace"},
		Labels:    map[string]string{kni.LabelPodUID: kniP.UID, kni.LabelPodName: kniP.Name, kni.LabelPodNamespace: kniP.Namespace},
	})
	cancel()
	if err != nil {
		t.Fatalf("AttachNetwork through the interposer: %v", err)
	}
	// Released at the end, or here if the test stops early (while the agent
	// that enrolled it still runs).
	detach := sync.OnceFunc(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		if _, err := knipb.NewKNIClient(kconn).DetachNetwork(ctx, &knipb.DetachInterfaceRequest{
			Id: kniP.ContainerID, Name: kniP.Name, Namespace: kniP.Namespace, Isolation: &knipb.Isolation{Path: kniP.NetNSPath, Type: "namespace"},
		}); err != nil {
			t.Errorf("DetachNetwork: %v", err)
		}
	})
	t.Cleanup(detach)

	// Hook: containerd runs the primary, then the chain [primary, hook].
	hookP := cniPod(t, node, viaHook)
	if _, err := node.Add(ctx, hookP, primary); err != nil {
		t.Fatalf("primary network for %s: %v", hookP.Name, err)
	}
	hook, reg := containerdhook.DialRegistered(t, pluginDir) // closed after the teardown below
	primaryRes, err := containerdhook.FromCNI(hookP.Result())
	if err != nil {
		t.Fatal(err)
	}
	chain := &containerdhook.Chain{Plugins: []containerdhook.Plugin{containerdhook.Done{Result: primaryRes}, hook}, Names: []string{"bridge", reg.Name}}
	sandbox := containerdhook.Pod{SandboxID: hookP.ContainerID, NetnsPath: hookP.NetNSPath, Name: hookP.Name, Namespace: hookP.Namespace, UID: hookP.UID}
	setupCtx, cancel := context.WithTimeout(ctx, 30*time.Second)
	merged, err := chain.Setup(setupCtx, sandbox)
	cancel()
	if err != nil {
		t.Fatalf("containerd's chain with the hook: %v", err)
	}
	teardown := sync.OnceFunc(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		if err := chain.Teardown(ctx, sandbox, merged); err != nil {
			t.Errorf("hook teardown: %v", err)
		}
	})
	t.Cleanup(teardown)
	ip, more, err := containerdhook.PodIPs(merged)
	if err != nil {
		t.Fatal(err)
	}
	if got, want := len(more)+1, len(hookP.Addrs()); got != want {
		t.Fatalf("containerd would give %s the IPs %s %v, want its %d addresses once each", hookP.Name, ip, more, want)
	}

	for _, x := range []struct {
		p  *harness.Pod
		sa string
	}{{cniP, "cni-sa"}, {kniP, "kni-sa"}, {hookP, "hook-sa"}} {
		if !a.enrolled(x.p) {
			t.Fatalf("%s is not enrolled", x.p.Name)
		}
		// The node proxy's first line about the pod: its listeners, opened in
		// the pod from the ZDS handoff, with the service account it was given.
		lineCtx, cancel := context.WithTimeout(ctx, 10*time.Second)
		raw, err := np.WaitForLine(lineCtx, `"pod":"`+x.p.UID+`"`)
		cancel()
		if err != nil {
			t.Fatalf("the node proxy never served %s: %v\n%s", x.p.Name, err, np.Output())
		}
		var line nodeProxyLine
		if err := json.Unmarshal([]byte(raw[strings.Index(raw, "{"):]), &line); err != nil {
			t.Fatalf("node proxy line %q: %v", raw, err)
		}
		if line.Msg != "proxy listening" || line.ServiceAccount != x.sa || line.Workload != x.p.Namespace+"/"+x.p.Name || len(line.Addrs) == 0 {
			t.Fatalf("node proxy about %s: %+v; want its listeners, workload %s/%s, service account %s", x.p.Name, line, x.p.Namespace, x.p.Name, x.sa)
		}
		before := len(proxy.MustReadRecords(t, records))
		if err := x.p.EchoRoundTrip(ctx, target, []byte("mesh-cni k8s")); err != nil {
			t.Fatalf("%s -> server: %v", x.p.Name, err)
		}
		recs := proxy.AwaitRecords(ctx, t, records, before+1)
		found := false
		for _, r := range recs[before:] {
			if r.Pod == x.p.UID && r.Direction == proxy.Outbound && r.Error == "" && r.OriginalDst.Addr().Unmap() == target.Addr() && r.OriginalDst.Port() == target.Port() {
				found = true
			}
		}
		if !found {
			t.Fatalf("no node proxy record of %s's connection to %s going out through its listener: %+v", x.p.Name, target, recs[before:])
		}
	}

	// A restarted agent hands the node proxy a snapshot from its records: the
	// service accounts survive the restart (an empty one would be refused).
	snapshots := func() int { return strings.Count(np.Output(), `"snapshot received"`) }
	before := snapshots()
	if err := a.Proc.Stop(ctx); err != nil {
		t.Fatalf("stop the agent: %v", err)
	}
	a.start(ctx)
	fixtures.WaitFor(t, 30*time.Second, "the node proxy's snapshot from the restarted agent", func() bool { return snapshots() > before })
	if out := np.Output(); strings.Contains(out, "deviates") {
		t.Fatalf("the ztunnel-behaving client saw a deviation:\n%s", out)
	}
	for _, p := range []*harness.Pod{cniP, kniP, hookP} {
		if err := p.EchoRoundTrip(ctx, target, []byte("mesh-cni k8s")); err != nil {
			t.Fatalf("%s -> server after the agent restarted: %v", p.Name, err)
		}
	}
	// Released through the restarted agent, before its process is stopped.
	detach()
	teardown()
}
