package bench

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/containernetworking/cni/libcni"

	"github.com/mesh-cni/mesh-cni/test/bench/results"
	"github.com/mesh-cni/mesh-cni/test/fixtures"
	"github.com/mesh-cni/mesh-cni/test/harness"
)

// chainVariant is one conflist a pod's ADD goes through.
type chainVariant struct {
	name, label string
	list        *libcni.NetworkConfigList
}

// concurrentPods is how many ADDs run at once in the concurrent measurement and
// how many pods wait for a stopped agent in the gate-release one.
const concurrentPods = 16

// noopEntry is the no-op chained plugin: tuning with nothing to tune parses its
// config and prevResult, enters the pod's netns and prints the result back. It
// is what any chained plugin costs at least (a process start and libcni's work
// for one more entry), the floor mesh-cni's overhead is measured against.
func noopEntry() map[string]any { return map[string]any{"type": "tuning"} }

// BenchmarkChainAdd measures pod start through the real chain, libcni running
// the plugins in the node netns as a runtime does:
//
//   - sequential: one pod's CNI ADD through [bridge], [bridge, tuning] (a no-op
//     chained plugin), [bridge, mesh-cni] with an eBPF agent, and [bridge,
//     mesh-cni] with an agent running the gate alone (--datapath none), which
//     splits mesh-cni's cost into the plugin and gate round trip and the eBPF
//     enrollment. The variants take turns in every iteration, in rotating
//     order.
//   - concurrent-16: 16 pods ADDed at once, the variants taking turns by round.
//   - gate-release: 16 pods wait in ADD for a stopped agent; the agent starts;
//     the time from its ready line to the last ADD done.
//
// Only the ADD is timed; making the pod's namespace and the DEL are not.
func BenchmarkChainAdd(b *testing.B) {
	requireRoot(b)
	ctx := fixtures.Context(b, 40*time.Minute)
	res := newResult(b, "chain-add", "Pod start: CNI ADD through the chain", "BenchmarkChainAdd",
		"A pod's CNI ADD through the node's real chain, run by libcni in the node's network namespace as a container runtime runs it: "+
			"the reference `bridge` + `host-local` plugins as the primary network, then `mesh-cni` asking a real `mesh-agent` over the gate socket. "+
			"Variants: `bridge` = [bridge]; `noop` = [bridge, tuning], the reference `tuning` plugin with nothing to tune, a chained plugin that does no work "+
			"(it parses its config and prevResult, enters the pod's namespace and prints the result): the floor every chained plugin pays, and the baseline; "+
			"`mesh` = [bridge, mesh-cni] with the eBPF data path (the product); "+
			"`mesh-gate` = [bridge, mesh-cni] with an agent started with `--datapath none`. "+
			"`mesh` and `noop` run the same number of plugins and processes (bridge, host-local, one chained plugin), so `mesh − noop` is what mesh-cni costs beyond being a chained plugin; "+
			"`noop − bridge` is the floor itself; `mesh-gate − noop` is the plugin's own share (its process start beyond the no-op plugin's, and the gate round trip with an agent that does no data-path work); "+
			"`mesh − mesh-gate` is the eBPF enrollment. Only the ADD is timed (the pod's namespace is made before, the DEL is done after). "+
			"The variants take turns within every iteration (sequential) or round (concurrent), in rotating order, so machine noise hits them alike.")

	ebpfAgent := newAgent(b, agentOptions{})
	gateAgent := newAgent(b, agentOptions{Datapath: "none"})
	for _, a := range []*agent{ebpfAgent, gateAgent} {
		if _, _, err := a.start(ctx); err != nil {
			b.Fatal(err)
		}
	}
	node := harness.NewNode(b, harness.NodeOptions{Plugins: append(harness.ReferencePluginNames(), "mesh-cni")})
	variants := []chainVariant{
		{"bridge", "[bridge]", node.Conflist(b, benchNet)},
		{"noop", "[bridge, tuning] no-op chained plugin", node.Conflist(b, benchNet, noopEntry())},
		{"mesh", "[bridge, mesh-cni] eBPF", node.Conflist(b, benchNet, ebpfAgent.meshEntry("mesh-cni"))},
		{"mesh-gate", "[bridge, mesh-cni] gate only", node.Conflist(b, benchNet, gateAgent.meshEntry("mesh-cni"))},
	}
	ps := newPods(b, node)
	// Warm every path (the bridge, the page cache, the agents' first enrollment).
	for _, v := range variants {
		if _, err := addOnce(ctx, ps, v.list, "warm"); err != nil {
			b.Fatal(err)
		}
	}

	b.Run("sequential", func(b *testing.B) {
		_, ebpfSkip := ebpfAgent.logFields("pod enrolled", 0)
		_, gateSkip := gateAgent.logFields("pod enrolled", 0)
		m := benchSequentialAdd(ctx, b, ps, variants, size(400, 20))
		res.Metrics = append(res.Metrics, m)
		// The agents' own account of the same ADDs: from the gate call's
		// arrival to its answer.
		ebpfTook, _ := ebpfAgent.logFields("pod enrolled", ebpfSkip, "took")
		gateTook, _ := gateAgent.logFields("pod enrolled", gateSkip, "took")
		res.Metrics = append(res.Metrics, results.Metric{
			Name:  "agent-side",
			Title: "The agent's own time per ADD, one pod at a time (its log: gate call received → answered)",
			Unit:  "ms",
			Series: []results.Series{
				{Variant: "mesh", Label: "eBPF enrollment", Samples: secondsToMs(ebpfTook["took"])},
				{Variant: "mesh-gate", Label: "gate only (--datapath none)", Samples: secondsToMs(gateTook["took"])},
			},
		})
		for _, v := range variants {
			report(b, &m, v.name, 0, "ms")
		}
		reportRatio(b, &m, "", "mesh", "noop")
		b.ReportMetric(0, "ns/op")
	})
	b.Run(fmt.Sprintf("concurrent-%d", concurrentPods), func(b *testing.B) {
		m := benchConcurrentAdd(ctx, b, ps, variants, size(24, 2))
		res.Metrics = append(res.Metrics, m)
		report(b, &m, "noop", 0, "ms")
		report(b, &m, "mesh", 0, "ms")
		b.ReportMetric(0, "ns/op")
	})
	b.Run("gate-release", func(b *testing.B) {
		gm := benchGateRelease(ctx, b, node, size(16, 2))
		res.Metrics = append(res.Metrics, gm...)
		for i := range gm {
			report(b, &gm[i], gm[i].Series[0].Variant, 0, "ms")
		}
		b.ReportMetric(0, "ns/op")
	})
	finish(b, res)
}

