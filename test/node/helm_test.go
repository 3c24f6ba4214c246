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

	"github.com/mesh-cni/mesh-cni/test/proxy"
)

// pluginLog is the plugin's log file on the node, as the Helm install sets
// it (plugin.logFile), with one line per CNI call (plugin.logLevel debug).
const pluginLog = "/run/mesh-cni/plugin.log"

// helm installs the chart with its defaults (the pinned release) over a
// primary of CNI spec 1.1.0, so that the runtime also calls STATUS; records which CNI verbs
// containerd sends; shows STATUS taking the node's network readiness while
// the chain entry has no agent; and uninstalls as docs/install.md says.
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
	s.agentCrashLoop(t, ctx, target)
	for _, ns := range []string{"shop2", "plain2"} {
		if err := s.deleteNamespace(ctx, ns); err != nil {
			t.Fatal(err)
		}
	}

	verbs := pluginVerbs(t, s.n.Path(pluginLog))
	t.Logf("CNI calls containerd made to mesh-cni: %v", verbs)
	for _, v := range []string{"ADD", "DEL", "STATUS"} {
		if verbs[v] == 0 {
			t.Errorf("containerd never called %s", v)
		}
	}
	if verbs["ADD"] < 3 || verbs["DEL"] < 3 {
		t.Errorf("3 pods created and deleted, but %d ADD and %d DEL", verbs["ADD"], verbs["DEL"])
	}
	s.bench.note("CNI calls containerd 2.4.2 made to mesh-cni while the Helm install ran three pods (the plugin's log at debug): " +
		formatVerbs(verbs) + ".")

	// The DaemonSet gone, the chain entry stays and names an agent that is
	// not there: new pods would wait, and the node stays Ready (STATUS does not
	// turn an absent agent into an unready node) until the Job removes it.
	links := pinnedLinkIDs(t, s.n)
	s.op.run(ctx, s.releaseDir, "helm-uninstall", 0)
	if c, err := s.n.ReadyCondition(ctx); err != nil || c.Status != corev1.ConditionTrue {
		t.Errorf("with the DaemonSet gone the node is not Ready: %v %s", err, c.Message)
	}
	s.op.run(ctx, s.releaseDir, "helm-uninstall", 1, 2)
	var cond corev1.NodeCondition
	if err := waitNode(ctx, s, true, &cond); err != nil {
		t.Fatal(err)
	}
	s.op.run(ctx, s.releaseDir, "helm-uninstall", 3)

	snapshotNode(t, s.n).mustEqual(t, before)
	checkLinksGone(t, links)
}

// waitNode waits for the node's Ready condition to be (not) True and stores it.
func waitNode(ctx context.Context, s *scenario, ready bool, cond *corev1.NodeCondition) error {
	ctx, cancel := context.WithTimeout(ctx, 3*time.Minute)
	defer cancel()
	if err := s.n.WaitReady(ctx, ready); err != nil {
		return err
	}
	c, err := s.n.ReadyCondition(ctx)
	*cond = c
	return err
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
