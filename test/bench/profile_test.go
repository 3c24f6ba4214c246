package bench

import (
	"context"
	"errors"
	"fmt"
	"net/netip"
	"os"
	"path/filepath"
	"slices"
	"sort"
	"strings"
	"testing"
	"time"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/link"
	"github.com/google/pprof/profile"
	"golang.org/x/sys/unix"

	"github.com/mesh-cni/mesh-cni/test/bench/results"
	"github.com/mesh-cni/mesh-cni/test/fixtures"
	"github.com/mesh-cni/mesh-cni/test/harness"
)

// Profiling wrappers (test/bench/cmd): the agent's and the plugin's own code
// with a CPU profile around it, since neither binary has a profiling flag.
const (
	agentProfPkg  = "github.com/mesh-cni/mesh-cni/test/bench/cmd/mesh-agent-prof"
	pluginProfPkg = "github.com/mesh-cni/mesh-cni/test/bench/cmd/mesh-cni-prof"
	// Environment variables the wrappers read (see their package docs).
	envAgentProfile   = "MESH_BENCH_CPUPROFILE"
	envPluginProfiles = "MESH_BENCH_PLUGIN_PROFILE_DIR"
)

// BenchmarkProfile collects CPU profiles of the agent and of the plugin under
// pod churn, and the eBPF programs' own run time under connection load:
//
//   - agent-add: the agent's whole life while pods are ADDed through the chain
//     one by one and in bursts of 16 (mesh-agent-prof, the agent's command line
//     with pprof around it);
//   - plugin-add: every plugin invocation of those ADDs, merged
//     (mesh-cni-prof, the plugin with pprof around it);
//   - agent-restart: an agent starting with those pods enrolled, until ready;
//   - BPF: run count and run time of each program (BPF_ENABLE_STATS) while an
//     enrolled pod makes connections through the proxies to another.
func BenchmarkProfile(b *testing.B) {
	requireRoot(b)
	ctx := fixtures.Context(b, 30*time.Minute)
	out := outDir(b)
	profDir := profilesDir(b)
	binDir := b.TempDir()
	buildCtx, cancel := context.WithTimeout(ctx, 10*time.Minute)
	err := harness.Build(buildCtx, binDir, map[string]string{"mesh-agent-prof": agentProfPkg, "mesh-cni-prof": pluginProfPkg})
	cancel()
	if err != nil {
		b.Fatal(err)
	}
	pluginDir := b.TempDir()
	b.Setenv(envPluginProfiles, pluginDir)

	res := newResult(b, "profile", "Profiles: agent, plugin and eBPF programs", "BenchmarkProfile",
		"CPU profiles (pprof) of the agent and the plugin while pods are ADDed through the real chain, one at a time and in bursts of 16, "+
			"and of an agent restarting with those pods enrolled. Neither binary has a profiling flag, so the benchmark builds thin wrappers "+
			"(`test/bench/cmd/mesh-agent-prof`, `test/bench/cmd/mesh-cni-prof`) that run the same code (`agentcli.Main`, `cniplugin.Main`) inside "+
			"`pprof.StartCPUProfile`; the plugin's profiles, one per invocation, are merged. A plugin profile starts at `main`: "+
			"exec and the Go runtime's start-up are not in it (the plugin's start is measured in its own section). "+
			"Go's CPU profiler counts a thread's CPU time in user space and in the kernel alike, so time the kernel spends in a system call (such as loading a BPF program, "+
			"which runs the verifier) shows under the Go function that made the call. "+
			"The eBPF programs' cost is measured by the kernel (BPF_ENABLE_STATS, only during that phase) "+
			"while an enrolled client pod makes connections through both proxies to an enrolled server pod; each pod has its own sk_lookup program, "+
			"and the figures for `sk_lookup` add up all of them. The programs' sizes are the kernel's own account (bpf_prog_info: instructions the verifier processed, instructions after the verifier's rewrites).")

	agentProfile := filepath.Join(profDir, "agent-add.pprof")
	// Debug level: the agent then logs each ADD's steps with their times.
	a := newAgent(b, agentOptions{Binary: filepath.Join(binDir, "mesh-agent-prof"), Env: []string{envAgentProfile + "=" + agentProfile}, LogLevel: "debug"})
	if _, _, err := a.start(ctx); err != nil {
		b.Fatal(err)
	}
	node := harness.NewNode(b, harness.NodeOptions{Plugins: append(harness.ReferencePluginNames(), "mesh-cni")})
	if err := os.Symlink(filepath.Join(binDir, "mesh-cni-prof"), filepath.Join(node.BinDir, "mesh-cni-prof")); err != nil {
		b.Fatal(err)
	}
	list := node.Conflist(b, benchNet, a.meshEntry("mesh-cni-prof"))
	ps := newPods(b, node)

	sequential, bursts := size(200, 30), size(8, 2)
	for i := range sequential {
		p, err := ps.create("prof", fmt.Sprintf("seq-%d", i))
		if err != nil {
			b.Fatal(err)
		}
		if _, err := ps.add(ctx, p, list); err != nil {
			b.Fatal(err)
		}
	}
	for r := range bursts {
		if _, err := addConcurrently(ctx, ps, list, concurrentPods, fmt.Sprintf("burst-%d", r)); err != nil {
			b.Fatal(err)
		}
	}

	steps, _ := a.logFields("add timing", 0, "readiness", "lock", "policy", "enroll")
	stepMetric := results.Metric{Name: "agent-add-steps", Title: "Where the agent's time per ADD goes (its debug log)", Unit: "ms"}
	for _, step := range []struct{ name, label string }{
		{"readiness", "waiting for readiness"},
		{"lock", "waiting for the pod's lock"},
		{"policy", "enrollment decision"},
		{"enroll", "data path enrollment and record"},
	} {
		stepMetric.Series = append(stepMetric.Series, results.Series{Variant: step.name, Label: step.label, Samples: secondsToMs(steps[step.name])})
	}
	res.Metrics = append(res.Metrics, stepMetric)

	stats, err := bpfRunStats(ctx, b, node, a, size(3000, 500))
	if err != nil {
		b.Fatal(err)
	}
	res.Metrics = append(res.Metrics, stats...)

	if err := a.stop(ctx); err != nil {
		b.Fatal(err)
	}
	pluginProfile := filepath.Join(profDir, "plugin-add.pprof")
	n, err := mergeProfiles(pluginDir, pluginProfile)
	if err != nil {
		b.Fatal(err)
	}
	res.Notes = append(res.Notes, fmt.Sprintf("%d pods ADDed one at a time and %d in bursts of %d while profiling; %d plugin profiles merged.",
		sequential, bursts*concurrentPods, concurrentPods, n))

	// Restart with the sequential pods still enrolled.
	restartProfile := filepath.Join(profDir, "agent-restart.pprof")
	a.env = []string{envAgentProfile + "=" + restartProfile}
	started, ready, err := a.start(ctx)
	if err != nil {
		b.Fatal(err)
	}
	if err := a.stop(ctx); err != nil {
		b.Fatal(err)
	}
	res.Notes = append(res.Notes, fmt.Sprintf("The restarted agent adopted %d enrolled pods and was ready after %.0f ms.", sequential, ms(ready.Sub(started))))

	adds := sequential + bursts*concurrentPods
	for _, p := range []struct {
		name, title, path, op string
		ops                   int
	}{
		{"agent-add", fmt.Sprintf("mesh-agent during %d pod ADDs (and the bursts' DELs)", adds), agentProfile, "ADD", adds},
		{"plugin-add", fmt.Sprintf("mesh-cni plugin, %d invocations merged (ADDs, and the bursts' DELs)", n), pluginProfile, "invocation", n},
		{"agent-restart", fmt.Sprintf("mesh-agent restarting with %d pods enrolled", sequential), restartProfile, "restart", 1},
	} {
		rel, err := filepath.Rel(out, p.path)
		if err != nil {
			b.Fatal(err)
		}
		res.Profiles = append(res.Profiles, results.Profile{Name: p.name, Title: p.title, File: rel,
			Command: "go tool pprof -http=: " + filepath.Join(results.DefaultOut, rel), Operations: p.ops, Operation: p.op})
	}
	for _, m := range stats {
		for _, s := range m.Series {
			if len(s.Samples) > 0 {
				b.ReportMetric(s.Samples[0], s.Variant+"-"+m.Name)
			}
		}
	}
	report(b, &stepMetric, "enroll", 0, "ms")
	b.ReportMetric(0, "ns/op")
	finish(b, res)
}

