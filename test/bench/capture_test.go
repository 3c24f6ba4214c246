package bench

import (
	"context"
	"errors"
	"fmt"
	"net/netip"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/containernetworking/cni/libcni"

	"github.com/mesh-cni/mesh-cni/test/bench/results"
	"github.com/mesh-cni/mesh-cni/test/capture"
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
	// The splice and its baselines, whose proxies copy with read(2), as
	// --splice asks of a proxy (the others' copy with splice(2)).
	varLimitRead = "limit-read"
	varEBPFRead  = "ebpf-read"
	varSplice    = "splice"
)

var variantLabels = map[string]string{
	varDirect:    "direct, no proxy",
	varLimit:     "proxy port dialed, no capture",
	varEBPF:      "eBPF (mesh-cni)",
	varIPTables:  "iptables REDIRECT",
	varNFTables:  "nftables redirect",
	varIstio:     "istio-cni's in-pod rules",
	varLimitRead: "proxy port dialed, no capture (proxies read(2))",
	varEBPFRead:  "eBPF (mesh-cni), proxies read(2)",
	varSplice:    "eBPF with --splice=all, proxies read(2)",
}

// readCopy says which variants' proxies copy with read(2).
var readCopy = map[string]bool{varLimitRead: true, varEBPFRead: true, varSplice: true}

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
	// noSplice says why there is no "splice" variant ("" when there is).
	noSplice string
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
	ctx := benchContext(b, 40*time.Minute)
	env := newCaptureEnv(ctx, b)
	res := newResult(b, "capture", "Connection capture: eBPF vs istio-cni's rules vs iptables vs nftables", "BenchmarkCapture", captureDescription(env))
	for _, note := range []string{env.noLimit, env.noSplice} {
		if note != "" {
			res.Notes = append(res.Notes, note)
		}
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
			reportRatio(b, &rate, cfg.name+":", varSplice, varLimitRead)
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
			reportRatio(b, &m, cfg.name+":", varSplice, varLimitRead)
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
			reportRatio(b, &m, cfg.name+":", varSplice, varLimitRead)
		}
		b.ReportMetric(0, "ns/op")
	})
	b.Run("machine-profile", func(b *testing.B) {
		profileSplice(ctx, b, res, env.chain)
		b.ReportMetric(0, "ns/op")
	})
	finish(b, res)
}

// profileSplice records machine profiles (perf, every CPU, kernel included)
// of the splice and of the same capture without it, each alone on the
// machine, in the full chain: a bulk upload and a request/response batch.
// They show what bounds the splice where it misses its targets.
func profileSplice(ctx context.Context, b *testing.B, res *run, chain []captureSetup) {
	const uploads = 8
	uploadSize := int64(size(128<<20, 32<<20))
	requests := size(10000, 2000)
	buf := make([]byte, 256<<10)
	for _, su := range chain {
		if su.variant != varSplice && su.variant != varEBPFRead {
			continue
		}
		for _, kind := range []struct {
			name, title string
			ops         int
			op          string
			run         func() error
		}{
			{"throughput", "bulk upload", uploads * int(uploadSize>>20), "MiB", func() error {
				for range uploads {
					if _, err := su.client.upload(ctx, uploadSize, buf); err != nil {
						return err
					}
				}
				return nil
			}},
			{"request", "request/response", requests, "request", func() error {
				_, err := su.client.requests(ctx, requests)
				return err
			}},
		} {
			name := "machine-" + kind.name + "-" + su.variant
			file := filepath.Join(profilesDir(b), name+".pprof")
			if err := machineProfile(ctx, file, kind.run); err != nil {
				if errors.Is(err, errNoPerf) {
					res.Notes = append(res.Notes, "No machine profiles: "+err.Error()+".")
					return
				}
				b.Fatalf("%s: %v", name, err)
			}
			rel, _ := filepath.Rel(outDir(b), file)
			res.Profiles = append(res.Profiles, results.Profile{
				Name:       name,
				Title:      fmt.Sprintf("Machine, %s, full chain: `%s` %s (perf, all CPUs, kernel included)", kind.title, su.variant, variantLabels[su.variant]),
				File:       rel,
				Command:    "go tool pprof -top " + filepath.Join(results.DefaultOut, rel),
				Operations: kind.ops,
				Operation:  kind.op,
			})
		}
	}
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
		"`splice` = pods of a second `mesh-agent`, run with `--splice=all`: what an application writes to its proxy is moved into the proxy's socket instead of through loopback TCP. " +
		"Its proxies copy with read(2) and write(2) (refproxy `-read-copy`), as the splice asks of a proxy, where the others' copy with splice(2); `limit-read` and `ebpf-read` are `limit` and `ebpf` with those same proxies, the splice's own baselines. " +
		"The splice's read accounting runs on every socket read of the node, in every variant alike, and leaves at its first lookup for the sockets that are not spliced. " +
		"Two configurations: **chain** = client → client proxy → server proxy → server, a mesh's real path; " +
		"**capture** = the client's proxy runs with `-echo` and answers itself, which isolates the capture (the `limit` there dials 127.0.0.1:15001 of an echoing proxy). " +
		"Throughput: in the chain, uploads of 128 MiB (32 MiB in quick mode) to a counting sink; in the capture-only configuration the same amount sent and echoed back at once. " +
		"CPU per request: the machine's busy CPU time (user, system, irq and softirq of both CPUs, from /proc/stat, in 10 ms ticks) over a request batch, divided by its requests; only that variant runs meanwhile, so it is everything a request costs: client, application, both proxies and the kernel. " +
		"In every round each variant runs one batch, in rotating order; rates are per batch (conn/s, MiB/s), latencies per operation. " +
		"Ratios are paired: the median over rounds of variant ÷ baseline in the same round. " +
		"Machine profiles: after the rounds, `splice` and `ebpf-read` each run 8 uploads and one batch of 10,000 requests (2,000 in quick mode) of the full chain alone, under `perf record -a -g` " +
		"(cpu-clock at 997 Hz on every CPU: user space, kernel and softirq, whichever process they run for; idle CPUs left out), converted to pprof with each process's name as the root of its stacks."
}

