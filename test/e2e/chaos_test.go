package e2e

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"math/rand/v2"
	"net/netip"
	"os"
	"path/filepath"
	"slices"
	"sort"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/link"
	"github.com/containernetworking/cni/libcni"
	"github.com/containernetworking/cni/pkg/types"

	"github.com/mesh-cni/mesh-cni/internal/netns"
	"github.com/mesh-cni/mesh-cni/test/fixtures"
	"github.com/mesh-cni/mesh-cni/test/harness"
	"github.com/mesh-cni/mesh-cni/test/proxy"
)

// Chaos run size. 200 pods through the chain with 8 workers and at least 5
// agent kills fits in well under three minutes on two busy cores.
const (
	chaosPods     = 200
	chaosWorkers  = 8
	chaosMinKills = 10
	chaosClients  = 3
)

// meshState is what one node holds for the mesh, read from the three places
// that must agree: the agent's records (through its List API), the pinned
// settings map every BPF program keys on, and the pinned link dirs.
type meshState struct {
	records  map[string]uint64 // container id -> netns cookie
	settings map[uint64]bool   // cookies in the settings map
	pinDirs  map[uint64]int    // cookie -> inbound capture links pinned there and attached
}

func (s meshState) String() string {
	return fmt.Sprintf("%d records, %d settings entries, %d pod pin dirs", len(s.records), len(s.settings), len(s.pinDirs))
}

// readMeshState reads the node's mesh state; the agent must be running.
func readMeshState(ctx context.Context, t *testing.T, a *agent) meshState {
	t.Helper()
	st := meshState{records: map[string]uint64{}, settings: settingsCookies(t, a), pinDirs: pinnedPods(t, a)}
	for _, e := range a.list(ctx).GetEnrollments() {
		st.records[e.GetAttachment().GetContainerId()] = e.GetNetnsCookie()
	}
	return st
}

// settingsCookies lists the keys of the agent's pinned pods map.
func settingsCookies(t *testing.T, a *agent) map[uint64]bool {
	t.Helper()
	m, err := ebpf.LoadPinnedMap(filepath.Join(a.BPFFS, "maps", "pods"), &ebpf.LoadPinOptions{ReadOnly: true})
	if err != nil {
		t.Fatalf("open pinned pods map: %v", err)
	}
	defer m.Close()
	out := map[uint64]bool{}
	var cookie uint64
	value := make([]byte, m.ValueSize())
	it := m.Iterate()
	for it.Next(&cookie, value) {
		out[cookie] = true
	}
	if err := it.Err(); err != nil {
		t.Fatalf("iterate settings map: %v", err)
	}
	return out
}

// pinnedPods lists <bpffs>/pods/<cookie>/ and counts, per pod, the pinned
// inbound capture links that are still attached to a namespace. Anything else in
// that directory fails the test.
func pinnedPods(t *testing.T, a *agent) map[uint64]int {
	t.Helper()
	dir := filepath.Join(a.BPFFS, "pods")
	entries, err := os.ReadDir(dir)
	if err != nil {
		t.Fatalf("list pod pins: %v", err)
	}
	out := map[uint64]int{}
	for _, e := range entries {
		cookie, err := strconv.ParseUint(e.Name(), 10, 64)
		if err != nil || !e.IsDir() {
			t.Fatalf("unexpected entry %s in %s", e.Name(), dir)
		}
		pins, err := os.ReadDir(filepath.Join(dir, e.Name()))
		if err != nil {
			t.Fatalf("list pins of pod %d: %v", cookie, err)
		}
		out[cookie] = 0
		for _, p := range pins {
			l, err := link.LoadPinnedLink(filepath.Join(dir, e.Name(), p.Name()), nil)
			if err != nil {
				continue
			}
			info, err := l.Info()
			l.Close()
			if err == nil && info.NetNs() != nil && info.NetNs().NetnsInode != 0 {
				out[cookie]++
			}
		}
	}
	return out
}

