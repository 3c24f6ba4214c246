// Command mesh-cni-prof is the mesh-cni plugin with a CPU profile, for the
// benchmarks (test/bench BenchmarkProfile). It runs the same code as
// cmd/mesh-cni (cniplugin.Main) and, when $MESH_BENCH_PLUGIN_PROFILE_DIR names a
// directory, writes one CPU profile per invocation there (mesh-cni-*.pprof),
// for the benchmark to merge. A runtime passes its environment on to plugins,
// so setting the variable in the process that runs libcni is enough.
//
// The profile covers main: the Go runtime's start-up and the exec before it
// are not in it. An invocation that fails exits from inside the CNI library
// and leaves an empty profile behind.
package main

import (
	"fmt"
	"os"
	"runtime"
	"runtime/pprof"

	"github.com/mesh-cni/mesh-cni/internal/cniplugin"
)

// envProfileDir names the directory the profiles go to.
const envProfileDir = "MESH_BENCH_PLUGIN_PROFILE_DIR"

// sampleHz is the sampling rate: one invocation uses a few milliseconds of CPU,
// which pprof's default of 100 Hz would mostly miss.
const sampleHz = 1000

func main() {
	dir := os.Getenv(envProfileDir)
	if dir == "" {
		cniplugin.Main()
		return
	}
	f, err := os.CreateTemp(dir, "mesh-cni-*.pprof")
	if err != nil {
		// Profiling is the benchmark's business; the plugin still runs.
		fmt.Fprintf(os.Stderr, "mesh-cni-prof: %s: %v\n", envProfileDir, err)
		cniplugin.Main()
		return
	}
	// sampleHz instead of pprof's 100 Hz (see sampleHz); the runtime then
	// complains once on stderr that the rate is already set, and keeps it.
	runtime.SetCPUProfileRate(sampleHz)
	if err := pprof.StartCPUProfile(f); err != nil {
		fmt.Fprintf(os.Stderr, "mesh-cni-prof: start CPU profile: %v\n", err)
	}
	cniplugin.Main()
	pprof.StopCPUProfile()
	if err := f.Close(); err != nil {
		fmt.Fprintf(os.Stderr, "mesh-cni-prof: write CPU profile: %v\n", err)
	}
}