func newCaptureEnv(ctx context.Context, b *testing.B) *captureEnv {
	a := newAgent(b, agentOptions{})
	if _, _, err := a.start(ctx); err != nil {
		b.Fatal(err)
	}
	node := harness.NewNode(b, harness.NodeOptions{Plugins: append(harness.ReferencePluginNames(), "mesh-cni")})
	bridgeOnly := node.Conflist(b, benchNet)
	withMesh := node.Conflist(b, benchNet, a.meshEntry("mesh-cni"))
	// The splice's pods are another agent's, with --splice=all: data paths of
	// several agents share the cgroup root, each acting on its own pods.
	sa := newAgent(b, agentOptions{Args: []string{"--splice=all"}})
	if _, _, err := sa.start(ctx); err != nil {
		b.Fatal(err)
	}
	withSplice := node.Conflist(b, benchNet, sa.meshEntry("mesh-cni"))
	refproxy := harness.Bins(b).Path("refproxy")
	env := &captureEnv{}
	if _, on := sa.logFields("splicing the pod-local hop into the proxy", 0); on == 0 {
		why := "no reason logged"
		for _, line := range strings.Split(sa.proc.Output(), "\n") {
			if strings.Contains(line, "splicing is off") {
				why = line
			}
		}
		env.noSplice = "There is no `splice` variant: the agent with `--splice=all` could not splice on this kernel (its log: " + why + ")."
	}
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
		switch variant {
		case varEBPF, varEBPFRead:
			return withMesh
		case varSplice:
			return withSplice
		}
		return bridgeOnly
	}
	proxyArgs := func(variant string, args ...string) []string {
		if readCopy[variant] {
			return append(args, "-read-copy")
		}
		return args
	}

	// Full chain: a client and a server pod per variant.
	chainVariants := []string{varDirect, varEBPF, varIstio, varIPTables, varNFTables, varEBPFRead}
	if env.noLimit == "" {
		chainVariants = append(chainVariants, varLimit, varLimitRead)
	}
	if env.noSplice == "" {
		chainVariants = append(chainVariants, varSplice)
	}
	for _, v := range chainVariants {
		cp := addPod(listFor(v), v+"-client")
		sp := addPod(listFor(v), v+"-server")
		serveApp(b, sp, appPort)
		target := netip.AddrPortFrom(sp.IPv4(b), appPort)
		switch v {
		case varDirect:
		case varLimit, varLimitRead:
			startRefproxy(ctx, b, spawn, cp, proxyArgs(v, "-"+forwardToFlag, netip.AddrPortFrom(sp.IPv4(b), proxy.DefaultInboundPort).String())...)
			startRefproxy(ctx, b, spawn, sp, proxyArgs(v, "-"+forwardToFlag, target.String())...)
			target = netip.AddrPortFrom(netip.MustParseAddr("127.0.0.1"), proxy.DefaultOutboundPort)
		default:
			startRefproxy(ctx, b, spawn, cp, proxyArgs(v)...)
			startRefproxy(ctx, b, spawn, sp, proxyArgs(v)...)
			install(cp, v)
			install(sp, v)
		}
		env.chain = append(env.chain, captureSetup{variant: v, client: client{netns: cp.NetNSPath, target: target}})
	}
	// Capture only: one client pod per variant with an echoing proxy; the
	// destination is the direct server, which the capture never lets it reach.
	nominal := env.chain[0].client.target
	echoVariants := []string{varLimit, varEBPF, varIstio, varIPTables, varNFTables, varLimitRead, varEBPFRead}
	if env.noSplice == "" {
		echoVariants = append(echoVariants, varSplice)
	}
	for _, v := range echoVariants {
		cp := addPod(listFor(v), v+"-echo")
		startRefproxy(ctx, b, spawn, cp, proxyArgs(v, "-echo")...)
		install(cp, v)
		target := nominal
		if v == varLimit || v == varLimitRead {
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
