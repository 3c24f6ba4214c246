package bench

import (
	"context"
	"net/netip"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/containernetworking/cni/libcni"

	"github.com/mesh-cni/mesh-cni/test/bench/results"
	"github.com/mesh-cni/mesh-cni/test/capture"
	"github.com/mesh-cni/mesh-cni/test/fixtures"
	"github.com/mesh-cni/mesh-cni/test/harness"
	"github.com/mesh-cni/mesh-cni/test/proxy"
)

// Variants of the capture benchmarks.
const (
	varDirect   = "direct"
	varLimit    = "limit"
	varEBPF     = "ebpf"
	varIPTables = "iptables"
	varNFTables = "nftables"
	varIstio    = "istio-cni"
)

var variantLabels = map[string]string{
	varDirect:   "direct, no proxy",
	varLimit:    "proxy port dialed, no capture",
	varEBPF:     "eBPF (mesh-cni)",
	varIPTables: "iptables REDIRECT",
	varNFTables: "nftables redirect",
	varIstio:    "istio-cni's in-pod rules",
}

// forwardToFlag is the refproxy flag the "limit" variant of the full chain
// needs: forward every accepted connection to one fixed address instead of its
// original destination, so a client can dial the proxy port explicitly and the
// same two-proxy chain runs without any capture.
const forwardToFlag = "forward-to"

// captureSetup is one variant's pods: a client and what it dials.
type captureSetup struct {
	variant string
	client  client
}

// captureEnv is everything the capture benchmarks share: one node, one agent,
// and per configuration the variants' client pods.
type captureEnv struct {
	// chain: a client pod and a server pod per variant, the reference proxy
	// forwarding in both (client proxy → server proxy → server).
	chain []captureSetup
	// echo: a client pod per variant whose proxy answers itself: the capture
	// and one proxy hop alone.
	echo []captureSetup
	// noLimit says why the chain has no "limit" variant ("" when it has one).
	noLimit string
}

// BenchmarkCapture measures connection capture pod→pod on one node: the same
// reference proxy (test/cmd/refproxy) behind each capture mechanism, with the
// variants taking turns round by round.
//
//   - connect: connections per second, each a connect, one 64-byte request and
//     its response, and close; and each cycle's latency.
//   - request: request/response latency on a kept connection.
//   - throughput: bulk transfer pod→pod through the proxies.
//
// Each in two configurations: "chain", client proxy → server proxy → server as
// in a mesh, and "capture", where the client's proxy answers itself, which
// isolates the capture from everything behind it.
func BenchmarkCapture(b *testing.B) {
	requireRoot(b)
	ctx := fixtures.Context(b, 40*time.Minute)
	env := newCaptureEnv(ctx, b)
	res := newResult(b, "capture", "Connection capture: eBPF vs istio-cni's rules vs iptables vs nftables", "BenchmarkCapture", captureDescription(env))
	if env.noLimit != "" {
		res.Notes = append(res.Notes, env.noLimit)
	}
	rounds := size(20, 3)

	b.Run("connect", func(b *testing.B) {
		for _, cfg := range []struct {
			name   string
			setups []captureSetup
		}{{"chain", env.chain}, {"capture", env.echo}} {
			rate, cycle := benchConnect(ctx, b, cfg.setups, rounds, size(500, 150))
			rate.Name, cycle.Name = "conn-rate-"+cfg.name, "conn-cycle-"+cfg.name
			rate.Title = "Connections per second (connect, 64 B request/response, close), " + configTitle(cfg.name)
			cycle.Title = "Connection cycle latency, " + configTitle(cfg.name)
			res.Metrics = append(res.Metrics, rate, cycle)
			reportRatio(b, &rate, cfg.name+":", varEBPF, rate.Baseline)
			reportRatio(b, &rate, cfg.name+":", varEBPF, varIPTables)
			reportRatio(b, &rate, cfg.name+":", varEBPF, varIstio)
		}
		b.ReportMetric(0, "ns/op")
	})
	b.Run("request", func(b *testing.B) {
		for _, cfg := range []struct {
			name   string
			setups []captureSetup
		}{{"chain", env.chain}, {"capture", env.echo}} {
			m, cpu := benchRequests(ctx, b, cfg.setups, rounds, size(2000, 500))
			m.Name = "rr-" + cfg.name
			m.Title = "Request/response latency on a kept connection (64 B), " + configTitle(cfg.name)
			cpu.Name = "rr-cpu-" + cfg.name
			cpu.Title = "CPU time per request on a kept connection (all CPUs busy: client, application, proxies, kernel, softirq), " + configTitle(cfg.name)
			res.Metrics = append(res.Metrics, m, cpu)
			report(b, &m, varEBPF, 0, cfg.name+"-us")
			reportRatio(b, &cpu, cfg.name+"-cpu:", varEBPF, varIstio)
		}
		b.ReportMetric(0, "ns/op")
	})
	b.Run("throughput", func(b *testing.B) {
		for _, cfg := range []struct {
			name   string
			setups []captureSetup
			echo   bool
		}{{"chain", env.chain, false}, {"capture", env.echo, true}} {
			m := benchThroughput(ctx, b, cfg.setups, rounds, 2, int64(size(128<<20, 32<<20)), cfg.echo)
			m.Name = "throughput-" + cfg.name
			m.Title = "Bulk transfer throughput, " + configTitle(cfg.name)
			if cfg.echo {
				m.Title += ", each byte sent and echoed back"
			}
			res.Metrics = append(res.Metrics, m)
			reportRatio(b, &m, cfg.name+":", varEBPF, m.Baseline)
		}
		b.ReportMetric(0, "ns/op")
	})
	finish(b, res)
}

