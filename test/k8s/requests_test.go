package k8s

import (
	"fmt"
	"net/url"
	"regexp"
	"strconv"
	"strings"
	"testing"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/mesh-cni/mesh-cni/internal/enroll"
	"github.com/mesh-cni/mesh-cni/test/fixtures"
	"github.com/mesh-cni/mesh-cni/test/harness"
	"github.com/mesh-cni/mesh-cni/test/k8s/kubeenv"
)

// testAgentPodStartRequests counts, in the API server's audit log, what pod
// starts through the real chain ask of the API server: no write at all for a
// pod outside the mesh, exactly one (the annotation) for a meshed pod, no
// request from the plugin, and a decision the agent's watch could not answer
// (a pod its node-scoped watch never holds) read from the API server's watch
// cache (resourceVersion=0), not from etcd, and counted in
// meshcni_enrollment_cache_misses_total.
func testAgentPodStartRequests(t *testing.T, c *cluster) {
	ctx := apiContext(t)
	kubeNode := "node-" + fixtures.RandomHex(4)
	lab := c.namespace(t, "lab", enabled)
	plain := c.namespace(t, "plain", nil)
	a := newAgent(t, c.api, kubeNode, "--metrics-addr", "127.0.0.1:0")
	a.start(ctx)
	addr := harness.AgentMetricsAddr(ctx, t, a.Proc)
	node := harness.NewNode(t, harness.NodeOptions{Plugins: append(harness.ReferencePluginNames(), "mesh-cni")})
	list := node.Conflist(t, "meshnet", a.meshEntry())

	// Outside the mesh first: the agent writes outcomes in the order it
	// decided them, so once the meshed pods show theirs, any write for these
	// would have been made.
	var plainPods, meshedPods []string
	for i := range 3 {
		name := fmt.Sprintf("plain-%d", i)
		add(ctx, t, node, list, cniPod(t, node, c.pod(t, plain, name, kubeNode, nil, nil)))
		plainPods = append(plainPods, name)
	}
	optOut := c.pod(t, lab, "opt-out", kubeNode, disabled, nil)
	add(ctx, t, node, list, cniPod(t, node, optOut))
	// A pod of another node is never in the agent's watch: its decision has
	// to ask the API server. It is in the API server's watch cache by the time
	// the ADD comes (an admin's resourceVersion=0 read finds it).
	elsewhere := c.pod(t, plain, "elsewhere", "other-"+kubeNode, nil, nil)
	fixtures.WaitFor(t, 30*time.Second, "the pod in the API server's watch cache", func() bool {
		_, err := c.admin.CoreV1().Pods(plain).Get(ctx, "elsewhere", metav1.GetOptions{ResourceVersion: "0"})
		return err == nil
	})
	add(ctx, t, node, list, cniPod(t, node, elsewhere))
	for i := range 3 {
		name := fmt.Sprintf("meshed-%d", i)
		add(ctx, t, node, list, cniPod(t, node, c.pod(t, lab, name, kubeNode, nil, nil)))
		meshedPods = append(meshedPods, name)
	}
	for _, name := range meshedPods {
		c.waitAnnotation(t, lab, name, enroll.OutcomeEnabled)
	}

	// A miss is counted before its read is sent, and the agent may re-decide
	// a pod it already admitted (on any watch change) at any time, so the
	// counter is read first and the audit log until it holds that many reads
	// from the watch cache: a miss that never asked would keep it short.
	var (
		misses float64
		events []kubeenv.AuditEvent
	)
	fixtures.WaitFor(t, 30*time.Second, "a watch-cache read in the audit log for every counted cache miss", func() bool {
		misses = cacheMisses(t, addr, enroll.ResourcePod)
		var err error
		if events, err = c.api.Audit(); err != nil {
			t.Fatal(err)
		}
		return float64(agentCacheReads(t, events, "mesh-agent/"+kubeNode)) >= misses
	})
	agentUA := "mesh-agent/" + kubeNode
	writes := map[string]int{}
	var gets []kubeenv.AuditEvent
	for _, e := range events {
		ns := e.ObjectRef.Namespace
		if ns != lab && ns != plain {
			continue
		}
		pod := ns + "/" + e.ObjectRef.Name
		switch {
		case e.UserAgent == agentUA:
			if e.Write() {
				writes[pod]++
			}
			if e.Verb == "get" {
				gets = append(gets, e)
			}
		case strings.HasPrefix(e.UserAgent, "mesh-cni-e2e/"):
			// The test's own requests.
		case e.ObjectRef.Resource == "pods":
			// Anyone else asking about these pods can only be the plugin.
			t.Errorf("%s %s by %q (%s): only the agent may ask the API server about a pod start", e.Verb, e.RequestURI, e.User.Username, e.UserAgent)
		}
	}
	for _, name := range append(plainPods, "elsewhere") {
		if n := writes[plain+"/"+name]; n != 0 {
			t.Errorf("%d writes for %s/%s, outside the mesh: want none", n, plain, name)
		}
		c.noRedirection(t, plain, name)
	}
	if n := writes[lab+"/opt-out"]; n != 0 {
		t.Errorf("%d writes for the opted-out %s/opt-out: want none", n, lab)
	}
	for _, name := range meshedPods {
		if n := writes[lab+"/"+name]; n != 1 {
			t.Errorf("%d writes for the meshed %s/%s: want one, the annotation istiod and operators read", n, lab, name)
		}
	}

	// Every read the agent made goes to the watch cache first; a quorum read
	// (etcd) only follows one that did not find the object there.
	fromCache := 0
	notFound := map[string]bool{}
	for _, e := range gets {
		obj := e.ObjectRef.Resource + " " + e.ObjectRef.Namespace + "/" + e.ObjectRef.Name
		if watchCacheRead(t, e.RequestURI) {
			fromCache++
			if e.ResponseStatus.Code == 404 {
				notFound[obj] = true
			}
			continue
		}
		if !notFound[obj] {
			t.Errorf("GET %s went to etcd without first asking the watch cache", e.RequestURI)
		}
		delete(notFound, obj)
	}
	elsewhereGets := 0
	for _, e := range gets {
		if e.ObjectRef.Resource == "pods" && e.ObjectRef.Name == "elsewhere" {
			elsewhereGets++
			if !watchCacheRead(t, e.RequestURI) {
				t.Errorf("GET %s: the pod was in the watch cache, the read went to etcd", e.RequestURI)
			}
		}
	}
	if elsewhereGets == 0 {
		t.Error("the agent decided a pod its watch does not hold without asking the API server")
	}
	// Each decision that asked counts once, however many tries it took.
	if misses < 1 || misses > float64(fromCache) {
		t.Errorf("meshcni_enrollment_cache_misses_total{resource=pod} = %v; want between 1 and the %d reads from the watch cache", misses, fromCache)
	}
	t.Logf("agent requests for %d pod starts: writes %v, %d GETs (%d from the watch cache), %v cache misses", len(plainPods)+len(meshedPods)+2, writes, len(gets), fromCache, misses)
}

