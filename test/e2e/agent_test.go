package e2e

import (
	"context"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/containernetworking/cni/libcni"
	"google.golang.org/grpc"

	"github.com/mesh-cni/mesh-cni/internal/gaterpc"
	"github.com/mesh-cni/mesh-cni/pkg/gate/gatepb"
	"github.com/mesh-cni/mesh-cni/test/harness"
)

// agent is a mesh-agent process under test and the paths it uses.
type agent struct {
	t testing.TB
	harness.AgentDirs
	Args []string
	Proc *harness.Process
	// NetNSPath runs the agent in that network namespace, as the DaemonSet runs
	// it in the node's (hostNetwork); "" keeps the test's.
	NetNSPath string
	// Wrapper runs the agent through this command line (e.g. setpriv), the
	// agent's path and arguments appended; WrapperLaunches says it forks the
	// agent rather than exec it (nsenter into a PID namespace,
	// harness.ProcessOptions.Launcher).
	Wrapper         []string
	WrapperLaunches bool
}

// command is the agent's path and args through its wrapper.
func (a *agent) command(args []string) (string, []string) {
	path := harness.Bins(a.t).Path("mesh-agent")
	if len(a.Wrapper) == 0 {
		return path, args
	}
	return a.Wrapper[0], append(append(slices.Clone(a.Wrapper[1:]), path), args...)
}

// newAgent prepares (but does not start) an agent with its own socket and
// state directory (harness.NewAgentDirs), extraArgs added to its flags.
// TestProxyKnownByCgroup runs one without the proxy mark.
func newAgent(t testing.TB, extraArgs ...string) *agent {
	t.Helper()
	a := &agent{t: t, AgentDirs: harness.NewAgentDirs(t, "mesh-e2e-")}
	a.Args = append(a.RunArgs(), extraArgs...)
	return a
}

// agents maps gate sockets to their agents, for diagnostics.
var agents sync.Map

// start runs the agent and waits until it reports ready.
func (a *agent) start(ctx context.Context) {
	a.t.Helper()
	path, args := a.command(a.Args)
	a.Proc = harness.StartProcess(a.t, harness.ProcessOptions{Path: path, Args: args, Name: "mesh-agent", NetNSPath: a.NetNSPath, Launcher: a.WrapperLaunches})
	agents.Store(a.Socket, a)
	a.waitReady(ctx)
}

func (a *agent) waitReady(ctx context.Context) {
	a.t.Helper()
	ctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	if err := harness.WaitForHealthy(ctx, a.Socket); err != nil {
		a.t.Fatalf("agent did not become ready: %v", err)
	}
}

// kill stops the agent with SIGKILL: no shutdown code runs.
func (a *agent) kill() {
	a.t.Helper()
	if err := a.Proc.Kill(); err != nil {
		a.t.Fatalf("kill agent: %v", err)
	}
}

func (a *agent) stop(ctx context.Context) {
	a.t.Helper()
	if err := a.Proc.Stop(ctx); err != nil {
		a.t.Fatalf("stop agent: %v", err)
	}
}

// list returns the agent's enrollment records through the gate API.
func (a *agent) list(ctx context.Context) *gatepb.ListResponse {
	a.t.Helper()
	conn, err := gaterpc.Dial(a.Socket)
	if err != nil {
		a.t.Fatal(err)
	}
	defer conn.Close()
	ctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	resp, err := gatepb.NewGateClient(conn).List(ctx, &gatepb.ListRequest{}, grpc.WaitForReady(true))
	if err != nil {
		a.t.Fatalf("list enrollments: %v", err)
	}
	return resp
}

// meshEntry is mesh-cni's entry in a conflist, pointed at this agent.
func (a *agent) meshEntry(gateTimeout string) map[string]any {
	return map[string]any{
		"type":        "mesh-cni",
		"socketPath":  a.Socket,
		"gateTimeout": gateTimeout,
		"logLevel":    "debug",
	}
}

