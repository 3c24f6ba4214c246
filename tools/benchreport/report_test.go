package benchreport

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/google/pprof/profile"
	"github.com/mesh-cni/mesh-cni/test/bench/results"
)

func series(variant string, x float64, samples ...float64) results.Series {
	return results.Series{Variant: variant, X: x, Samples: samples, Rounds: samples}
}

func ramp(from, step float64, n int) []float64 {
	out := make([]float64, n)
	for i := range out {
		out[i] = from + step*float64(i)
	}
	return out
}

// writeFixture writes a results directory shaped like a real run: ADD misses
// its overhead target (10 ms over the no-op chain), the concurrent tail meets
// its own, capture meets the limit target but not the iptables one, scale
// stops at 100 pods; the fleet misses some targets of its own and has a
// machine profile.
func writeFixture(t *testing.T, dir string) {
	t.Helper()
	start := time.Date(2026, 1, 2, 3, 4, 5, 0, time.UTC)
	env := results.Env{Kernel: "6.18", CPUs: 2, CPUModel: "test", GoVersion: "go1.26", LoadStart: 0.5, LoadEnd: 0.7,
		UptimeStart: &results.LoadAvg{One: 0.5, Five: 0.6, Fifteen: 0.75}, LoadSamples: []float64{0.5, 1.5, 2.5}, LoadInterval: 5 * time.Second}
	rs := []*results.Result{
		{Name: "chain-add", Title: "Pod start", Command: "make bench", Started: start, Finished: start.Add(time.Minute), Env: env,
			Metrics: []results.Metric{
				{Name: "add-sequential", Title: "ADD", Unit: "ms", Baseline: "noop", Series: []results.Series{
					series("bridge", 0, ramp(20, 0.1, 60)...),
					series("noop", 0, ramp(30, 0.1, 60)...),
					series("mesh", 0, ramp(40, 0.1, 60)...),
					series("mesh-gate", 0, ramp(33, 0.1, 60)...),
				}},
				{Name: "add-concurrent-16", Title: "ADD x16", Unit: "ms", Baseline: "noop", Series: []results.Series{
					series("noop", 0, ramp(200, 1, 32)...),
					series("mesh", 0, ramp(250, 1, 32)...),
				}},
				{Name: "gate-release", Title: "release", Unit: "ms", Series: []results.Series{series("release-last", 0, 150, 180)}},
			}},
		{Name: "plugin", Title: "Plugin", Command: "make bench", Started: start, Finished: start, Env: env,
			Metrics: []results.Metric{
				{Name: "binary-size", Title: "size", Unit: "MiB", Baseline: "tuning", Series: []results.Series{series("tuning", 0, 4.5), series("mesh-cni", 0, 7)}},
				{Name: "exec-version", Title: "version", Unit: "ms", Baseline: "tuning", Series: []results.Series{series("tuning", 0, 1, 1.2), series("mesh-cni", 0, 1.5, 1.7)}},
				{Name: "exec-version-cpu", Title: "version cpu", Unit: "ms", Baseline: "tuning", Series: []results.Series{series("tuning", 0, 0.9), series("mesh-cni", 0, 1.1)}},
				{Name: "plugin-add", Title: "add", Unit: "ms", Baseline: "tuning", Series: []results.Series{series("tuning", 0, 2), series("mesh-gate", 0, 3), series("mesh", 0, 5)}},
				{Name: "plugin-add-cpu", Title: "add cpu", Unit: "ms", Baseline: "tuning", Series: []results.Series{series("tuning", 0, 1), series("mesh-gate", 0, 1.5), series("mesh", 0, 1.6)}},
				{Name: "init-total", Title: "init", Unit: "ms", Baseline: "tuning", Series: []results.Series{series("tuning", 0, 0.3), series("mesh-cni", 0, 0.5)}},
				{Name: "init-packages", Title: "inits", Unit: "packages", Baseline: "tuning", Series: []results.Series{series("tuning", 0, 35), series("mesh-cni", 0, 60)}},
			}},
		{Name: "capture", Title: "Capture", Command: "make bench", Started: start, Finished: start, Env: env, Quick: true,
			Notes: []string{"a note"},
			Metrics: []results.Metric{
				{Name: "conn-rate-chain", Title: "conn/s", Unit: "conn/s", HigherIsBetter: true, Baseline: "limit", Series: []results.Series{
					series("limit", 0, 1000, 1010, 990), series("ebpf", 0, 990, 1000, 985), series("iptables", 0, 900, 910, 880),
					series("istio-cni", 0, 890, 900, 870),
				}},
				{Name: "conn-cycle-chain", Title: "cycle", Unit: "µs", Baseline: "limit", Series: []results.Series{
					series("limit", 0, ramp(100, 1, 80)...), series("ebpf", 0, ramp(101, 1, 80)...), series("iptables", 0, ramp(120, 1, 80)...),
					series("istio-cni", 0, ramp(125, 1, 80)...),
				}},
				{Name: "throughput-chain", Title: "tput", Unit: "MiB/s", HigherIsBetter: true, Baseline: "limit", Series: []results.Series{
					series("limit", 0, 800, 810), series("ebpf", 0, 700, 720),
				}},
			}},
		{Name: "scale", Title: "Scale", Command: "make bench", Started: start, Finished: start, Env: env,
			Metrics: []results.Metric{
				{Name: "enroll-per-pod", Title: "enroll", Unit: "ms", XLabel: "pods enrolled", Baseline: "iptables", Series: []results.Series{
					series("enroll-release", 1, 2, 2.2), series("enroll-release", 10, 2, 2.4), series("enroll-release", 100, 2.2, 2.4),
					series("iptables", 1, 8), series("iptables", 100, 8),
				}},
				{Name: "agent-memory", Title: "memory", Unit: "MiB", XLabel: "pods enrolled", Series: []results.Series{
					series("rss", 100, 30), series("rss-restarted", 100, 28), series("hwm", 100, 31),
				}},
			}},
		{Name: "profile", Title: "Profiles", Command: "make bench", Started: start, Finished: start, Env: env,
			Metrics: []results.Metric{
				{Name: "bpf-ns-per-conn", Title: "bpf", Unit: "ns", Series: []results.Series{series("connect4", 0, 3000), series("sk_lookup", 0, 600)}},
			},
			Profiles: []results.Profile{{Name: "agent-add", Title: "agent", File: "profiles/agent.pprof", Command: "go tool pprof", Operations: 2, Operation: "ADD"}}},
	}
	fleet := fleetResult(0.5, 1.5, 0)
	fleet.Title, fleet.Command, fleet.Started, fleet.Finished, fleet.Env = "Fleet", "make bench", start, start, env
	fleet.Profiles = []results.Profile{{Name: machinePrefix + "fleet", Title: "machine", File: "profiles/machine.pprof", Command: "go tool pprof"}}
	rs = append(rs, fleet)
	for i, r := range rs {
		// One after the other, as a run measures them.
		r.Started, r.Finished = r.Started.Add(time.Duration(i)*time.Hour), r.Finished.Add(time.Duration(i)*time.Hour)
		r.Command += " " + r.Name
		if err := results.Write(dir, r); err != nil {
			t.Fatal(err)
		}
	}
	writeProfile(t, filepath.Join(dir, "profiles", "agent.pprof"))
	writeProfile(t, filepath.Join(dir, "profiles", "machine.pprof"))
}