// addOnce makes a pod, ADDs it through list (timed), then DELs and removes it.
func addOnce(ctx context.Context, ps *pods, list *libcni.NetworkConfigList, name string) (time.Duration, error) {
	p, err := ps.create("bench", name)
	if err != nil {
		return 0, err
	}
	took, err := ps.add(ctx, p, list)
	return took, errors.Join(err, ps.remove(ctx, p))
}

func benchSequentialAdd(ctx context.Context, b *testing.B, ps *pods, variants []chainVariant, iterations int) results.Metric {
	samples := make([][]float64, len(variants))
	for i := range iterations {
		for k := range variants {
			j := (i + k) % len(variants)
			took, err := addOnce(ctx, ps, variants[j].list, fmt.Sprintf("%s-%d", variants[j].name, i))
			if err != nil {
				b.Fatal(err)
			}
			samples[j] = append(samples[j], ms(took))
		}
	}
	m := results.Metric{Name: "add-sequential", Title: "CNI ADD latency, one pod at a time", Unit: "ms", Baseline: "noop"}
	for j, v := range variants {
		// Every iteration is a round: the variants ran back to back.
		m.Series = append(m.Series, results.Series{Variant: v.name, Label: v.label, Samples: samples[j], Rounds: samples[j]})
	}
	return m
}

func benchConcurrentAdd(ctx context.Context, b *testing.B, ps *pods, variants []chainVariant, rounds int) results.Metric {
	samples := make([][]float64, len(variants))
	roundMedians := make([][]float64, len(variants))
	for r := range rounds {
		for k := range variants {
			j := (r + k) % len(variants)
			took, err := addConcurrently(ctx, ps, variants[j].list, concurrentPods, fmt.Sprintf("%s-r%d", variants[j].name, r))
			if err != nil {
				b.Fatal(err)
			}
			var round []float64
			for _, d := range took {
				round = append(round, ms(d))
			}
			samples[j] = append(samples[j], round...)
			roundMedians[j] = append(roundMedians[j], results.Median(round))
		}
	}
	m := results.Metric{
		Name:     fmt.Sprintf("add-concurrent-%d", concurrentPods),
		Title:    fmt.Sprintf("CNI ADD latency, %d pods at once", concurrentPods),
		Unit:     "ms",
		Baseline: "noop",
	}
	for j, v := range variants {
		m.Series = append(m.Series, results.Series{Variant: v.name, Label: v.label, Samples: samples[j], Rounds: roundMedians[j]})
	}
	return m
}

// addConcurrently makes n pods, starts their ADDs at the same moment and returns
// each ADD's latency; then it DELs and removes the pods.
func addConcurrently(ctx context.Context, ps *pods, list *libcni.NetworkConfigList, n int, name string) ([]time.Duration, error) {
	var made []*pod
	defer func() {
		var wg sync.WaitGroup
		for _, p := range made {
			wg.Go(func() { _ = ps.remove(context.WithoutCancel(ctx), p) })
		}
		wg.Wait()
	}()
	for i := range n {
		p, err := ps.create("bench", fmt.Sprintf("%s-%d", name, i))
		if err != nil {
			return nil, err
		}
		made = append(made, p)
	}
	took := make([]time.Duration, n)
	errs := make([]error, n)
	startGun := make(chan struct{})
	var wg sync.WaitGroup
	for i, p := range made {
		wg.Go(func() {
			<-startGun
			took[i], errs[i] = ps.add(ctx, p, list)
		})
	}
	close(startGun)
	wg.Wait()
	return took, errors.Join(errs...)
}

