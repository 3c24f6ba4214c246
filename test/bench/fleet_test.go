package bench

import (
	"context"
	"errors"
	"fmt"
	"net/netip"
	"net/url"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/prometheus/procfs"
	"gonum.org/v1/gonum/stat"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/fields"
	"k8s.io/client-go/informers"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/tools/cache"

	"github.com/mesh-cni/mesh-cni/internal/enroll"
	"github.com/mesh-cni/mesh-cni/internal/gaterpc"
	"github.com/mesh-cni/mesh-cni/pkg/gate/gatepb"
	"github.com/mesh-cni/mesh-cni/test/bench/results"
	"github.com/mesh-cni/mesh-cni/test/fixtures"
	"github.com/mesh-cni/mesh-cni/test/harness"
	"github.com/mesh-cni/mesh-cni/test/k8s/kubeenv"
)

// fleetAgentPrefix starts the name of every fleet agent's user: the audit log
// tells the agents' requests from the benchmark's own by it.
const fleetAgentPrefix = "mesh-agent-"

// BenchmarkFleet measures what a fleet of node agents costs one API server:
// N real mesh-agent processes (--datapath none: the data path is not what is
// measured), each with its own node name and credential, on one real
// kube-apiserver and etcd with API Priority and Fairness on and an audit log.
// Pods are created bound to a node (spec.nodeName, as the scheduler leaves
// them), in many namespaces (half of them in the mesh), at a steady rate and
// then in a burst; each pod's start reaches its node's agent over the gate,
// as the plugin's call does, once its node's kubelet watch has the pod. The audit log
// attributes every request to its agent; /proc gives the API server's and
// etcd's CPU time and memory. At the smallest fleet, istio-cni's real node
// agent and plugin take the same phases (but the outage) on a control plane of
// their own, so the report compares the two from one run.
func BenchmarkFleet(b *testing.B) {
	requireRoot(b)
	ctx := fixtures.Context(b, 50*time.Minute)
	bins, err := kubeenv.EnsureBinaries(ctx)
	if err != nil {
		b.Fatal(err)
	}
	levels := []int{10, 40, 100, 200}
	if quickMode() {
		levels = []int{3}
	}
	if v := os.Getenv(envFleetLevels); v != "" {
		levels = nil
		for f := range strings.SplitSeq(v, ",") {
			n, err := strconv.Atoi(strings.TrimSpace(f))
			if err != nil || n < 1 {
				b.Fatalf("$%s=%q: want fleet sizes, comma-separated", envFleetLevels, v)
			}
			levels = append(levels, n)
		}
	}
	cfg := fleetConfig{
		namespaces: size(400, 40), steady: size(400, 40), rate: 20,
		burstPerNode: size(10, 5), churn: size(40, 10),
		rounds: size(8, 2), roundPods: size(40, 10), bareNodes: 2,
	}
	res := newResult(b, "fleet", "Fleet: what node agents cost one API server", "BenchmarkFleet",
		fmt.Sprintf("N real `mesh-agent` processes (`--enrollment kubernetes --datapath none`: the data path is not what is measured), "+
			"each with its own node name and bearer token, on one real kube-apiserver and etcd (API Priority and Fairness on, an audit log of every request's metadata). "+
			"%d namespaces, every other one labelled `mesh-cni.io/dataplane-mode=enabled`. "+
			"Each node has a kubelet's watch of its pods (field selector `spec.nodeName`, one per node, from the start on), and so have %d more nodes that never get an agent. "+
			"**Baseline**: before any agent starts, the API server sits idle for 15 s: its own background work. "+
			"Then the agents start together (**agent start**), sit idle for 15 s (**idle**, counted above the API server's own idle cost), and take **pod starts**: %d pods at %d/s across the nodes and namespaces, "+
			"then a **burst** of %d pods per node created all at once, at most %d creates in flight (as controllers create in batches; beyond that, 2,000 creates from one client at once starve this two-CPU API server's own loopback requests); each pod's start reaches its node's agent over the gate socket as soon as its node's kubelet watch has the pod, "+
			"as the plugin's call would (the plugin itself makes no API request: it holds no credential). That is still sooner than a kubelet calls CNI (after its watch, the pod's sandbox and the chain before mesh-cni), "+
			"so a pod the agent's watch has not delivered yet, a cache miss, is more frequent here than on a node. "+
			"Requests are the agents' own, from the audit log (by user); watch events are the API server's `apiserver_watch_events_total`, every watcher counted. "+
			"**Paired rounds**: %d rounds of %d pods at %d/s on the nodes without an agent and %d on the agents' nodes, the order alternating from round to round, each measured on its own: "+
			"what the agents (and istio-cni's plugin) add to a pod start's cost is the difference within a round, on one API server at one time, the create itself (the same whatever the CNI) taken out; "+
			"each round's CPU is counted above what the idle cluster (its agents included) spends in as long. "+
			"Then %d namespaces are created (**namespace churn**), and every agent is restarted at once (**fleet restart**: SIGTERM, start, until every gate is ready). "+
			"At the smallest fleet only, the API server is then killed for a minute (**outage**): the agents' gates must stay ready (decisions from their caches), and the report gives how long after its start every agent was back on it. "+
			"CPU is the processes' user+system time from /proc over each phase; the machine is shared, so ratios and counts hold better than absolute times. "+
			"The burst of the largest fleet runs under a machine profile (perf, every CPU), which shows what its latency is bound by.",
			cfg.namespaces, cfg.bareNodes, cfg.steady, cfg.rate, cfg.burstPerNode, maxCreatesInFlight, cfg.rounds, cfg.roundPods, cfg.rate, cfg.roundPods, cfg.churn))
	res.Notes = append(res.Notes, fmt.Sprintf("istio-cni's side, at %d nodes (the smallest fleet; it runs after mesh-cni's, on an API server and etcd of its own): "+
		"the same phases but the outage, with istio-cni's real node agent (`install-cni` from istio.io/istio, ambient on with its chart's enablement selector, repair off) on every node, "+
		"each in a network namespace of its own (where it writes its host rules), its own PID and mount namespace and chroot with its service account's token (a user of its own), "+
		"and a ztunnel double's ZDS session (test/ztunnel's, serving no data path) acking the pods it hands over. "+
		"Namespaces in the mesh are labelled `istio.io/dataplane-mode=ambient`. Each pod start runs istio-cni's real plugin's ADD as the kubelet's chain would, once its node's kubelet watch has the pod "+
		"(the CNI environment, its entry of the conflist install-cni wrote, the primary network's result), tried again 10 s later when it fails, as the kubelet's pod worker does. "+
		"A node's plugin runs on that node's CPUs; here every node's shares the machine's two, and a process start of the plugin costs about a tenth of a CPU-second, "+
		"so at most one plugin process per CPU runs at once and the others wait their turn (the wait is left out of its ADD's own time, and the rounds count CPU above idle). "+
		"The plugin is given a kubeconfig of its own (in a cluster it uses its agent's token) so the audit log tells its requests from the agent's. "+
		"Every pod shares one network namespace: the agent's in-pod rules are written there over and over, and no traffic is redirected.", levels[0]))

	// The pods' network namespace, shared: the agent records each pod by its
	// attachment; with no data path nothing is put inside it. Made before any
	// process starts: netns.Create ends the thread it ran on, and a child
	// forked from that thread would die with it (see spawner).
	nsPath := filepath.Join(harness.NetnsDir, harness.NetnsPrefix()+"fleet-"+fixtures.RandomHex(4))
	podNS := fixtures.NewNetns(b, nsPath)

	m := newFleetMetrics()
	for i, n := range levels {
		lc := cfg
		if i == 0 {
			// Once: a minute without the API server.
			lc.outage = time.Duration(size(60, 10)) * time.Second
		}
		// The largest burst, profiled.
		lc.profile = i == len(levels)-1
		// The smallest fleet's start, profiled as istio-cni's below, and the
		// largest's: what an agent's start costs, beside istio-cni's and as
		// the fleet grows.
		lc.profileStart = i == 0 || i == len(levels)-1
		b.Run(fmt.Sprintf("agents=%d", n), func(b *testing.B) {
			runFleetLevel(ctx, b, bins, podNS.Path, n, lc, m, false)
		})
		if b.Failed() {
			return
		}
		if i == 0 {
			ic := cfg
			ic.profileStart = true
			b.Run(fmt.Sprintf("istio-cni/agents=%d", n), func(b *testing.B) {
				runFleetLevel(ctx, b, bins, podNS.Path, n, ic, m, true)
			})
			if b.Failed() {
				return
			}
		}
	}
	res.Metrics = append(res.Metrics, m.all()...)
	res.Notes = append(res.Notes, m.notes...)
	if note := memorySlope(&m.memory); note != "" {
		res.Notes = append(res.Notes, note)
	}
	res.Profiles = append(res.Profiles, m.profiles...)
	b.ReportMetric(0, "ns/op")
	finish(b, res)
}