// writeProfile writes a CPU profile where the gate's Add calls the sk_lookup
// program load: 4 ms in all, 3 of them in the load.
func writeProfile(t *testing.T, path string) {
	t.Helper()
	const (
		work = "github.com/mesh-cni/mesh-cni/internal/agent.(*Service).Add"
		hot  = "github.com/mesh-cni/mesh-cni/internal/redirect.(*lookupTemplate).load"
	)
	writeStacks(t, path, []string{hot, work}, []string{hot, work}, []string{hot, work}, []string{work})
}

func TestGenerate(t *testing.T) {
	dir := t.TempDir()
	in := filepath.Join(dir, "results")
	writeFixture(t, in)
	out := filepath.Join(dir, "docs", "benchmarks.md")
	figs := filepath.Join(dir, "docs", "bench")
	if err := os.MkdirAll(figs, 0o755); err != nil {
		t.Fatal(err)
	}
	stale := filepath.Join(figs, "gone-metric.svg")
	if err := os.WriteFile(stale, []byte("<svg/>"), 0o644); err != nil {
		t.Fatal(err)
	}
	if err := Generate(Options{In: in, Out: out, FigDir: figs, Now: time.Unix(0, 0)}); err != nil {
		t.Fatal(err)
	}
	data, err := os.ReadFile(out)
	if err != nil {
		t.Fatal(err)
	}
	md := string(data)
	for _, want := range []string{
		"| ADD overhead over the no-op chained plugin ≤ 1.5 ms (median, one pod at a time) | +10.0 ms median ADD: 33.0 ms [bridge, tuning] → 43.0 ms [bridge, mesh-cni]; paired median difference +10.0 ms | ❌ missed |",
		"### What bounds the missed targets",
		"### Where a pod's ADD spends its time",
		"the plugin's own share (`mesh-gate − noop`) is 3.00 ms, the eBPF enrollment (`mesh − mesh-gate`) 7.00 ms",
		"The plugin's ADD step alone (exec → exit, the bridge's result as prevResult) takes a median 3.00 ms against an agent without a data path and 5.00 ms against the eBPF agent, where the no-op `tuning` takes 2.00 ms",
		"the binary is 7.00 MiB against 4.50 MiB",
		"| 16 concurrent ADDs: p99 ≤ 1.3× the no-op chain's | 1.22× (p99 231 ms [bridge, tuning] → 281 ms [bridge, mesh-cni]) | ✅ met |",
		"| gate release: 16 waiting pods all admitted ≤ 100 ms after the agent is ready (worst round) | last of 16 ADDs done 165 ms after ready (median of 2 rounds), 180 ms in the worst round | ❌ missed |",
		"| eBPF capture: conn/s ≥ 0.98× the no-capture limit | 0.990× (paired median, full chain) | ✅ met |",
		"| eBPF capture: conn/s ≥ 1.2× iptables REDIRECT | 1.100× (paired median, full chain); connection p99 179 µs vs 198 µs | ❌ missed |",
		"iptables already reaches 0.900× of it (paired), so even a capture that cost nothing would be 1.111× iptables here",
		"### The eBPF programs' run time per connection",
		"In the profile's connection phase the eBPF programs ran 3.60 µs per proxied connection in all",
		"- **Fleet** — in [its section](#fleet), below its own targets.",
		"**CPU profiles** list the functions with the most CPU time",
		"Machine profiles (`machine-…`)",
		"| per-pod enroll+release ≤ 1 ms at 1000 pods | 2.30 ms median at 100 pods",
		"only up to 100 pods in this run | — not measured |",
		"load average 0.50, 0.60, 0.75 at the start, 0.70 at the end; 1-minute load during the run (3 readings, every 5s): median 1.50, max 2.50",
		"| chain-add | 2026-01-02 03:04 | 1m0s | 0.50 0.60 0.75 | 0.70 | 1.50 | 2.50 |",
		"**Quick mode**",
		"> a note",
		"| `ebpf` | 3 | 990 conn/s | 985 conn/s | 0.99× | 0.99× | 0.990 (better in 0 of 3) |",
		"| pods enrolled | enroll-release: median | p99 | iptables |",
		"| 10 | 2.20 ms | 2.40 ms | — |",
		"![ADD](bench/chain-add-add-sequential.svg)",
		"| `internal/redirect.(*lookupTemplate).load` | 75.0% | 75.0% |",
		"| `internal/agent.(*Service).Add` | 100.0% | 25.0% |",
		"answering one gate Add costs 2.00 ms of CPU, of which loading the pod's sk_lookup program",
		"is 1.50 ms (75% of the Add; 75% of all the agent's CPU in the profiled run, start-up and DELs included).",
		"Reproduce: `make bench chain-add`",
	} {
		if !strings.Contains(md, want) {
			t.Errorf("report lacks %q", want)
		}
	}
	for _, unwanted := range []string{"TCX", "RCU", "rcu", "issue", "#9", "about "} {
		if strings.Contains(md, unwanted) {
			t.Errorf("report mentions %q", unwanted)
		}
	}
	if t.Failed() {
		t.Logf("report:\n%s", md)
	}
	for _, fig := range []string{"chain-add-add-sequential.svg", "capture-conn-rate-chain.svg", "capture-conn-cycle-chain.svg", "scale-enroll-per-pod.svg", "profile-bpf-ns-per-conn.svg"} {
		st, err := os.Stat(filepath.Join(figs, fig))
		if err != nil || st.Size() == 0 {
			t.Errorf("figure %s: %v", fig, err)
		}
	}
	if _, err := os.Stat(stale); !os.IsNotExist(err) {
		t.Errorf("stale figure was left in place: %v", err)
	}
}

