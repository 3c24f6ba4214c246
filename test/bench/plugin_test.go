package bench

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/containernetworking/cni/libcni"
	"github.com/containernetworking/cni/pkg/types"

	"github.com/mesh-cni/mesh-cni/test/bench/results"
	"github.com/mesh-cni/mesh-cni/test/fixtures"
	"github.com/mesh-cni/mesh-cni/test/harness"
)

// BenchmarkPlugin measures the plugin's own share of a pod's ADD against the
// no-op chained plugin (tuning with nothing to tune), each binary exec'd by
// the benchmark as libcni execs it (CNI environment, config on stdin), so the
// kernel's account of the child's CPU time (rusage) comes with every wall
// time:
//
//   - exec-version: CNI VERSION, which every plugin answers without doing
//     anything: exec, the Go runtime's start, package initialization, answer.
//   - plugin-add: the chained step of a pod's ADD alone (prevResult from an
//     untimed bridge ADD): tuning; mesh-cni with an agent that runs the gate
//     without a data path; mesh-cni with the eBPF agent.
//   - init: the Go runtime's own account of package initialization
//     (GODEBUG=inittrace=1) per VERSION run.
//   - binary-size: the binaries' sizes on disk.
func BenchmarkPlugin(b *testing.B) {
	requireRoot(b)
	ctx := fixtures.Context(b, 20*time.Minute)
	res := newResult(b, "plugin", "The plugin's own share: process start and gate round trip", "BenchmarkPlugin",
		"The chained plugin's step of a pod's ADD on its own, against the no-op chained plugin (`tuning` with nothing to tune) and the bridge plugin. "+
			"Each binary is exec'd by the benchmark the way libcni execs a plugin (the CNI environment variables, the config with prevResult on stdin, from the node's network namespace), "+
			"so the kernel's account of the child's CPU time (user + system, from wait4's rusage) comes with each wall time (fork → exit reaped). "+
			"`exec-version` is CNI VERSION, which each plugin answers without any work: exec, the Go runtime's start, package initialization, one line of output. "+
			"`plugin-add` is the chained step of an ADD with the bridge's result as prevResult (the bridge ADD before it is not timed): "+
			"`tuning`; `mesh-cni` against an agent with `--datapath none` (config parsing, the gate dial and call, an agent that only decides and records); "+
			"`mesh-cni` against the eBPF agent (the same plus the pod's enrollment). "+
			"`init` is the Go runtime's own report of package initialization (GODEBUG=inittrace=1: the sum of every package's init clock time in one VERSION run). "+
			"Variants take turns in every round, in rotating order.")

	gateAgent := newAgent(b, agentOptions{Datapath: "none"})
	ebpfAgent := newAgent(b, agentOptions{})
	for _, a := range []*agent{gateAgent, ebpfAgent} {
		if _, _, err := a.start(ctx); err != nil {
			b.Fatal(err)
		}
	}
	node := harness.NewNode(b, harness.NodeOptions{Plugins: append(harness.ReferencePluginNames(), "mesh-cni")})
	ps := newPods(b, node)
	bin := func(name string) string { return filepath.Join(node.BinDir, name) }

	sizes := results.Metric{Name: "binary-size", Title: "Plugin binary size on disk", Unit: "MiB", Baseline: "tuning"}
	for _, name := range []string{"tuning", "bridge", "mesh-cni"} {
		st, err := os.Stat(bin(name))
		if err != nil {
			b.Fatal(err)
		}
		sizes.Series = append(sizes.Series, results.Series{Variant: name, Samples: []float64{float64(st.Size()) / (1 << 20)}})
	}
	res.Metrics = append(res.Metrics, sizes)

	// keepTimes keeps a sub-benchmark's wall and CPU times and reports the
	// wall time of variant against the no-op plugin's.
	keepTimes := func(b *testing.B, wall, cpu results.Metric, err error, prefix, variant string) {
		b.Helper()
		if err != nil {
			b.Fatal(err)
		}
		res.Metrics = append(res.Metrics, wall, cpu)
		reportRatio(b, &wall, prefix, variant, "tuning")
		b.ReportMetric(0, "ns/op")
	}
	b.Run("exec-version", func(b *testing.B) {
		wall, cpu, err := benchExecVersion(ctx, node, []string{"tuning", "bridge", "mesh-cni"}, size(300, 30))
		keepTimes(b, wall, cpu, err, "version:", "mesh-cni")
	})
	b.Run("plugin-add", func(b *testing.B) {
		steps := []pluginStep{
			{name: "tuning", label: "tuning (no-op)", plugin: "tuning", entry: noopEntry()},
			{name: "mesh-gate", label: "mesh-cni, agent --datapath none", plugin: "mesh-cni", entry: gateAgent.meshEntry("mesh-cni")},
			{name: "mesh", label: "mesh-cni, eBPF agent", plugin: "mesh-cni", entry: ebpfAgent.meshEntry("mesh-cni")},
		}
		for i := range steps {
			steps[i].list = node.Conflist(b, benchNet, steps[i].entry)
		}
		wall, cpu, err := benchPluginAdd(ctx, ps, node, node.Conflist(b, benchNet), steps, size(300, 20))
		keepTimes(b, wall, cpu, err, "add:", "mesh-gate")
	})
	b.Run("init", func(b *testing.B) {
		m, notes, err := benchInitTrace(ctx, node, []string{"tuning", "mesh-cni"}, size(100, 10))
		if err != nil {
			b.Fatal(err)
		}
		res.Metrics = append(res.Metrics, m...)
		res.Notes = append(res.Notes, notes...)
		b.ReportMetric(0, "ns/op")
	})
	finish(b, res)
}