// memorySlope says how the API server's memory grows with mesh-cni's fleet:
// the least-squares slope over the levels run, per agent, and what it comes
// to for fleets larger than this machine holds.
func memorySlope(m *results.Metric) string {
	var xs, ys []float64
	for _, s := range m.Series {
		if s.Variant == "apiserver" && len(s.Samples) > 0 {
			xs, ys = append(xs, s.X), append(ys, results.Median(s.Samples))
		}
	}
	if len(xs) < 2 {
		return ""
	}
	base, perAgent := stat.LinearRegression(xs, ys, nil, false)
	return fmt.Sprintf("The API server's memory at the end grows by %.2f MiB per agent (least squares over %d fleet sizes, %.0f MiB at none): %.0f MiB at 1,000 nodes, %.0f MiB at 5,000, if it stays linear.",
		perAgent, len(xs), base, base+1000*perAgent, base+5000*perAgent)
}

// fleetIdle is how long the idle phases last.
const fleetIdle = 15 * time.Second

// sleepCtx waits for d or until ctx ends.
func sleepCtx(ctx context.Context, d time.Duration) error {
	select {
	case <-ctx.Done():
		return ctx.Err()
	case <-time.After(d):
		return nil
	}
}

// fleetConfig sizes one level.
type fleetConfig struct {
	namespaces   int
	steady, rate int
	burstPerNode int
	churn        int
	// rounds of roundPods pods each on the nodes without an agent and on the
	// agents' nodes, for what the agents add to a pod start.
	rounds, roundPods int
	// bareNodes is how many nodes have a kubelet's watch but no agent.
	bareNodes int
	// outage, when set, stops the API server that long at the end.
	outage time.Duration
	// profile takes a machine profile of the burst, profileStart one of the
	// agents' start.
	profile, profileStart bool
}

// fleetMetrics collects every level's numbers.
type fleetMetrics struct {
	requests, writes, misses, watchEvents, cpuPerPod, etcdPerPod, cpuAdded,
	idle, startReqs, startBytes, startCPU, latency, ownLatency, restart, restartRate, memory results.Metric
	notes    []string
	profiles []results.Profile
}

func newFleetMetrics() *fleetMetrics {
	const x = "agents (nodes)"
	return &fleetMetrics{
		requests:    results.Metric{Name: "requests-per-pod", Title: "Node agents' (and istio-cni's plugins') API requests per pod start, by verb", Unit: "req", XLabel: x},
		writes:      results.Metric{Name: "writes-per-pod", Title: "Agents' API writes per pod start, meshed and not", Unit: "req", XLabel: x},
		misses:      results.Metric{Name: "cache-misses", Title: "Decisions that had to ask the API server (pod GETs per pod start)", Unit: "req", XLabel: x},
		watchEvents: results.Metric{Name: "watch-events", Title: "Watch events the API server sent, per object created", Unit: "events", XLabel: x},
		cpuPerPod:   results.Metric{Name: "apiserver-cpu-per-pod", Title: "API server CPU per pod start, on nodes without and with an agent (paired rounds)", Unit: "ms", XLabel: x},
		etcdPerPod:  results.Metric{Name: "etcd-cpu-per-pod", Title: "etcd CPU per pod start, on nodes without and with an agent (paired rounds)", Unit: "ms", XLabel: x},
		cpuAdded:    results.Metric{Name: "cpu-added-per-pod", Title: "What the node agents (and istio-cni's plugin) add to a pod start's CPU, round by round", Unit: "ms", XLabel: x},
		idle:        results.Metric{Name: "idle-cpu-per-agent", Title: "API server CPU per idle agent", Unit: "ms/s", XLabel: x},
		startReqs:   results.Metric{Name: "agent-start-requests", Title: "API requests per agent start, and refused", Unit: "req", XLabel: x},
		startCPU:    results.Metric{Name: "agent-start-cpu", Title: "API server CPU per agent start (above its own idle work)", Unit: "ms", XLabel: x},
		latency:     results.Metric{Name: "decision-latency", Title: "Pod create → the gate's decision (istio-cni: its plugin's ADD returned, its process start included)", Unit: "ms", XLabel: x},
		startBytes:  results.Metric{Name: "agent-start-bytes", Title: "What the API server sent per agent start (pods and namespaces: lists, gets and watch events)", Unit: "KiB", XLabel: x},
		ownLatency:  results.Metric{Name: "decision-after-kubelet", Title: "The node's kubelet has the pod → the gate's decision (the node agent's and plugin's own share)", Unit: "ms", XLabel: x},
		restart:     results.Metric{Name: "fleet-restart", Title: "Whole-fleet restart: until every agent is ready", Unit: "s", XLabel: x},
		restartRate: results.Metric{Name: "restart-request-rate", Title: "Agents' requests in the busiest second of a start all at once", Unit: "req/s", XLabel: x},
		memory:      results.Metric{Name: "control-plane-memory", Title: "API server and etcd memory (VmRSS) at the end", Unit: "MiB", XLabel: x},
	}
}