// diff says how state differs from the expected enrollments (container id ->
// cookie), each pod having exactly one attached link; "" when they agree.
func (s meshState) diff(want map[string]uint64) string {
	var problems []string
	for id, c := range want {
		got, ok := s.records[id]
		switch {
		case !ok:
			problems = append(problems, fmt.Sprintf("no record for pod %.12s", id))
		case got != c:
			problems = append(problems, fmt.Sprintf("record for pod %.12s has cookie %d, its netns has %d", id, got, c))
		}
		if !s.settings[c] {
			problems = append(problems, fmt.Sprintf("no settings entry for pod %.12s (cookie %d)", id, c))
		}
		if n, ok := s.pinDirs[c]; !ok || n != 1 {
			problems = append(problems, fmt.Sprintf("pod %.12s (cookie %d) has %d attached links pinned (dir present: %v)", id, c, n, ok))
		}
	}
	wantCookies := map[uint64]bool{}
	for _, c := range want {
		wantCookies[c] = true
	}
	for id, c := range s.records {
		if _, ok := want[id]; !ok {
			problems = append(problems, fmt.Sprintf("stale record for pod %.12s (cookie %d)", id, c))
		}
	}
	for c := range s.settings {
		if !wantCookies[c] {
			problems = append(problems, fmt.Sprintf("stale settings entry for cookie %d", c))
		}
	}
	for c := range s.pinDirs {
		if !wantCookies[c] {
			problems = append(problems, fmt.Sprintf("stale pin dir for cookie %d", c))
		}
	}
	sort.Strings(problems)
	if len(problems) > 10 {
		problems = append(problems[:10], fmt.Sprintf("... and %d more", len(problems)-10))
	}
	return strings.Join(problems, "; ")
}

// waitMeshState polls until the node's mesh state equals want (container id ->
// cookie) or limit passes, and fails the test with the difference then.
func waitMeshState(ctx context.Context, t *testing.T, a *agent, want map[string]uint64, limit time.Duration) meshState {
	t.Helper()
	var st meshState
	var d string
	// Each look asks the agent for its status: every 100 ms, not WaitInterval.
	if !fixtures.Eventually(ctx, limit, 100*time.Millisecond, func() bool {
		st = readMeshState(ctx, t, a)
		d = st.diff(want)
		return d == ""
	}) {
		t.Fatalf("mesh state did not converge to %d enrolled pods within %v (%v): %s", len(want), limit, st, d)
	}
	return st
}

// cookieOf is the netns cookie of pod, failing the test if it has none.
func cookieOf(t *testing.T, p *harness.Pod) uint64 {
	t.Helper()
	c, err := netns.Cookie(p.NetNSPath)
	if err != nil {
		t.Fatalf("cookie of pod %s: %v", p.Name, err)
	}
	return c
}

// chaosNode is a node whose pod range is a /22, so the run never runs out of
// addresses however the deletes fall.
func chaosNode(t *testing.T) *harness.Node {
	r := rand.Uint32()
	return harness.NewNode(t, harness.NodeOptions{
		Plugins:   append(harness.ReferencePluginNames(), "mesh-cni"),
		IPv4Range: netip.PrefixFrom(netip.AddrFrom4([4]byte{10, byte(r), byte(r>>8) &^ 3, 0}), 22),
	})
}

type chaosPodState int

const (
	podFresh chaosPodState = iota // netns made, never added
	podAdded                      // ADD succeeded, not deleted
	podGone                       // DEL succeeded and the netns removed
)

// chaosPod is one pod sandbox of the run. Like a runtime, the test runs one
// operation at a time per pod (mu).
type chaosPod struct {
	*harness.Pod
	enrolled bool // its namespace is one the mesh enrolls
	mu       sync.Mutex
	state    chaosPodState
}

// chaosCounts counts outcomes by operation and CNI error code.
type chaosCounts struct {
	mu sync.Mutex
	m  map[string]int
}