// execResult is one plugin process: its wall time from fork to reaped exit and
// the CPU time the kernel charged it.
type execResult struct {
	wall, cpu time.Duration
	stdout    []byte
	stderr    []byte
}

// execPlugin runs a plugin binary the way libcni does (its environment plus
// the CNI variables, stdin the config) on the calling thread's network
// namespace and times it.
func execPlugin(ctx context.Context, path string, env []string, stdin []byte) (execResult, error) {
	cmd := exec.CommandContext(ctx, path)
	cmd.Env = append(os.Environ(), env...)
	cmd.Stdin = bytes.NewReader(stdin)
	var stdout, stderr bytes.Buffer
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	start := time.Now()
	err := cmd.Run()
	wall := time.Since(start)
	r := execResult{wall: wall, stdout: stdout.Bytes(), stderr: stderr.Bytes()}
	if cmd.ProcessState != nil {
		if ru, ok := cmd.ProcessState.SysUsage().(*syscall.Rusage); ok {
			r.cpu = time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
		}
	}
	if err != nil {
		return r, fmt.Errorf("%s: %w: %s%s", filepath.Base(path), err, bytes.TrimSpace(stdout.Bytes()), bytes.TrimSpace(stderr.Bytes()))
	}
	return r, nil
}

// benchExecVersion runs CNI VERSION of each plugin n times, the plugins taking
// turns in rotating order, from the node's network namespace.
func benchExecVersion(ctx context.Context, node *harness.Node, plugins []string, n int) (wall, cpu results.Metric, err error) {
	wall = results.Metric{Name: "exec-version", Title: "Starting a plugin: CNI VERSION, exec → exit (wall)", Unit: "ms", Baseline: "tuning"}
	cpu = results.Metric{Name: "exec-version-cpu", Title: "Starting a plugin: CNI VERSION, CPU time of the process (user + system)", Unit: "ms", Baseline: "tuning"}
	for _, p := range plugins {
		wall.Series = append(wall.Series, results.Series{Variant: p})
		cpu.Series = append(cpu.Series, results.Series{Variant: p})
	}
	stdin := []byte(`{"cniVersion":"` + harness.CNIVersion + `"}`)
	err = node.Do(func() error {
		for i := range n {
			for k := range plugins {
				j := (i + k) % len(plugins)
				r, err := execPlugin(ctx, filepath.Join(node.BinDir, plugins[j]), []string{"CNI_COMMAND=VERSION"}, stdin)
				if err != nil {
					return err
				}
				addSample(&wall.Series[j], ms(r.wall))
				addSample(&cpu.Series[j], ms(r.cpu))
			}
		}
		return nil
	})
	return wall, cpu, err
}