func (m *fleetMetrics) all() []results.Metric {
	return []results.Metric{m.requests, m.writes, m.misses, m.watchEvents, m.cpuPerPod, m.etcdPerPod, m.cpuAdded, m.idle, m.startReqs, m.startBytes, m.startCPU, m.latency, m.ownLatency, m.restart, m.restartRate, m.memory}
}

func point(m *results.Metric, variant, label string, x float64, samples ...float64) {
	m.Series = append(m.Series, results.Series{Variant: variant, Label: label, X: x, Samples: samples})
}

// fleet is one level's cluster: the control plane, the namespaces and the agents.
type fleet struct {
	api        *kubeenv.APIServer
	etcd       *kubeenv.Etcd
	admin      kubernetes.Interface
	namespaces []string
	meshed     map[string]bool
	agents     []*agent
	gates      []gatepb.GateClient
	nodes      []string
	// bare are nodes with a kubelet but no agent.
	bare  []string
	netns string
	mu    sync.Mutex
	seq   int
	// createdLog lists the pods created in the current phase.
	createdLog []createdPod
	// istio, when set, is istio-cni's side in place of mesh-cni's.
	istio *istioFleet
	// apiAddr is the API server's address for istio-cni's agents.
	apiAddr netip.AddrPort
	// kubelets is each node's kubelet's watch of its pods: a pod's start
	// goes on once it has delivered the pod, as a kubelet's sandbox and CNI
	// ADD come after its watch.
	kubelets *kubelets
	// creates holds a slot for each pod create in flight (maxCreatesInFlight).
	creates chan struct{}
}

// maxCreatesInFlight bounds the benchmark's concurrent pod creates. Pods come
// from controllers that create in batches at their clients' rates, not from
// one client sending thousands at once; on two CPUs 2,000 creates at once
// starve the API server's own loopback lookups (the admission plugins') into
// TLS handshake timeouts. A burst of up to this many pods is still created
// all at once (the 10-node fleet's, beside istio-cni's); a larger one keeps
// this many in flight. The time to a decision counts from the create's return.
const maxCreatesInFlight = 100

// kubelets stands for the nodes' kubelets: one watch per node of the pods
// bound to it (as a kubelet's), which tells each pod start when its node has
// the pod.
type kubelets struct {
	mu      sync.Mutex
	waiting map[string]chan struct{} // namespace/name → closed once delivered
	// changes counts each pod's updates the watch delivered: the writes that
	// changed it (a write that changes nothing is no new revision, no event).
	changes map[string]int
}

// startKubelets starts a watch of its pods for every node, as the benchmark's
// administrator (its requests are not the agents'), until the level ends.
func startKubelets(ctx context.Context, b *testing.B, client kubernetes.Interface, nodes []string) *kubelets {
	k := &kubelets{waiting: map[string]chan struct{}{}, changes: map[string]int{}}
	ctx, cancel := context.WithCancel(ctx)
	var factories []informers.SharedInformerFactory
	// Registered first, so that a failure below stops those already started.
	b.Cleanup(func() {
		cancel()
		for _, f := range factories {
			f.Shutdown()
		}
	})
	syncCtx, synced := context.WithTimeout(ctx, time.Minute)
	defer synced()
	for _, node := range nodes {
		factory := informers.NewSharedInformerFactoryWithOptions(client, 0, informers.WithTweakListOptions(func(o *metav1.ListOptions) {
			o.FieldSelector = fields.OneTermEqualSelector("spec.nodeName", node).String()
		}))
		factories = append(factories, factory)
		inf := factory.Core().V1().Pods().Informer()
		if _, err := inf.AddEventHandler(cache.ResourceEventHandlerFuncs{AddFunc: func(obj any) {
			if p, ok := obj.(*corev1.Pod); ok {
				k.deliver(p.Namespace + "/" + p.Name)
			}
		}, UpdateFunc: func(old, cur any) {
			o, ok1 := old.(*corev1.Pod)
			c, ok2 := cur.(*corev1.Pod)
			if ok1 && ok2 && o.ResourceVersion != c.ResourceVersion {
				k.changed(c.Namespace + "/" + c.Name)
			}
		}}); err != nil {
			b.Fatal(err)
		}
		factory.Start(ctx.Done())
		if !cache.WaitForCacheSync(syncCtx.Done(), inf.HasSynced) {
			b.Fatalf("node %s's kubelet watch did not sync", node)
		}
	}
	return k
}

// expect returns what is closed once the pod's node has it; call it before
// the pod's create.
func (k *kubelets) expect(key string) <-chan struct{} {
	k.mu.Lock()
	defer k.mu.Unlock()
	ch := make(chan struct{})
	k.waiting[key] = ch
	return ch
}

func (k *kubelets) changed(key string) {
	k.mu.Lock()
	defer k.mu.Unlock()
	k.changes[key]++
}

// changesOf returns how often the watch has seen the pod change.
func (k *kubelets) changesOf(key string) int {
	k.mu.Lock()
	defer k.mu.Unlock()
	return k.changes[key]
}

func (k *kubelets) deliver(key string) {
	k.mu.Lock()
	defer k.mu.Unlock()
	if ch, ok := k.waiting[key]; ok {
		close(ch)
		delete(k.waiting, key)
	}
}

// series names a series of the fleet's variant.
func (f *fleet) series(name string) string {
	if f.istio != nil {
		return istioSeries + name
	}
	return name
}

// variant names the fleet's variant.
func (f *fleet) variant() string {
	if f.istio != nil {
		return "istio-cni's"
	}
	return "mesh-cni's"
}

// label labels a series of the fleet's variant.
func (f *fleet) label(l string) string {
	if f.istio != nil {
		return "istio-cni: " + l
	}
	return l
}

// counted reports whether user is one of the variant's node agents or plugins.
func (f *fleet) counted(user string) bool {
	if f.istio != nil {
		return f.istio.counted(user)
	}
	return strings.HasPrefix(user, fleetAgentPrefix)
}

