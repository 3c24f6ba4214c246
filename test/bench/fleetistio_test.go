package bench

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/mesh-cni/mesh-cni/test/fixtures"
	"github.com/mesh-cni/mesh-cni/test/harness"
	"github.com/mesh-cni/mesh-cni/test/k8s/kubeenv"
	"github.com/mesh-cni/mesh-cni/test/ztunnel"
)

// The users of istio-cni's side: each node's agent, and its plugin, which in
// a cluster uses the agent's token (install-cni writes it a kubeconfig) and
// here has a token of its own so the audit log tells the two apart.
const (
	istioAgentPrefix  = "istio-cni-agent-"
	istioPluginPrefix = "istio-cni-plugin-"
	istioCNIGroup     = "istio-cni:nodes"
	// istioSeries starts the name of every istio-cni series in the fleet's
	// metrics (the report pairs them with mesh-cni's by the rest).
	istioSeries = "istio-cni:"
)

// istioNet is the network of istio-cni's nodes: each node a network namespace
// of its own (install-cni writes its host rules into "the host's", which must
// not be the machine's), linked by a veth pair to the benchmark's, where the API
// server listens on the first link's address, which every node routes to.
type istioNet struct {
	// bins is the directory of install-cni and istio-cni.
	bins  string
	api   netip.Addr
	nodes []istioNodeNet
}

// istioNodeNet is one node's namespace and its end of the link.
type istioNodeNet struct {
	netns string
	addr  netip.Addr
}

// newIstioNet makes n node namespaces, their links and the API server's
// address. It runs before any long-lived process of the level starts (see
// spawner).
func newIstioNet(ctx context.Context, b *testing.B, n int) *istioNet {
	b.Helper()
	bins, err := harness.IstioBinDir(ctx)
	if err != nil {
		b.Fatal(err)
	}
	if n > 60 {
		b.Fatalf("istio-cni fleet of %d nodes: the links' /24 holds 60", n)
	}
	tag := fixtures.RandomHex(3)
	// 169.254.0.0/16 is link-local: nothing outside this machine is reached.
	third := byte(64 + int(tag[0])%128)
	base := netip.AddrFrom4([4]byte{169, 254, third, 0})
	ipCmd := func(args ...string) {
		b.Helper()
		if out, err := exec.Command("ip", args...).CombinedOutput(); err != nil {
			b.Fatalf("ip %s: %v: %s", strings.Join(args, " "), err, out)
		}
	}
	// The API server listens on the first link's address in the benchmark's
	// namespace; every other node routes to it over its own link.
	in := &istioNet{bins: bins, api: base.Next()}
	for i := range n {
		path := filepath.Join(harness.NetnsDir, harness.NetnsPrefix()+fmt.Sprintf("fleeti-%s-%d", tag, i))
		fixtures.NewNetns(b, path)
		name := filepath.Base(path)
		gw := base
		for range 4*i + 1 {
			gw = gw.Next()
		}
		addr := gw.Next()
		veth := fmt.Sprintf("mfi%s%d", tag, i)
		ipCmd("link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", name)
		b.Cleanup(func() { _ = exec.Command("ip", "link", "del", veth).Run() })
		ipCmd("addr", "add", gw.String()+"/30", "dev", veth)
		ipCmd("link", "set", veth, "up")
		ipCmd("-n", name, "link", "set", "lo", "up")
		ipCmd("-n", name, "addr", "add", addr.String()+"/30", "dev", "eth0")
		ipCmd("-n", name, "link", "set", "eth0", "up")
		if i > 0 {
			ipCmd("-n", name, "route", "add", in.api.String()+"/32", "via", gw.String())
		}
		in.nodes = append(in.nodes, istioNodeNet{netns: path, addr: addr})
	}
	return in
}

// istioNode is one node of istio-cni's fleet: its node agent (install-cni, in
// its own mount and PID namespace and chroot, as test/k8s runs it), its
// directories, and the ztunnel double's ZDS session that acks what the agent
// hands over.
type istioNode struct {
	name      string
	net       istioNodeNet
	dir       string
	root      string
	sa        string
	bin       string // the node's CNI bin dir
	conf      string // the node's CNI conf dir
	run       string // CNI_AGENT_RUN_DIR
	pluginRun string // the plugin's: its own kubeconfig, the agent's sockets
	zds       string
	proc      *harness.Process
	sp        *spawner
	// plugin is istio-cni's entry of the conflist install-cni wrote.
	plugin map[string]any
	// synced is set while a ZDS session has its snapshot; adds counts the
	// pods the agent handed over.
	synced atomic.Bool
	adds   atomic.Int64
	// notReady says why the last readiness check failed.
	notReady string
}

