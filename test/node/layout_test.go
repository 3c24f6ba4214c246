package node

import (
	"context"
	"encoding/json"
	"fmt"
	"net"
	"net/http"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/mesh-cni/mesh-cni/install/kubernetes"
	"github.com/mesh-cni/mesh-cni/test/fixtures"
	"github.com/mesh-cni/mesh-cni/test/harness"
	"github.com/mesh-cni/mesh-cni/test/node/nodeenv"
	"github.com/mesh-cni/mesh-cni/test/proxy"
)

// TestPlatformLayouts installs the chart, as docs/install.md says for a
// platform, on nodes whose containerd reads CNI plugins and configs from that
// platform's directories (GKE's and k3s'), into a cluster that already runs
// pods: those pods are meshed in place, without a restart; a pod started
// afterwards passes the plugin where that runtime looks for it; the plugin
// and the chain entry are there and nowhere else; Prometheus on another
// machine (the host, off the node) scrapes the agent through the chart's
// Service, with the chart's alert rules loaded; and uninstalling releases the
// running pods and leaves the node's CNI directories and pins as they were.
// Each platform runs twice: with the platform value (helm install --set
// platform), and rendered as a GitOps tool renders it, by helm template with
// no cluster and no platform value (the default layout's directories
// mounted), where the agent finds the runtime's directories itself.
func TestPlatformLayouts(t *testing.T) {
	current := currentImages(t)
	prometheus, err := exec.LookPath("prometheus")
	if err != nil {
		t.Fatalf("Prometheus scrapes the agent here (apt-get install prometheus): %v", err)
	}
	for _, name := range []string{"gke", "k3s"} {
		var platform kubernetes.Platform
		for _, p := range kubernetes.Platforms() {
			if p.Name == name {
				platform = p
			}
		}
		t.Run(name, func(t *testing.T) { platformLayout(t, platform, current, prometheus, platformSet) })
		t.Run(name+"-rendered", func(t *testing.T) { platformLayout(t, platform, current, prometheus, renderedBlocks) })
	}
}

// layoutInstall is how a layout test installs and uninstalls: the blocks of
// docs/install.md it runs.
type layoutInstall struct {
	install, uninstall opBlock
	// rendered: the chart rendered without the platform.
	rendered bool
}

// platformSet installs with helm install --set platform=$PLATFORM.
func platformSet(t *testing.T) layoutInstall {
	t.Helper()
	var li layoutInstall
	for _, b := range opBlocks() {
		switch b.Name {
		case "platform":
			li.install = b
		case "platform-uninstall":
			li.uninstall = b
		}
	}
	if li.install.Name == "" || li.uninstall.Name == "" {
		t.Fatal("docs/install.md has no platform blocks")
	}
	return li
}

// renderedBlocks renders the chart with helm template and no platform and
// applies it, as a GitOps tool does; the uninstall deletes the DaemonSet
// (the agents remove what they installed), runs the uninstall Job for
// anything an agent already gone left, and deletes the rest.
func renderedBlocks(*testing.T) layoutInstall {
	return layoutInstall{rendered: true, install: opBlock{Name: "rendered", Cmds: []opCommand{
		importAgent(),
		{Run: "kubectl apply -f install/kubernetes/namespace.yaml"},
		{Run: `helm template mesh-cni install/helm/mesh-cni -n mesh-system \
  --set image.digest=$(cat bin/image/mesh-agent.tar.digest) --set proxyMark=0x539 \
  --set metrics.bindAddress=0.0.0.0 --set metrics.service.enabled=true > mesh-cni.yaml`},
		{Run: "kubectl apply -f mesh-cni.yaml"},
		{Run: rollout},
	}}, uninstall: opBlock{Name: "rendered-uninstall", Cmds: []opCommand{
		{Run: "kubectl -n mesh-system delete daemonset mesh-agent --cascade=foreground"},
		{Run: `helm template mesh-cni install/helm/mesh-cni -n mesh-system \
  --set image.digest=$(cat bin/image/mesh-agent.tar.digest) --set uninstall.node=$NODE \
  --show-only templates/uninstall-job.yaml | kubectl apply -f -`},
		{Run: `kubectl -n mesh-system wait --for=condition=Complete --timeout=3m job/mesh-agent-uninstall-$NODE`},
		{Run: "kubectl delete -f mesh-cni.yaml --ignore-not-found"},
		{Run: "kubectl delete -f install/kubernetes/namespace.yaml"},
	}}}
}