func configTitle(name string) string {
	if name == "chain" {
		return "full chain (client proxy → server proxy → server)"
	}
	return "capture only (the client's proxy answers)"
}

func captureDescription(env *captureEnv) string {
	limit := "`limit` = the limit of any capture mechanism: the same two proxies doing the same work, but addressed explicitly, so no capture acts anywhere " +
		"(the client dials its proxy at 127.0.0.1:15001, which forwards to the server pod's proxy port 15006, which forwards to the server: refproxy `-" + forwardToFlag + "`); " +
		"the only difference to `ebpf` is the capture itself, and a capture can only add to it."
	if env.noLimit != "" {
		limit = "`limit` exists only in the capture-only configuration here (see the note)."
	}
	return "Pod→pod TCP over IPv4 between pods on one node (the reference bridge), measured by a client in the client pod's network namespace " +
		"(one goroutine locked in the namespace makes every connection of a batch, the same dialer for every variant). " +
		"The server application echoes (a connection starting with `S` is a bulk upload it counts instead). " +
		"Every capture variant runs the same reference proxy (`test/cmd/refproxy`, `-log-level warn`) in both pods. " +
		"Variants: `direct` = no proxy, no capture; `ebpf` = pods added through [bridge, mesh-cni] with a real `mesh-agent` (eBPF data path); " +
		"`iptables` / `nftables` = pods added through [bridge] with in-pod NAT REDIRECT rules like Istio ambient's (`test/capture`); " +
		"`istio-cni` = pods added through [bridge] with Istio ambient's own in-pod rules, written by istio-cni's code (`hack/istio-inpod`: its nat, mangle and raw chains, the policy route and the mark rule, DNS capture on as in its chart); " + limit + " " +
		"Two configurations: **chain** = client → client proxy → server proxy → server, a mesh's real path; " +
		"**capture** = the client's proxy runs with `-echo` and answers itself, which isolates the capture (the `limit` there dials 127.0.0.1:15001 of an echoing proxy). " +
		"Throughput: in the chain, uploads of 128 MiB (32 MiB in quick mode) to a counting sink; in the capture-only configuration the same amount sent and echoed back at once. " +
		"CPU per request: the machine's busy CPU time (user, system, irq and softirq of both CPUs, from /proc/stat, in 10 ms ticks) over a request batch, divided by its requests; only that variant runs meanwhile, so it is everything a request costs: client, application, both proxies and the kernel. " +
		"In every round each variant runs one batch, in rotating order; rates are per batch (conn/s, MiB/s), latencies per operation. " +
		"Ratios are paired: the median over rounds of variant ÷ baseline in the same round."
}