func addSample(s *results.Series, v float64) {
	s.Samples = append(s.Samples, v)
	s.Rounds = append(s.Rounds, v)
}

// pluginStep is one chained plugin whose ADD step is timed on its own.
type pluginStep struct {
	name, label, plugin string
	entry               map[string]any
	// list is [bridge, entry]: the chain a pod is DELeted through afterwards.
	list *libcni.NetworkConfigList
}

// benchPluginAdd times n ADD steps of each plugin, taking turns in rotating
// order: per step a new pod, ADDed through [bridge] (not timed), then the
// plugin exec'd with the bridge's result as prevResult (timed), then DEL
// through the whole chain and the pod removed.
func benchPluginAdd(ctx context.Context, ps *pods, node *harness.Node, bridgeOnly *libcni.NetworkConfigList, steps []pluginStep, n int) (wall, cpu results.Metric, err error) {
	wall = results.Metric{Name: "plugin-add", Title: "The chained plugin's ADD step alone, exec → exit (wall)", Unit: "ms", Baseline: "tuning"}
	cpu = results.Metric{Name: "plugin-add-cpu", Title: "The chained plugin's ADD step alone, CPU time of the process (user + system)", Unit: "ms", Baseline: "tuning"}
	for _, s := range steps {
		wall.Series = append(wall.Series, results.Series{Variant: s.name, Label: s.label})
		cpu.Series = append(cpu.Series, results.Series{Variant: s.name, Label: s.label})
	}
	for i := range n {
		for k := range steps {
			j := (i + k) % len(steps)
			r, err := pluginAddOnce(ctx, ps, node, bridgeOnly, steps[j], fmt.Sprintf("step-%s-%d", steps[j].name, i))
			if err != nil {
				return wall, cpu, err
			}
			addSample(&wall.Series[j], ms(r.wall))
			addSample(&cpu.Series[j], ms(r.cpu))
		}
	}
	return wall, cpu, nil
}

func pluginAddOnce(ctx context.Context, ps *pods, node *harness.Node, bridgeOnly *libcni.NetworkConfigList, step pluginStep, name string) (execResult, error) {
	p, err := ps.create("bench", name)
	if err != nil {
		return execResult{}, err
	}
	r, err := func() (execResult, error) {
		prev, err := addBridge(ctx, ps, p, bridgeOnly)
		if err != nil {
			return execResult{}, err
		}
		stdin, err := stepConfig(step.entry, prev)
		if err != nil {
			return execResult{}, err
		}
		// From here on the pod is DELeted through the plugin too.
		p.Attached = []*libcni.NetworkConfigList{step.list}
		var r execResult
		err = node.Do(func() error {
			var err error
			r, err = execPlugin(ctx, filepath.Join(node.BinDir, step.plugin), cniEnv("ADD", p, node.BinDir), stdin)
			return err
		})
		return r, err
	}()
	return r, errors.Join(err, ps.remove(ctx, p))
}

// stepConfig is a plugin entry as libcni hands it to the plugin in a chain:
// the network's name and version, and the previous plugin's result.
func stepConfig(entry map[string]any, prev types.Result) ([]byte, error) {
	conf := map[string]any{}
	for k, v := range entry {
		conf[k] = v
	}
	conf["cniVersion"] = harness.CNIVersion
	conf["name"] = benchNet
	conf["prevResult"] = prev
	raw, err := json.Marshal(conf)
	if err != nil {
		return nil, fmt.Errorf("encode plugin config: %w", err)
	}
	return raw, nil
}

// cniEnv is the environment libcni gives a plugin for cmd on pod p.
func cniEnv(cmd string, p *pod, binDir string) []string {
	var args []string
	for _, kv := range p.rt.Args {
		args = append(args, kv[0]+"="+kv[1])
	}
	return []string{
		"CNI_COMMAND=" + cmd,
		"CNI_CONTAINERID=" + p.rt.ContainerID,
		"CNI_NETNS=" + p.rt.NetNS,
		"CNI_IFNAME=" + p.rt.IfName,
		"CNI_ARGS=" + strings.Join(args, ";"),
		"CNI_PATH=" + binDir,
	}
}

