package node

import (
	"context"
	"fmt"
	"os"
	"runtime"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/mesh-cni/mesh-cni/test/bench/results"
	"github.com/mesh-cni/mesh-cni/test/harness"
)

// resultName names the node's result file and its section of
// docs/benchmarks.md.
const resultName = "node"

// nodeBench collects what TestNode measured: raw samples, in ms, for the
// report generator (tools/benchreport), which computes every number in
// docs/benchmarks.md from them.
type nodeBench struct {
	mu      sync.Mutex
	start   time.Time
	load    float64
	samples map[string]map[string][]float64 // metric -> variant -> ms
	order   map[string][]string             // metric -> variants, first seen first
	notes   []string
}

func newNodeBench() *nodeBench {
	return &nodeBench{start: time.Now(), load: loadAverage(), samples: map[string]map[string][]float64{}, order: map[string][]string{}}
}

func (b *nodeBench) sample(metric, variant string, d time.Duration) {
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.samples[metric] == nil {
		b.samples[metric] = map[string][]float64{}
	}
	if _, ok := b.samples[metric][variant]; !ok {
		b.order[metric] = append(b.order[metric], variant)
	}
	b.samples[metric][variant] = append(b.samples[metric][variant], float64(d)/float64(time.Millisecond))
}

func (b *nodeBench) note(s string) {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.notes = append(b.notes, s)
}

// summary is the medians of a metric's variants, for the test log.
func (b *nodeBench) summary(metric string) string {
	b.mu.Lock()
	defer b.mu.Unlock()
	var parts []string
	for _, v := range b.order[metric] {
		xs := b.samples[metric][v]
		parts = append(parts, fmt.Sprintf("%s median %.0f ms of %d", v, results.Median(xs), len(xs)))
	}
	return strings.Join(parts, ", ")
}

// metrics describes each metric the scenario samples.
func metrics() []results.Metric {
	return []results.Metric{
		{Name: "gate-release", Title: "Agent ready → a waiting pod Running", Unit: "ms"},
		{Name: "pod-start", Title: "Pod created → Running, in an enrolled namespace and in one that is not", Unit: "ms", Baseline: "unmeshed"},
		{Name: "uninstall", Title: "helm uninstall returned → a new pod of a meshed namespace Running", Unit: "ms"},
	}
}

// write stores the result in $MESH_BENCH_OUT, when it is set (make e2e-node
// sets it; the report then comes from it).
func (b *nodeBench) write(t *testing.T) {
	t.Helper()
	if os.Getenv(results.EnvOut) == "" {
		return
	}
	root, err := harness.ModuleRoot(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	r := &results.Result{
		Name:  resultName,
		Title: "A real node: kubelet, containerd, the DaemonSet",
		Description: "TestNode (test/node) on one node of a real cluster on this machine: kubelet and containerd " +
			"(CRI, runc) with the bridge primary, the agent installed with the commands of docs/install.md. " +
			"**Agent ready → waiting pod Running**: two pods of an enrolled namespace created while the agent was away (its " +
			"DaemonSet's node selector matched no node), " +
			"one with the reference proxy as a sidecar and one without, their ADDs held at the gate (kubelet retries each " +
			"after `gateTimeout` and its back-off; the test removes that node selector again while both are held); from the first " +
			"200 of the agent's `/readyz` (polled every 20 ms) to each pod's phase Running as a watch sees it. " +
			"**Pod created → Running**: the same one-container pod (the echo server, no proxy) in a namespace that is enrolled " +
			"and in one that is not, taking turns, from the create call to phase Running seen by a watch. **helm uninstall → new pod Running**: from `helm uninstall " +
			"--wait` returning (the agent, stopped, uninstalled its node) to a new pod of the meshed namespace Running, no Job run.",
		Command:  "make e2e-node",
		Started:  b.start,
		Finished: time.Now(),
		Env:      results.Env{Kernel: kernel(), CPUs: runtime.NumCPU(), GoVersion: runtime.Version(), LoadStart: b.load, LoadEnd: loadAverage()},
		Notes:    slices.Clone(b.notes),
	}
	for _, m := range metrics() {
		for _, v := range b.order[m.Name] {
			m.Series = append(m.Series, results.Series{Variant: v, Samples: b.samples[m.Name][v]})
		}
		if len(m.Series) > 0 {
			r.Metrics = append(r.Metrics, m)
		}
	}
	if err := results.Write(results.Out(root), r); err != nil {
		t.Fatal(err)
	}
	t.Logf("wrote the node's samples to %s", results.Out(root))
}

func kernel() string {
	var u unix.Utsname
	if err := unix.Uname(&u); err != nil {
		return ""
	}
	return unix.ByteSliceToString(u.Release[:])
}

// loadAverage is the 1-minute load average, 0 if unknown.
func loadAverage() float64 {
	data, err := os.ReadFile("/proc/loadavg")
	if err != nil {
		return 0
	}
	var one float64
	if _, err := fmt.Sscanf(string(data), "%f", &one); err != nil {
		return 0
	}
	return one
}
