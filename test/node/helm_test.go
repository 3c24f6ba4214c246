package node

import (
	"context"
	"encoding/json"
	"net"
	"os"
	"strconv"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/mesh-cni/mesh-cni/test/proxy"
)

// pluginLog is the plugin's log file on the node, as the Helm install sets
// it (plugin.logFile), with one line per CNI call (plugin.logLevel debug).
const pluginLog = "/run/mesh-cni/plugin.log"

// helm installs the chart with its defaults (the pinned release) over a
// primary of CNI spec 1.1.0, so that the runtime also calls STATUS; upgrades
// it to this tree's build with pods talking; records which CNI verbs containerd sends; runs the agent in a
// crash loop with the node staying Ready; and uninstalls as docs/install.md
// says, the node clean once helm uninstall returns.
func (s *scenario) helm(t *testing.T, ctx context.Context) {
	// The primary CNI upgraded to a config of spec 1.1.0, as its installer
	// would: containerd reloads it.
	s.n.WritePrimary(t, "1.1.0")
	before := snapshotNode(t, s.n)
	s.op.run(ctx, s.releaseDir, "helm")

	s.namespace(ctx, "shop2", true)
	s.namespace(ctx, "plain2", false)
	s.create(ctx, s.server("shop2", "server2", true))
	ip := s.podIP(ctx, "shop2", "server2")
	target := net.JoinHostPort(ip, strconv.Itoa(serverPort))
	s.create(ctx, s.client("shop2", "client2", target, true))
	s.create(ctx, s.client("plain2", "plain2", target, false))
	s.podIP(ctx, "shop2", "client2")
	s.podIP(ctx, "plain2", "plain2")
	s.waitConnections(t, ctx, "client2", 10)
	s.waitConnections(t, ctx, "plain2", 5)
	if len(s.proxied(t, "client2", proxy.Outbound)) == 0 || len(s.proxied(t, "server2", proxy.Inbound)) == 0 {
		t.Error("installed with Helm, the meshed client's traffic does not go through both proxies")
	}
	checkOnlyProxy(t, s.cluster, "server2", ip, time.Time{}, time.Time{})

	// An upgrade to this tree's build, a rolling update: the chain entry
	// stays, and the meshed pair keeps talking through its proxies.
	s.keepsTalking(t, ctx, "helm upgrade to this tree's build", "client2", "server2", ip, func() { s.op.run(ctx, s.currentDir, "helm-upgrade") })
	if img := s.agentPod(t, ctx).Spec.Containers[0].Image; img != s.im["mesh-agent"].Ref() {
		t.Errorf("after helm upgrade the agent runs %s, want %s", img, s.im["mesh-agent"].Ref())
	}
	s.bench.note("Upgrading the Helm release from the pinned release to this tree's build with a meshed client talking every 100 ms: no round trip failed, none reached the meshed server but through its proxy, and the chain entry stayed.")

	s.agentCrashLoop(t, ctx, target)

	// Pods deleted while the agent runs: containerd's DEL reaches mesh-cni.
	if err := s.deleteNamespace(ctx, "plain2"); err != nil {
		t.Fatal(err)
	}
	for _, name := range []string{"steady", "held"} {
		if err := s.n.Admin.CoreV1().Pods("shop2").Delete(ctx, name, metav1.DeleteOptions{}); err != nil {
			t.Fatal(err)
		}
		s.untilGone(ctx, "shop2", name)
	}
	verbs := pluginVerbs(t, s.n.Path(pluginLog))
	t.Logf("CNI calls containerd made to mesh-cni: %v", verbs)
	for _, v := range []string{"ADD", "DEL", "STATUS"} {
		if verbs[v] == 0 {
			t.Errorf("containerd never called %s", v)
		}
	}
	if verbs["ADD"] < 3 || verbs["DEL"] < 3 {
		t.Errorf("at least 3 pods created and deleted, but %d ADD and %d DEL", verbs["ADD"], verbs["DEL"])
	}
	s.bench.note("CNI calls containerd 2.4.2 made to mesh-cni while the Helm install ran its pods (the plugin's log at debug): " +
		formatVerbs(verbs) + ".")

	// helm uninstall alone cleans the node: its agent, told to stop, sees its
	// DaemonSet deleted and uninstalls, before the Job runs. The meshed pair,
	// released, keeps talking, directly now; a new pod of the meshed
	// namespace starts at once, without the gate.
	links := pinnedLinkIDs(t, s.n)
	okBefore, failedBefore := s.connections(t, "client2")
	s.op.run(ctx, s.releaseDir, "helm-uninstall", 0)
	uninstalled := time.Now()
	snapshotNode(t, s.n).mustEqual(t, before)
	checkLinksGone(t, links, "uninstall")
	if c, err := s.n.ReadyCondition(ctx); err != nil || c.Status != corev1.ConditionTrue {
		t.Errorf("after helm uninstall the node is not Ready: %v %s", err, c.Message)
	}
	s.create(ctx, s.client("shop2", "after", target, false))
	_, runningAt := s.until(ctx, "shop2", "after", "running", running)
	s.waitConnections(t, ctx, "after", 5)
	s.waitConnections(t, ctx, "client2", 10)
	if ok, failed := s.connections(t, "client2"); failed != failedBefore {
		t.Errorf("across helm uninstall %d of the released client's round trips failed (%d succeeded)", failed-failedBefore, ok-okBefore)
	}
	t.Logf("helm uninstall: node clean when it returned; a new pod of the meshed namespace Running %v later", runningAt.Sub(uninstalled).Round(time.Millisecond))
	s.bench.sample("uninstall", "helm uninstall returned → new pod Running", runningAt.Sub(uninstalled))

	// The Job, for nodes whose agent was away, finds nothing to do here.
	s.op.run(ctx, s.releaseDir, "helm-uninstall", 1, 2)
	snapshotNode(t, s.n).mustEqual(t, before)
	if err := s.deleteNamespace(ctx, "shop2"); err != nil {
		t.Fatal(err)
	}
	s.op.run(ctx, s.releaseDir, "helm-uninstall", 3)
	snapshotNode(t, s.n).mustEqual(t, before)
}