func (c *chaosCounts) add(op string, err error) {
	key := op + " ok"
	if err != nil {
		var cniErr *types.Error
		if errors.As(err, &cniErr) {
			key = fmt.Sprintf("%s failed (code %d)", op, cniErr.Code)
		} else {
			key = op + " failed (no CNI code)"
		}
	}
	c.mu.Lock()
	c.m[key]++
	c.mu.Unlock()
}

func (c *chaosCounts) String() string {
	c.mu.Lock()
	defer c.mu.Unlock()
	keys := slices.Sorted(maps.Keys(c.m))
	parts := make([]string, 0, len(keys))
	for _, k := range keys {
		parts = append(parts, fmt.Sprintf("%s: %d", k, c.m[k]))
	}
	return strings.Join(parts, ", ")
}

// isTryAgain: the plugin's "the agent is not ready" (CNI code 11).
func isTryAgain(err error) bool {
	var cniErr *types.Error
	return errors.As(err, &cniErr) && cniErr.Code == types.ErrTryAgainLater
}

// chaosRun is the shared state of the chaos workers.
type chaosRun struct {
	t      *testing.T
	node   *harness.Node
	list   *libcni.NetworkConfigList
	pods   []*chaosPod
	fixed  []*meshPod
	next   atomic.Int64 // pods[next] is the next to add
	gcMu   sync.RWMutex // GC runs alone, as a runtime never GCs with ADD/DEL in flight
	counts chaosCounts
	odd    chaosCounts   // failures other than "agent away", by operation
	stop   chan struct{} // closed when the run ends
}

func (r *chaosRun) stopped() bool {
	select {
	case <-r.stop:
		return true
	default:
		return false
	}
}

// add runs ADD the way kubelet does until it succeeds: a failed attempt is torn
// down (DEL) and tried again after a short back-off.
func (r *chaosRun) add(ctx context.Context, p *chaosPod) {
	r.gcMu.RLock()
	defer r.gcMu.RUnlock()
	for attempt := 1; ; attempt++ {
		_, err := r.node.Add(ctx, p.Pod, r.list)
		r.counts.add("ADD", err)
		if err == nil {
			p.state = podAdded
			return
		}
		if !isTryAgain(err) {
			r.odd.add("ADD", err)
			r.t.Logf("ADD %s (attempt %d): %v", p.Name, attempt, err)
		}
		if ctx.Err() != nil || r.stopped() {
			r.t.Errorf("ADD %s never succeeded: %v", p.Name, err)
			return
		}
		if !r.del(ctx, p) {
			return
		}
		// Part of the chaos, not a wait: pods come and go at random spacing.
		time.Sleep(time.Duration(50+rand.IntN(200)) * time.Millisecond)
	}
}

// del runs DEL until it succeeds (it must not fail because the agent is away).
func (r *chaosRun) del(ctx context.Context, p *chaosPod) bool {
	for attempt := 1; ; attempt++ {
		err := r.node.Del(ctx, p.Pod, r.list)
		r.counts.add("DEL", err)
		if err == nil {
			return true
		}
		r.odd.add("DEL", err)
		r.t.Errorf("DEL %s (attempt %d): %v", p.Name, attempt, err)
		if ctx.Err() != nil || attempt == 5 {
			return false
		}
		// The spacing of kubelet's retries of a failed DEL, not a wait.
		time.Sleep(100 * time.Millisecond)
	}
}

// remove deletes a pod: DEL, then its sandbox (netns) goes, as on a node.
func (r *chaosRun) remove(ctx context.Context, p *chaosPod) {
	r.gcMu.RLock()
	defer r.gcMu.RUnlock()
	if !r.del(ctx, p) {
		return
	}
	if err := netns.Remove(p.NetNSPath); err != nil {
		r.t.Errorf("remove netns of %s: %v", p.Name, err)
		return
	}
	p.state = podGone
}