// istioFleet is istio-cni's side of one level.
type istioFleet struct {
	net    *istioNet
	src    string // the plugin alone, install-cni's image's /opt/cni/bin
	nodes  []*istioNode
	failed atomic.Int64 // plugin ADDs that failed and were tried again
	// slots bounds the plugin processes running at once (see add).
	slots chan struct{}
}

// newIstioFleet is istio-cni's side on the nodes of net.
func newIstioFleet(net *istioNet) *istioFleet {
	return &istioFleet{net: net, slots: make(chan struct{}, runtime.NumCPU())}
}

// counted reports whether user is one of istio-cni's.
func (f *istioFleet) counted(user string) bool {
	return strings.HasPrefix(user, istioAgentPrefix) || strings.HasPrefix(user, istioPluginPrefix)
}

// prepare makes every node's directories and credentials.
func (f *istioFleet) prepare(ctx context.Context, b *testing.B, api *kubeenv.APIServer, names []string) error {
	f.src = b.TempDir()
	plugin, err := os.ReadFile(filepath.Join(f.net.bins, "istio-cni"))
	if err != nil {
		return err
	}
	if err := os.WriteFile(filepath.Join(f.src, "istio-cni"), plugin, 0o755); err != nil {
		return err
	}
	ca, err := os.ReadFile(api.CAFile())
	if err != nil {
		return err
	}
	// The doubles' sessions end with the level.
	ctx, cancel := context.WithCancel(ctx)
	b.Cleanup(cancel)
	for i, name := range names {
		// Short: socket paths are limited to 107 bytes.
		dir, err := os.MkdirTemp("", "mfi-")
		if err != nil {
			return err
		}
		b.Cleanup(func() { os.RemoveAll(dir) })
		n := &istioNode{
			name: name, net: f.net.nodes[i], dir: dir,
			root: filepath.Join(dir, "root"), sa: filepath.Join(dir, "sa"), bin: filepath.Join(dir, "bin"),
			conf: filepath.Join(dir, "net.d"), run: filepath.Join(dir, "run"), pluginRun: filepath.Join(dir, "prun"),
			zds: filepath.Join(dir, "zds.sock"),
		}
		for _, d := range []string{n.sa, n.bin, n.conf, n.run, n.pluginRun} {
			if err := os.MkdirAll(d, 0o755); err != nil {
				return err
			}
		}
		if err := os.WriteFile(filepath.Join(n.sa, "token"), []byte(api.Token(istioAgentPrefix+name)), 0o600); err != nil {
			return err
		}
		if err := os.WriteFile(filepath.Join(n.sa, "ca.crt"), ca, 0o644); err != nil {
			return err
		}
		// The primary network's conflist, which install-cni chains into.
		primary := `{"cniVersion":"1.0.0","name":"fleet","plugins":[{"type":"ptp"}]}`
		if err := os.WriteFile(filepath.Join(n.conf, "10-fleet.conflist"), []byte(primary), 0o644); err != nil {
			return err
		}
		// The plugin's run dir: its own kubeconfig where install-cni writes
		// the agent's, and the agent's event and log sockets.
		api.WriteKubeconfig(b, istioPluginPrefix+name, filepath.Join(n.pluginRun, "istio-cni-kubeconfig"))
		for _, sock := range []string{"pluginevent.sock", "log.sock"} {
			if err := os.Symlink(filepath.Join(n.run, sock), filepath.Join(n.pluginRun, sock)); err != nil {
				return err
			}
		}
		n.sp = newSpawner(b)
		go n.serveZDS(ctx)
		f.nodes = append(f.nodes, n)
	}
	return nil
}

// zdsNop is a node proxy that takes every pod and serves none: ztunnel's side
// of ZDS is what istio-cni's agent needs to enroll a pod, not its data path.
type zdsNop struct{}

func (zdsNop) Start(_ string, _ ztunnel.WorkloadInfo, netns *os.File) error {
	return netns.Close()
}
func (zdsNop) Stop(string)               {}
func (zdsNop) Reconcile(map[string]bool) {}

// serveZDS keeps a ztunnel double's ZDS session with the node's agent, as
// ztunnel does (reconnecting with its back-off), until ctx ends.
func (n *istioNode) serveZDS(ctx context.Context) {
	backoff := 10 * time.Millisecond
	for ctx.Err() == nil {
		if c, err := ztunnel.Dial(ctx, n.zds); err == nil {
			backoff = 10 * time.Millisecond
			s := ztunnel.NewSession(zdsNop{}, ztunnel.Options{OnRequest: func(r *ztunnel.Request) {
				switch r.Kind {
				case ztunnel.SnapshotSent:
					n.synced.Store(true)
				case ztunnel.Add:
					n.adds.Add(1)
				}
			}})
			_ = s.Serve(ctx, c)
			n.synced.Store(false)
			c.Close()
		}
		if sleepCtx(ctx, backoff) != nil {
			return
		}
		backoff = min(2*backoff, time.Second)
	}
}

