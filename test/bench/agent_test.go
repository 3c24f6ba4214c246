package bench

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/cilium/ebpf"

	"github.com/mesh-cni/mesh-cni/test/harness"
)

// readyLine is what mesh-agent logs (at info level) once every readiness
// condition holds and waiting pods are admitted.
const readyLine = `"agent ready"`

// agent is a mesh-agent process the benchmark starts, stops and restarts.
type agent struct {
	tb       testing.TB
	bin      string
	dir      string
	Socket   string
	StateDir string
	BPFFS    string
	args     []string
	env      []string
	proc     *harness.Process
	spawner  *spawner
}

// agentOptions configures newAgent.
type agentOptions struct {
	// Datapath is "ebpf" (default) or "none" (the gate without redirection).
	Datapath string
	// Binary replaces the mesh-agent binary (the profiling wrapper).
	Binary string
	// Env is added to the agent's environment.
	Env []string
	// LogLevel is the agent's log level; default info, where it logs its ready
	// line and every pod's enrollment with the time it took.
	LogLevel string
	// Args are further flags of mesh-agent run.
	Args []string
}

// newAgent prepares an agent with its own socket, state dir and bpffs, in a
// short-named directory (Unix socket paths are limited to 107 bytes). It is not
// started. The pinned data path outlives the agent on purpose; the cleanup
// removes it with the product's own uninstall once the agent is gone (cleanups
// run last-registered first, so every start's kill runs before this).
func newAgent(tb testing.TB, opts agentOptions) *agent {
	tb.Helper()
	if opts.Datapath == "" {
		opts.Datapath = "ebpf"
	}
	if opts.LogLevel == "" {
		opts.LogLevel = "info"
	}
	bin := opts.Binary
	if bin == "" {
		bin = harness.Bins(tb).Path("mesh-agent")
	}
	dir, err := os.MkdirTemp("", "mesh-bench-")
	if err != nil {
		tb.Fatal(err)
	}
	a := &agent{
		tb:       tb,
		bin:      bin,
		dir:      dir,
		Socket:   filepath.Join(dir, "run", "gate.sock"),
		StateDir: filepath.Join(dir, "pods"),
		BPFFS:    filepath.Join(dir, "bpf"),
		env:      opts.Env,
	}
	// Info level: the agent logs its ready line there. The periodic reconcile
	// stays at its default; the chain entry is the benchmark's, not installed.
	// The benchmarks' proxies run in the pods, in the benchmark's cgroup, and are
	// known by ztunnel's mark (an opt-in).
	a.args = []string{"run", "--socket", a.Socket, "--state-dir", a.StateDir, "--bpffs-root", a.BPFFS,
		"--datapath", opts.Datapath, "--cni-install=false", "--log-level", opts.LogLevel, "--proxy-mark", "0x539"}
	a.args = append(a.args, opts.Args...)
	// Agents that serve metrics default to a fixed loopback port; several agents
	// run at once here (and on this machine), so that listener is turned off.
	// The same for the ZDS handoff socket, whose default is a fixed path: the
	// benchmarks run their proxies inside the pods and need no handoff.
	for _, f := range []string{"metrics-addr", "zds-socket"} {
		if hasFlag(tb, bin, f) {
			a.args = append(a.args, "--"+f+"=")
		}
	}
	tb.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
		defer cancel()
		if opts.Datapath == "ebpf" {
			out, err := exec.CommandContext(ctx, harness.Bins(tb).Path("mesh-agent"), "uninstall",
				"--bpffs-root", a.BPFFS, "--cni-install=false", "--log-level", "warn").CombinedOutput()
			if err != nil {
				tb.Errorf("mesh-agent uninstall: %v\n%s", err, out)
			}
		}
		if err := os.RemoveAll(dir); err != nil {
			tb.Errorf("remove agent dir: %v", err)
		}
	})
	// After the uninstall's registration, so it stops before the uninstall
	// runs and after every start's kill.
	a.spawner = newSpawner(tb)
	return a
}

// hasFlag reports whether `mesh-agent run -h` lists the flag.
func hasFlag(tb testing.TB, bin, name string) bool {
	tb.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	// -h exits with status 0 or 2 depending on the flag package's mood; the
	// usage text is what counts.
	out, _ := exec.CommandContext(ctx, bin, "run", "-h").CombinedOutput()
	return strings.Contains(string(out), "\n  -"+name+" ")
}

// meshEntry is mesh-cni's conflist entry pointed at this agent.
func (a *agent) meshEntry(pluginType string) map[string]any {
	return map[string]any{
		"type":        pluginType,
		"socketPath":  a.Socket,
		"gateTimeout": "60s",
		"logLevel":    "warn",
	}
}

