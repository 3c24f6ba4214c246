package benchreport

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/mesh-cni/mesh-cni/test/bench/results"
)

// nodeResult is a result another command measures than make bench.
func nodeResult(median float64) *results.Result {
	start := time.Date(2026, 1, 2, 3, 4, 5, 0, time.UTC)
	return &results.Result{Name: "node", Title: "A real node", Command: "make e2e-node", Started: start, Finished: start.Add(time.Minute),
		Env: results.Env{Kernel: "6.18", CPUs: 2, GoVersion: "go1.26"},
		Metrics: []results.Metric{{Name: "pod-start", Title: "Pod start", Unit: "ms", Baseline: "unmeshed", Series: []results.Series{
			{Variant: "unmeshed", Samples: []float64{median, median + 1}}, {Variant: "meshed", Samples: []float64{median + 2, median + 3}},
		}}}}
}

// UpdateSection rewrites one result's section and leaves the rest of the
// report; Generate with the other results keeps that section.
func TestUpdateSectionAndKeep(t *testing.T) {
	dir := t.TempDir()
	in, nodeIn := filepath.Join(dir, "bench"), filepath.Join(dir, "node")
	writeFixture(t, in)
	opts := Options{In: in, Out: filepath.Join(dir, "benchmarks.md"), FigDir: filepath.Join(dir, "figs"), Now: time.Date(2026, 1, 3, 0, 0, 0, 0, time.UTC)}
	if err := Generate(opts); err != nil {
		t.Fatal(err)
	}
	before, err := os.ReadFile(opts.Out)
	if err != nil {
		t.Fatal(err)
	}

	for _, median := range []float64{1000, 2000} {
		if err := results.Write(nodeIn, nodeResult(median)); err != nil {
			t.Fatal(err)
		}
		node := opts
		node.In = nodeIn
		if err := UpdateSection(node, "node"); err != nil {
			t.Fatal(err)
		}
	}
	after, err := os.ReadFile(opts.Out)
	if err != nil {
		t.Fatal(err)
	}
	report := string(after)
	rest := strings.Replace(report, " · [A real node](#a-real-node)", "", 1)
	rest = rest[:strings.Index(rest, sectionBegin("node"))]
	if strings.TrimRight(rest, "\n") != strings.TrimRight(string(before), "\n") {
		t.Error("UpdateSection changed more of the report than its section and the contents")
	}
	if n := strings.Count(report, sectionBegin("node")); n != 1 {
		t.Fatalf("the node section is in the report %d times", n)
	}
	if !strings.Contains(report, "2000") || strings.Contains(report, "| `unmeshed` | 2 | 1000") {
		t.Error("the node section is not the latest samples'")
	}
	if !strings.Contains(report, "[A real node](#a-real-node)") {
		t.Error("the node section is not in the contents")
	}

	// A full regeneration from make bench's results keeps it, figures too.
	figs, _ := filepath.Glob(filepath.Join(opts.FigDir, "node-*"))
	if len(figs) == 0 {
		t.Fatal("no figure of the node section")
	}
	if err := Generate(opts); err != nil {
		t.Fatal(err)
	}
	regen, err := os.ReadFile(opts.Out)
	if err != nil {
		t.Fatal(err)
	}
	if got := markedSections(string(regen)); len(got) == 0 || got[len(got)-1].name != "node" || !strings.Contains(got[len(got)-1].text, "2000") {
		t.Errorf("Generate dropped the node section: %v", got)
	}
	for _, f := range figs {
		if _, err := os.Stat(f); err != nil {
			t.Errorf("Generate removed the node section's figure: %v", err)
		}
	}
	if err := UpdateSection(Options{In: in, Out: opts.Out, FigDir: opts.FigDir}, "nope"); err == nil {
		t.Error("UpdateSection of a result that is not there: no error")
	}
}

// A result of make bench rewritten alone (a rerun of one benchmark) also
// rewrites its rows of the summary: its line of the table of runs and its
// rows of the table of every target, which must not keep the earlier run's.
func TestUpdateSectionRefreshesSummary(t *testing.T) {
	dir := t.TempDir()
	in, rerun := filepath.Join(dir, "bench"), filepath.Join(dir, "rerun")
	writeFixture(t, in)
	start := time.Date(2026, 1, 2, 3, 4, 5, 0, time.UTC)
	first := fleetResult(0, 1, 0)
	first.Title, first.Started, first.Finished = "Fleet", start, start.Add(time.Minute)
	if err := results.Write(in, first); err != nil {
		t.Fatal(err)
	}
	opts := Options{In: in, Out: filepath.Join(dir, "benchmarks.md"), FigDir: filepath.Join(dir, "figs"), Now: start}
	if err := Generate(opts); err != nil {
		t.Fatal(err)
	}
	second := fleetResult(0, 1, 10)
	second.Title, second.Started, second.Finished = "Fleet", start.Add(time.Hour), start.Add(time.Hour+7*time.Minute)
	if err := results.Write(rerun, second); err != nil {
		t.Fatal(err)
	}
	opts.In = rerun
	if err := UpdateSection(opts, "fleet"); err != nil {
		t.Fatal(err)
	}
	out, err := os.ReadFile(opts.Out)
	if err != nil {
		t.Fatal(err)
	}
	report := string(out)
	top := report[:strings.Index(report, sectionBegin("chain-add"))]
	var rows string
	for _, s := range markedSections(report) {
		if s.name == "fleet" {
			rows = targetRows(s.text)
		}
	}
	if !strings.Contains(rows, "istio-cni at 10 nodes") {
		t.Fatalf("the rewritten section's targets are not the rerun's:\n%s", rows)
	}
	if !strings.Contains(top, rows) {
		t.Errorf("the summary's targets do not hold the rerun's rows:\n%s", top)
	}
	if strings.Count(report, "| API writes per pod start") != 2 {
		t.Errorf("the fleet's first target is in the report %d times, want 2 (summary and section)", strings.Count(report, "| API writes per pod start"))
	}
	if !strings.Contains(top, "| fleet | 2026-01-02 04:04 | 7m0s |") {
		t.Errorf("the table of runs does not hold the rerun's start and time:\n%s", top)
	}
}