func newCaptureEnv(ctx context.Context, b *testing.B) *captureEnv {
	a := newAgent(b, agentOptions{})
	if _, _, err := a.start(ctx); err != nil {
		b.Fatal(err)
	}
	node := harness.NewNode(b, harness.NodeOptions{Plugins: append(harness.ReferencePluginNames(), "mesh-cni")})
	bridgeOnly := node.Conflist(b, benchNet)
	withMesh := node.Conflist(b, benchNet, a.meshEntry("mesh-cni"))
	refproxy := harness.Bins(b).Path("refproxy")
	env := &captureEnv{}
	spawn := newSpawner(b)
	if !refproxyHasFlag(b, refproxy, forwardToFlag) {
		env.noLimit = "The full-chain `limit` variant is missing: the reference proxy has no `-" + forwardToFlag +
			"` flag yet (forward every accepted connection to a fixed address, so a client can dial the proxy port explicitly with the same proxy chain and no capture). " +
			"The capture-only configuration has its `limit`, and the chain's ratios fall back to `iptables` and `direct`."
	}

	addPod := func(list *libcni.NetworkConfigList, name string) *harness.Pod {
		p := node.NewPod(b, "bench", name)
		if _, err := node.Add(ctx, p, list); err != nil {
			b.Fatal(err)
		}
		return p
	}
	istio := istioHelper(b) // looked up (or built) once, before any pod
	install := func(p *harness.Pod, variant string) {
		var fn func(context.Context, string, capture.Rules) (capture.Cleanup, error)
		switch variant {
		case varIPTables:
			fn = capture.InstallIPTables
		case varNFTables:
			fn = capture.InstallNFTables
		case varIstio:
			fn = func(ctx context.Context, netnsPath string, _ capture.Rules) (capture.Cleanup, error) {
				return capture.InstallIstio(ctx, istio, netnsPath)
			}
		default:
			return
		}
		cleanup, err := fn(ctx, p.NetNSPath, capture.DefaultRules())
		if err != nil {
			b.Fatal(err)
		}
		b.Cleanup(func() {
			if err := cleanup(context.Background()); err != nil {
				b.Errorf("remove %s capture: %v", variant, err)
			}
		})
	}
	listFor := func(variant string) *libcni.NetworkConfigList {
		if variant == varEBPF {
			return withMesh
		}
		return bridgeOnly
	}

	// Full chain: a client and a server pod per variant.
	chainVariants := []string{varDirect, varEBPF, varIstio, varIPTables, varNFTables}
	if env.noLimit == "" {
		chainVariants = append(chainVariants, varLimit)
	}
	for _, v := range chainVariants {
		cp := addPod(listFor(v), v+"-client")
		sp := addPod(listFor(v), v+"-server")
		serveApp(b, sp, appPort)
		target := netip.AddrPortFrom(sp.IPv4(b), appPort)
		switch v {
		case varDirect:
		case varLimit:
			startRefproxy(ctx, b, spawn, cp, "-"+forwardToFlag, netip.AddrPortFrom(sp.IPv4(b), proxy.DefaultInboundPort).String())
			startRefproxy(ctx, b, spawn, sp, "-"+forwardToFlag, target.String())
			target = netip.AddrPortFrom(netip.MustParseAddr("127.0.0.1"), proxy.DefaultOutboundPort)
		default:
			startRefproxy(ctx, b, spawn, cp)
			startRefproxy(ctx, b, spawn, sp)
			install(cp, v)
			install(sp, v)
		}
		env.chain = append(env.chain, captureSetup{variant: v, client: client{netns: cp.NetNSPath, target: target}})
	}
	// Capture only: one client pod per variant with an echoing proxy; the
	// destination is the direct server, which the capture never lets it reach.
	nominal := env.chain[0].client.target
	echoVariants := []string{varLimit, varEBPF, varIstio, varIPTables, varNFTables}
	for _, v := range echoVariants {
		cp := addPod(listFor(v), v+"-echo")
		startRefproxy(ctx, b, spawn, cp, "-echo")
		install(cp, v)
		target := nominal
		if v == varLimit {
			target = netip.AddrPortFrom(netip.MustParseAddr("127.0.0.1"), proxy.DefaultOutboundPort)
		}
		env.echo = append(env.echo, captureSetup{variant: v, client: client{netns: cp.NetNSPath, target: target}})
	}
	return env
}

// istioHelper is hack/istio-inpod from hack/build-istio.sh's cache
// (harness.IstioBinDir).
func istioHelper(tb testing.TB) string {
	tb.Helper()
	dir, err := harness.IstioBinDir(context.Background())
	if err != nil {
		tb.Fatalf("istio-cni's rules: %v", err)
	}
	return filepath.Join(dir, capture.IstioBinary)
}

func refproxyHasFlag(tb testing.TB, bin, name string) bool {
	tb.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	out, _ := exec.CommandContext(ctx, bin, "-h").CombinedOutput()
	return strings.Contains(string(out), "\n  -"+name+" ")
}

// startRefproxy runs the reference proxy in pod and waits until it listens.
func startRefproxy(ctx context.Context, b *testing.B, spawn *spawner, pod *harness.Pod, args ...string) {
	b.Helper()
	p := spawn.start(b, inPod(pod.NetNSPath, harness.ProcessOptions{
		Path: harness.Bins(b).Path("refproxy"),
		Args: append([]string{"-log-level", "warn"}, args...),
		Name: "refproxy-" + pod.Name,
	}))
	ctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	if _, err := p.WaitForLine(ctx, "ready"); err != nil {
		b.Fatalf("refproxy in %s: %v", pod.Name, err)
	}
}