// launch starts the node's agent as its DaemonSet runs it: in the node's
// network namespace, its own PID namespace (where it is process 1: it finds
// "the host" at /host/proc/1) and chroot, ambient on with the chart's
// selector, repair off. DNS capture and IPv6 are off: they add in-pod rules
// (node work, two CPUs shared), not API requests.
func (n *istioNode) launch(b *testing.B, api netip.AddrPort, src, bins string) {
	n.proc = n.sp.start(b, inPod(n.net.netns, harness.ProcessOptions{
		Path: "unshare",
		Args: kubeenv.IstioCNIArgs(n.root, n.sa, src, n.bin, bins, "/proc"),
		Name: "istio-cni-" + n.name,
		// Signals reach install-cni, unshare's child.
		Launcher: true,
		Env: []string{
			"KUBERNETES_SERVICE_HOST=" + api.Addr().String(), fmt.Sprintf("KUBERNETES_SERVICE_PORT=%d", api.Port()), "KUBECONFIG=",
			"NODE_NAME=" + n.name, "KUBERNETES_NODE_NAME=" + n.name, "POD_NAMESPACE=istio-system",
			"MOUNTED_CNI_NET_DIR=" + n.conf, "CNI_AGENT_RUN_DIR=" + n.run, "ZTUNNEL_UDS_ADDRESS=" + n.zds,
			"AMBIENT_ENABLED=true", "AMBIENT_DNS_CAPTURE=false", "AMBIENT_IPV6=false",
			"AMBIENT_ENABLEMENT_SELECTOR=" + kubeenv.IstioAmbientSelector, "EXCLUDE_NAMESPACES=kube-system,istio-system",
			"REPAIR_ENABLED=false", "MONITORING_PORT=15014", "PLUGIN_LOG_LEVEL=warn", "LOG_LEVEL=warn",
		},
	}))
}

// ready reports whether the agent says it is ready (its readiness endpoint,
// on the node's address), its ZDS session with the double is synced, and its
// plugin is chained into the node's conflist.
func (n *istioNode) ready(ctx context.Context) bool {
	n.notReady = "no ZDS session with the double"
	if !n.synced.Load() {
		return false
	}
	n.notReady = "its readiness endpoint does not answer 200"
	rctx, cancel := context.WithTimeout(ctx, 2*time.Second)
	defer cancel()
	if harness.GetOK(rctx, "http://"+netip.AddrPortFrom(n.net.addr, 8000).String()+"/readyz") != nil {
		return false
	}
	n.notReady = "its plugin is not in the conflist"
	raw, err := os.ReadFile(filepath.Join(n.conf, "10-fleet.conflist"))
	if err != nil {
		return false
	}
	var list struct {
		Plugins []map[string]any `json:"plugins"`
	}
	if json.Unmarshal(raw, &list) != nil {
		return false
	}
	for _, p := range list.Plugins {
		if p["type"] == "istio-cni" {
			n.plugin = p
			return true
		}
	}
	return false
}

// launchAll starts every node's agent at once and waits until each is ready.
func (f *istioFleet) launchAll(ctx context.Context, b *testing.B, api netip.AddrPort) error {
	for _, n := range f.nodes {
		n.launch(b, api, f.src, f.net.bins)
	}
	ctx, cancel := context.WithTimeout(ctx, 2*time.Minute)
	defer cancel()
	errs := make([]error, len(f.nodes))
	var wg sync.WaitGroup
	for i, n := range f.nodes {
		wg.Go(func() {
			for !n.ready(ctx) {
				select {
				case <-n.proc.Done():
					errs[i] = fmt.Errorf("istio-cni on %s exited before it was ready:\n%s", n.name, n.proc.Output())
					return
				case <-ctx.Done():
					errs[i] = fmt.Errorf("istio-cni on %s not ready (%s): %w", n.name, n.notReady, ctx.Err())
					return
				case <-time.After(100 * time.Millisecond):
				}
			}
		})
	}
	wg.Wait()
	return errors.Join(errs...)
}