// start runs the agent and waits for its ready line. It returns when the
// process was started and when the ready line arrived.
func (a *agent) start(ctx context.Context) (started, ready time.Time, err error) {
	started = a.launch()
	ready, err = a.waitReady(ctx)
	return started, ready, err
}

// launch starts the agent without waiting; waitReady waits.
func (a *agent) launch() time.Time {
	started := time.Now()
	a.proc = a.spawner.start(a.tb, harness.ProcessOptions{Path: a.bin, Args: a.args, Env: a.env, Name: "mesh-agent"})
	return started
}

// waitReady waits for the ready line and returns when the agent became
// ready: the line's own timestamp (what the agent's gate calls waited for),
// or when the line was seen if it has none. The timestamp has millisecond
// resolution and is truncated, so it is never later than the moment itself.
func (a *agent) waitReady(ctx context.Context) (time.Time, error) {
	ctx, cancel := context.WithTimeout(ctx, 2*time.Minute)
	defer cancel()
	line, err := a.proc.WaitForLine(ctx, readyLine)
	if err != nil {
		return time.Time{}, fmt.Errorf("agent did not become ready: %w", err)
	}
	seen := time.Now()
	var rec struct {
		TS string `json:"ts"`
	}
	if json.Unmarshal([]byte(line), &rec) == nil {
		if ts, err := time.Parse("2006-01-02T15:04:05.000Z0700", rec.TS); err == nil && !ts.After(seen) {
			return ts, nil
		}
	}
	return seen, nil
}

// stop stops the agent with SIGTERM and waits for it to exit.
func (a *agent) stop(ctx context.Context) error {
	ctx, cancel := context.WithTimeout(ctx, time.Minute)
	defer cancel()
	if err := a.proc.Stop(ctx); err != nil {
		return fmt.Errorf("stop agent: %w", err)
	}
	return nil
}

// pid is the running agent's process id.
func (a *agent) pid() int { return a.proc.Pid() }

// logFields returns, for every line of the agent's output (this run) whose
// message is msg, the named fields that are numbers (zap writes durations as
// seconds), from the skip-th such line on. It also returns how many such lines
// there are in all, to skip next time.
func (a *agent) logFields(msg string, skip int, fields ...string) (values map[string][]float64, seen int) {
	values = map[string][]float64{}
	for _, line := range strings.Split(a.proc.Output(), "\n") {
		if !strings.Contains(line, `"msg":"`+msg+`"`) {
			continue
		}
		seen++
		if seen <= skip {
			continue
		}
		var rec map[string]any
		if err := json.Unmarshal([]byte(line), &rec); err != nil {
			continue
		}
		for _, f := range fields {
			if v, ok := rec[f].(float64); ok {
				values[f] = append(values[f], v)
			}
		}
	}
	return values, seen
}

// procStatusKiB reads a "Field:   N kB" line of /proc/PID/status, in KiB.
func procStatusKiB(pid int, field string) (float64, error) {
	f, err := os.Open(fmt.Sprintf("/proc/%d/status", pid))
	if err != nil {
		return 0, fmt.Errorf("read status of pid %d: %w", pid, err)
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		k, v, ok := strings.Cut(sc.Text(), ":")
		if !ok || k != field {
			continue
		}
		num := strings.TrimSuffix(strings.TrimSpace(v), " kB")
		n, err := strconv.ParseFloat(strings.TrimSpace(num), 64)
		if err != nil {
			return 0, fmt.Errorf("parse %s of pid %d: %w", field, pid, err)
		}
		return n, nil
	}
	if err := sc.Err(); err != nil {
		return 0, fmt.Errorf("read status of pid %d: %w", pid, err)
	}
	return 0, fmt.Errorf("no %s in /proc/%d/status", field, pid)
}

// mapMemlock sums the kernel's memlock accounting of every map pinned under the
// agent's bpffs (as bpftool map show reports it, from the maps' fdinfo). It
// returns the total and the size per map name.
func (a *agent) mapMemlock() (total uint64, perMap map[string]uint64, err error) {
	dir := filepath.Join(a.BPFFS, "maps")
	entries, err := os.ReadDir(dir)
	if err != nil {
		return 0, nil, fmt.Errorf("list pinned maps: %w", err)
	}
	perMap = map[string]uint64{}
	var errs []error
	for _, e := range entries {
		m, err := ebpf.LoadPinnedMap(filepath.Join(dir, e.Name()), &ebpf.LoadPinOptions{ReadOnly: true})
		if err != nil {
			errs = append(errs, fmt.Errorf("open pinned map %s: %w", e.Name(), err))
			continue
		}
		info, err := m.Info()
		m.Close()
		if err != nil {
			errs = append(errs, fmt.Errorf("info of map %s: %w", e.Name(), err))
			continue
		}
		if n, ok := info.Memlock(); ok {
			perMap[e.Name()] = n
			total += n
		}
	}
	return total, perMap, errors.Join(errs...)
}
