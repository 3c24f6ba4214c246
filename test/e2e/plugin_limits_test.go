package e2e

import (
	"encoding/json"
	"io"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"

	types100 "github.com/containernetworking/cni/pkg/types/100"

	"github.com/mesh-cni/mesh-cni/test/harness"
)

// TestDelBestEffort: a DEL the agent answers with an error (here: a pod name it
// rejects as invalid, and a caller it refuses) still succeeds, so the runtime
// goes on to the primary plugin's DEL and the pod's address is released. A DEL
// whose prevResult cannot be parsed succeeds too: DEL does not read it.
func TestDelBestEffort(t *testing.T) {
	t.Parallel()
	ctx := testContext(t)
	a, node, list := meshedNode(ctx, t, "30s", "--datapath=none")

	// leased reports whether host-local still holds an address for pod.
	leased := func(pod *harness.Pod, ip string) bool {
		_, err := os.Stat(filepath.Join(node.DataDir, list.Name, ip))
		return err == nil
	}
	addPod := func(name string) (*harness.Pod, string) {
		pod := node.NewPod(t, "shop", name)
		res, err := node.Add(ctx, pod, list)
		if err != nil {
			t.Fatalf("ADD %s: %v", name, err)
		}
		r, err := types100.GetResult(res)
		if err != nil || len(r.IPs) == 0 {
			t.Fatalf("ADD %s: result %v without an address (%v)", name, res, err)
		}
		ip := r.IPs[0].Address.IP.String()
		if !leased(pod, ip) {
			t.Fatalf("host-local holds no lease for %s after ADD", ip)
		}
		return pod, ip
	}

	t.Run("agent rejects the request", func(t *testing.T) {
		pod, ip := addPod("rejected")
		// A name the agent's validation refuses (InvalidArgument, code 101
		// before DEL became best effort).
		badArgs := harness.WithArgs([][2]string{{"IgnoreUnknown", "1"}, {"K8S_POD_NAMESPACE", "shop"}, {"K8S_POD_NAME", "Not_A_DNS_Name"}})
		if err := node.Del(ctx, pod, list, badArgs); err != nil {
			t.Fatalf("DEL the agent rejects: %v", err)
		}
		if leased(pod, ip) {
			t.Fatalf("the primary's DEL did not run: %s is still leased", ip)
		}
	})

	t.Run("agent refuses the caller", func(t *testing.T) {
		pod, ip := addPod("refused")
		// The same agent state, restarted to admit only another uid: the
		// plugin (root) is refused with PermissionDenied (code 100 before).
		a.stop(ctx)
		a.Args = append(a.Args, "--allowed-uids=4242")
		a.Proc = harness.StartProcess(t, harness.ProcessOptions{Path: harness.Bins(t).Path("mesh-agent"), Args: a.Args, Name: "mesh-agent-refusing"})
		if _, err := a.Proc.WaitForLine(ctx, "agent ready"); err != nil {
			t.Fatalf("restarted agent: %v", err)
		}
		if err := node.Del(ctx, pod, list); err != nil {
			t.Fatalf("DEL refused by the agent: %v", err)
		}
		if leased(pod, ip) {
			t.Fatalf("the primary's DEL did not run: %s is still leased", ip)
		}
	})

	t.Run("unparseable prevResult", func(t *testing.T) {
		conf, err := json.Marshal(map[string]any{
			"cniVersion": "1.1.0", "name": "meshnet", "type": "mesh-cni", "socketPath": a.Socket,
			"prevResult": map[string]any{"cniVersion": "1.1.0", "ips": []map[string]any{{"address": "not-an-address"}}},
		})
		if err != nil {
			t.Fatal(err)
		}
		if _, cniErr := (pluginCall{Command: "DEL", ContainerID: "c0ffee", IfName: "eth0", Stdin: conf}).run(ctx, t); cniErr != nil {
			t.Fatalf("DEL with an unparseable prevResult: code %d %s", cniErr.Code, cniErr.Msg)
		}
	})
}

// hugeStdin is the stdin TestPluginStdinCapped gives the plugin, and
// refusedStdinRSS what the plugin may take resident refusing it.
const (
	hugeStdin       = 200 << 20
	refusedStdinRSS = 64 << 20
)

// TestPluginStdinCapped: a huge stdin is refused as an invalid configuration
// (code 7) after at most MaxStdin bytes, without the plugin's memory growing
// with it (skel alone read all of a 200 MB stdin, over 400 MB resident).
func TestPluginStdinCapped(t *testing.T) {
	t.Parallel()
	ctx := testContext(t)
	const size = hugeStdin
	var usage syscall.Rusage
	_, cniErr := pluginCall{
		Command: "ADD", ContainerID: "c0ffee", IfName: "eth0", Netns: "/proc/self/ns/net",
		StdinReader: io.LimitReader(spaces{}, size),
		Usage:       &usage,
	}.run(ctx, t)
	if cniErr == nil {
		t.Fatal("ADD with a 200 MB stdin succeeded")
	}
	if cniErr.Code != 7 || !strings.Contains(cniErr.Msg, "larger than the limit") {
		t.Fatalf("code %d %q, want 7 naming the limit", cniErr.Code, cniErr.Msg)
	}
	// Maxrss is in KiB. The bound is far above what reading the capped 4 MiB
	// needs and far below the stdin's size.
	t.Logf("plugin max RSS: %d KiB", usage.Maxrss)
	if usage.Maxrss > refusedStdinRSS>>10 {
		t.Fatalf("plugin max RSS %d KiB for a refused stdin: it read more than the cap", usage.Maxrss)
	}
}

// spaces is an endless stream of JSON whitespace.
type spaces struct{}

func (spaces) Read(p []byte) (int, error) {
	for i := range p {
		p[i] = ' '
	}
	return len(p), nil
}

// TestPluginLogFileNoFollow: the plugin (root) does not follow a symlink at its
// logFile path: the file the link points to is left untouched and the logs go
// to stderr.
func TestPluginLogFileNoFollow(t *testing.T) {
	t.Parallel()
	ctx := testContext(t)
	dir := t.TempDir()
	victim := filepath.Join(dir, "victim")
	if err := os.WriteFile(victim, []byte("precious\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	link := filepath.Join(dir, "mesh-cni.log")
	if err := os.Symlink(victim, link); err != nil {
		t.Fatal(err)
	}
	conf, err := json.Marshal(map[string]any{
		"cniVersion": "1.1.0", "name": "meshnet", "type": "mesh-cni",
		"socketPath": filepath.Join(dir, "no-agent.sock"), "logFile": link,
	})
	if err != nil {
		t.Fatal(err)
	}
	// DEL with no agent logs a warning and succeeds.
	if _, cniErr := (pluginCall{Command: "DEL", ContainerID: "c0ffee", IfName: "eth0", Stdin: conf}).run(ctx, t); cniErr != nil {
		t.Fatalf("DEL: code %d %s", cniErr.Code, cniErr.Msg)
	}
	got, err := os.ReadFile(victim)
	if err != nil {
		t.Fatal(err)
	}
	if string(got) != "precious\n" {
		t.Fatalf("the plugin wrote through the logFile symlink into %s:\n%s", victim, got)
	}
	if fi, err := os.Lstat(link); err != nil || fi.Mode()&os.ModeSymlink == 0 {
		t.Fatalf("logFile symlink replaced: %v %v", fi, err)
	}
}