// TestReadmeInstallRendered keeps the rendered install and uninstall of
// docs/install.md the commands TestPlatformLayouts runs, word for word.
func TestReadmeInstallRendered(t *testing.T) {
	li := renderedBlocks(t)
	for _, b := range []opBlock{li.install, li.uninstall} {
		begin, end := readmeMarkers(b.Name)
		harness.DocSection(t, "docs/install.md", begin, end, b.markdown())
	}
}

// runBlock runs every command of b in the checkout dir, as operator.run
// does for docs/install.md's blocks, and fails the test on the first that
// fails.
func runBlock(ctx context.Context, o *operator, dir string, b opBlock) {
	o.t.Helper()
	for _, c := range b.Cmds {
		start := time.Now()
		out, err := o.exec(ctx, dir, c)
		o.t.Logf("$ %s\n%s(%s, %v)", c.Run, out, b.Name, time.Since(start).Round(time.Millisecond))
		if err != nil {
			o.diagnose(ctx)
			o.t.Fatalf("docs/install.md step %q of %s failed: %v", c.Run, b.Name, err)
		}
	}
}

func platformLayout(t *testing.T, platform kubernetes.Platform, current nodeenv.Images, prometheus string, how func(*testing.T) layoutInstall) {
	li := how(t)
	ctx, cancel := context.WithTimeout(context.Background(), 12*time.Minute)
	defer cancel()
	s := startScenario(t, ctx, nodeenv.Options{CNIBinDir: platform.CNIBinDir, CNIConfDir: platform.CNIConfDir}, current, nil)
	n, op, dir := s.n, s.op, s.currentDir
	op.env = append(op.env, "PLATFORM="+platform.Name)
	before := snapshotNode(t, n)

	// Pods that run before the install, in a namespace the mesh selects.
	s.namespace(ctx, "shop", true)
	s.create(ctx, s.server("shop", "server", true))
	ip := s.podIP(ctx, "shop", "server")
	target := net.JoinHostPort(ip, strconv.Itoa(serverPort))
	s.create(ctx, s.client("shop", "client", target, true))
	clientIP := s.podIP(ctx, "shop", "client")
	s.waitConnections(t, ctx, "client", 3)
	started := map[string]*corev1.Pod{}
	for _, name := range []string{"server", "client"} {
		started[name], _ = s.until(ctx, "shop", name, "running", running)
	}

	runBlock(ctx, op, dir, li.install)
	if file, meshed := s.chainEntry(t); !meshed {
		t.Fatalf("the runtime loads %s from %s first, which does not chain mesh-cni", file, platform.CNIConfDir)
	}
	if _, err := os.Stat(n.Path(filepath.Join(platform.CNIBinDir, "mesh-cni"))); err != nil {
		t.Errorf("the plugin is not in %s, where this runtime looks: %v", platform.CNIBinDir, err)
	}
	if _, err := os.Stat(n.Path("/opt/cni/bin/mesh-cni")); err == nil && platform.CNIBinDir != "/opt/cni/bin" {
		t.Errorf("the plugin was also installed into /opt/cni/bin, which this runtime does not read")
	}
	if platform.CNIConfDir != "/etc/cni/net.d" {
		if entries, _ := os.ReadDir(n.Path("/etc/cni/net.d")); len(entries) != 0 {
			t.Errorf("the agent wrote %v into /etc/cni/net.d, which this runtime does not read", entries)
		}
	}
	if li.rendered {
		// The DaemonSet mounts the default layout's directories; the agent
		// says it reached this runtime's through the host's root.
		var st struct {
			CNI struct {
				Dirs string `json:"dirs"`
			} `json:"cniConfig"`
		}
		out := s.kubectl(t, ctx, "-n", kubernetes.Namespace, "exec", "ds/mesh-agent", "--", kubernetes.AgentBinary, "status", "-o", "json")
		if err := json.Unmarshal([]byte(out), &st); err != nil {
			t.Fatalf("mesh-agent status -o json: %v\n%s", err, out)
		}
		if dirs, want := st.CNI.Dirs, filepath.Join("/proc/1/root", platform.CNIBinDir); !strings.Contains(dirs, want+" (host root)") {
			t.Errorf("mesh-agent status says the CNI directories are %q, want the plugin in %s", dirs, want)
		}
	}

	// The running pods are enrolled where they run: same pods, no restart,
	// and from then on every connection to the server goes through its proxy.
	for name, was := range started {
		p, _ := s.until(ctx, "shop", name, redirectionAnn+"=enabled", func(p *corev1.Pod) bool { return p.Annotations[redirectionAnn] == "enabled" })
		if p.UID != was.UID {
			t.Errorf("pod %s was replaced (uid %s, was %s)", name, p.UID, was.UID)
		}
		for _, c := range append(p.Status.InitContainerStatuses, p.Status.ContainerStatuses...) {
			if c.RestartCount != 0 {
				t.Errorf("pod %s: container %s restarted %d times (last end: %s; events: %s)", name, c.Name, c.RestartCount, lastEnd(c), s.warnings(ctx, "shop", name))
			}
		}
	}
	adopted := time.Now()
	s.waitConnections(t, ctx, "client", 5)
	if len(s.proxied(t, "client", proxy.Outbound)) == 0 || len(s.proxied(t, "server", proxy.Inbound)) == 0 {
		t.Errorf("on the %s layout, the running client's traffic does not go through both proxies once enrolled in place", platform.Name)
	}
	if _, direct := checkOnlyProxy(t, s.cluster, "server", ip, time.Time{}, adopted); len(direct) == 0 {
		t.Errorf("no connection reached the server directly before the install: the pods were meshed before it")
	}

	// A pod started now passes the chain entry and the plugin in this
	// platform's directories.
	s.create(ctx, s.client("shop", "late", target, true))
	s.podIP(ctx, "shop", "late")
	s.waitConnections(t, ctx, "late", 5)
	if len(s.proxied(t, "late", proxy.Outbound)) == 0 {
		t.Errorf("on the %s layout, a pod started after the install does not go through its proxy", platform.Name)
	}
	checkOnlyProxy(t, s.cluster, "server", ip, time.Time{}, adopted)

	scrapeOffNode(t, ctx, n, prometheus, filepath.Join(dir, "install/helm/mesh-cni/files/prometheus-rules.yaml"))

	// Uninstalled, the running pods are released: they keep running and
	// talking, now directly.
	if li.rendered {
		// Up to the uninstall Job's completion, whose log says where it
		// looked: the runtime's directories, found as the agent finds them.
		runBlock(ctx, op, dir, opBlock{Name: li.uninstall.Name, Cmds: li.uninstall.Cmds[:3]})
		logs := s.kubectl(t, ctx, "-n", kubernetes.Namespace, "logs", "job/mesh-agent-uninstall-"+n.Name)
		if want := strconv.Quote(filepath.Join("/proc/1/root", platform.CNIBinDir)); !strings.Contains(logs, want) {
			t.Errorf("the uninstall Job did not look in %s, where this runtime loads plugins:\n%s", want, logs)
		}
		runBlock(ctx, op, dir, opBlock{Name: li.uninstall.Name, Cmds: li.uninstall.Cmds[3:]})
	} else {
		runBlock(ctx, op, dir, li.uninstall)
	}
	released := time.Now()
	s.waitConnections(t, ctx, "client", 5)
	direct := 0
	for _, r := range fixtures.MustReadJSONL[accepted](t, filepath.Join(s.records(), "server.jsonl")) {
		if host, _, _ := net.SplitHostPort(r.Client); host == clientIP && r.Time.After(released) {
			direct++
		}
	}
	if direct == 0 {
		t.Errorf("after the uninstall the client's connections still do not reach the server directly: not released")
	}
	if err := s.deleteNamespace(ctx, "shop"); err != nil {
		t.Fatal(err)
	}
	snapshotNode(t, n).mustEqual(t, before)
}

