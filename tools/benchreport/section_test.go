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