// runFleetLevel runs one level: mesh-cni's agents, or istio-cni's.
func runFleetLevel(ctx context.Context, b *testing.B, bins kubeenv.Binaries, netnsPath string, n int, cfg fleetConfig, m *fleetMetrics, istio bool) {
	x := float64(n)
	f := &fleet{netns: netnsPath, meshed: map[string]bool{}, creates: make(chan struct{}, maxCreatesInFlight)}
	opts := kubeenv.APIServerOptions{Users: map[string][]string{}, PriorityAndFairness: true, Audit: true}
	if istio {
		// The nodes' namespaces are made before this level's first
		// process starts (see spawner); the levels before have ended theirs.
		inet := newIstioNet(ctx, b, n)
		f.istio = newIstioFleet(inet)
		opts.Address = inet.api.String()
	}
	for i := range n {
		node := fmt.Sprintf("node-%03d", i)
		f.nodes = append(f.nodes, node)
		if f.istio != nil {
			opts.Users[istioAgentPrefix+node] = []string{istioCNIGroup}
			opts.Users[istioPluginPrefix+node] = []string{istioCNIGroup}
		} else {
			opts.Users[fleetAgentPrefix+node] = []string{kubeenv.AgentGroup}
		}
	}
	for i := range cfg.bareNodes {
		f.bare = append(f.bare, fmt.Sprintf("bare-%03d", i))
	}
	f.etcd = kubeenv.StartEtcd(b, bins)
	f.api = kubeenv.StartAPIServerWith(b, bins, f.etcd, "fleet", opts)
	if f.istio != nil {
		f.api.GrantIstioCNI(b, istioCNIGroup)
		u, err := url.Parse(f.api.URL)
		if err != nil {
			b.Fatal(err)
		}
		if f.apiAddr, err = netip.ParseAddrPort(u.Host); err != nil {
			b.Fatal(err)
		}
	} else {
		f.api.GrantAgent(b)
	}
	rc := f.api.RestConfig(kubeenv.AdminUser)
	// The benchmark's own creates must not be what limits the rate.
	rc.QPS, rc.Burst = 1000, 2000
	admin, err := kubernetes.NewForConfig(rc)
	if err != nil {
		b.Fatal(err)
	}
	f.admin = admin
	if err := f.makeNamespaces(ctx, "fleet", cfg.namespaces); err != nil {
		b.Fatal(err)
	}
	// The kubelets run from the baseline on: their watches are part of
	// what a pod create costs the API server without any mesh.
	f.kubelets = startKubelets(ctx, b, admin, append(slices.Clone(f.nodes), f.bare...))

	// Baseline: the API server idle, with no agent at all.
	idleBase, err := f.phase(ctx, func() error { return sleepCtx(ctx, fleetIdle) })
	if err != nil {
		b.Fatal(err)
	}

	// The agents start together.
	var startTook time.Duration
	start, err := f.phase(ctx, func() error {
		t0 := time.Now()
		run := func() error {
			if f.istio != nil {
				if err := f.istio.prepare(ctx, b, f.api, f.nodes); err != nil {
					return err
				}
				return f.istio.launchAll(ctx, b, f.apiAddr)
			}
			return f.startAgents(ctx, b, n)
		}
		var err error
		if cfg.profileStart {
			// Where an agent start's API server CPU goes, beside
			// istio-cni's at the same size.
			err = f.profiled(ctx, b, m, "machine-fleet-"+f.series("start-")+strconv.Itoa(n),
				fmt.Sprintf("Machine during the start of %d of %s node agents (perf, all CPUs, kernel included; each process its own root)", n, f.variant()),
				n, "agent start", run)
		} else {
			err = run()
		}
		startTook = time.Since(t0)
		return err
	})
	if err != nil {
		b.Fatal(err)
	}
	point(&m.startReqs, f.series("first-start"), f.label("first start, all at once"), x, float64(len(start.agentReqs))/x)
	// An agent start's cost is what the API server spent above its own idle
	// work over the phase (which lasts as long as the slowest start and the
	// audit log's settling).
	aboveIdle := func(p phaseResult) float64 {
		return p.apiCPU - idleBase.apiCPU*p.took.Seconds()/idleBase.took.Seconds()
	}
	point(&m.startCPU, f.series("first-start"), f.label("first start, all at once"), x, aboveIdle(start)/x)
	point(&m.startBytes, f.series("first-start"), f.label("first start, all at once"), x, start.bytes/1024/x)
	point(&m.restart, f.series("first-start"), f.label("first start, all at once"), x, startTook.Seconds())

	idle, err := f.phase(ctx, func() error { return sleepCtx(ctx, fleetIdle) })
	if err != nil {
		b.Fatal(err)
	}
	// What the idle agents add to the idle API server's own background work.
	perAgentIdle := (idle.apiCPU/idle.took.Seconds() - idleBase.apiCPU/idleBase.took.Seconds()) / x
	point(&m.idle, f.series("apiserver"), f.label("API server CPU per agent, idle (above the API server's own)"), x, perAgentIdle)

	// Steady pod starts.
	var steadyLat latencies
	steady, err := f.phase(ctx, func() error {
		var err error
		steadyLat, err = f.steadyPodsLatency(ctx, cfg.steady, cfg.rate)
		return err
	})
	if err != nil {
		b.Fatal(err)
	}
	// A burst: every node's pods at once.
	var burstLat latencies
	runBurst := func() error {
		var err error
		burstLat, err = f.burstPods(ctx, cfg.burstPerNode*n)
		return err
	}
	burst, err := f.phase(ctx, func() error {
		if !cfg.profile {
			return runBurst()
		}
		// What bounds the burst: the machine's CPUs, split by process.
		return f.profiled(ctx, b, m, fmt.Sprintf("machine-fleet-burst-%d", n),
			fmt.Sprintf("Machine during the burst of %d pods on %d nodes (perf, all CPUs, kernel included; each process its own root)", cfg.burstPerNode*n, n),
			cfg.burstPerNode*n, "pod start", runBurst)
	})
	if err != nil {
		b.Fatal(err)
	}
	point(&m.latency, f.series("steady"), f.label(fmt.Sprintf("steady, %d pods/s", cfg.rate)), x, steadyLat.total...)
	point(&m.latency, f.series("burst"), f.label("burst, every node's pods at once"), x, burstLat.total...)
	point(&m.ownLatency, f.series("steady"), f.label(fmt.Sprintf("steady, %d pods/s", cfg.rate)), x, steadyLat.own...)
	point(&m.ownLatency, f.series("burst"), f.label("burst, every node's pods at once"), x, burstLat.own...)
	pods := float64(cfg.steady + cfg.burstPerNode*n)
	both := append(slices.Clone(steady.agentReqs), burst.agentReqs...)
	for _, verb := range []string{"get", "patch", "create", "list", "watch"} {
		count := 0
		for _, e := range both {
			if e.Verb == verb {
				count++
			}
		}
		point(&m.requests, f.series(verb), f.label(verb), x, float64(count)/pods)
	}
	point(&m.requests, f.series("all"), f.label("all verbs"), x, float64(len(both))/pods)
	if f.istio != nil {
		plugin := 0
		for _, e := range both {
			if strings.HasPrefix(e.User.Username, istioPluginPrefix) {
				plugin++
			}
		}
		point(&m.requests, f.series("plugin"), f.label("of which the plugin's"), x, float64(plugin)/pods)
	}
	refusedPods := 0
	for _, e := range both {
		if e.ResponseStatus.Code == 429 {
			refusedPods++
		}
	}
	point(&m.requests, f.series("refused"), f.label("of which refused (429)"), x, float64(refusedPods)/pods)
	created := append(slices.Clone(steady.created), burst.created...)
	meshedPods, plainPods := f.byMesh(created, func(createdPod) int { return 1 })
	meshedW, plainW := 0, 0
	// Writes of an object written before in these phases: what went beyond
	// one write per pod, for the report to say what they were.
	seen := map[string]int{}
	var again []string
	for _, e := range both {
		// A write the API server refused (API Priority and Fairness: 429)
		// changed nothing; it counts among the requests, retried.
		if e.Write() && e.ResponseStatus.Code < 400 {
			if f.meshed[e.ObjectRef.Namespace] {
				meshedW++
			} else {
				plainW++
			}
			obj := e.ObjectRef.Resource + " " + e.ObjectRef.Namespace + "/" + e.ObjectRef.Name
			if seen[obj]++; seen[obj] > 1 && len(again) < 5 {
				changes := ""
				if e.ObjectRef.Resource == "pods" {
					changes = fmt.Sprintf(", the pod changed %d times after its create (its kubelet's watch)",
						f.kubelets.changesOf(e.ObjectRef.Namespace+"/"+e.ObjectRef.Name))
				}
				again = append(again, fmt.Sprintf("%s %s by %s at %s (code %d%s)", e.Verb, obj, e.User.Username, e.Received.Format("15:04:05.000"), e.ResponseStatus.Code, changes))
			}
		}
	}
	if len(again) > 0 {
		who := "mesh-cni"
		if f.istio != nil {
			who = "istio-cni"
		}
		m.notes = append(m.notes, fmt.Sprintf("%s at %d nodes: objects written more than once in the pod starts (the first few): %s.", who, n, strings.Join(again, "; ")))
	}
	point(&m.writes, f.series("meshed"), f.label("per meshed pod start"), x, float64(meshedW)/float64(meshedPods))
	point(&m.writes, f.series("unmeshed"), f.label("per pod start outside the mesh"), x, float64(plainW)/float64(plainPods))
	// What the writes changed: each pod's updates its node's watch saw (a
	// write that changes nothing is no new revision).
	meshedC, plainC := f.byMesh(created, func(c createdPod) int { return f.kubelets.changesOf(c.namespace + "/" + c.name) })
	point(&m.writes, f.series("meshed-changed"), f.label("changes per meshed pod (its node's watch)"), x, float64(meshedC)/float64(meshedPods))
	point(&m.writes, f.series("unmeshed-changed"), f.label("changes per pod outside the mesh (its node's watch)"), x, float64(plainC)/float64(plainPods))
	for _, ph := range []struct {
		name string
		p    phaseResult
		pods int
	}{{"steady", steady, cfg.steady}, {"burst", burst, cfg.burstPerNode * n}} {
		gets := 0
		for _, e := range ph.p.agentReqs {
			// istio-cni's plugin reads every pod it is called for: not a
			// decision its agent's cache missed.
			if e.Verb == "get" && e.ObjectRef.Resource == "pods" && !strings.HasPrefix(e.User.Username, istioPluginPrefix) {
				gets++
			}
		}
		point(&m.misses, f.series(ph.name), f.label(ph.name), x, float64(gets)/float64(ph.pods))
	}
	rounds, err := f.pairedRounds(ctx, cfg, idle)
	if err != nil {
		b.Fatal(err)
	}
	point(&m.cpuPerPod, f.series("no-agents"), f.label("nodes without an agent (the create alone)"), x, rounds.bareAPI...)
	point(&m.cpuPerPod, f.series("agents"), f.label("the agents' nodes"), x, rounds.gatedAPI...)
	point(&m.etcdPerPod, f.series("no-agents"), f.label("nodes without an agent (the create alone)"), x, rounds.bareEtcd...)
	point(&m.etcdPerPod, f.series("agents"), f.label("the agents' nodes"), x, rounds.gatedEtcd...)
	point(&m.cpuAdded, f.series("apiserver"), f.label("API server"), x, rounds.addedAPI()...)
	point(&m.cpuAdded, f.series("etcd"), f.label("etcd"), x, rounds.addedEtcd()...)
	point(&m.watchEvents, f.series("per-pod"), f.label("per pod created (pods)"), x, (steady.podEvents+burst.podEvents)/pods)

	churn, err := f.phase(ctx, func() error { return f.makeNamespaces(ctx, "churn", cfg.churn) })
	if err != nil {
		b.Fatal(err)
	}
	point(&m.watchEvents, f.series("per-namespace"), f.label("per namespace created (namespaces)"), x, churn.nsEvents/float64(cfg.churn))

	// Every agent restarted at once.
	var restartTook time.Duration
	restart, err := f.phase(ctx, func() error {
		if f.istio != nil {
			if err := f.istio.stopAll(ctx); err != nil {
				return err
			}
			t0 := time.Now()
			err := f.istio.launchAll(ctx, b, f.apiAddr)
			restartTook = time.Since(t0)
			return err
		}
		errs := make([]error, len(f.agents))
		var wg sync.WaitGroup
		for i, a := range f.agents {
			wg.Go(func() { errs[i] = a.stop(ctx) })
		}
		wg.Wait()
		if err := errors.Join(errs...); err != nil {
			return err
		}
		t0 := time.Now()
		err := f.launchAll(ctx)
		restartTook = time.Since(t0)
		return err
	})
	if err != nil {
		b.Fatal(err)
	}
	refused := 0
	for _, e := range restart.agentReqs {
		if e.ResponseStatus.Code == 429 {
			refused++
		}
	}
	point(&m.restart, f.series("restart"), f.label("SIGTERM all, start all, until every gate is ready"), x, restartTook.Seconds())
	point(&m.startReqs, f.series("restart"), f.label("fleet restart"), x, float64(len(restart.agentReqs))/x)
	point(&m.startReqs, f.series("refused"), f.label("refused (429) in the fleet restart"), x, float64(refused)/x)
	point(&m.startCPU, f.series("restart"), f.label("fleet restart"), x, aboveIdle(restart)/x)
	point(&m.startBytes, f.series("restart"), f.label("fleet restart"), x, restart.bytes/1024/x)
	point(&m.restartRate, f.series("restart"), f.label("fleet restart: the busiest second"), x, peakPerSecond(restart.agentReqs))
	point(&m.restartRate, f.series("first-start"), f.label("first start: the busiest second"), x, peakPerSecond(start.agentReqs))

	if cfg.outage > 0 {
		ready, reconnect, err := f.outage(ctx, b, cfg.outage)
		if err != nil {
			b.Fatal(err)
		}
		point(&m.restart, f.series("outage-reconnect"), f.label(fmt.Sprintf("after a %s API server outage: from its start until every agent is back", cfg.outage)), x, reconnect.Seconds())
		if ready < n {
			b.Errorf("%d of %d agents stopped being ready during the API server outage: a node's agent must keep deciding from its cache", n-ready, n)
		}
		res := fmt.Sprintf("API server down for %s with %d agents: %d stayed ready throughout; every agent was back on the API server %.1f s after it was started again (its own start-up included).",
			cfg.outage, n, ready, reconnect.Seconds())
		m.notes = append(m.notes, res)
	}

	apiRSS, err := procStatusKiB(f.api.Proc.Pid(), "VmRSS")
	if err != nil {
		b.Fatal(err)
	}
	etcdRSS, err := procStatusKiB(f.etcd.Proc.Pid(), "VmRSS")
	if err != nil {
		b.Fatal(err)
	}
	point(&m.memory, f.series("apiserver"), f.label("kube-apiserver"), x, apiRSS/1024)
	point(&m.memory, f.series("etcd"), f.label("etcd"), x, etcdRSS/1024)
	var agentRSS []float64
	for _, a := range f.agents {
		rss, err := procStatusKiB(a.pid(), "VmRSS")
		if err != nil {
			b.Fatal(err)
		}
		agentRSS = append(agentRSS, rss/1024)
	}
	agentName, variant := "one mesh-agent (each node's)", "mesh-cni"
	if f.istio != nil {
		if agentRSS, err = f.istio.rss(); err != nil {
			b.Fatal(err)
		}
		agentName, variant = "one install-cni (each node's)", "istio-cni"
		if retried := f.istio.failed.Load(); retried > 0 {
			m.notes = append(m.notes, fmt.Sprintf("istio-cni at %d nodes: %d plugin ADDs failed and were tried again 10 s later, as the kubelet's pod worker would (their requests are counted).", n, retried))
		}
		var adds int64
		for _, node := range f.istio.nodes {
			adds += node.adds.Load()
		}
		b.Logf("istio-cni: %d pods handed over to the ztunnel doubles", adds)
	}
	point(&m.memory, f.series("agent"), f.label(agentName), x, agentRSS...)
	b.Logf("%s N=%d: %.2f agent requests per pod start (%d pods), writes %.2f meshed / %.2f unmeshed, API server CPU %.2f ms per pod (%.2f of it the agents'), "+
		"decision p50 %.1f ms p99 %.1f ms (burst p99 %.1f ms; after the kubelet's watch %.1f ms), idle %.2f ms/s per agent, start %.1f s, restart %.1f s with %d refused",
		variant, n, float64(len(both))/pods, int(pods), float64(meshedW)/float64(meshedPods), float64(plainW)/float64(plainPods),
		results.Median(rounds.gatedAPI), results.Median(rounds.addedAPI()),
		results.Median(steadyLat.total), results.Quantile(steadyLat.total, 0.99), results.Quantile(burstLat.total, 0.99), results.Quantile(burstLat.own, 0.99),
		perAgentIdle, startTook.Seconds(), restartTook.Seconds(), refused)
}