// meshNode is a node whose CNI bin dir has the reference plugins and mesh-cni.
func meshNode(t testing.TB) *harness.Node {
	return harness.NewNode(t, harness.NodeOptions{Plugins: append(harness.ReferencePluginNames(), "mesh-cni")})
}

// chain is [bridge, mesh-cni] on node, pointed at a.
func chain(t testing.TB, node *harness.Node, a *agent, gateTimeout string) *libcni.NetworkConfigList {
	return node.Conflist(t, "meshnet", a.meshEntry(gateTimeout))
}

// meshedNode starts an agent with extraArgs and makes a node whose chain
// reaches it with gateTimeout.
func meshedNode(ctx context.Context, t *testing.T, gateTimeout string, extraArgs ...string) (*agent, *harness.Node, *libcni.NetworkConfigList) {
	t.Helper()
	a := newAgent(t, extraArgs...)
	a.start(ctx)
	node := meshNode(t)
	return a, node, chain(t, node, a, gateTimeout)
}

func testContext(t testing.TB) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	t.Cleanup(cancel)
	return ctx
}

// diagnoseSocket logs what the kernel says about the gate socket, from the test
// process and from inside the node's netns, to explain a refused connection.
func (a *agent) diagnoseSocket(t testing.TB, node *harness.Node) {
	t.Helper()
	var st syscall.Stat_t
	err := syscall.Stat(a.Socket, &st)
	t.Logf("diagnose: stat %s from test: ino=%d mode=%o err=%v", a.Socket, st.Ino, st.Mode, err)
	probe := func() string {
		c, err := net.Dial("unix", a.Socket)
		if err != nil {
			return err.Error()
		}
		c.Close()
		return "connected"
	}
	t.Logf("diagnose: dial from test process: %s", probe())
	_ = node.Do(func() error {
		var st2 syscall.Stat_t
		err := syscall.Stat(a.Socket, &st2)
		t.Logf("diagnose: from node netns thread: ino=%d err=%v dial=%s", st2.Ino, err, probe())
		return nil
	})
	out, _ := exec.Command("ss", "-xlpn").CombinedOutput()
	for _, line := range strings.Split(string(out), "\n") {
		if strings.Contains(line, filepath.Dir(a.Socket)) || strings.Contains(line, "mesh-agent") {
			t.Logf("diagnose: ss: %s", line)
		}
	}
	if a.Proc != nil {
		self, _ := os.Readlink("/proc/self/ns/mnt")
		agentNS, _ := os.Readlink(fmt.Sprintf("/proc/%d/ns/mnt", a.Proc.Pid()))
		t.Logf("diagnose: mount ns test=%s agent=%s", self, agentNS)
		tasks, _ := filepath.Glob("/proc/self/task/*/ns/mnt")
		seen := map[string]int{}
		for _, tk := range tasks {
			l, _ := os.Readlink(tk)
			seen[l]++
		}
		t.Logf("diagnose: mount ns of test threads: %v", seen)
		selfNet, _ := os.Readlink("/proc/self/ns/net")
		agentNet, _ := os.Readlink(fmt.Sprintf("/proc/%d/ns/net", a.Proc.Pid()))
		t.Logf("diagnose: net ns test=%s agent=%s", selfNet, agentNet)
		if unixTable, err := os.ReadFile(fmt.Sprintf("/proc/%d/net/unix", a.Proc.Pid())); err == nil {
			for _, line := range strings.Split(string(unixTable), "\n") {
				if strings.Contains(line, "gate.sock") {
					t.Logf("diagnose: agent's /proc/net/unix: %s", line)
				}
			}
		}
		fds, _ := filepath.Glob(fmt.Sprintf("/proc/%d/fd/*", a.Proc.Pid()))
		for _, fd := range fds {
			if l, _ := os.Readlink(fd); strings.HasPrefix(l, "socket:") {
				t.Logf("diagnose: agent fd %s -> %s", filepath.Base(fd), l)
			}
		}
	}
}