// scrapeOffNode runs Prometheus on the host, which reaches the node over its
// link as any machine of the cluster would, and has it scrape the endpoints of
// the chart's metrics Service. Debian's Prometheus is built without Kubernetes
// discovery, so the test reads the Service's EndpointSlices as that discovery
// would and hands their addresses to Prometheus in a file_sd file.
func scrapeOffNode(t *testing.T, ctx context.Context, n *nodeenv.Node, prometheus, rules string) {
	t.Helper()
	dir := t.TempDir()
	slices, err := n.Admin.DiscoveryV1().EndpointSlices(kubernetes.Namespace).List(ctx, metav1.ListOptions{LabelSelector: "kubernetes.io/service-name=mesh-agent-metrics"})
	if err != nil {
		t.Fatal(err)
	}
	var targets []string
	for _, sl := range slices.Items {
		for _, p := range sl.Ports {
			if p.Port == nil || p.Name == nil || *p.Name != "metrics" {
				continue
			}
			for _, ep := range sl.Endpoints {
				if ep.Conditions.Ready != nil && *ep.Conditions.Ready {
					for _, a := range ep.Addresses {
						targets = append(targets, net.JoinHostPort(a, strconv.Itoa(int(*p.Port))))
					}
				}
			}
		}
	}
	sd, err := json.Marshal([]map[string]any{{"targets": targets}})
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(dir, "targets.json"), sd, 0o644); err != nil {
		t.Fatal(err)
	}
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := l.Addr().String()
	l.Close()
	config := fmt.Sprintf(`global:
  scrape_interval: 2s
  evaluation_interval: 2s
rule_files: [%q]
scrape_configs:
  - job_name: mesh-agent
    file_sd_configs:
      - files: [%q]
`, rules, filepath.Join(dir, "targets.json"))
	if err := os.WriteFile(filepath.Join(dir, "prometheus.yml"), []byte(config), 0o644); err != nil {
		t.Fatal(err)
	}
	harness.StartProcess(t, harness.ProcessOptions{Path: prometheus, Dir: dir, Args: []string{
		"--config.file=" + filepath.Join(dir, "prometheus.yml"),
		"--storage.tsdb.path=" + filepath.Join(dir, "data"),
		"--web.listen-address=" + addr,
	}})
	want := net.JoinHostPort(n.NodeIP.String(), "15099")
	if len(targets) != 1 || targets[0] != want {
		t.Fatalf("the metrics Service's ready endpoints are %q, want the node's agent at %s", targets, want)
	}
	query := func(q string) (map[string]string, float64, bool) {
		resp, err := http.Get("http://" + addr + "/api/v1/query?query=" + url.QueryEscape(q))
		if err != nil {
			return nil, 0, false
		}
		defer resp.Body.Close()
		var r struct {
			Data struct {
				Result []struct {
					Metric map[string]string `json:"metric"`
					Value  [2]any            `json:"value"`
				} `json:"result"`
			} `json:"data"`
		}
		if err := json.NewDecoder(resp.Body).Decode(&r); err != nil || len(r.Data.Result) != 1 {
			return nil, 0, false
		}
		s, _ := r.Data.Result[0].Value[1].(string)
		v, err := strconv.ParseFloat(s, 64)
		return r.Data.Result[0].Metric, v, err == nil
	}
	var last map[string]string
	fixtures.WaitFor(t, 2*time.Minute, "Prometheus on the host to scrape the agent at "+want, func() bool {
		m, v, ok := query(`up{job="mesh-agent"}`)
		last = m
		return ok && v == 1 && m["instance"] == want
	})
	if _, v, ok := query(`meshcni_enrolled_pods{job="mesh-agent"}`); !ok || v < 3 {
		t.Errorf("scraped meshcni_enrolled_pods = %v (%v), want the 3 meshed pods", v, ok)
	}
	if _, v, ok := query(`meshcni_ready{job="mesh-agent"}`); !ok || v != 1 {
		t.Errorf("scraped meshcni_ready = %v (%v)", v, ok)
	}
	// The chart's rules are loaded and evaluated against the scraped series:
	// ALERTS has nothing firing or pending for a ready agent.
	if m, _, ok := query(`count(ALERTS)`); ok {
		t.Errorf("alerts pending or firing for a healthy agent: %v", m)
	}
	resp, err := http.Get("http://" + addr + "/api/v1/rules")
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	var rr struct {
		Data struct {
			Groups []struct {
				Name  string `json:"name"`
				Rules []struct {
					Name   string `json:"name"`
					Health string `json:"health"`
				} `json:"rules"`
			} `json:"groups"`
		} `json:"data"`
	}
	if err := json.NewDecoder(resp.Body).Decode(&rr); err != nil || len(rr.Data.Groups) == 0 || rr.Data.Groups[0].Name != "mesh-agent" || len(rr.Data.Groups[0].Rules) < 5 {
		t.Fatalf("Prometheus loaded rule groups %+v (%v), want the chart's", rr.Data.Groups, err)
	}
	for _, g := range rr.Data.Groups {
		for _, r := range g.Rules {
			if r.Health != "ok" {
				t.Errorf("rule %s of %s evaluates with health %q", r.Name, g.Name, r.Health)
			}
		}
	}
	// Every query of the chart's Grafana dashboard returns data from the
	// agent's scrape (rates once two scrapes are in).
	root, err := harness.ModuleRoot(ctx)
	if err != nil {
		t.Fatal(err)
	}
	data, err := os.ReadFile(filepath.Join(root, "install/helm/testdata/dashboard-queries.promql"))
	if err != nil {
		t.Fatal(err)
	}
	var queries []string
	for _, line := range strings.Split(string(data), "\n") {
		if line = strings.TrimSpace(line); line != "" && !strings.HasPrefix(line, "#") {
			queries = append(queries, line)
		}
	}
	if len(queries) == 0 {
		t.Fatal("the dashboard has no queries")
	}
	for _, q := range queries {
		var n int
		if !fixtures.Eventually(ctx, time.Minute, time.Second, func() bool {
			n = seriesCount(addr, q)
			return n > 0
		}) {
			t.Errorf("the dashboard's query %s returns no data from the agent's scrape", q)
		}
	}
	t.Logf("Prometheus on the host scraped the agent at %s: %v; the dashboard's %d queries return data", want, last, len(queries))
}

// seriesCount is how many series Prometheus at addr answers query with (-1 on an
// error).
func seriesCount(addr, query string) int {
	resp, err := http.Get("http://" + addr + "/api/v1/query?query=" + url.QueryEscape(query))
	if err != nil {
		return -1
	}
	defer resp.Body.Close()
	var r struct {
		Status string `json:"status"`
		Data   struct {
			Result []json.RawMessage `json:"result"`
		} `json:"data"`
	}
	if err := json.NewDecoder(resp.Body).Decode(&r); err != nil || r.Status != "success" {
		return -1
	}
	return len(r.Data.Result)
}