// phaseResult is what one phase cost the control plane.
type phaseResult struct {
	took            time.Duration
	apiCPU, etcdCPU float64 // ms
	agentReqs       []kubeenv.AuditEvent
	podEvents       float64
	nsEvents        float64
	// bytes is what the API server sent of pods and namespaces.
	bytes   float64
	created []createdPod
}

type createdPod struct{ namespace, name string }

// phase runs fn and measures it: CPU of the API server and etcd, the
// agents' requests from the audit log once it has settled, and watch events.
func (f *fleet) phase(ctx context.Context, fn func() error) (phaseResult, error) {
	var r phaseResult
	before, err := f.audit()
	if err != nil {
		return r, err
	}
	f.mu.Lock()
	f.createdLog = f.createdLog[:0]
	f.mu.Unlock()
	podEv0, nsEv0, bytes0, err := f.watchEvents(ctx)
	if err != nil {
		return r, err
	}
	api0, etcd0 := cpuMs(f.api.Proc.Pid()), cpuMs(f.etcd.Proc.Pid())
	t0 := time.Now()
	if err := fn(); err != nil {
		return r, err
	}
	// Writes queued by the agents land shortly after the decisions: wait
	// until the audit log stops growing.
	after, err := f.settle(ctx)
	if err != nil {
		return r, err
	}
	r.took = time.Since(t0)
	r.apiCPU, r.etcdCPU = cpuMs(f.api.Proc.Pid())-api0, cpuMs(f.etcd.Proc.Pid())-etcd0
	podEv1, nsEv1, bytes1, err := f.watchEvents(ctx)
	if err != nil {
		return r, err
	}
	r.podEvents, r.nsEvents, r.bytes = podEv1-podEv0, nsEv1-nsEv0, bytes1-bytes0
	for _, e := range after[len(before):] {
		if f.counted(e.User.Username) {
			r.agentReqs = append(r.agentReqs, e)
		}
	}
	f.mu.Lock()
	r.created = slices.Clone(f.createdLog)
	f.mu.Unlock()
	return r, nil
}