// mergeProfiles merges every mesh-cni-*.pprof in dir into out and returns how
// many it merged; empty ones (an invocation that exited early) are skipped.
func mergeProfiles(dir, out string) (int, error) {
	paths, err := filepath.Glob(filepath.Join(dir, "mesh-cni-*.pprof"))
	if err != nil {
		return 0, err
	}
	var profs []*profile.Profile
	for _, p := range paths {
		f, err := os.Open(p)
		if err != nil {
			return 0, fmt.Errorf("open plugin profile: %w", err)
		}
		prof, err := profile.Parse(f)
		f.Close()
		if err != nil {
			continue // an empty file: the invocation exited before writing it
		}
		profs = append(profs, prof)
	}
	if len(profs) == 0 {
		return 0, fmt.Errorf("no plugin profiles in %s", dir)
	}
	merged, err := profile.Merge(profs)
	if err != nil {
		return 0, fmt.Errorf("merge plugin profiles: %w", err)
	}
	f, err := os.Create(out)
	if err != nil {
		return 0, fmt.Errorf("write merged plugin profile: %w", err)
	}
	if err := merged.Write(f); err != nil {
		f.Close()
		return 0, fmt.Errorf("write merged plugin profile: %w", err)
	}
	return len(profs), f.Close()
}

// bpfRunStats makes connections cycles from an enrolled client pod through both
// pods' proxies to an enrolled server pod with the kernel's BPF run-time
// statistics on, and returns each attached program's run time per run and per
// connection. The statistics are global while enabled, so they are on only for
// this phase.
func bpfRunStats(ctx context.Context, b *testing.B, node *harness.Node, a *agent, cycles int) ([]results.Metric, error) {
	chain := node.Conflist(b, benchNet, a.meshEntry("mesh-cni"))
	spawn := newSpawner(b)
	cp := node.NewPod(b, "prof", "client")
	sp := node.NewPod(b, "prof", "server")
	for _, p := range []*harness.Pod{cp, sp} {
		if _, err := node.Add(ctx, p, chain); err != nil {
			return nil, err
		}
		startRefproxy(ctx, b, spawn, p)
	}
	serveApp(b, sp, appPort)
	c := client{netns: cp.NetNSPath, target: netip.AddrPortFrom(sp.IPv4(b), appPort)}
	// Warm up (first connections fault in the proxies' and programs' pages).
	if _, _, err := c.cycles(ctx, 50); err != nil {
		return nil, err
	}

	closer, err := ebpf.EnableStats(uint32(unix.BPF_STATS_RUN_TIME))
	if err != nil {
		return nil, fmt.Errorf("enable BPF run-time statistics: %w", err)
	}
	defer closer.Close()
	progs, err := attachedPrograms(a)
	if err != nil {
		return nil, err
	}
	defer func() {
		for _, p := range progs {
			p.prog.Close()
		}
	}()
	before := make([]ebpf.ProgramStats, len(progs))
	for i, p := range progs {
		s, err := p.prog.Stats()
		if err != nil {
			return nil, fmt.Errorf("stats of %s: %w", p.name, err)
		}
		before[i] = *s
	}
	if _, _, err := c.cycles(ctx, cycles); err != nil {
		return nil, err
	}
	perRun := results.Metric{Name: "bpf-ns-per-run", Title: "eBPF program run time per run", Unit: "ns"}
	perConn := results.Metric{Name: "bpf-ns-per-conn", Title: "eBPF program run time per connection (all runs ÷ connections made)", Unit: "ns"}
	runs := results.Metric{Name: "bpf-runs-per-conn", Title: "eBPF program runs per connection", Unit: "runs"}
	verified := results.Metric{Name: "bpf-verified-insns", Title: "eBPF programs: instructions the verifier processed at load (one program; sk_lookup: each pod's)", Unit: "insns"}
	xlated := results.Metric{Name: "bpf-xlated-insns", Title: "eBPF programs: instructions after the verifier's rewrites", Unit: "insns"}
	// Several programs share a name (every pod has its own sk_lookup
	// program): their runs and run time add up.
	type total struct{ runs, ns uint64 }
	totals := map[string]*total{}
	var names []string
	for i, p := range progs {
		s, err := p.prog.Stats()
		if err != nil {
			return nil, fmt.Errorf("stats of %s: %w", p.name, err)
		}
		t := totals[p.name]
		if t == nil {
			t = &total{}
			totals[p.name] = t
			names = append(names, p.name)
			if info, err := p.prog.Info(); err == nil {
				if n, ok := info.VerifiedInstructions(); ok {
					verified.Series = append(verified.Series, results.Series{Variant: p.name, Samples: []float64{float64(n)}})
				}
				if n, err := info.TranslatedSize(); err == nil {
					xlated.Series = append(xlated.Series, results.Series{Variant: p.name, Samples: []float64{float64(n) / 8}})
				}
			}
		}
		t.runs += s.RunCount - before[i].RunCount
		t.ns += uint64(s.Runtime - before[i].Runtime)
	}
	// The shared decision program every pod's sk_lookup program tail-calls:
	// verified once, when the data path loads. A tail-called program has no
	// run statistics of its own (the kernel counts the run, tail calls
	// included, to the program it entered), so only its size is reported.
	if main, err := tailCallTarget(a, "lookup_main"); err == nil {
		if info, err := main.Info(); err == nil {
			if n, ok := info.VerifiedInstructions(); ok {
				verified.Series = append(verified.Series, results.Series{Variant: "sk_lookup_main", Label: "shared, tail-called", Samples: []float64{float64(n)}})
			}
			if n, err := info.TranslatedSize(); err == nil {
				xlated.Series = append(xlated.Series, results.Series{Variant: "sk_lookup_main", Label: "shared, tail-called", Samples: []float64{float64(n) / 8}})
			}
		}
		main.Close()
	} else if !errors.Is(err, os.ErrNotExist) {
		return nil, err
	}
	for _, name := range names {
		t := totals[name]
		if t.runs == 0 {
			continue
		}
		perRun.Series = append(perRun.Series, results.Series{Variant: name, Samples: []float64{float64(t.ns) / float64(t.runs)}})
		perConn.Series = append(perConn.Series, results.Series{Variant: name, Samples: []float64{float64(t.ns) / float64(cycles)}})
		runs.Series = append(runs.Series, results.Series{Variant: name, Samples: []float64{float64(t.runs) / float64(cycles)}})
	}
	return []results.Metric{perRun, perConn, runs, verified, xlated}, nil
}

