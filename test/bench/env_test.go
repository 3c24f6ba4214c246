package bench

import (
	"bufio"
	"context"
	"fmt"
	"os"
	"runtime"
	"strconv"
	"strings"
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

// benchContext bounds a whole benchmark.
func benchContext(b *testing.B, d time.Duration) context.Context {
	ctx, cancel := context.WithTimeout(b.Context(), d)
	b.Cleanup(cancel)
	return ctx
}

func requireRoot(b *testing.B) {
	b.Helper()
	if os.Geteuid() != 0 {
		b.Fatal("the benchmarks make network namespaces, load BPF and run CNI plugins: run them as root")
	}
}

// reproduce is the command that measures one benchmark again and regenerates
// the report, run as root from the module root.
func reproduce(bench string) string {
	return fmt.Sprintf("make build && MESH_CNI_BIN_DIR=$PWD/bin go test -run '^$' -bench '^%s$' -benchtime 1x -timeout 60m ./test/bench/ && go run ./test/bench/cmd/benchreport", bench)
}

// newResult starts a benchmark's result; finish writes it.
func newResult(name, title, bench, description string) *results.Result {
	return &results.Result{
		Name:        name,
		Title:       title,
		Description: description,
		Command:     reproduce(bench),
		Quick:       quickMode(),
		Started:     time.Now().UTC(),
		Env:         machineEnv(),
	}
}

// finish stamps r and writes it to the results directory.
func finish(b *testing.B, r *results.Result) {
	b.Helper()
	r.Finished = time.Now().UTC()
	r.Env.LoadEnd = loadAvg()
	dir := outDir(b)
	if err := results.Write(dir, r); err != nil {
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
	data, err := os.ReadFile("/proc/loadavg")
	if err != nil {
		return 0
	}
	fields := strings.Fields(string(data))
	if len(fields) == 0 {
		return 0
	}
	v, err := strconv.ParseFloat(fields[0], 64)
	if err != nil {
		return 0
	}
	return v
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
