package agentcli

import (
	"bytes"
	"encoding/json"
	"io"
	"net"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"go.uber.org/zap"

	"github.com/mesh-cni/mesh-cni/internal/cniinstall"
)

// With the agent gone and the chain entry it wrote still in place, status
// says so, and what that does to new pods: they wait at the gate for as long
// as the entry's gateTimeout, outside its excluded namespaces. A gate socket
// an agent left behind counts as not running; without the entry, status says
// new pods start without the mesh.
func TestStatusAgentNotRunning(t *testing.T) {
	dir := t.TempDir()
	confDir, socket := filepath.Join(dir, "net.d"), filepath.Join(dir, "run", "gate.sock")
	for _, d := range []string{confDir, filepath.Dir(socket)} {
		if err := os.MkdirAll(d, 0o700); err != nil {
			t.Fatal(err)
		}
	}
	primary := `{"cniVersion": "1.0.0", "name": "pods", "plugins": [{"type": "bridge", "bridge": "cni0"}]}`
	if err := os.WriteFile(filepath.Join(confDir, "10-bridge.conflist"), []byte(primary), 0o644); err != nil {
		t.Fatal(err)
	}
	args := []string{"--socket=" + socket, "--state-dir=" + filepath.Join(dir, "pods"), "--datapath=none",
		"--cni-conf-dir=" + confDir, "--install-state-dir=" + filepath.Join(dir, "install"),
		"--gate-timeout=45s", "--exclude-namespaces=kube-system,monitoring"}
	status := func(extra ...string) string {
		t.Helper()
		var out, errOut bytes.Buffer
		if code := Main(t.Context(), append(append([]string{"status"}, args...), extra...), &out, &errOut); code != 0 {
			t.Fatalf("status exited %d: %s", code, errOut.String())
		}
		t.Logf("mesh-agent status %v:\n%s", extra, out.String())
		return out.String()
	}

	out := status()
	if !strings.Contains(out, "agent:      NOT RUNNING") || !strings.Contains(out, "chain:      NOT IN PLACE: 10-bridge.conflist (the file the runtime uses) ends with \"bridge\", not mesh-cni: new pods start without the mesh") {
		t.Errorf("before the entry is written:\n%s", out)
	}

	// The entry as the agent writes it, with these flags.
	var opts options
	fs := flagSet("mesh-agent run", &opts, io.Discard)
	if err := fs.Parse(args); err != nil {
		t.Fatal(err)
	}
	in, err := cniinstall.New(opts.installerConfig(zap.NewNop(), nil))
	if err != nil {
		t.Fatal(err)
	}
	if _, err := in.Install(t.Context()); err != nil {
		t.Fatal(err)
	}
	file := in.Status().File
	want := "chain:      in place in " + file + " while the agent is not running: new pods outside kube-system, monitoring WAIT AT THE GATE; each sandbox setup fails after 45s (gateTimeout)"
	out = status()
	if !strings.Contains(out, "agent:      NOT RUNNING") || !strings.Contains(out, want) {
		t.Errorf("the agent gone, its entry in place:\n%s\nwant the lines\nagent:      NOT RUNNING ...\n%s", out, want)
	}

	// What a killed agent leaves: the socket file, nothing listening.
	l, err := net.ListenUnix("unix", &net.UnixAddr{Name: socket, Net: "unix"})
	if err != nil {
		t.Fatal(err)
	}
	l.SetUnlinkOnClose(false)
	l.Close()
	var st NodeStatus
	if err := json.Unmarshal([]byte(status("-o", "json")), &st); err != nil {
		t.Fatal(err)
	}
	if st.Agent.Reachable || !st.Agent.NotRunning || st.ChainOnDisk == nil || !st.ChainOnDisk.InPlace ||
		st.ChainOnDisk.File != file || st.ChainOnDisk.GateTimeout != "45s" || strings.Join(st.ChainOnDisk.ExcludeNamespaces, ",") != "kube-system,monitoring" {
		t.Errorf("-o json with a stale socket: agent %+v, chain %+v", st.Agent, st.ChainOnDisk)
	}
}

// The text status names how each sidecar pod's proxy is told apart, and says
// nothing of pods without one.
func TestStatusSaysSidecarRule(t *testing.T) {
	var out bytes.Buffer
	printStatus(&out, NodeStatus{Agent: AgentStatus{Reachable: true, Ready: true}, Pods: []PodStatus{
		{Namespace: "shop", Name: "cart", Proxy: "uid 1337: the sidecar container's cgroup is not known yet"},
		{Namespace: "shop", Name: "ambient"},
	}})
	if !strings.Contains(out.String(), "sidecar:    shop/cart: proxy known by uid 1337: the sidecar container's cgroup is not known yet\n") {
		t.Errorf("status does not name the sidecar pod's rule:\n%s", out.String())
	}
	if strings.Contains(out.String(), "shop/ambient: proxy") {
		t.Errorf("status names a proxy rule for a pod without a sidecar:\n%s", out.String())
	}
}