func (r *chaosRun) check(ctx context.Context, p *chaosPod) {
	r.gcMu.RLock()
	defer r.gcMu.RUnlock()
	err := r.node.Check(ctx, p.Pod, r.list)
	r.counts.add("CHECK", err)
	if err != nil && !isTryAgain(err) {
		r.odd.add("CHECK", err)
		r.t.Logf("CHECK %s: %v", p.Name, err)
	}
}

// gc is a runtime's GC: every pod the test believes alive is valid.
func (r *chaosRun) gc(ctx context.Context) {
	r.gcMu.Lock()
	defer r.gcMu.Unlock()
	var valid []types.GCAttachment
	for _, p := range r.fixed {
		valid = append(valid, p.Attachment())
	}
	for _, p := range r.pods[:min(int(r.next.Load()), len(r.pods))] {
		// States change only under gcMu's read lock, so they are settled
		// here. (Taking p.mu would deadlock: workers hold it while they wait
		// for gcMu.)
		if p.state == podAdded {
			valid = append(valid, p.Attachment())
		}
	}
	err := r.node.GC(ctx, r.list, valid)
	r.counts.add("GC", err)
	if err != nil && !isTryAgain(err) {
		r.odd.add("GC", err)
		r.t.Logf("GC: %v", err)
	}
}

// randomAdded picks a pod that was added (it may have been deleted since; the
// caller checks under the pod's lock).
func (r *chaosRun) randomAdded() *chaosPod {
	n := min(int(r.next.Load()), len(r.pods))
	if n == 0 {
		return nil
	}
	return r.pods[rand.IntN(n)]
}

// work is one worker: random operations until stop is closed. While pods are
// left to add, ADD is the most likely; afterwards mostly CHECK and GC.
func (r *chaosRun) work(ctx context.Context) {
	for {
		if r.stopped() || ctx.Err() != nil {
			return
		}
		draining := int(r.next.Load()) >= len(r.pods)
		x := rand.Float64()
		switch {
		case !draining && x < 0.5:
			i := int(r.next.Add(1)) - 1
			if i >= len(r.pods) {
				continue
			}
			p := r.pods[i]
			p.mu.Lock()
			r.add(ctx, p)
			p.mu.Unlock()
		case (!draining && x < 0.72) || (draining && x < 0.08):
			if p := r.randomAdded(); p != nil {
				p.mu.Lock()
				if p.state == podAdded {
					r.remove(ctx, p)
				}
				p.mu.Unlock()
			}
		case x < 0.93:
			if p := r.randomAdded(); p != nil {
				p.mu.Lock()
				if p.state == podAdded {
					r.check(ctx, p)
				}
				p.mu.Unlock()
			}
		default:
			r.gc(ctx)
		}
	}
}