// tailCallTarget opens the program in slot 0 of the agent's pinned program
// array maps/<name>.
func tailCallTarget(a *agent, name string) (*ebpf.Program, error) {
	m, err := ebpf.LoadPinnedMap(filepath.Join(a.BPFFS, "maps", name), &ebpf.LoadPinOptions{ReadOnly: true})
	if err != nil {
		return nil, fmt.Errorf("open program array %s: %w", name, err)
	}
	defer m.Close()
	var id uint32
	if err := m.Lookup(uint32(0), &id); err != nil {
		return nil, fmt.Errorf("program array %s, slot 0: %w", name, err)
	}
	p, err := ebpf.NewProgramFromID(ebpf.ProgramID(id))
	if err != nil {
		return nil, fmt.Errorf("program %d of %s: %w", id, name, err)
	}
	return p, nil
}

type namedProgram struct {
	name string
	prog *ebpf.Program
}

// attachedPrograms opens the programs behind the agent's pinned links: the
// cgroup hooks (links/<hook>) and the pods' sk_lookup links
// (pods/<cookie>/lookup_<netns inode>), each distinct program once. Every pod
// has a program of its own (its netns cookie is built in), so several
// programs are named sk_lookup.
func attachedPrograms(a *agent) ([]namedProgram, error) {
	var pins []struct{ name, path string }
	cg, err := os.ReadDir(filepath.Join(a.BPFFS, "links"))
	if err != nil {
		return nil, fmt.Errorf("list pinned links: %w", err)
	}
	for _, e := range cg {
		pins = append(pins, struct{ name, path string }{e.Name(), filepath.Join(a.BPFFS, "links", e.Name())})
	}
	pods, err := os.ReadDir(filepath.Join(a.BPFFS, "pods"))
	if err != nil {
		return nil, fmt.Errorf("list pinned pods: %w", err)
	}
	for _, pod := range pods {
		links, err := os.ReadDir(filepath.Join(a.BPFFS, "pods", pod.Name()))
		if err != nil {
			return nil, fmt.Errorf("list pod pins: %w", err)
		}
		for _, l := range links {
			if !strings.HasPrefix(l.Name(), "lookup_") {
				return nil, fmt.Errorf("unexpected pin %s of pod %s: not an sk_lookup link", l.Name(), pod.Name())
			}
			pins = append(pins, struct{ name, path string }{"sk_lookup", filepath.Join(a.BPFFS, "pods", pod.Name(), l.Name())})
		}
	}
	seen := map[ebpf.ProgramID]bool{}
	var out []namedProgram
	var errs []error
	for _, pin := range pins {
		l, err := link.LoadPinnedLink(pin.path, nil)
		if err != nil {
			errs = append(errs, fmt.Errorf("load pinned link %s: %w", pin.path, err))
			continue
		}
		info, err := l.Info()
		l.Close()
		if err != nil {
			errs = append(errs, fmt.Errorf("info of link %s: %w", pin.path, err))
			continue
		}
		if seen[info.Program] {
			continue
		}
		seen[info.Program] = true
		prog, err := ebpf.NewProgramFromID(info.Program)
		if err != nil {
			errs = append(errs, fmt.Errorf("open program of %s: %w", pin.path, err))
			continue
		}
		out = append(out, namedProgram{name: pin.name, prog: prog})
	}
	sort.SliceStable(out, func(i, j int) bool { return out[i].name < out[j].name })
	if err := errors.Join(errs...); err != nil {
		for _, p := range out {
			p.prog.Close()
		}
		return nil, err
	}
	return slices.Clip(out), nil
}

// profilesDir is the results directory's folder of profiles, made if need be.
func profilesDir(b *testing.B) string {
	b.Helper()
	dir := filepath.Join(outDir(b), "profiles")
	if err := os.MkdirAll(dir, 0o755); err != nil {
		b.Fatal(err)
	}
	return dir
}
