package k8s

import (
	"context"
	"errors"
	"os"
	"os/exec"
	"strings"
	"testing"
	"time"

	"github.com/mesh-cni/mesh-cni/test/harness"
)

// TestAgentEnrollmentFlags: a bad enrollment configuration stops the agent at
// once with exit status 2 and a message naming the flag, before it serves
// anything.
func TestAgentEnrollmentFlags(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name string
		args []string
		want string
	}{
		{"unknown source", []string{"--enrollment", "everything"}, `--enrollment=\"everything\"`},
		{"unknown profile", []string{"--enrollment", "file", "--selector-profile", "linkerd"}, "--selector-profile"},
		{"policy file in a missing directory", []string{"--enrollment", "file", "--policy-file", "/nonexistent/mesh/enrollment.yaml"}, "--policy-file"},
		{"kubernetes without a node name", []string{"--enrollment", "kubernetes", "--kubeconfig", "/nonexistent/kubeconfig"}, "--node-name"},
		{"kubernetes with a missing kubeconfig", []string{"--enrollment", "kubernetes", "--node-name", "n1", "--kubeconfig", "/nonexistent/kubeconfig"}, "--kubeconfig"},
		{"startup taint that is no taint key", []string{"--startup-taint", "not a key", "--node-name", "n1"}, "--startup-taint"},
		{"startup taint without a node name", []string{"--startup-taint", "mesh-cni.io/agent-not-ready", "--kubeconfig", "/nonexistent/kubeconfig"}, "--startup-taint needs --node-name"},
		{"startup taint with a missing kubeconfig", []string{"--startup-taint", "mesh-cni.io/agent-not-ready", "--node-name", "n1", "--kubeconfig", "/nonexistent/kubeconfig"}, "--kubeconfig"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
			defer cancel()
			dir := t.TempDir()
			args := append([]string{"run", "--socket", dir + "/gate.sock", "--state-dir", dir + "/pods", "--bpffs-root", dir + "/bpf",
				"--cni-install=false", "--metrics-addr=", "--zds-socket="}, tc.args...)
			cmd := exec.CommandContext(ctx, harness.Bins(t).Path("mesh-agent"), args...)
			// No $NODE_NAME from the test's environment.
			cmd.Env = append(os.Environ(), "NODE_NAME=")
			out, err := cmd.CombinedOutput()
			var exit *exec.ExitError
			if !errors.As(err, &exit) || exit.ExitCode() != 2 {
				t.Fatalf("mesh-agent %s: %v, want exit status 2\n%s", strings.Join(tc.args, " "), err, out)
			}
			if !strings.Contains(string(out), tc.want) {
				t.Fatalf("output does not name %s:\n%s", tc.want, out)
			}
		})
	}
}