// agentCacheReads counts the pod GETs by userAgent that asked the API
// server's watch cache.
func agentCacheReads(t *testing.T, events []kubeenv.AuditEvent, userAgent string) int {
	t.Helper()
	n := 0
	for _, e := range events {
		if e.UserAgent == userAgent && e.Verb == "get" && e.ObjectRef.Resource == "pods" && watchCacheRead(t, e.RequestURI) {
			n++
		}
	}
	return n
}

// watchCacheRead reports whether a GET's request URI asks for
// resourceVersion=0: the API server's watch cache answers it.
func watchCacheRead(t *testing.T, requestURI string) bool {
	t.Helper()
	u, err := url.Parse(requestURI)
	if err != nil {
		t.Fatalf("audit log request URI %q: %v", requestURI, err)
	}
	return u.Query().Get("resourceVersion") == "0"
}

// cacheMisses reads meshcni_enrollment_cache_misses_total{resource} from the
// agent's /metrics (0 before the first miss).
func cacheMisses(t *testing.T, addr, resource string) float64 {
	t.Helper()
	_, body := httpGet(t, "http://"+addr+"/metrics")
	m := regexp.MustCompile(`(?m)^meshcni_enrollment_cache_misses_total\{resource="` + regexp.QuoteMeta(resource) + `"\} (\S+)$`).FindSubmatch(body)
	if m == nil {
		return 0
	}
	v, err := strconv.ParseFloat(string(m[1]), 64)
	if err != nil {
		t.Fatalf("meshcni_enrollment_cache_misses_total %q: %v", m[1], err)
	}
	return v
}