func TestGenerateErrors(t *testing.T) {
	dir := t.TempDir()
	if err := Generate(Options{In: dir, Out: filepath.Join(dir, "x.md"), FigDir: dir}); err == nil {
		t.Error("Generate with no results succeeded")
	}
	if err := Generate(Options{In: dir}); err == nil {
		t.Error("Generate without Out and FigDir succeeded")
	}
	if err := Generate(Options{In: dir, Out: filepath.Join(dir, "x.md"), FigDir: dir, Format: "gif"}); err == nil {
		t.Error("Generate with an unknown figure format succeeded")
	}
}

func TestDrawDegenerate(t *testing.T) {
	dir := t.TempDir()
	for _, m := range []results.Metric{
		{Name: "empty", Unit: "ms"},
		{Name: "zeros", Unit: "ms", Series: []results.Series{{Variant: "a", Samples: make([]float64, 100)}}},
		{Name: "negative", Unit: "ms", XLabel: "n", Series: []results.Series{{Variant: "a", X: 0, Samples: []float64{-1}}, {Variant: "a", X: 5, Samples: []float64{2}}}},
		{Name: "one", Unit: "conn/s", HigherIsBetter: true, Series: []results.Series{{Variant: "a", Samples: []float64{1, 1}}}},
	} {
		if _, err := drawMetric(&m, filepath.Join(dir, m.Name+".svg")); err != nil {
			t.Errorf("%s: %v", m.Name, err)
		}
	}
}

