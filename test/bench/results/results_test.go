package results

import (
	"math"
	"os"
	"path/filepath"
	"testing"
	"time"
)

func TestQuantile(t *testing.T) {
	xs := []float64{5, 1, 4, 2, 3}
	for _, c := range []struct {
		q, want float64
	}{{0, 1}, {0.5, 3}, {1, 5}, {0.25, 2}, {0.99, 4.96}, {-1, 1}, {2, 5}} {
		if got := Quantile(xs, c.q); math.Abs(got-c.want) > 1e-9 {
			t.Errorf("Quantile(%v, %v) = %v, want %v", xs, c.q, got, c.want)
		}
	}
	if xs[0] != 5 {
		t.Error("Quantile sorted its input")
	}
	if !math.IsNaN(Quantile(nil, 0.5)) {
		t.Error("Quantile of no samples is not NaN")
	}
}

func TestSummarizeTailDirection(t *testing.T) {
	xs := make([]float64, 101)
	for i := range xs {
		xs[i] = float64(i)
	}
	if s := Summarize(xs, false); s.Tail != 99 || s.Median != 50 || s.N != 101 {
		t.Errorf("latency summary %+v, want tail 99 (p99), median 50", s)
	}
	if s := Summarize(xs, true); s.Tail != 1 {
		t.Errorf("rate summary tail %v, want 1 (p1)", s.Tail)
	}
	if s := Summarize(nil, false); !math.IsNaN(s.Median) || s.N != 0 {
		t.Errorf("empty summary %+v", s)
	}
}

func TestPairedRatio(t *testing.T) {
	a := &Series{Rounds: []float64{110, 90, 120, 100}}
	b := &Series{Rounds: []float64{100, 100, 100, 0, 7}}
	// Rounds 0-2 pair up (1.1, 0.9, 1.2); round 3 has a zero baseline.
	r, ok := PairedRatio(a, b)
	if !ok || math.Abs(r-1.1) > 1e-9 {
		t.Errorf("PairedRatio = %v, %v; want 1.1", r, ok)
	}
	if _, ok := PairedRatio(a, &Series{}); ok {
		t.Error("PairedRatio without baseline rounds reported a ratio")
	}
	if _, ok := PairedRatio(nil, b); ok {
		t.Error("PairedRatio of nil reported a ratio")
	}
	if wins, n := PairedWins(a, b, true); wins != 3 || n != 4 {
		t.Errorf("PairedWins higher-is-better = %d of %d, want 3 of 4", wins, n)
	}
	if wins, n := PairedWins(a, b, false); wins != 1 || n != 4 {
		t.Errorf("PairedWins lower-is-better = %d of %d, want 1 of 4", wins, n)
	}
}

func TestPairedDiff(t *testing.T) {
	a := &Series{Rounds: []float64{12, 9, 14, math.NaN()}}
	b := &Series{Rounds: []float64{10, 10, 10, 10, 10}}
	// Rounds 0-2 pair up (2, -1, 4); round 3 is not a number.
	if d, ok := PairedDiff(a, b); !ok || math.Abs(d-2) > 1e-9 {
		t.Errorf("PairedDiff = %v, %v; want 2", d, ok)
	}
	if _, ok := PairedDiff(a, &Series{}); ok {
		t.Error("PairedDiff without baseline rounds reported a difference")
	}
	if _, ok := PairedDiff(nil, b); ok {
		t.Error("PairedDiff of nil reported a difference")
	}
}

func TestWriteReadDir(t *testing.T) {
	dir := t.TempDir()
	r := &Result{
		Name: "demo", Title: "Demo", Started: time.Unix(1, 0).UTC(),
		Metrics: []Metric{{Name: "lat", Unit: "ms", XLabel: "pods", Series: []Series{
			{Variant: "a", X: 10, Samples: []float64{1, 2}},
			{Variant: "a", X: 1, Samples: []float64{3}},
			{Variant: "b", X: 10, Samples: []float64{4}},
		}}},
	}
	if err := Write(dir, r); err != nil {
		t.Fatal(err)
	}
	if err := Write(dir, &Result{Name: "../escape"}); err == nil {
		t.Error("Write accepted a name with a path separator")
	}
	// Not a result: ignored by extension.
	if err := os.WriteFile(filepath.Join(dir, "bench.txt"), []byte("x"), 0o644); err != nil {
		t.Fatal(err)
	}
	got, err := ReadDir(dir)
	if err != nil {
		t.Fatal(err)
	}
	if len(got) != 1 || got[0].Name != "demo" || !got[0].Started.Equal(r.Started) {
		t.Fatalf("ReadDir = %+v", got)
	}
	m := got[0].Metric("lat")
	if m == nil {
		t.Fatal("metric lost")
	}
	if s := m.Find("a", 1); s == nil || s.Samples[0] != 3 {
		t.Errorf("Find(a, 1) = %+v", s)
	}
	if xs := m.Xs(); len(xs) != 2 || xs[0] != 1 || xs[1] != 10 {
		t.Errorf("Xs = %v", xs)
	}
	if vs := m.Variants(); len(vs) != 2 || vs[0] != "a" || vs[1] != "b" {
		t.Errorf("Variants = %v", vs)
	}
	if err := os.WriteFile(filepath.Join(dir, "broken.json"), []byte("{"), 0o644); err != nil {
		t.Fatal(err)
	}
	if got, err := ReadDir(dir); err == nil || len(got) != 1 {
		t.Errorf("ReadDir with a broken file: %d results, err %v; want the good one and an error", len(got), err)
	}
}

func TestOut(t *testing.T) {
	t.Setenv(EnvOut, "")
	if got := Out("/mod"); got != "/mod/"+DefaultOut {
		t.Errorf("Out default = %s", got)
	}
	t.Setenv(EnvOut, "rel/dir")
	if got := Out("/mod"); got != "/mod/rel/dir" {
		t.Errorf("Out relative = %s", got)
	}
	t.Setenv(EnvOut, "/abs")
	if got := Out("/mod"); got != "/abs" {
		t.Errorf("Out absolute = %s", got)
	}
}
