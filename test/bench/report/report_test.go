package report

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

// writeFixture writes a results directory shaped like a real run: ADD meets no
// target (20 ms overhead), capture meets its targets, scale stops at 100 pods.
func writeFixture(t *testing.T, dir string) {
	t.Helper()
	start := time.Date(2026, 1, 2, 3, 4, 5, 0, time.UTC)
	env := results.Env{Kernel: "6.18", CPUs: 2, CPUModel: "test", GoVersion: "go1.26", LoadStart: 0.5, LoadEnd: 0.7}
	rs := []*results.Result{
		{Name: "chain-add", Title: "Pod start", Command: "make bench", Started: start, Finished: start.Add(time.Minute), Env: env,
			Metrics: []results.Metric{
				{Name: "add-sequential", Title: "ADD", Unit: "ms", Baseline: "bridge", Series: []results.Series{
					series("bridge", 0, ramp(20, 0.1, 60)...),
					series("mesh", 0, ramp(40, 0.1, 60)...),
					series("mesh-gate", 0, ramp(28, 0.1, 60)...),
				}},
				{Name: "add-concurrent-16", Title: "ADD x16", Unit: "ms", Baseline: "bridge", Series: []results.Series{
					series("bridge", 0, ramp(200, 1, 32)...),
					series("mesh", 0, ramp(250, 1, 32)...),
				}},
				{Name: "gate-release", Title: "release", Unit: "ms", Series: []results.Series{series("release-last", 0, 150, 180)}},
			}},
		{Name: "capture", Title: "Capture", Command: "make bench", Started: start, Finished: start, Env: env, Quick: true,
			Notes: []string{"a note"},
			Metrics: []results.Metric{
				{Name: "conn-rate-chain", Title: "conn/s", Unit: "conn/s", HigherIsBetter: true, Baseline: "limit", Series: []results.Series{
					series("limit", 0, 1000, 1010, 990), series("ebpf", 0, 990, 1000, 985), series("iptables", 0, 900, 910, 880),
				}},
				{Name: "conn-cycle-chain", Title: "cycle", Unit: "µs", Baseline: "limit", Series: []results.Series{
					series("limit", 0, ramp(100, 1, 80)...), series("ebpf", 0, ramp(101, 1, 80)...), series("iptables", 0, ramp(120, 1, 80)...),
				}},
				{Name: "throughput-chain", Title: "tput", Unit: "MiB/s", HigherIsBetter: true, Baseline: "limit", Series: []results.Series{
					series("limit", 0, 800, 810), series("ebpf", 0, 700, 720),
				}},
			}},
		{Name: "scale", Title: "Scale", Command: "make bench", Started: start, Finished: start, Env: env,
			Metrics: []results.Metric{
				{Name: "enroll-per-pod", Title: "enroll", Unit: "ms", XLabel: "pods enrolled", Series: []results.Series{
					series("mesh-cni", 1, 10, 11), series("mesh-cni", 10, 10, 12), series("mesh-cni", 100, 11, 12),
					series("iptables", 1, 5), series("iptables", 100, 5),
				}},
				{Name: "agent-memory", Title: "memory", Unit: "MiB", XLabel: "pods enrolled", Series: []results.Series{
					series("rss", 100, 30), series("rss-restarted", 100, 28), series("hwm", 100, 31),
				}},
			}},
		{Name: "profile", Title: "Profiles", Command: "make bench", Started: start, Finished: start, Env: env,
			Metrics: []results.Metric{
				{Name: "bpf-ns-per-conn", Title: "bpf", Unit: "ns", Series: []results.Series{series("connect4", 0, 3000), series("tcx-ingress", 0, 6000)}},
			},
			Profiles: []results.Profile{{Name: "agent", Title: "agent", File: "profiles/agent.pprof", Command: "go tool pprof"}}},
	}
	for _, r := range rs {
		if err := results.Write(dir, r); err != nil {
			t.Fatal(err)
		}
	}
	writeProfile(t, filepath.Join(dir, "profiles", "agent.pprof"))
}

// writeProfile writes a CPU profile where main.work calls main.hot.
func writeProfile(t *testing.T, path string) {
	t.Helper()
	work := &profile.Function{ID: 1, Name: "main.work"}
	hot := &profile.Function{ID: 2, Name: "github.com/mesh-cni/mesh-cni/pkg/redirect.hot"}
	lWork := &profile.Location{ID: 1, Line: []profile.Line{{Function: work}}}
	lHot := &profile.Location{ID: 2, Line: []profile.Line{{Function: hot}}}
	p := &profile.Profile{
		SampleType:    []*profile.ValueType{{Type: "samples", Unit: "count"}, {Type: "cpu", Unit: "nanoseconds"}},
		Sample:        []*profile.Sample{{Location: []*profile.Location{lHot, lWork}, Value: []int64{3, 3e6}}, {Location: []*profile.Location{lWork}, Value: []int64{1, 1e6}}},
		Location:      []*profile.Location{lWork, lHot},
		Function:      []*profile.Function{work, hot},
		DurationNanos: 2e9,
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
		"| mesh-cni adds ≤ 2 ms median to ADD | +20.0 ms",
		"❌ missed",
		"### What limits the missed targets",
		"(`mesh-gate` − `bridge`) takes 8.00 ms, and the eBPF enrollment (`mesh` − `mesh-gate`) 12.0 ms",
		"| p99 ADD under 16 concurrent ADDs ≤ 1.5× bridge-only | 1.22×",
		"| gate release: all waiting pods admitted within 200 ms of ready | last of 16 ADDs done 165 ms after ready (median), 180 ms (worst of 2 rounds) | ✅ met |",
		"0.990× (paired median, full chain) | ✅ met |",
		"only up to 100 pods in this run | — not measured |",
		"**Quick mode**",
		"> a note",
		"| `ebpf` | 3 | 990 conn/s | 985 conn/s | 0.99× | 0.99× | 0.990 (better in 0 of 3) |",
		"| pods enrolled | mesh-cni: median | p99 | iptables |",
		"| 10 | 11.0 ms | 12.0 ms | — |",
		"![ADD](bench/chain-add-add-sequential.svg)",
		"| `pkg/redirect.hot` | 75.0% | 75.0% |",
		"| `main.work` | 100.0% | 25.0% |",
		"Reproduce: `make bench`",
	} {
		if !strings.Contains(md, want) {
			t.Errorf("report lacks %q", want)
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