func (f *fleet) audit() ([]kubeenv.AuditEvent, error) { return f.api.Audit() }

// settle waits until the audit log has not grown for two seconds (at most 30 s).
func (f *fleet) settle(ctx context.Context) ([]kubeenv.AuditEvent, error) {
	deadline := time.Now().Add(30 * time.Second)
	last := -1
	for {
		evs, err := f.audit()
		if err != nil {
			return nil, err
		}
		if len(evs) == last || time.Now().After(deadline) {
			return evs, nil
		}
		last = len(evs)
		select {
		case <-ctx.Done():
			return nil, ctx.Err()
		case <-time.After(2 * time.Second):
		}
	}
}

// watchEvents reads the API server's count of watch events sent for pods and
// for namespaces, to every watcher.
func (f *fleet) watchEvents(ctx context.Context) (pods, namespaces, bytes float64, err error) {
	ctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	fams, err := kubeenv.Metrics(ctx, f.admin)
	if err != nil {
		return 0, 0, 0, err
	}
	// Newer API servers label watch metrics by resource, older by kind.
	sum := func(name, resource, kind string) float64 {
		return kubeenv.SumMetric(fams, name, map[string]string{"resource": resource}) + kubeenv.SumMetric(fams, name, map[string]string{"kind": kind})
	}
	pods = sum("apiserver_watch_events_total", "pods", "Pod")
	namespaces = sum("apiserver_watch_events_total", "namespaces", "Namespace")
	// What the API server sent of pods and namespaces: watch events (a
	// streamed list's initial ones too) and list or get answers.
	for _, r := range []struct{ resource, kind string }{{"pods", "Pod"}, {"namespaces", "Namespace"}} {
		bytes += sum("apiserver_watch_events_sizes", r.resource, r.kind) +
			kubeenv.SumMetric(fams, "apiserver_response_sizes", map[string]string{"resource": r.resource})
	}
	return pods, namespaces, bytes, nil
}