// benchInitTrace runs CNI VERSION of each plugin n times with
// GODEBUG=inittrace=1 and returns the sum of the package init clock times per
// run, the number of packages initialized, and a note naming the packages
// with the largest median init time in the last plugin.
func benchInitTrace(ctx context.Context, node *harness.Node, plugins []string, n int) ([]results.Metric, []string, error) {
	total := results.Metric{Name: "init-total", Title: "Package initialization per VERSION run (GODEBUG=inittrace=1: sum of init clock times)", Unit: "ms", Baseline: "tuning"}
	count := results.Metric{Name: "init-packages", Title: "Packages with init work per run (GODEBUG=inittrace=1 lines)", Unit: "packages", Baseline: "tuning"}
	perPkg := make([]map[string][]float64, len(plugins))
	for j, p := range plugins {
		total.Series = append(total.Series, results.Series{Variant: p})
		count.Series = append(count.Series, results.Series{Variant: p})
		perPkg[j] = map[string][]float64{}
	}
	stdin := []byte(`{"cniVersion":"` + harness.CNIVersion + `"}`)
	err := node.Do(func() error {
		for i := range n {
			for k := range plugins {
				j := (i + k) % len(plugins)
				r, err := execPlugin(ctx, filepath.Join(node.BinDir, plugins[j]), []string{"CNI_COMMAND=VERSION", "GODEBUG=inittrace=1"}, stdin)
				if err != nil {
					return err
				}
				inits, err := parseInitTrace(r.stderr)
				if err != nil {
					return fmt.Errorf("%s: %w", plugins[j], err)
				}
				var sum float64
				for pkg, v := range inits {
					sum += v
					perPkg[j][pkg] = append(perPkg[j][pkg], v)
				}
				addSample(&total.Series[j], sum)
				addSample(&count.Series[j], float64(len(inits)))
			}
		}
		return nil
	})
	if err != nil {
		return nil, nil, err
	}
	var notes []string
	for j, p := range plugins {
		type pkgTime struct {
			name string
			ms   float64
		}
		var top []pkgTime
		for pkg, v := range perPkg[j] {
			top = append(top, pkgTime{pkg, results.Median(v)})
		}
		slices.SortFunc(top, func(a, b pkgTime) int {
			if a.ms != b.ms {
				if a.ms > b.ms {
					return -1
				}
				return 1
			}
			return strings.Compare(a.name, b.name)
		})
		var parts []string
		for _, t := range top[:min(6, len(top))] {
			parts = append(parts, fmt.Sprintf("`%s` %.3f ms", t.name, t.ms))
		}
		notes = append(notes, fmt.Sprintf("Largest package inits of `%s` (median over %d runs): %s.", p, n, strings.Join(parts, ", ")))
	}
	return []results.Metric{total, count}, notes, nil
}

// parseInitTrace reads GODEBUG=inittrace=1 output: one line per package,
// "init <pkg> @<t> ms, <clock> ms clock, <bytes> bytes, <allocs> allocs".
func parseInitTrace(stderr []byte) (map[string]float64, error) {
	out := map[string]float64{}
	sc := bufio.NewScanner(bytes.NewReader(stderr))
	for sc.Scan() {
		f := strings.Fields(sc.Text())
		if len(f) < 7 || f[0] != "init" || f[6] != "clock," {
			continue
		}
		v, err := strconv.ParseFloat(f[4], 64)
		if err != nil {
			return nil, fmt.Errorf("inittrace line %q: %w", sc.Text(), err)
		}
		// A package appears once; the runtime's own lines come first.
		out[f[1]] += v
	}
	if len(out) == 0 {
		return nil, fmt.Errorf("no inittrace lines in %q", bytes.TrimSpace(stderr))
	}
	return out, sc.Err()
}
