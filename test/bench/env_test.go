package bench

import (
	"bufio"
	"context"
	"fmt"
	"os"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/mesh-cni/mesh-cni/test/bench/results"
	"github.com/mesh-cni/mesh-cni/test/harness"
)

// envQuick names the environment variable that selects the quick development
// mode: the same code paths with a fraction of the samples (and at most 100 pods
// for the scale benchmark), for checking that everything runs end to end.
const envQuick = "MESH_BENCH_QUICK"

// envFleetLevels names the environment variable that replaces BenchmarkFleet's
// fleet sizes: comma-separated, e.g. "10" (istio-cni's side runs at the first).
const envFleetLevels = "MESH_BENCH_FLEET_LEVELS"

// quickMode reports whether MESH_BENCH_QUICK is set to something true.
func quickMode() bool {
	v, err := strconv.ParseBool(os.Getenv(envQuick))
	return err == nil && v
}

// size picks the full or the quick value of a sample count.
func size(full, quick int) int {
	if quickMode() {
		return quick
	}
	return full
}

func requireRoot(b testing.TB) {
	b.Helper()
	if os.Geteuid() != 0 {
		b.Fatal("the benchmarks make network namespaces, load BPF and run CNI plugins: run them as root")
	}
}

// reproduce is the command that measures one benchmark again and regenerates
// the report, run as root from the module root.
func reproduce(bench string) string {
	return fmt.Sprintf("make build && MESH_CNI_BIN_DIR=$PWD/bin go test -run '^$' -bench '^%s$' -benchtime 1x -timeout 60m ./test/bench/ && go run ./tools/cmd/benchreport", bench)
}

// loadInterval is how often the load average is read while a benchmark runs.
const loadInterval = 5 * time.Second

// run is a benchmark's result being measured, with the sampler that records
// the machine's load meanwhile.
type run struct {
	*results.Result
	stopLoad func() []float64
}

// newResult starts a benchmark's result and its load sampler; finish writes it.
func newResult(b *testing.B, name, title, bench, description string) *run {
	r := &run{Result: &results.Result{
		Name:        name,
		Title:       title,
		Description: description,
		Command:     reproduce(bench),
		Quick:       quickMode(),
		Started:     time.Now().UTC(),
		Env:         machineEnv(),
	}}
	r.stopLoad = sampleLoad(b.Context(), loadInterval)
	// A benchmark that fails before finish still stops its sampler.
	b.Cleanup(func() { r.stopLoad() })
	return r
}

// sampleLoad reads the 1-minute load average every interval until the returned
// function is called, which returns the readings. Calling it again returns
// the same readings.
func sampleLoad(ctx context.Context, interval time.Duration) func() []float64 {
	ctx, cancel := context.WithCancel(ctx)
	done := make(chan []float64, 1)
	go func() {
		var samples []float64
		t := time.NewTicker(interval)
		defer t.Stop()
		for {
			select {
			case <-ctx.Done():
				done <- samples
				return
			case <-t.C:
				if l, err := readLoadAvg(); err == nil {
					samples = append(samples, l.One)
				}
			}
		}
	}()
	var once sync.Once
	var samples []float64
	return func() []float64 {
		once.Do(func() {
			cancel()
			samples = <-done
		})
		return samples
	}
}

// finish stamps r and writes it to the results directory.
func finish(b *testing.B, r *run) {
	b.Helper()
	r.Finished = time.Now().UTC()
	r.Env.LoadEnd = loadAvg()
	if l, err := readLoadAvg(); err == nil {
		r.Env.UptimeEnd = &l
	}
	r.Env.LoadSamples, r.Env.LoadInterval = r.stopLoad(), loadInterval
	dir := outDir(b)
	if err := results.Write(dir, r.Result); err != nil {
		b.Fatal(err)
	}
	b.Logf("wrote %s/%s.json", dir, r.Name)
}

// outDir is the results directory: $MESH_BENCH_OUT, or bin/bench in the module.
func outDir(b *testing.B) string {
	b.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	root, err := harness.ModuleRoot(ctx)
	if err != nil {
		b.Fatal(err)
	}
	return results.Out(root)
}

func machineEnv() results.Env {
	env := results.Env{CPUs: runtime.NumCPU(), GoVersion: runtime.Version(), LoadStart: loadAvg()}
	if l, err := readLoadAvg(); err == nil {
		env.UptimeStart = &l
	}
	var u unix.Utsname
	if err := unix.Uname(&u); err == nil {
		env.Kernel = unix.ByteSliceToString(u.Release[:])
	}
	if f, err := os.Open("/proc/cpuinfo"); err == nil {
		defer f.Close()
		sc := bufio.NewScanner(f)
		for sc.Scan() {
			if k, v, ok := strings.Cut(sc.Text(), ":"); ok && strings.TrimSpace(k) == "model name" {
				env.CPUModel = strings.TrimSpace(v)
				break
			}
		}
	}
	return env
}

// loadAvg is the 1-minute load average, 0 if unknown.
func loadAvg() float64 {
	l, err := readLoadAvg()
	if err != nil {
		return 0
	}
	return l.One
}

// readLoadAvg reads /proc/loadavg: "0.50 0.60 0.70 2/345 1234".
func readLoadAvg() (results.LoadAvg, error) {
	data, err := os.ReadFile("/proc/loadavg")
	if err != nil {
		return results.LoadAvg{}, fmt.Errorf("read load average: %w", err)
	}
	var l results.LoadAvg
	if _, err := fmt.Sscanf(string(data), "%f %f %f %d/%d", &l.One, &l.Five, &l.Fifteen, &l.Running, &l.Threads); err != nil {
		return results.LoadAvg{}, fmt.Errorf("parse /proc/loadavg %q: %w", strings.TrimSpace(string(data)), err)
	}
	return l, nil
}

// ms converts a duration to float milliseconds.
func ms(d time.Duration) float64 { return float64(d) / float64(time.Millisecond) }

// us converts a duration to float microseconds.
func us(d time.Duration) float64 { return float64(d) / float64(time.Microsecond) }

// report puts a series' median and tail into the benchmark's output line.
func report(b *testing.B, m *results.Metric, variant string, x float64, unit string) {
	s := m.Find(variant, x)
	if s == nil || len(s.Samples) == 0 {
		return
	}
	sum := results.Summarize(s.Samples, m.HigherIsBetter)
	tail := "p99"
	if m.HigherIsBetter {
		tail = "p1"
	}
	b.ReportMetric(sum.Median, variant+"-p50-"+unit)
	b.ReportMetric(sum.Tail, variant+"-"+tail+"-"+unit)
}

// reportRatio puts the paired ratio variant/baseline into the output line,
// its unit prefixed with prefix (to tell configurations apart).
func reportRatio(b *testing.B, m *results.Metric, prefix, variant, baseline string) {
	if r, ok := results.PairedRatio(m.Find(variant, 0), m.Find(baseline, 0)); ok {
		b.ReportMetric(r, prefix+variant+"/"+baseline)
	}
}

// secondsToMs converts seconds (as zap logs durations) to milliseconds.
func secondsToMs(s []float64) []float64 {
	out := make([]float64, len(s))
	for i, v := range s {
		out[i] = v * 1000
	}
	return out
}