// cpuMs is a process's user+system CPU time in ms, 0 if it cannot be read.
func cpuMs(pid int) float64 {
	p, err := procfs.NewProc(pid)
	if err != nil {
		return 0
	}
	st, err := p.Stat()
	if err != nil {
		return 0
	}
	return st.CPUTime() * 1000
}

// makeNamespaces creates count namespaces named prefix-i, every other one
// in the mesh.
func (f *fleet) makeNamespaces(ctx context.Context, prefix string, count int) error {
	for i := range count {
		ns := &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: fmt.Sprintf("%s-%04d", prefix, i)}}
		if i%2 == 0 {
			ns.Labels = map[string]string{enroll.LabelDataplaneMode: enroll.ValueEnabled}
			if f.istio != nil {
				ns.Labels = map[string]string{enroll.IstioLabelDataplaneMode: enroll.IstioValueAmbient}
			}
		}
		cctx, cancel := context.WithTimeout(ctx, 30*time.Second)
		_, err := f.admin.CoreV1().Namespaces().Create(cctx, ns, metav1.CreateOptions{})
		cancel()
		if err != nil {
			return fmt.Errorf("create namespace %s: %w", ns.Name, err)
		}
		if prefix == "fleet" {
			f.namespaces = append(f.namespaces, ns.Name)
			f.meshed[ns.Name] = i%2 == 0
		}
	}
	return nil
}

// startAgents prepares n agents and starts them all at once.
func (f *fleet) startAgents(ctx context.Context, b *testing.B, n int) error {
	for i := range n {
		a := newAgent(b, agentOptions{Datapath: "none", LogLevel: "warn"})
		kubeconfig := f.api.WriteKubeconfig(b, fleetAgentPrefix+f.nodes[i], filepath.Join(a.dir, "kubeconfig"))
		a.args = append(a.args, "--enrollment", "kubernetes", "--kubeconfig", kubeconfig, "--node-name", f.nodes[i])
		f.agents = append(f.agents, a)
		conn, err := gaterpc.Dial(a.Socket)
		if err != nil {
			return err
		}
		b.Cleanup(func() { conn.Close() })
		f.gates = append(f.gates, gatepb.NewGateClient(conn))
	}
	return f.launchAll(ctx)
}

// launchAll starts every agent at once and waits until each gate is ready.
func (f *fleet) launchAll(ctx context.Context) error {
	for _, a := range f.agents {
		a.launch()
	}
	ctx, cancel := context.WithTimeout(ctx, 5*time.Minute)
	defer cancel()
	errs := make([]error, len(f.agents))
	var wg sync.WaitGroup
	for i, a := range f.agents {
		wg.Go(func() { errs[i] = waitHealthy(ctx, a) })
	}
	wg.Wait()
	return errors.Join(errs...)
}

// byMesh sums count over created pods in meshed and in other namespaces.
func (f *fleet) byMesh(created []createdPod, count func(createdPod) int) (meshed, plain int) {
	for _, c := range created {
		if f.meshed[c.namespace] {
			meshed += count(c)
		} else {
			plain += count(c)
		}
	}
	return meshed, plain
}

// steadyPods creates count pods at rate per second on target's nodes, each
// followed by its start; latencies are collected into lat when not nil.
func (f *fleet) steadyPods(ctx context.Context, count, rate int, target podTarget, lat *latencies) error {
	tick := time.NewTicker(time.Second / time.Duration(rate))
	defer tick.Stop()
	var mu sync.Mutex
	errs := make([]error, count)
	var wg sync.WaitGroup
	for i := range count {
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-tick.C:
		}
		wg.Go(func() {
			d, own, err := f.podStart(ctx, target)
			errs[i] = err
			if lat != nil && err == nil {
				mu.Lock()
				lat.total = append(lat.total, ms(d))
				lat.own = append(lat.own, ms(own))
				mu.Unlock()
			}
		})
	}
	wg.Wait()
	return errors.Join(errs...)
}

// latencies are pod starts' times to the decision, in ms: total from the
// create's return, own from the node's kubelet having the pod.
type latencies struct{ total, own []float64 }

func (f *fleet) steadyPodsLatency(ctx context.Context, count, rate int) (latencies, error) {
	var lat latencies
	err := f.steadyPods(ctx, count, rate, toAgents, &lat)
	return lat, err
}

// profiled runs fn under a machine profile kept as the report's name,
// or without one where perf is missing (the report says so).
func (f *fleet) profiled(ctx context.Context, b *testing.B, m *fleetMetrics, name, title string, ops int, op string, fn func() error) error {
	file := filepath.Join(profilesDir(b), name+".pprof")
	err := machineProfile(ctx, file, fn)
	switch {
	case errors.Is(err, errNoPerf):
		m.notes = append(m.notes, fmt.Sprintf("No machine profile of %s: %v.", name, err))
		return fn()
	case err != nil:
		return err
	}
	rel, _ := filepath.Rel(outDir(b), file)
	m.profiles = append(m.profiles, results.Profile{
		Name:       name,
		Title:      title,
		File:       rel,
		Command:    "go tool pprof -top " + filepath.Join(results.DefaultOut, rel),
		Operations: ops,
		Operation:  op,
	})
	return nil
}

// burstPods creates count pods at once, each followed by its gate Add.
func (f *fleet) burstPods(ctx context.Context, count int) (latencies, error) {
	lat := latencies{total: make([]float64, count), own: make([]float64, count)}
	errs := make([]error, count)
	var wg sync.WaitGroup
	for i := range count {
		wg.Go(func() {
			d, own, err := f.podStart(ctx, toAgents)
			lat.total[i], lat.own[i], errs[i] = ms(d), ms(own), err
		})
	}
	wg.Wait()
	return lat, errors.Join(errs...)
}

// podTarget says which nodes a pod start goes to.
type podTarget int

const (
	// toAgents: the agents' nodes; the start goes through the node's agent
	// (mesh-cni's gate, istio-cni's plugin).
	toAgents podTarget = iota
	// toBare: the nodes without an agent; the start ends once the node's
	// kubelet has the pod.
	toBare
)