// keepsTalking checks that client kept going through disrupt: more round
// trips through its proxy, none failed, the chain entry in place after it,
// and server (at ip) reached only through its proxy meanwhile.
func (s *scenario) keepsTalking(t *testing.T, ctx context.Context, what, client, server, ip string, disrupt func()) {
	t.Helper()
	okBefore, failedBefore := s.connections(t, client)
	proxiedBefore := len(s.proxied(t, client, proxy.Outbound))
	from := time.Now()
	disrupt()
	to := time.Now()
	if file, meshed := s.chainEntry(t); !meshed {
		t.Errorf("%s: the runtime loads %s, without mesh-cni", what, file)
	}
	s.waitConnections(t, ctx, client, 10)
	ok, failed := s.connections(t, client)
	if failed != failedBefore {
		t.Errorf("%s: %d of %s's round trips failed", what, failed-failedBefore, client)
	}
	if proxied := len(s.proxied(t, client, proxy.Outbound)); proxied <= proxiedBefore {
		t.Errorf("%s: %s's round trips no longer go through its proxy", what, client)
	}
	if _, gap := checkOnlyProxy(t, s.cluster, server, ip, from, to); len(gap) > 0 {
		t.Errorf("%s: %d connections reached %s directly: %q", what, len(gap), server, gap)
	}
	t.Logf("%s (%v): %s made %d more round trips, all through its proxy", what, to.Sub(from).Round(time.Millisecond), client, ok-okBefore)
}

// pluginVerbs counts the plugin's calls by CNI command from its log.
func pluginVerbs(t *testing.T, path string) map[string]int {
	t.Helper()
	data, err := os.ReadFile(path)
	if err != nil {
		t.Fatalf("the plugin's log: %v", err)
	}
	counts := map[string]int{}
	for _, line := range strings.Split(string(data), "\n") {
		var l struct {
			Msg string `json:"msg"`
			Cmd string `json:"cmd"`
		}
		if json.Unmarshal([]byte(line), &l) == nil && l.Msg == "cni call" {
			counts[l.Cmd]++
		}
	}
	return counts
}

func formatVerbs(v map[string]int) string {
	var parts []string
	for _, k := range []string{"ADD", "DEL", "CHECK", "GC", "STATUS"} {
		parts = append(parts, k+" "+strconv.Itoa(v[k]))
	}
	return strings.Join(parts, ", ")
}
