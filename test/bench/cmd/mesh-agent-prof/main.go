// Command mesh-agent-prof is mesh-agent with a CPU profile, for the benchmarks
// (test/bench BenchmarkProfile): mesh-agent itself has no profiling flag. It
// runs the same command line (agentcli.Main, exactly as cmd/mesh-agent does)
// and, when $MESH_BENCH_CPUPROFILE names a file, profiles the whole run into it,
// written when the agent exits (SIGTERM or SIGINT stop it cleanly).
package main

import (
	"context"
	"fmt"
	"os"
	"os/signal"
	"runtime"
	"runtime/pprof"
	"syscall"

	"github.com/mesh-cni/mesh-cni/internal/agentcli"
)

// envProfile names the file the CPU profile is written to.
const envProfile = "MESH_BENCH_CPUPROFILE"

// sampleHz is the sampling rate: the agent spends a few milliseconds of CPU per
// pod, which pprof's default of 100 Hz resolves poorly.
const sampleHz = 1000

func main() {
	os.Exit(run())
}

func run() int {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	if path := os.Getenv(envProfile); path != "" {
		f, err := os.Create(path)
		if err != nil {
			fmt.Fprintf(os.Stderr, "mesh-agent-prof: %s: %v\n", envProfile, err)
			return 1
		}
		// sampleHz instead of pprof's 100 Hz (see sampleHz); the runtime then
		// complains once on stderr that the rate is already set, and keeps it.
		runtime.SetCPUProfileRate(sampleHz)
		if err := pprof.StartCPUProfile(f); err != nil {
			fmt.Fprintf(os.Stderr, "mesh-agent-prof: start CPU profile: %v\n", err)
			f.Close()
			return 1
		}
		defer func() {
			pprof.StopCPUProfile()
			if err := f.Close(); err != nil {
				fmt.Fprintf(os.Stderr, "mesh-agent-prof: write CPU profile: %v\n", err)
			}
		}()
	}
	return agentcli.Main(ctx, os.Args[1:], os.Stdout, os.Stderr)
}