// benchGateRelease: per round, concurrentPods pods start their ADD while the
// agent is stopped; once every one of them is waiting in mesh-cni (and has
// waited a second, so the plugins' reconnect back-off is at its cap, as after
// an agent crash), the agent starts. Measured: agent start to ready, and ready
// to each ADD's end.
func benchGateRelease(ctx context.Context, b *testing.B, node *harness.Node, rounds int) []results.Metric {
	a := newAgent(b, agentOptions{})
	list := node.Conflist(b, benchNet, a.meshEntry("mesh-cni"))
	ps := newPods(b, node)
	// A first start loads and pins the data path, as on a node where the agent
	// ran before; the rounds measure restarts.
	if _, _, err := a.start(ctx); err != nil {
		b.Fatal(err)
	}
	if err := a.stop(ctx); err != nil {
		b.Fatal(err)
	}
	var last, perPod, startReady []float64
	for r := range rounds {
		var made []*pod
		for i := range concurrentPods {
			p, err := ps.create("bench", fmt.Sprintf("gate-r%d-%d", r, i))
			if err != nil {
				b.Fatal(err)
			}
			made = append(made, p)
		}
		done := make([]time.Time, len(made))
		errs := make([]error, len(made))
		var wg sync.WaitGroup
		for i, p := range made {
			wg.Go(func() {
				_, errs[i] = ps.add(ctx, p, list)
				done[i] = time.Now()
			})
		}
		if err := waitChildren(ctx, "mesh-cni", len(made)); err != nil {
			b.Fatal(err)
		}
		// Part of the scenario, not a synchronisation: the agent stays away a
		// while, as after a crash or during an upgrade.
		time.Sleep(time.Second)
		started := a.launch()
		ready, err := a.waitReady(ctx)
		if err != nil {
			b.Fatal(err)
		}
		wg.Wait()
		if err := errors.Join(errs...); err != nil {
			b.Fatal(err)
		}
		startReady = append(startReady, ms(ready.Sub(started)))
		var lastDone time.Time
		for _, d := range done {
			perPod = append(perPod, ms(d.Sub(ready)))
			if d.After(lastDone) {
				lastDone = d
			}
		}
		last = append(last, ms(lastDone.Sub(ready)))
		if err := a.stop(ctx); err != nil {
			b.Fatal(err)
		}
		for _, p := range made {
			if err := ps.remove(ctx, p); err != nil {
				b.Fatal(err)
			}
		}
	}
	label := fmt.Sprintf("%d pods waiting", concurrentPods)
	return []results.Metric{
		{Name: "gate-release", Title: fmt.Sprintf("Gate release: agent ready → last of %d waiting ADDs done", concurrentPods), Unit: "ms",
			Series: []results.Series{{Variant: "release-last", Label: label, Samples: last, Rounds: last}}},
		{Name: "gate-release-per-pod", Title: "Gate release: agent ready → each waiting ADD done", Unit: "ms",
			Series: []results.Series{{Variant: "release-each", Label: label, Samples: perPod}}},
		{Name: "agent-start-ready", Title: fmt.Sprintf("Agent start → ready, %d pods waiting", concurrentPods), Unit: "ms",
			Series: []results.Series{{Variant: "start-ready", Label: label, Samples: startReady, Rounds: startReady}}},
	}
}

// waitChildren waits until n child processes of this process named comm are
// running: the plugins a runtime's ADDs have started.
func waitChildren(ctx context.Context, comm string, n int) error {
	ctx, cancel := context.WithTimeout(ctx, time.Minute)
	defer cancel()
	for {
		got, err := countChildren(comm)
		if err != nil {
			return err
		}
		if got >= n {
			return nil
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("waiting for %d %s processes (have %d): %w", n, comm, got, ctx.Err())
		case <-time.After(5 * time.Millisecond):
		}
	}
}

func countChildren(comm string) (int, error) {
	self := strconv.Itoa(os.Getpid())
	entries, err := os.ReadDir("/proc")
	if err != nil {
		return 0, fmt.Errorf("list /proc: %w", err)
	}
	n := 0
	for _, e := range entries {
		if _, err := strconv.Atoi(e.Name()); err != nil {
			continue
		}
		stat, err := os.ReadFile(filepath.Join("/proc", e.Name(), "stat"))
		if err != nil {
			continue // exited meanwhile
		}
		s := string(stat)
		open, end := strings.IndexByte(s, '('), strings.LastIndexByte(s, ')')
		if open < 0 || end < open {
			continue
		}
		rest := strings.Fields(s[end+1:])
		if len(rest) < 2 || rest[1] != self || slices.Contains([]string{"Z", "X"}, rest[0]) {
			continue
		}
		if s[open+1:end] == comm {
			n++
		}
	}
	return n, nil
}