// TestChaos drives 200 pods through the real chain with random ADD, DEL, CHECK
// and GC from 8 workers while the agent is SIGKILLed and restarted at random
// moments, and enrolled clients keep connecting through their proxies. At the
// end the agent's records, the pinned pods map and the pinned links are
// exactly the pods alive and enrolled, no connection bypassed a proxy, and
// tearing the pods down leaves nothing behind.
func TestChaos(t *testing.T) {
	if testing.Short() {
		t.Skip("chaos run is long; skipped with -short")
	}
	t.Parallel()
	ctx := testContext(t)
	a := newAgent(t, "--reconcile-interval", "1s", "--log-level", "info")
	a.start(ctx)
	node := chaosNode(t)
	list := chain(t, node, a, "10s")
	run := &chaosRun{t: t, node: node, list: list, counts: chaosCounts{m: map[string]int{}}, odd: chaosCounts{m: map[string]int{}},
		stop: make(chan struct{})}

	// Long-lived enrolled pods with sidecars: clients and a server.
	srv := addMeshPod(ctx, t, node, list, "shop", "server")
	srv.startProxy(ctx, t)
	app := srv.ServeEcho(t, 8080)
	clients := make([]*meshPod, chaosClients)
	for i := range clients {
		clients[i] = addMeshPod(ctx, t, node, list, "shop", fmt.Sprintf("client-%d", i))
		clients[i].startProxy(ctx, t)
	}
	run.fixed = append([]*meshPod{srv}, clients...)

	// The sandboxes, made up front; about one in ten is in a namespace the
	// plugin passes through without the agent.
	for i := range chaosPods {
		ns := "shop"
		if i%10 == 9 {
			ns = "kube-system"
		}
		run.pods = append(run.pods, &chaosPod{Pod: node.NewPod(t, ns, fmt.Sprintf("chaos-%d", i)), enrolled: ns != "kube-system"})
	}

	start := time.Now()
	var wg, workers sync.WaitGroup
	var stopOnce sync.Once
	halt := func() {
		stopOnce.Do(func() { close(run.stop) })
		workers.Wait()
		wg.Wait()
	}
	// Also on failure: no worker may outlive the test's pods and agent.
	t.Cleanup(halt)
	var connOK, connFailed atomic.Int64
	perClientOK := make([]atomic.Int64, len(clients))
	target := netip.AddrPortFrom(srv.IPv4(t), 8080)
	for i, c := range clients {
		wg.Go(func() {
			for {
				if run.stopped() {
					return
				}
				if err := c.EchoRoundTrip(ctx, target, []byte("chaos")); err != nil {
					connFailed.Add(1)
				} else {
					connOK.Add(1)
					perClientOK[i].Add(1)
				}
				// A client's pace, not a wait: a round trip every 20 ms.
				time.Sleep(20 * time.Millisecond)
			}
		})
	}
	for range chaosWorkers {
		workers.Go(func() { run.work(ctx) })
	}

	// The chaos monkey: kill -9 at a random moment while up, stay down a
	// random while, start again; now and then kill the new agent again during
	// its start-up (while it loads the data path or reconciles). Until every
	// pod was added and enough kills happened.
	procs := []*harness.Process{a.Proc}
	kills, startupKills := 0, 0
	for {
		up := time.Duration(100+rand.IntN(1400)) * time.Millisecond
		select {
		case <-time.After(up):
		case <-ctx.Done():
			t.Fatal("chaos run ran out of time")
		}
		if kills >= chaosMinKills && int(run.next.Load()) >= len(run.pods) {
			break
		}
		a.kill()
		kills++
		// Part of the chaos, not a wait: the agent stays down a random while.
		time.Sleep(time.Duration(rand.IntN(800)) * time.Millisecond)
		if rand.IntN(3) == 0 {
			a.Proc = harness.StartProcess(t, harness.ProcessOptions{Path: harness.Bins(t).Path("mesh-agent"), Args: a.Args, Name: "mesh-agent"})
			procs = append(procs, a.Proc)
			// Killed at a random point of its start: chaos, not a wait.
			time.Sleep(time.Duration(rand.IntN(150)) * time.Millisecond)
			a.kill()
			kills++
			startupKills++
		}
		a.start(ctx)
		procs = append(procs, a.Proc)
	}
	halt()
	chaosTime := time.Since(start)

	// Final restart: the start-up reconcile alone must leave the node exact.
	a.kill()
	kills++
	a.start(ctx)
	procs = append(procs, a.Proc)
	want := map[string]uint64{}
	alive, aliveEnrolled := len(run.fixed), len(run.fixed)
	for _, p := range run.fixed {
		want[p.ContainerID] = cookieOf(t, p.Pod)
	}
	for _, p := range run.pods {
		if p.state != podAdded {
			continue
		}
		alive++
		if p.enrolled {
			aliveEnrolled++
			want[p.ContainerID] = cookieOf(t, p.Pod)
		}
	}
	final := waitMeshState(ctx, t, a, want, 10*time.Second)

	// No connection reached the server except through its inbound proxy,
	// which dials from the server pod itself; every success went through the
	// client's outbound proxy.
	srvAddrs := []netip.Addr{srv.IPv4(t), srv.IPv6(t)}
	seen := app.Clients()
	bypassed := 0
	for _, c := range seen {
		if !slices.Contains(srvAddrs, c) {
			bypassed++
			t.Errorf("the server saw client address %s: a connection bypassed the proxies", c)
		}
	}
	for i, c := range clients {
		n := int(perClientOK[i].Load())
		if recs := proxy.AwaitRecords(ctx, t, c.records, n); len(recs) != n {
			t.Errorf("client %d's proxy handled %d connections, the client completed %d", i, len(recs), n)
		}
	}

	t.Logf("chaos: %d pods (%d in kube-system), %d workers, %d agent kills (%d during start-up), %v under chaos",
		chaosPods, chaosPods/10, chaosWorkers, kills, startupKills, chaosTime.Round(time.Second))
	var agentLog strings.Builder
	for _, p := range procs {
		agentLog.WriteString(p.Output())
	}
	var events []string
	for _, e := range []string{"pod released: its network namespace is gone", "orphan redirection released",
		"removing pins of a pod that is not enrolled", "pod released by gc", "pod redirection broken; repairing",
		"reconcile finished with errors", "pod state problem repaired at start"} {
		events = append(events, fmt.Sprintf("%q: %d", e, strings.Count(agentLog.String(), e)))
	}
	t.Logf("chaos: agent events over %d agent processes: %s", len(procs), strings.Join(events, ", "))
	shown := 0
	for _, line := range strings.Split(agentLog.String(), "\n") {
		if shown < 5 && (strings.Contains(line, "pod redirection broken") || strings.Contains(line, "reconcile finished with errors")) {
			t.Logf("chaos: agent: %s", line)
			shown++
		}
	}
	t.Logf("chaos: operations: %s", &run.counts)
	if s := run.odd.String(); s != "" {
		t.Logf("chaos: failures other than 'agent away': %s", s)
	}
	t.Logf("chaos: connections: %d succeeded through the proxies, %d failed, %d bypassed; the server accepted %d",
		connOK.Load(), connFailed.Load(), bypassed, len(seen))
	t.Logf("chaos: end state: %d pods alive, %d enrolled; agent holds %v", alive, aliveEnrolled, final)
	if connOK.Load() == 0 {
		t.Error("no client connection succeeded during the run")
	}
	if t.Failed() {
		return
	}

	// Teardown as a node does: proxies stop, every pod is deleted, its netns
	// removed. Nothing of the mesh may remain.
	for _, p := range run.fixed {
		if err := p.proxy.Kill(); err != nil {
			t.Fatal(err)
		}
	}
	var all []*harness.Pod
	for _, p := range run.fixed {
		all = append(all, p.Pod)
	}
	for _, p := range run.pods {
		if p.state == podAdded {
			all = append(all, p.Pod)
		}
	}
	for _, p := range all {
		if err := node.Del(ctx, p, list); err != nil {
			t.Fatalf("teardown: %v", err)
		}
		if err := netns.Remove(p.NetNSPath); err != nil {
			t.Fatalf("teardown: %v", err)
		}
	}
	empty := waitMeshState(ctx, t, a, map[string]uint64{}, 10*time.Second)
	veths, err := node.Veths()
	if err != nil {
		t.Fatal(err)
	}
	allocs, err := node.Allocations(list.Name)
	if err != nil {
		t.Fatal(err)
	}
	var leftNetns []string
	for _, p := range run.pods {
		if _, err := os.Stat(p.NetNSPath); err == nil {
			leftNetns = append(leftNetns, p.NetNSPath)
		}
	}
	files, err := os.ReadDir(a.StateDir)
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("chaos: after teardown: %v, %d veths, %d addresses held, %d pod netns, %d files in the state dir",
		empty, len(veths), len(allocs), len(leftNetns), len(files))
	if len(veths)+len(allocs)+len(leftNetns)+len(files) != 0 {
		t.Fatalf("teardown left veths %v, addresses %v, netns %v, state files %v", veths, allocs, leftNetns, files)
	}
}
