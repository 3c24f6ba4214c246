package containerdhook

import (
	"context"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/mesh-cni/mesh-cni/internal/nethook"
	"github.com/mesh-cni/mesh-cni/test/harness"
)

// Hook is `mesh-agent hook` running for a test.
type Hook struct {
	*harness.Process
	// Socket is the hook's socket, PluginDir the runtime's plugin directory
	// it registers in, Registration its file there.
	Socket, PluginDir, Registration string
	args                            []string
	noCaps                          bool
}

// StartHook runs `mesh-agent hook` for the agent on gateSocket, registering in
// pluginDir, and waits until it has registered. args are more flags. In
// cleanup it is stopped with SIGTERM, as the kubelet stops it.
func StartHook(tb testing.TB, gateSocket, pluginDir string, args ...string) *Hook {
	tb.Helper()
	return startHook(tb, false, gateSocket, pluginDir, args...)
}

// StartHookWithoutCapabilities is StartHook for a hook that runs as root
// with no capability at all (bounding, inheritable and ambient sets empty),
// as the chart runs it.
func StartHookWithoutCapabilities(tb testing.TB, gateSocket, pluginDir string, args ...string) *Hook {
	tb.Helper()
	return startHook(tb, true, gateSocket, pluginDir, args...)
}

func startHook(tb testing.TB, noCaps bool, gateSocket, pluginDir string, args ...string) *Hook {
	tb.Helper()
	dir, err := os.MkdirTemp("", "hook-")
	if err != nil {
		tb.Fatal(err)
	}
	tb.Cleanup(func() { os.RemoveAll(dir) })
	h := &Hook{Socket: filepath.Join(dir, "run", "hook.sock"), PluginDir: pluginDir, Registration: filepath.Join(pluginDir, "mesh-cni.json"), noCaps: noCaps}
	h.args = append([]string{"hook", "--socket", gateSocket, "--hook-socket", h.Socket, "--hook-plugin-dir", pluginDir, "--log-level", "debug"}, args...)
	h.Restart(tb)
	return h
}

// Restart starts the hook again with the same flags (after a Kill or Stop),
// or a second one next to it (a successor taking the socket over), and waits
// until it has registered. The returned process is the new one.
func (h *Hook) Restart(tb testing.TB) *harness.Process {
	tb.Helper()
	path, args := harness.Bins(tb).Path("mesh-agent"), h.args
	if h.noCaps {
		path, args = "setpriv", append([]string{"--bounding-set=-all", "--inh-caps=-all", "--ambient-caps=-all", path}, args...)
	}
	p := harness.StartProcess(tb, harness.ProcessOptions{Path: path, Args: args, Name: "mesh-agent-hook"})
	tb.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		_ = p.Stop(ctx)
	})
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if _, err := p.WaitForLine(ctx, "network-plugin hook registered"); err != nil {
		tb.Fatalf("the hook did not register: %v\n%s", err, p.Output())
	}
	h.Process = p
	return p
}

// DialRegistered connects, as the runtime's loader does, to the hook that
// registered as mesh-cni in pluginDir, at the address its registration names,
// and returns the connection (closed in cleanup) with the registration.
func DialRegistered(tb testing.TB, pluginDir string) (*GRPC, nethook.Registration) {
	tb.Helper()
	reg, err := nethook.ReadRegistration(nethook.RegistrationPath(pluginDir, "mesh-cni"))
	if err != nil {
		tb.Fatal(err)
	}
	g, err := Dial(strings.TrimPrefix(reg.Address, "unix://"))
	if err != nil {
		tb.Fatal(err)
	}
	tb.Cleanup(func() { g.Close() })
	return g, reg
}