// baselineOf picks the variant ratios are taken against: the limit when the
// configuration has one.
func baselineOf(setups []captureSetup) string {
	for _, s := range setups {
		if s.variant == varLimit {
			return varLimit
		}
	}
	return varIPTables
}

// eachRound runs fn for every setup in every round, rotating the order, after
// one warm-up round that is not recorded (round -1).
func eachRound(b *testing.B, setups []captureSetup, rounds int, fn func(round, j int) error) {
	for r := -1; r < rounds; r++ {
		for k := range setups {
			j := (max(r, 0) + k) % len(setups)
			if err := fn(r, j); err != nil {
				b.Fatalf("%s: %v", setups[j].variant, err)
			}
		}
	}
}

func newSeries(setups []captureSetup) []results.Series {
	out := make([]results.Series, len(setups))
	for j, s := range setups {
		out[j] = results.Series{Variant: s.variant, Label: variantLabels[s.variant]}
	}
	return out
}

func benchConnect(ctx context.Context, b *testing.B, setups []captureSetup, rounds, perRound int) (rate, cycle results.Metric) {
	rate = results.Metric{Unit: "conn/s", HigherIsBetter: true, Baseline: baselineOf(setups), Series: newSeries(setups)}
	cycle = results.Metric{Unit: "µs", Baseline: baselineOf(setups), Series: newSeries(setups)}
	eachRound(b, setups, rounds, func(r, j int) error {
		lat, total, err := setups[j].client.cycles(ctx, perRound)
		if err != nil || r < 0 {
			return err
		}
		perSec := float64(perRound) / total.Seconds()
		rate.Series[j].Samples = append(rate.Series[j].Samples, perSec)
		rate.Series[j].Rounds = append(rate.Series[j].Rounds, perSec)
		var round []float64
		for _, d := range lat {
			round = append(round, us(d))
		}
		cycle.Series[j].Samples = append(cycle.Series[j].Samples, round...)
		cycle.Series[j].Rounds = append(cycle.Series[j].Rounds, results.Median(round))
		return nil
	})
	return rate, cycle
}

// benchRequests measures request/response latency on kept connections, and
// the machine's CPU time per request of each batch (machineBusy).
func benchRequests(ctx context.Context, b *testing.B, setups []captureSetup, rounds, perRound int) (latency, cpu results.Metric) {
	latency = results.Metric{Unit: "µs", Baseline: baselineOf(setups), Series: newSeries(setups)}
	cpu = results.Metric{Unit: "µs", Baseline: baselineOf(setups), Series: newSeries(setups)}
	eachRound(b, setups, rounds, func(r, j int) error {
		before, err := machineBusy()
		if err != nil {
			return err
		}
		lat, err := setups[j].client.requests(ctx, perRound)
		if err != nil || r < 0 {
			return err
		}
		after, err := machineBusy()
		if err != nil {
			return err
		}
		var round []float64
		for _, d := range lat {
			round = append(round, us(d))
		}
		latency.Series[j].Samples = append(latency.Series[j].Samples, round...)
		latency.Series[j].Rounds = append(latency.Series[j].Rounds, results.Median(round))
		perReq := us(after-before) / float64(len(lat))
		cpu.Series[j].Samples = append(cpu.Series[j].Samples, perReq)
		cpu.Series[j].Rounds = append(cpu.Series[j].Rounds, perReq)
		return nil
	})
	return latency, cpu
}

func benchThroughput(ctx context.Context, b *testing.B, setups []captureSetup, rounds, perRound int, bytes int64, echo bool) results.Metric {
	m := results.Metric{Unit: "MiB/s", HigherIsBetter: true, Baseline: baselineOf(setups), Series: newSeries(setups)}
	buf := make([]byte, 256<<10)
	eachRound(b, setups, rounds, func(r, j int) error {
		var total time.Duration
		for range perRound {
			var took time.Duration
			var err error
			if echo {
				took, err = setups[j].client.echoTransfer(ctx, bytes, buf)
			} else {
				took, err = setups[j].client.upload(ctx, bytes, buf)
			}
			if err != nil {
				return err
			}
			total += took
			if r >= 0 {
				m.Series[j].Samples = append(m.Series[j].Samples, mib(bytes)/took.Seconds())
			}
		}
		if r >= 0 {
			m.Series[j].Rounds = append(m.Series[j].Rounds, mib(bytes)*float64(perRound)/total.Seconds())
		}
		return nil
	})
	return m
}

func mib(n int64) float64 { return float64(n) / (1 << 20) }