func TestWrap(t *testing.T) {
	if got := wrap("aaa bbb ccc", 7); got != "aaa bbb\nccc" {
		t.Errorf("wrap = %q", got)
	}
	if got := wrap("", 7); got != "" {
		t.Errorf("wrap empty = %q", got)
	}
}

// writeStacks writes a CPU profile of the given stacks (leaf first), 1 ms each.
func writeStacks(t *testing.T, path string, stacks ...[]string) {
	t.Helper()
	p := &profile.Profile{SampleType: []*profile.ValueType{{Type: "samples", Unit: "count"}, {Type: "cpu", Unit: "nanoseconds"}}}
	locs := map[string]*profile.Location{}
	for _, st := range stacks {
		s := &profile.Sample{Value: []int64{1, 1e6}}
		for _, name := range st {
			l, found := locs[name]
			if !found {
				fn := &profile.Function{ID: uint64(len(p.Function) + 1), Name: name}
				p.Function = append(p.Function, fn)
				l = &profile.Location{ID: uint64(len(p.Location) + 1), Line: []profile.Line{{Function: fn}}}
				p.Location = append(p.Location, l)
				locs[name] = l
			}
			s.Location = append(s.Location, l)
		}
		p.Sample = append(p.Sample, s)
	}
	if err := os.MkdirAll(filepath.Dir(path), 0o755); err != nil {
		t.Fatal(err)
	}
	f, err := os.Create(path)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	if err := p.Write(f); err != nil {
		t.Fatal(err)
	}
}

// TestEachExplanationOnce: the report states each explanation once and refers
// to it elsewhere; no paragraph (a block of prose or a list item), nor a long
// sentence within one, stands in it twice. The fixture's results make every
// explanation appear: targets missed for the same reasons, a section with
// its own targets, profiles in two sections.
func TestEachExplanationOnce(t *testing.T) {
	dir := t.TempDir()
	in := filepath.Join(dir, "results")
	writeFixture(t, in)
	out := filepath.Join(dir, "benchmarks.md")
	if err := Generate(Options{In: in, Out: out, FigDir: filepath.Join(dir, "bench"), Now: time.Unix(0, 0)}); err != nil {
		t.Fatal(err)
	}
	md, err := os.ReadFile(out)
	if err != nil {
		t.Fatal(err)
	}
	paras := proseParagraphs(string(md))
	if len(paras) < 10 {
		t.Fatalf("only %d paragraphs of prose in the report:\n%s", len(paras), md)
	}
	// Shorter sentences are references ("… is broken down below") and
	// headings of a kind, which may recur.
	const longSentence = 80
	seen := map[string]int{}
	for _, p := range paras {
		seen[p]++
		for _, s := range strings.SplitAfter(p, ". ") {
			if s = strings.TrimSpace(s); len(s) >= longSentence && s != p {
				seen[s]++
			}
		}
	}
	for s, n := range seen {
		if n > 1 {
			t.Errorf("the report says %d times: %q", n, s)
		}
	}
}

// proseParagraphs are the report's blocks of prose and list items; headings,
// tables, figures and section markers are not prose.
func proseParagraphs(md string) []string {
	var out []string
	for _, block := range strings.Split(md, "\n\n") {
		block = strings.TrimSpace(block)
		for _, skip := range []string{"#", "|", "![", "<!--"} {
			if strings.HasPrefix(block, skip) {
				block = ""
			}
		}
		if block == "" {
			continue
		}
		if strings.HasPrefix(block, "- ") || strings.HasPrefix(block, "> ") {
			out = append(out, strings.Split(block, "\n")...)
			continue
		}
		out = append(out, block)
	}
	return out
}
