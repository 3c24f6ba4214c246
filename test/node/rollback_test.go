package node

import (
	"context"
	"net"
	"net/netip"
	"os"
	"path/filepath"
	"runtime"
	"strconv"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/mesh-cni/mesh-cni/install/kubernetes"
	"github.com/mesh-cni/mesh-cni/test/fixtures"
	"github.com/mesh-cni/mesh-cni/test/node/nodeenv"
	"github.com/mesh-cni/mesh-cni/test/proxy"
)

// TestRollback rolls the agent back from this tree's build to the pinned
// release in place, and forward again, with meshed pods talking, as
// docs/install.md says (helm rollback, then helm upgrade): through each, no
// round trip of the meshed clients fails, the server accepts only from its
// proxy, a connection kept open the whole time keeps working, the agent
// answers ready and still holds every pod, and a pod created next starts
// meshed. Which data path serves shows in what the client's proxy sees: this
// build binds a redirected connect to the pod's address, the release leaves it
// on loopback; so the pods this build enrolled are served by the release's
// programs after the rollback, and after the forward one every pod, the one
// the release enrolled too, has this build's entries again.
func TestRollback(t *testing.T) {
	current, release := readImages(t)
	ctx := fixtures.Context(t, 15*time.Minute)
	s := startScenario(t, ctx, nodeenv.Options{}, current, release)
	n, op := s.n, s.op
	op.run(ctx, s.releaseDir, "helm")
	op.run(ctx, s.currentDir, "helm-upgrade")

	// The pods this build enrolls: a server, a client making a connection
	// every 100 ms, and one keeping a single connection.
	s.namespace(ctx, "shop", true)
	s.create(ctx, s.server("shop", "server", true))
	serverIP := s.podIP(ctx, "shop", "server")
	target := net.JoinHostPort(serverIP, strconv.Itoa(serverPort))
	s.create(ctx, s.client("shop", "client", target, true))
	held := s.client("shop", "held", target, true)
	held.Spec.Containers[0].Args = append(held.Spec.Containers[0].Args, "-hold")
	s.create(ctx, held)
	clientIP := s.podIP(ctx, "shop", "client")
	s.podIP(ctx, "shop", "held")
	s.waitConnections(t, ctx, "client", 10)
	s.waitConnections(t, ctx, "held", 10)
	s.sourcesSeen(t, ctx, "client", time.Now(), clientIP)

	meshed := []string{"server", "client", "held"}
	s.keepsTalking(t, ctx, "helm rollback to the release", "client", "server", serverIP, func() { op.run(ctx, s.currentDir, "helm-rollback") })
	back := time.Now()
	s.agentServes(t, ctx, kubernetes.Image+"@"+kubernetes.ReleaseDigest, meshed)
	s.sourcesSeen(t, ctx, "client", back, "127.0.0.1")
	s.startsMeshed(t, ctx, "late", target)
	meshed = append(meshed, "late")

	s.keepsTalking(t, ctx, "helm upgrade to this tree's build again", "client", "server", serverIP, func() { op.run(ctx, s.currentDir, "helm-upgrade") })
	forward := time.Now()
	s.agentServes(t, ctx, s.im["mesh-agent"].Ref(), meshed)
	s.sourcesSeen(t, ctx, "client", forward, clientIP)
	s.sourcesSeen(t, ctx, "late", forward, s.podIP(ctx, "shop", "late"))
	s.startsMeshed(t, ctx, "later", target)
	checkOnlyProxy(t, s.cluster, "server", serverIP, time.Time{}, time.Time{})

	// The kept connection lasted through both: every round trip on it, one
	// connection, which its proxy took (recorded when it closes, with the pod).
	trips := fixtures.MustReadJSONL[connection](t, filepath.Join(s.records(), "held.jsonl"))
	var locals []string
	for _, c := range trips {
		if c.Error != "" {
			t.Errorf("a round trip on the kept connection failed at %s: %s", c.Time.Format("15:04:05.000"), c.Error)
		}
		if c.Local != "" && (len(locals) == 0 || locals[len(locals)-1] != c.Local) {
			locals = append(locals, c.Local)
		}
	}
	if len(locals) != 1 {
		t.Errorf("the kept connection's client dialed %d times (%q), want once", len(locals), locals)
	}
	if err := n.Admin.CoreV1().Pods("shop").Delete(ctx, "held", metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	s.untilGone(ctx, "shop", "held")
	want := netip.MustParseAddrPort(target)
	if out := s.proxied(t, "held", proxy.Outbound); len(out) != 1 || out[0].OriginalDst != want {
		t.Errorf("the kept connection's proxy recorded %+v, want one connection to %s", out, want)
	}
	t.Logf("the kept connection made %d round trips through the rollback and forward again, none failed", len(trips))

	if left := op.unused("helm-rollback"); len(left) > 0 {
		t.Errorf("docs/install.md commands the test never ran: %q", left)
	}
	op.run(ctx, s.currentDir, "helm-uninstall", 0, 3)
}

// readImages reads this tree's images and the release's, which TestMain built,
// and checks the release's agent is the one the manifests pin.
func readImages(t *testing.T) (current, release nodeenv.Images) {
	t.Helper()
	current = currentImages(t)
	release, err := nodeenv.ReadImages(os.Getenv(EnvReleaseImageDir))
	if err != nil {
		t.Fatal(err)
	}
	if got := release["mesh-agent"].Digest; got != kubernetes.ReleaseDigest {
		t.Fatalf("make image at the release commit %s built the agent as %s, but the manifests pin %s (Go %s; release.go says %s): see TestReleaseImageReproducible",
			kubernetes.ReleaseCommit, got, kubernetes.ReleaseDigest, runtime.Version(), kubernetes.ReleaseGo)
	}
	return current, release
}

// currentImages skips t under -short, since it runs a whole node, and
// returns this tree's images.
func currentImages(t *testing.T) nodeenv.Images {
	t.Helper()
	if testing.Short() {
		t.Skip("a whole node: skipped with -short")
	}
	current, err := nodeenv.ReadImages(os.Getenv(nodeenv.EnvImageDir))
	if err != nil {
		t.Fatal(err)
	}
	return current
}

// startScenario starts a node with opts and this tree's images imported, and
// checks out the chart and docs of current, and of release unless it is nil,
// for the operator.
func startScenario(t *testing.T, ctx context.Context, opts nodeenv.Options, current, release nodeenv.Images) *scenario {
	t.Helper()
	n := nodeenv.Start(t, opts)
	importTestImages(t, ctx, n, current)
	s := &scenario{cluster: &cluster{t: t, n: n, im: current}, op: newOperator(t, n),
		currentDir: checkout(t, filepath.Dir(current["mesh-agent"].Tar))}
	if release != nil {
		s.releaseDir = checkout(t, filepath.Dir(release["mesh-agent"].Tar))
	}
	return s
}

// agentServes checks, after a rollout, that the agent runs image, answers
// ready and holds every pod of shop named.
func (s *scenario) agentServes(t *testing.T, ctx context.Context, image string, pods []string) {
	t.Helper()
	if img := s.agentPod(t, ctx).Spec.Containers[0].Image; img != image {
		t.Errorf("the agent runs %s, want %s", img, image)
	}
	st := s.status(t, ctx)
	if !st.Agent.Ready {
		t.Errorf("mesh-agent status: not ready")
	}
	for _, p := range pods {
		if !st.enrolled("shop", p) {
			t.Errorf("shop/%s is no longer enrolled: %+v", p, st.Pods)
		}
	}
}

// startsMeshed creates a meshed client of target in shop and checks that its
// round trips go through its proxy and the server sees only its own.
func (s *scenario) startsMeshed(t *testing.T, ctx context.Context, name, target string) {
	t.Helper()
	s.create(ctx, s.client("shop", name, target, true))
	s.until(ctx, "shop", name, "running", running)
	s.until(ctx, "shop", name, redirectionAnn+"=enabled", func(p *corev1.Pod) bool { return p.Annotations[redirectionAnn] == "enabled" })
	s.waitConnections(t, ctx, name, 5)
	if len(s.proxied(t, name, proxy.Outbound)) == 0 {
		t.Errorf("the new pod %s reaches the server, but not through its proxy", name)
	}
	if _, failed := s.connections(t, name); failed > 0 {
		t.Errorf("%d of the new pod %s's round trips failed", failed, name)
	}
}

// sourcesSeen waits for connections of pod that its outbound proxy accepted
// after since, and checks each came from src: the pod's address when this
// build's data path with the pod's entries redirects it, loopback when the
// release's does.
func (s *scenario) sourcesSeen(t *testing.T, ctx context.Context, pod string, since time.Time, src string) {
	t.Helper()
	want := netip.MustParseAddr(src)
	var seen, other []netip.Addr
	if !fixtures.Eventually(ctx, 30*time.Second, 200*time.Millisecond, func() bool {
		seen, other = nil, nil
		for _, r := range s.proxied(t, pod, proxy.Outbound) {
			if r.Time.Before(since) {
				continue
			}
			seen = append(seen, r.Client.Addr())
			if r.Client.Addr() != want {
				other = append(other, r.Client.Addr())
			}
		}
		return len(other) > 0 || len(seen) >= 5
	}) {
		t.Errorf("%s's proxy accepted %d connections since %s, want 5", pod, len(seen), since.Format("15:04:05.000"))
		return
	}
	if len(other) > 0 {
		t.Errorf("%s's proxy accepted %d connections since %s, %d not from %s: %v", pod, len(seen), since.Format("15:04:05.000"), len(other), src, other)
	}
}
