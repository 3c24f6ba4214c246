package e2e

import (
	"bytes"
	"context"
	"encoding/json"
	"net/http"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"github.com/cilium/ebpf/link"
	dto "github.com/prometheus/client_model/go"
	"github.com/prometheus/common/expfmt"
	"github.com/prometheus/common/model"

	"github.com/mesh-cni/mesh-cni/internal/agentcli"
	"github.com/mesh-cni/mesh-cni/internal/netns"
	"github.com/mesh-cni/mesh-cni/test/harness"
)

func scrape(t *testing.T, addr string) map[string]*dto.MetricFamily {
	t.Helper()
	resp, err := http.Get("http://" + addr + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	parser := expfmt.NewTextParser(model.UTF8Validation)
	families, err := parser.TextToMetricFamilies(resp.Body)
	if err != nil {
		t.Fatalf("parse /metrics: %v", err)
	}
	return families
}

// metricValue is the value of the sample of family name whose labels include
// want (a histogram reports its count).
func metricValue(fams map[string]*dto.MetricFamily, name string, want map[string]string) float64 {
	f, ok := fams[name]
	if !ok {
		return 0
	}
	var sum float64
next:
	for _, m := range f.GetMetric() {
		for k, v := range want {
			found := false
			for _, l := range m.GetLabel() {
				if l.GetName() == k && l.GetValue() == v {
					found = true
				}
			}
			if !found {
				continue next
			}
		}
		switch {
		case m.Counter != nil:
			sum += m.GetCounter().GetValue()
		case m.Gauge != nil:
			sum += m.GetGauge().GetValue()
		case m.Histogram != nil:
			sum += float64(m.GetHistogram().GetSampleCount())
		}
	}
	return sum
}

func httpStatus(t *testing.T, url string) int {
	t.Helper()
	resp, err := http.Get(url)
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	return resp.StatusCode
}

// TestMetricsFollowTraffic scrapes /metrics during a run: gate counters follow
// the pods added, and the data path counters follow the connections made.
func TestMetricsFollowTraffic(t *testing.T) {
	t.Parallel()
	ctx := testContext(t)
	a := newAgent(t, "--metrics-addr", "127.0.0.1:0")
	a.start(ctx)
	addr := harness.AgentMetricsAddr(ctx, t, a.Proc)
	if code := httpStatus(t, "http://"+addr+"/healthz"); code != http.StatusOK {
		t.Fatalf("/healthz = %d", code)
	}
	if code := httpStatus(t, "http://"+addr+"/readyz"); code != http.StatusOK {
		t.Fatalf("/readyz = %d on a ready agent", code)
	}
	before := scrape(t, addr)
	if v := metricValue(before, "meshcni_ready", nil); v != 1 {
		t.Fatalf("meshcni_ready = %v", v)
	}

	node := meshNode(t)
	list := chain(t, node, a, "30s")
	client := addMeshPod(ctx, t, node, list, "shop", "client")
	srv := addMeshPod(ctx, t, node, list, "shop", "server")
	client.startProxy(ctx, t)
	srv.startProxy(ctx, t)
	srv.ServeEcho(t, 8080)
	const conns = 7
	for i := 0; i < conns; i++ {
		if err := client.EchoRoundTrip(ctx, netip.AddrPortFrom(srv.IPv4(t), 8080), []byte("ping")); err != nil {
			t.Fatal(err)
		}
	}
	after := scrape(t, addr)
	delta := func(name string, labels map[string]string) float64 {
		return metricValue(after, name, labels) - metricValue(before, name, labels)
	}
	checks := []struct {
		what string
		got  float64
		want float64
		min  bool
	}{
		{"Add OK calls", delta("meshcni_gate_requests_total", map[string]string{"verb": "Add", "code": "OK"}), 2, false},
		{"Add duration observations", delta("meshcni_gate_add_duration_seconds", nil), 2, false},
		{"enrolled pods", metricValue(after, "meshcni_enrolled_pods", nil), 2, false},
		{"outbound redirected", delta("meshcni_datapath_decisions_total", map[string]string{"direction": "outbound", "decision": "redirected"}), conns, true},
		{"inbound redirected", delta("meshcni_datapath_decisions_total", map[string]string{"direction": "inbound", "decision": "redirected"}), conns, true},
	}
	for _, c := range checks {
		if (c.min && c.got < c.want) || (!c.min && c.got != c.want) {
			t.Errorf("%s moved by %v, want %v", c.what, c.got, c.want)
		}
	}
	// The proxies' own onward connections carry the mark: counted as passed.
	if d := delta("meshcni_datapath_decisions_total", map[string]string{"direction": "outbound", "decision": "passed"}); d < conns {
		t.Errorf("outbound passed moved by %v, want at least %d (the proxies' marked connections)", d, conns)
	}
	if err := node.Del(ctx, client.Pod, list); err != nil {
		t.Fatal(err)
	}
	if v := metricValue(scrape(t, addr), "meshcni_enrolled_pods", nil); v != 1 {
		t.Errorf("meshcni_enrolled_pods = %v after one DEL, want 1", v)
	}
}

func runAgentCommand(ctx context.Context, t *testing.T, args ...string) (string, int) {
	t.Helper()
	cmd := exec.CommandContext(ctx, harness.Bins(t).Path("mesh-agent"), args...)
	var out, errOut bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &errOut
	err := cmd.Run()
	code := 0
	if ee, ok := err.(*exec.ExitError); ok {
		code = ee.ExitCode()
	} else if err != nil {
		t.Fatalf("run mesh-agent %v: %v", args, err)
	}
	if errOut.Len() > 0 {
		t.Logf("mesh-agent %s stderr: %s", args[0], errOut.String())
	}
	return out.String(), code
}

// TestStatusJSON: `mesh-agent status -o json` lists exactly the enrolled pods,
// with their redirection intact, from the agent and from the pinned state with
// the agent stopped.
func TestStatusJSON(t *testing.T) {
	t.Parallel()
	ctx := testContext(t)
	a, node, list := meshedNode(ctx, t, "30s")
	pods := []*meshPod{
		addMeshPod(ctx, t, node, list, "shop", "one"),
		addMeshPod(ctx, t, node, list, "shop", "two"),
		addMeshPod(ctx, t, node, list, "kube-system", "not-meshed"),
	}
	flags := []string{"--socket", a.Socket, "--state-dir", a.StateDir, "--bpffs-root", a.BPFFS, "--cni-install=false"}
	assertStatus := func(source string) {
		t.Helper()
		out, code := runAgentCommand(ctx, t, append([]string{"status", "-o", "json"}, flags...)...)
		if code != 0 {
			t.Fatalf("status exited %d: %s", code, out)
		}
		var st agentcli.NodeStatus
		if err := json.Unmarshal([]byte(out), &st); err != nil {
			t.Fatalf("status -o json is not JSON: %v\n%s", err, out)
		}
		if st.Source != source {
			t.Fatalf("status source %q, want %q", st.Source, source)
		}
		if len(st.Pods) != 2 {
			t.Fatalf("status lists %d pods, want the 2 enrolled: %+v", len(st.Pods), st.Pods)
		}
		for i, p := range st.Pods {
			want := pods[i]
			cookie, err := netns.Cookie(want.NetNSPath)
			if err != nil {
				t.Fatal(err)
			}
			if p.Namespace != want.Namespace || p.Name != want.Name || p.ContainerID != want.ContainerID || p.NetnsCookie != cookie ||
				p.State != agentcli.StateRedirected || len(p.Interfaces) != 1 || p.Interfaces[0] != "eth0" {
				t.Fatalf("status pod %d = %+v, want %s/%s cookie %d redirected on eth0", i, p, want.Namespace, want.Name, cookie)
			}
		}
		if st.Datapath == nil || len(st.Datapath.Pods) != 2 {
			t.Fatalf("status data path: %+v", st.Datapath)
		}
	}
	assertStatus("agent")
	table, code := runAgentCommand(ctx, t, append([]string{"status"}, flags...)...)
	if code != 0 || !strings.Contains(table, "shop/one") || !strings.Contains(table, "redirected") {
		t.Fatalf("status table (exit %d):\n%s", code, table)
	}
	t.Logf("status:\n%s", table)
	a.stop(ctx)
	assertStatus("pinned state")
}

// TestCheckNamesFaults: `mesh-agent check` passes on a healthy node and names each
// fault introduced.
func TestCheckNamesFaults(t *testing.T) {
	t.Parallel()
	ctx := testContext(t)
	node := harness.NewNode(t, harness.NodeOptions{})
	primary, err := node.ConflistJSON("podnet")
	if err != nil {
		t.Fatal(err)
	}
	primaryFile := node.WriteConf(t, "10-bridge.conflist", primary)
	a := newAgent(t)
	installFlags := []string{"--cni-install=true", "--owned-config=false", "--cni-conf-dir", node.ConfDir, "--cni-bin-dir", node.BinDir,
		"--install-state-dir", filepath.Join(filepath.Dir(a.StateDir), "install"), "--plugin-binary", harness.Bins(t).Path("mesh-cni")}
	a.Args = append(a.Args, installFlags...)
	a.start(ctx)
	t.Cleanup(func() {
		// Put the chain entry back out of the primary file; uninstall of the data
		// path is done by the agent helper.
		runAgentCommand(context.Background(), t, append([]string{"uninstall", "--bpffs-root", a.BPFFS, "--log-level", "warn"}, installFlags...)...)
	})
	checkFlags := append([]string{"check", "--socket", a.Socket, "--bpffs-root", a.BPFFS}, installFlags...)
	check := func() (string, int) { return runAgentCommand(ctx, t, checkFlags...) }

	out, code := check()
	if code != 0 {
		t.Fatalf("check on a healthy node exited %d:\n%s", code, out)
	}
	t.Logf("healthy:\n%s", out)

	// Fault 1: the socket opened up to everyone.
	if err := os.Chmod(a.Socket, 0o666); err != nil {
		t.Fatal(err)
	}
	out, code = check()
	if code == 0 || !strings.Contains(out, "FAIL  gate socket modes") || !strings.Contains(out, "666") {
		t.Fatalf("check with socket mode 0666 (exit %d):\n%s", code, out)
	}
	if err := os.Chmod(a.Socket, 0o600); err != nil {
		t.Fatal(err)
	}

	// Fault 2: a cgroup program detached behind the agent's back.
	l, err := link.LoadPinnedLink(filepath.Join(a.BPFFS, "links", "connect4"), nil)
	if err != nil {
		t.Fatal(err)
	}
	if err := l.Detach(); err != nil {
		t.Fatalf("detach connect4: %v", err)
	}
	l.Close()
	out, code = check()
	if code == 0 || !strings.Contains(out, "FAIL  data path programs attached") || !strings.Contains(out, "connect4") {
		t.Fatalf("check with connect4 detached (exit %d):\n%s", code, out)
	}

	// Fault 3: the chain entry removed while no agent is there to repair it.
	a.stop(ctx)
	if err := os.WriteFile(primaryFile, primary, 0o644); err != nil {
		t.Fatal(err)
	}
	out, code = check()
	if code == 0 || !strings.Contains(out, "FAIL  chain entry present and last") || !strings.Contains(out, "FAIL  agent ready") {
		t.Fatalf("check with the chain entry removed and the agent stopped (exit %d):\n%s", code, out)
	}
	t.Logf("faults:\n%s", out)
}