// stopAll stops every node's agent (SIGTERM) and waits until each is gone.
func (f *istioFleet) stopAll(ctx context.Context) error {
	errs := make([]error, len(f.nodes))
	var wg sync.WaitGroup
	for i, n := range f.nodes {
		wg.Go(func() {
			sctx, cancel := context.WithTimeout(ctx, time.Minute)
			defer cancel()
			if err := n.proc.Stop(sctx); err != nil {
				// install-cni exits non-zero on SIGTERM; only a kill is a failure.
				if strings.Contains(err.Error(), "killed it") {
					errs[i] = err
				}
			}
		})
	}
	wg.Wait()
	return errors.Join(errs...)
}

// add runs istio-cni's plugin's ADD for the pod on node i as the kubelet's
// chain would, after the primary network (whose result it is given): the
// plugin's own binary, installed by its agent, with the CNI environment and its
// entry of the conflist. A failed ADD is tried again 10 s later, as the
// kubelet's pod worker requeues a failed sync (the plugin fails while its agent
// has not seen the pod yet, or while its work for the pods before keeps it past
// the plugin's 5 s timeout), for up to istioAddLimit.
//
// Each node's kubelet runs its plugin on the node's own CPUs; here every
// node's plugin shares the machine's, and a process start of the plugin costs
// about a tenth of a CPU-second before it does anything. So at most one plugin
// process per CPU runs at once and the others wait their turn: unbounded, the
// steady rate's starts outrun the two CPUs, every ADD passes its 5 s timeout,
// each retry adds to the pile and the API server itself starves. The wait for
// a turn is returned, to be taken out of the ADD's own latency.
func (f *istioFleet) add(ctx context.Context, i int, namespace, name, uid string, seq int, netnsPath string) (waited time.Duration, err error) {
	n := f.nodes[i]
	conf := map[string]any{}
	for k, v := range n.plugin {
		conf[k] = v
	}
	conf["cniVersion"], conf["name"] = "1.0.0", "fleet"
	conf["cni_agent_run_dir"] = n.pluginRun
	// An address of 198.18.0.0/15 (benchmarking, never routed) per pod: the
	// agent records it on the node; nothing is sent to it.
	ip := netip.AddrFrom4([4]byte{198, 18, byte(seq >> 8), byte(seq)})
	conf["prevResult"] = map[string]any{
		"cniVersion": "1.0.0",
		"interfaces": []map[string]any{{"name": "eth0", "sandbox": netnsPath}},
		"ips":        []map[string]any{{"address": ip.String() + "/32", "interface": 0}},
	}
	stdin, err := json.Marshal(conf)
	if err != nil {
		return 0, err
	}
	cid := strings.ReplaceAll(uid, "-", "")
	deadline := time.Now().Add(istioAddLimit)
	for {
		cmd := exec.CommandContext(ctx, filepath.Join(n.bin, "istio-cni"))
		cmd.Env = []string{"CNI_COMMAND=ADD", "CNI_CONTAINERID=" + cid, "CNI_NETNS=" + netnsPath, "CNI_IFNAME=eth0", "CNI_PATH=" + n.bin,
			fmt.Sprintf("CNI_ARGS=IgnoreUnknown=1;K8S_POD_NAMESPACE=%s;K8S_POD_NAME=%s;K8S_POD_INFRA_CONTAINER_ID=%s;K8S_POD_UID=%s", namespace, name, cid, uid)}
		cmd.Stdin = bytes.NewReader(stdin)
		var stderr bytes.Buffer
		cmd.Stderr = &stderr
		t0 := time.Now()
		select {
		case f.slots <- struct{}{}:
		case <-ctx.Done():
			return waited, ctx.Err()
		}
		waited += time.Since(t0)
		out, err := cmd.Output()
		<-f.slots
		if err == nil {
			return waited, nil
		}
		if time.Now().After(deadline) || ctx.Err() != nil {
			return waited, fmt.Errorf("istio-cni ADD %s/%s on %s: %w: %s %s", namespace, name, n.name, err, out, stderr.String())
		}
		f.failed.Add(1)
		if err := sleepCtx(ctx, istioAddRetry); err != nil {
			return waited, err
		}
	}
}

// istioAddRetry is the kubelet's back-off after a failed pod sync
// (backOffPeriod), and istioAddLimit how long a pod's ADD is tried.
const (
	istioAddRetry = 10 * time.Second
	istioAddLimit = 5 * time.Minute
)

// rss is every agent's resident memory, in MiB.
func (f *istioFleet) rss() ([]float64, error) {
	var out []float64
	for _, n := range f.nodes {
		kids := n.proc.Children()
		if len(kids) == 0 {
			return nil, fmt.Errorf("istio-cni on %s: no process under unshare", n.name)
		}
		kib, err := procStatusKiB(kids[0], "VmRSS")
		if err != nil {
			return nil, err
		}
		out = append(out, kib/1024)
	}
	return out, nil
}
