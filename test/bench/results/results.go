// Package results is the file format between mesh-cni's benchmarks (test/bench)
// and the report generator (tools/benchreport): every benchmark writes one JSON
// file of raw samples, and the report computes its tables, ratios and plots from
// those samples alone, so a report can be regenerated without measuring again.
package results

import (
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"sort"
	"strings"
	"time"
)

// EnvOut names the environment variable holding the results directory.
const EnvOut = "MESH_BENCH_OUT"

// DefaultOut is the results directory when EnvOut is not set, relative to the
// module root.
const DefaultOut = "bin/bench"

// Result is what one benchmark measured.
type Result struct {
	// Name identifies the benchmark and names its file (Name + ".json").
	Name string `json:"name"`
	// Title heads the benchmark's section of the report.
	Title string `json:"title"`
	// Description says what was measured and how, in Markdown.
	Description string `json:"description"`
	// Command reproduces the measurement (and the report) from the module root.
	Command string `json:"command"`
	// Quick is set when the run was the reduced development mode.
	Quick    bool      `json:"quick"`
	Started  time.Time `json:"started"`
	Finished time.Time `json:"finished"`
	Env      Env       `json:"env"`
	Metrics  []Metric  `json:"metrics"`
	// Notes are observations the benchmark made while running (Markdown).
	Notes []string `json:"notes,omitempty"`
	// Profiles are pprof files the benchmark wrote into the results directory.
	Profiles []Profile `json:"profiles,omitempty"`
}

// Profile is a pprof file written next to the results.
type Profile struct {
	Name  string `json:"name"`
	Title string `json:"title"`
	// File is the profile's path relative to the results directory.
	File string `json:"file"`
	// Command shows the profile interactively.
	Command string `json:"command"`
	// Operations is how many operations (pod ADDs, plugin invocations) the
	// profile covers, for CPU time per operation; 0 if not counted.
	Operations int    `json:"operations,omitempty"`
	Operation  string `json:"operation,omitempty"`
}

// Env describes the machine a result was measured on.
type Env struct {
	Kernel    string `json:"kernel"`
	CPUs      int    `json:"cpus"`
	CPUModel  string `json:"cpu_model"`
	GoVersion string `json:"go_version"`
	// LoadStart and LoadEnd are the 1-minute load averages when the benchmark
	// started and finished: a load above CPUs means others shared the machine.
	LoadStart float64 `json:"load_start"`
	LoadEnd   float64 `json:"load_end"`
	// UptimeStart and UptimeEnd are /proc/loadavg's 1-, 5- and 15-minute load
	// averages at the start and the end, as uptime prints them.
	UptimeStart *LoadAvg `json:"uptime_start,omitempty"`
	UptimeEnd   *LoadAvg `json:"uptime_end,omitempty"`
	// LoadSamples are the 1-minute load average read every LoadInterval while
	// the benchmark ran: the start and end alone can miss a burst of other
	// work in between.
	LoadSamples  []float64     `json:"load_samples,omitempty"`
	LoadInterval time.Duration `json:"load_interval,omitempty"`
}

// LoadAvg is one reading of /proc/loadavg.
type LoadAvg struct {
	One     float64 `json:"one"`
	Five    float64 `json:"five"`
	Fifteen float64 `json:"fifteen"`
	// Running and Threads are the runnable and all scheduling entities
	// ("2/345") when it was read.
	Running int `json:"running"`
	Threads int `json:"threads"`
}

// Metric is one measured quantity compared across variants, e.g. ADD latency for
// [bridge] and [bridge, mesh-cni].
type Metric struct {
	// Name is unique within the result and names the metric's figure.
	Name  string `json:"name"`
	Title string `json:"title"`
	// Unit of every sample, e.g. "ms", "µs", "conn/s", "MiB/s", "MiB".
	Unit string `json:"unit"`
	// HigherIsBetter is true for rates (conn/s, MiB/s); the report's tail
	// percentile is then the low one (p1), the bad direction.
	HigherIsBetter bool `json:"higher_is_better"`
	// Baseline names the variant ratios are taken against ("" for none).
	Baseline string `json:"baseline,omitempty"`
	// XLabel, when set, makes this a scaling metric: each series is one point
	// (variant, X) and the report plots the median against X.
	XLabel string   `json:"x_label,omitempty"`
	Series []Series `json:"series"`
}