// podStart creates the next pod (round robin over target's nodes and the
// namespaces), waits until its node's kubelet has it and, on an agent's
// node, calls its node's gate Add as the plugin would, returning the time
// from the create's return to the decision, and from the kubelet's watch to
// the decision.
func (f *fleet) podStart(ctx context.Context, target podTarget) (total, own time.Duration, err error) {
	f.mu.Lock()
	i := f.seq
	f.seq++
	ns := f.namespaces[i%len(f.namespaces)]
	name := fmt.Sprintf("pod-%06d", i)
	f.createdLog = append(f.createdLog, createdPod{namespace: ns, name: name})
	f.mu.Unlock()
	node := i % len(f.nodes)
	nodeName := f.nodes[node]
	if target == toBare {
		nodeName = f.bare[i%len(f.bare)]
	}
	limit := time.Minute
	if f.istio != nil {
		// Its plugin's ADD is tried again for as long.
		limit += istioAddLimit
	}
	cctx, cancel := context.WithTimeout(ctx, limit)
	defer cancel()
	atNode := f.kubelets.expect(ns + "/" + name)
	select {
	case f.creates <- struct{}{}:
	case <-cctx.Done():
		return 0, 0, fmt.Errorf("create pod %s/%s: %w", ns, name, cctx.Err())
	}
	p, err := f.admin.CoreV1().Pods(ns).Create(cctx, &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: ns, Labels: map[string]string{"app": "fleet"}},
		Spec: corev1.PodSpec{
			NodeName:                      nodeName,
			ServiceAccountName:            "default",
			Containers:                    []corev1.Container{{Name: "app", Image: "registry.invalid/app:never-pulled"}},
			TerminationGracePeriodSeconds: new(int64),
		},
	}, metav1.CreateOptions{})
	<-f.creates
	if err != nil {
		return 0, 0, fmt.Errorf("create pod %s/%s: %w", ns, name, err)
	}
	created := time.Now()
	select {
	case <-atNode:
	case <-cctx.Done():
		return 0, 0, fmt.Errorf("pod %s/%s: not delivered to its node's kubelet: %w", ns, name, cctx.Err())
	}
	delivered := time.Now()
	if target == toBare {
		return delivered.Sub(created), 0, nil
	}
	uid := string(p.UID)
	if f.istio != nil {
		waited, err := f.istio.add(cctx, node, ns, name, uid, i, f.netns)
		if err != nil {
			return 0, 0, err
		}
		// Its own share leaves out the wait for a turn of the machine's
		// CPUs, which a node's own would not have made it wait.
		return time.Since(created), time.Since(delivered) - waited, nil
	}
	_, err = f.gates[node].Add(cctx, &gatepb.AddRequest{
		Pod:        &gatepb.PodIdentity{Namespace: ns, Name: name, Uid: uid},
		Attachment: &gatepb.Attachment{ContainerId: strings.ReplaceAll(uid, "-", ""), Ifname: "eth0", Network: "fleet"},
		NetnsPath:  f.netns,
		Source:     gatepb.Source_SOURCE_CNI,
	})
	if err != nil {
		return 0, 0, fmt.Errorf("gate Add for %s/%s on %s: %w", ns, name, f.nodes[node], err)
	}
	return time.Since(created), time.Since(delivered), nil
}

// rounds is what the paired rounds cost per pod start, one sample per round.
type rounds struct {
	bareAPI, gatedAPI, bareEtcd, gatedEtcd []float64 // ms per pod
}

func (r rounds) addedAPI() []float64  { return differences(r.gatedAPI, r.bareAPI) }
func (r rounds) addedEtcd() []float64 { return differences(r.gatedEtcd, r.bareEtcd) }

// differences is a[i]−b[i] for every i.
func differences(a, b []float64) []float64 {
	d := make([]float64, len(a))
	for i := range a {
		d[i] = a[i] - b[i]
	}
	return d
}

// pairedRounds creates cfg.roundPods pods at cfg.rate on the nodes without an
// agent, then as many on the agents' nodes (the other way round every other
// round), each measured as a phase of its own: within a round the two differ
// by what the agents add to a pod start, on the same API server at nearly the
// same time, while the API server's own cost of a create (its size, garbage
// collection, the machine's other load) drifts from round to round. What
// the idle cluster (its agents included) spends in as long as the phase
// lasted is taken out of each: a phase whose starts take longer (istio-cni's
// plugin processes wait for a CPU) would otherwise count more idle work.
func (f *fleet) pairedRounds(ctx context.Context, cfg fleetConfig, idle phaseResult) (rounds, error) {
	var r rounds
	perPod := func(target podTarget) (api, etcd float64, err error) {
		p, err := f.phase(ctx, func() error { return f.steadyPods(ctx, cfg.roundPods, cfg.rate, target, nil) })
		if err != nil {
			return 0, 0, err
		}
		scale := p.took.Seconds() / idle.took.Seconds()
		pods := float64(cfg.roundPods)
		return (p.apiCPU - idle.apiCPU*scale) / pods, (p.etcdCPU - idle.etcdCPU*scale) / pods, nil
	}
	for i := range cfg.rounds {
		order := []podTarget{toBare, toAgents}
		if i%2 == 1 {
			order = []podTarget{toAgents, toBare}
		}
		for _, target := range order {
			api, etcd, err := perPod(target)
			if err != nil {
				return r, err
			}
			if target == toBare {
				r.bareAPI, r.bareEtcd = append(r.bareAPI, api), append(r.bareEtcd, etcd)
			} else {
				r.gatedAPI, r.gatedEtcd = append(r.gatedAPI, api), append(r.gatedEtcd, etcd)
			}
		}
	}
	return r, nil
}

// peakPerSecond is the most requests received in any one second.
func peakPerSecond(evs []kubeenv.AuditEvent) float64 {
	per := map[int64]int{}
	peak := 0
	for _, e := range evs {
		s := e.Received.Unix()
		per[s]++
		peak = max(peak, per[s])
	}
	return float64(peak)
}

// outage stops the API server for d, counts the agents whose gate stays
// ready throughout, starts it again and returns how long until every agent
// had made a request of the new server (its watches back), from the server's
// start.
func (f *fleet) outage(ctx context.Context, b *testing.B, d time.Duration) (ready int, reconnect time.Duration, err error) {
	f.api.Stop(b)
	if err := sleepCtx(ctx, d); err != nil {
		return 0, 0, err
	}
	for _, a := range f.agents {
		hctx, cancel := context.WithTimeout(ctx, 2*time.Second)
		if harness.WaitForHealthy(hctx, a.Socket) == nil {
			ready++
		}
		cancel()
	}
	// From the server's start: its own start-up is part of the wait.
	back := time.Now()
	f.api.Start(b)
	deadline := back.Add(3 * time.Minute)
	for {
		evs, err := f.audit()
		if err != nil {
			return ready, 0, err
		}
		seen := map[string]time.Time{}
		for _, e := range evs {
			if strings.HasPrefix(e.User.Username, fleetAgentPrefix) && e.Received.After(back) {
				if _, ok := seen[e.User.Username]; !ok {
					seen[e.User.Username] = e.Received
				}
			}
		}
		if len(seen) == len(f.agents) {
			var last time.Time
			for _, t := range seen {
				if t.After(last) {
					last = t
				}
			}
			return ready, last.Sub(back), nil
		}
		if time.Now().After(deadline) {
			return ready, 0, fmt.Errorf("%d of %d agents back on the API server %s after it returned", len(seen), len(f.agents), time.Since(back).Round(time.Second))
		}
		if err := sleepCtx(ctx, time.Second); err != nil {
			return ready, 0, err
		}
	}
}

// waitHealthy waits until the agent's gate answers its health check.
func waitHealthy(ctx context.Context, a *agent) error {
	return harness.WaitForHealthy(ctx, a.Socket)
}
