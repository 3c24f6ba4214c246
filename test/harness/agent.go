package harness

import (
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"testing"
	"time"
)

// AgentDirs are a test agent's own paths: its gate socket, pod state and
// bpffs, under a short temporary directory (a Unix socket's path is limited to
// 107 bytes).
type AgentDirs struct {
	Dir, Socket, StateDir, BPFFS string
}

// uninstallTimeout bounds the uninstall NewAgentDirs runs in cleanup.
const uninstallTimeout = time.Minute

// NewAgentDirs makes an agent's directory, its name starting with prefix. The
// data path the agent pins outlives it on purpose; in tb's cleanup the
// product's own uninstall removes it, then the directory goes. An agent process
// started after this call is stopped before that (cleanups run last first).
func NewAgentDirs(tb testing.TB, prefix string) AgentDirs {
	tb.Helper()
	dir, err := os.MkdirTemp("", prefix)
	if err != nil {
		tb.Fatal(err)
	}
	d := AgentDirs{Dir: dir, Socket: filepath.Join(dir, "run", "gate.sock"), StateDir: filepath.Join(dir, "pods"), BPFFS: filepath.Join(dir, "bpf")}
	tb.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), uninstallTimeout)
		defer cancel()
		out, err := exec.CommandContext(ctx, Bins(tb).Path("mesh-agent"), "uninstall",
			"--bpffs-root", d.BPFFS, "--cni-install=false", "--log-level", "warn").CombinedOutput()
		if err != nil {
			tb.Errorf("mesh-agent uninstall: %v\n%s", err, out)
		}
		if err := os.RemoveAll(dir); err != nil {
			tb.Errorf("remove agent dir: %v", err)
		}
	})
	return d
}

// RunArgs are `mesh-agent run`'s flags for a test's agent on these paths. It
// installs no chain entry (the tests drive their own conflists; the installer
// has tests of its own), opens no metrics listener or ZDS socket at their
// fixed defaults (tests run agents side by side), logs at debug, and knows the
// sidecar proxies, which run in the test's cgroup like its clients, by
// ztunnel's mark, an opt-in (a later --proxy-mark 0 turns it off).
func (d AgentDirs) RunArgs() []string {
	return []string{"run", "--socket", d.Socket, "--state-dir", d.StateDir, "--bpffs-root", d.BPFFS,
		"--cni-install=false", "--metrics-addr=", "--zds-socket=", "--log-level", "debug", "--proxy-mark", "0x539"}
}

// metricsLineTimeout bounds how long AgentMetricsAddr waits for the line.
const metricsLineTimeout = time.Minute

// AgentMetricsAddr waits for a started agent to log where it serves metrics
// and health, and returns that address.
func AgentMetricsAddr(ctx context.Context, tb testing.TB, agent *Process) string {
	tb.Helper()
	ctx, cancel := context.WithTimeout(ctx, metricsLineTimeout)
	defer cancel()
	line, err := agent.WaitForLine(ctx, "metrics and health serving")
	if err != nil {
		tb.Fatal(err)
	}
	m := regexp.MustCompile(`"addr":"([^"]+)"`).FindStringSubmatch(line)
	if m == nil {
		tb.Fatalf("no address in %q", line)
	}
	return m[1]
}