// Series is the samples of one variant (at one X, for scaling metrics).
type Series struct {
	Variant string `json:"variant"`
	// Label is the human name of the variant; default Variant.
	Label string  `json:"label,omitempty"`
	X     float64 `json:"x,omitempty"`
	// Samples are the individual measurements, in Metric.Unit.
	Samples []float64 `json:"samples"`
	// Rounds, when set, hold one aggregate per measurement round; rounds with
	// the same index in different series ran back to back, so their ratio is a
	// paired comparison that machine noise affects less than a ratio of medians.
	Rounds []float64 `json:"rounds,omitempty"`
}

// DisplayLabel is Label, or Variant when Label is empty.
func (s Series) DisplayLabel() string {
	if s.Label != "" {
		return s.Label
	}
	return s.Variant
}

// Find returns the series of variant at x (x is ignored for metrics without
// XLabel), or nil.
func (m *Metric) Find(variant string, x float64) *Series {
	for i := range m.Series {
		s := &m.Series[i]
		if s.Variant == variant && (m.XLabel == "" || s.X == x) {
			return s
		}
	}
	return nil
}

// Variants lists the metric's variants in first-seen order.
func (m *Metric) Variants() []string {
	return distinct(m.Series, func(s Series) string { return s.Variant })
}

// Xs lists the metric's X values, ascending.
func (m *Metric) Xs() []float64 {
	out := distinct(m.Series, func(s Series) float64 { return s.X })
	slices.Sort(out)
	return out
}

// distinct lists key of each series, once each, in first-seen order.
func distinct[K comparable](series []Series, key func(Series) K) []K {
	var out []K
	for _, s := range series {
		if k := key(s); !slices.Contains(out, k) {
			out = append(out, k)
		}
	}
	return out
}

// Metric returns the named metric, or nil.
func (r *Result) Metric(name string) *Metric {
	for i := range r.Metrics {
		if r.Metrics[i].Name == name {
			return &r.Metrics[i]
		}
	}
	return nil
}

// Out returns the results directory: $MESH_BENCH_OUT, or DefaultOut; a relative
// path is taken from root, the module root (go test runs each package in its
// own directory, so the working directory is no anchor).
func Out(root string) string {
	d := os.Getenv(EnvOut)
	if d == "" {
		d = DefaultOut
	}
	if filepath.IsAbs(d) {
		return d
	}
	return filepath.Join(root, d)
}

// Write stores r as dir/<r.Name>.json, atomically.
func Write(dir string, r *Result) error {
	if r.Name == "" || strings.ContainsAny(r.Name, `/\`) {
		return fmt.Errorf("result name %q: want a plain file name", r.Name)
	}
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return fmt.Errorf("results dir: %w", err)
	}
	data, err := json.MarshalIndent(r, "", "  ")
	if err != nil {
		return fmt.Errorf("encode result %s: %w", r.Name, err)
	}
	path := filepath.Join(dir, r.Name+".json")
	tmp, err := os.CreateTemp(dir, "."+r.Name+".json.tmp-")
	if err != nil {
		return fmt.Errorf("write result %s: %w", r.Name, err)
	}
	defer os.Remove(tmp.Name())
	if _, err := tmp.Write(append(data, '\n')); err != nil {
		tmp.Close()
		return fmt.Errorf("write result %s: %w", r.Name, err)
	}
	if err := tmp.Close(); err != nil {
		return fmt.Errorf("write result %s: %w", r.Name, err)
	}
	if err := os.Chmod(tmp.Name(), 0o644); err != nil {
		return fmt.Errorf("write result %s: %w", r.Name, err)
	}
	if err := os.Rename(tmp.Name(), path); err != nil {
		return fmt.Errorf("write result %s: %w", r.Name, err)
	}
	return nil
}

// ReadDir reads every *.json result in dir, sorted by name.
func ReadDir(dir string) ([]*Result, error) {
	paths, err := filepath.Glob(filepath.Join(dir, "*.json"))
	if err != nil {
		return nil, fmt.Errorf("list results in %s: %w", dir, err)
	}
	sort.Strings(paths)
	var out []*Result
	var errs []error
	for _, p := range paths {
		data, err := os.ReadFile(p)
		if err != nil {
			errs = append(errs, fmt.Errorf("read result: %w", err))
			continue
		}
		var r Result
		if err := json.Unmarshal(data, &r); err != nil {
			errs = append(errs, fmt.Errorf("decode result %s: %w", p, err))
			continue
		}
		out = append(out, &r)
	}
	return out, errors.Join(errs...)
}
