package e2e

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/containernetworking/cni/libcni"
	"github.com/containernetworking/cni/pkg/types"
	"google.golang.org/grpc"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"

	"github.com/mesh-cni/mesh-cni/internal/gaterpc"
	"github.com/mesh-cni/mesh-cni/internal/netns"
	"github.com/mesh-cni/mesh-cni/test/fixtures"
	"github.com/mesh-cni/mesh-cni/test/harness"
)

// These tests drive the agent's own CNI installer: the agent copies mesh-cni
// into the node's bin dir, chains itself onto the primary network's conflist,
// keeps the entry there while the primary rewrites its file, and `mesh-agent
// uninstall` takes everything out again.

const (
	// primaryFile is the primary CNI's config file name on the test nodes.
	primaryFile = "10-meshnet.conflist"
	// ownedFile is the merged config the agent writes in owned mode: it sorts
	// before primaryFile.
	ownedFile = "00-mesh-cni.conflist"
	// generationKey is a top-level key the test's "primary CNI" puts in its
	// conflist so a test can tell which of its rewrites a file derives from.
	// Plugins never see top-level keys.
	generationKey = "meshE2EGeneration"
	// repairLimit is how soon the design promises the entry back after the
	// primary rewrote its file.
	repairLimit = time.Second
)

// installNode is a node whose bin dir has only the reference plugins: the agent
// under test installs mesh-cni there itself.
func installNode(t testing.TB) *harness.Node {
	return harness.NewNode(t, harness.NodeOptions{Plugins: harness.ReferencePluginNames()})
}

// newInstallAgent prepares an agent that installs mesh-cni into node (later
// flags override newAgent's --cni-install=false).
func newInstallAgent(t testing.TB, node *harness.Node, extraArgs ...string) *agent {
	t.Helper()
	a := newAgent(t)
	a.Args = append(a.Args,
		"--cni-install=true",
		"--owned-config=false", // chain mode unless a test asks for owned

		"--cni-conf-dir", node.ConfDir,
		"--cni-bin-dir", node.BinDir,
		"--install-state-dir", a.installStateDir(),
		"--plugin-binary", harness.Bins(t).Path("mesh-cni"),
		"--gate-timeout", "60s",
		"--plugin-log-level", "debug",
	)
	a.Args = append(a.Args, extraArgs...)
	return a
}

// installStateDir is where the agent keeps the primary's original bytes; it is
// inside the agent's own directory, removed in newAgent's cleanup.
func (a *agent) installStateDir() string {
	return filepath.Join(filepath.Dir(a.StateDir), "install")
}

// launch starts the agent without waiting for it to be ready.
func (a *agent) launch() {
	a.t.Helper()
	path, args := a.command(a.Args)
	a.Proc = harness.StartProcess(a.t, harness.ProcessOptions{Path: path, Args: args, Name: "mesh-agent", Launcher: a.WrapperLaunches})
	agents.Store(a.Socket, a)
}

// launchReady is launch, then wait until the agent reports ready.
func (a *agent) launchReady(ctx context.Context) {
	a.t.Helper()
	a.launch()
	a.waitReady(ctx)
}

// uninstall runs `mesh-agent uninstall` with the flags the agent ran with.
func (a *agent) uninstall(ctx context.Context) {
	a.t.Helper()
	if len(a.Args) == 0 || a.Args[0] != "run" {
		a.t.Fatalf("agent args %q do not start with run", a.Args)
	}
	ctx, cancel := context.WithTimeout(ctx, time.Minute)
	defer cancel()
	path, args := a.command(append([]string{"uninstall"}, a.Args[1:]...))
	out, err := exec.CommandContext(ctx, path, args...).CombinedOutput()
	if err != nil {
		a.t.Fatalf("mesh-agent uninstall: %v\n%s", err, out)
	}
	a.t.Logf("mesh-agent uninstall:\n%s", out)
}

// health asks the agent's grpc.health.v1 service for the overall status.
func (a *agent) health(ctx context.Context) (healthpb.HealthCheckResponse_ServingStatus, error) {
	conn, err := gaterpc.Dial(a.Socket)
	if err != nil {
		return 0, err
	}
	defer conn.Close()
	ctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	resp, err := healthpb.NewHealthClient(conn).Check(ctx, &healthpb.HealthCheckRequest{}, grpc.WaitForReady(true))
	if err != nil {
		return 0, fmt.Errorf("health check on %s: %w", a.Socket, err)
	}
	return resp.GetStatus(), nil
}

func (a *agent) wantHealth(ctx context.Context, want healthpb.HealthCheckResponse_ServingStatus) {
	a.t.Helper()
	got, err := a.health(ctx)
	if err != nil {
		a.t.Fatal(err)
	}
	if got != want {
		a.t.Fatalf("agent health is %s, want %s", got, want)
	}
}

// enrolled is the set of container ids the agent holds enrollment records for.
func (a *agent) enrolled(ctx context.Context) map[string]bool {
	a.t.Helper()
	out := map[string]bool{}
	for _, e := range a.list(ctx).GetEnrollments() {
		out[e.GetAttachment().GetContainerId()] = true
	}
	return out
}

// primaryConflist is the primary network's conflist as the test's "primary CNI"
// writes it: bridge only, tagged with gen.
func primaryConflist(t testing.TB, node *harness.Node, gen int) []byte {
	t.Helper()
	raw, err := node.ConflistJSON("meshnet")
	if err != nil {
		t.Fatal(err)
	}
	var m map[string]any
	if err := json.Unmarshal(raw, &m); err != nil {
		t.Fatal(err)
	}
	m[generationKey] = gen
	out, err := json.MarshalIndent(m, "", "  ")
	if err != nil {
		t.Fatal(err)
	}
	return out
}

// confState is what a runtime would make of one config file.
type confState struct {
	err     error    // nil when libcni parses it as a conflist
	plugins []string // plugin types in order
	gen     int      // generationKey, -1 when absent
	mesh    map[string]any
}

// meshLast reports whether mesh-cni is the last plugin, and the only one.
func (s confState) meshLast() bool {
	return s.err == nil && len(s.plugins) > 0 && s.plugins[len(s.plugins)-1] == "mesh-cni" &&
		slices.Index(s.plugins, "mesh-cni") == len(s.plugins)-1
}

func parseConf(data []byte) confState {
	st := confState{gen: -1}
	list, err := libcni.ConfListFromBytes(data)
	if err != nil {
		st.err = err
		return st
	}
	for _, p := range list.Plugins {
		st.plugins = append(st.plugins, p.Network.Type)
		if p.Network.Type == "mesh-cni" {
			_ = json.Unmarshal(p.Bytes, &st.mesh)
		}
	}
	var top map[string]any
	if err := json.Unmarshal(data, &top); err == nil {
		if g, ok := top[generationKey].(float64); ok {
			st.gen = int(g)
		}
	}
	return st
}

func readConf(path string) (confState, []byte) {
	data, err := os.ReadFile(path)
	if err != nil {
		return confState{err: err, gen: -1}, nil
	}
	return parseConf(data), data
}

// listHasMesh reports whether a loaded chain runs mesh-cni.
func listHasMesh(list *libcni.NetworkConfigList) bool {
	for _, p := range list.Plugins {
		if p.Network.Type == "mesh-cni" {
			return true
		}
	}
	return false
}

// waitEntry polls path until it carries the mesh-cni entry last and derives
// from generation gen, for at most limit; it returns how long that took.
// It looks every millisecond, as the time it returns is a measure.
func waitEntry(path string, gen int, start time.Time, limit time.Duration) (time.Duration, error) {
	var st confState
	if fixtures.Eventually(context.Background(), limit-time.Since(start), time.Millisecond, func() bool {
		st, _ = readConf(path)
		return st.meshLast() && st.gen == gen
	}) {
		return time.Since(start), nil
	}
	return time.Since(start), fmt.Errorf("%s does not carry the mesh-cni entry for generation %d after %v (plugins %v, generation %d, %v)",
		filepath.Base(path), gen, limit, st.plugins, st.gen, st.err)
}

// waitPodInterface waits until the primary plugin has created eth0 in the pod:
// from then on only mesh-cni holds its ADD.
func waitPodInterface(t testing.TB, pod *harness.Pod) {
	t.Helper()
	fixtures.WaitFor(t, 30*time.Second, "the primary plugin to create eth0 in pod "+pod.Name, func() bool {
		return netns.Do(pod.NetNSPath, func() error { _, err := net.InterfaceByName("eth0"); return err }) == nil
	})
}

type addOutcome struct {
	res types.Result
	err error
	at  time.Time
}

// addAsync runs the pod's ADD of list in the background. If the test ends
// first, its cleanup cancels the ADD and waits for it, so no plugin process
// outlives the test.
func addAsync(ctx context.Context, t testing.TB, node *harness.Node, pod *harness.Pod, list *libcni.NetworkConfigList) <-chan addOutcome {
	ctx, cancel := context.WithCancel(ctx)
	done := make(chan addOutcome, 1)
	finished := make(chan struct{})
	go func() {
		defer close(finished)
		res, err := node.Add(ctx, pod, list)
		done <- addOutcome{res, err, time.Now()}
	}()
	t.Cleanup(func() {
		cancel()
		<-finished
	})
	return done
}

// assertHeld checks that an ADD is still waiting after a while.
func assertHeld(t testing.TB, done <-chan addOutcome, why string) {
	t.Helper()
	select {
	case r := <-done:
		t.Fatalf("ADD completed %s (err %v): it must wait", why, r.err)
	case <-time.After(2 * time.Second):
	}
}

func awaitAdd(t testing.TB, done <-chan addOutcome, what string) addOutcome {
	t.Helper()
	select {
	case r := <-done:
		if r.err != nil {
			t.Fatalf("ADD %s: %v", what, r.err)
		}
		return r
	case <-time.After(2 * time.Minute):
		t.Fatalf("ADD %s did not complete", what)
		return addOutcome{}
	}
}

// TestInstallWaitsForPrimaryConfig: an agent started on a node with no CNI
// config yet is not ready and holds pods; once the primary network writes its
// conflist the agent installs itself, and the held ADD completes enrolled.
func TestInstallWaitsForPrimaryConfig(t *testing.T) {
	t.Parallel()
	ctx := testContext(t)
	node := installNode(t)
	a := newInstallAgent(t, node)
	a.launch()
	binary := filepath.Join(node.BinDir, "mesh-cni")

	waitCtx, cancel := context.WithTimeout(ctx, 30*time.Second)
	_, err := a.Proc.WaitForLine(waitCtx, "Waiting for the primary CNI config")
	cancel()
	if err != nil {
		t.Fatal(err)
	}
	a.wantHealth(ctx, healthpb.HealthCheckResponse_NOT_SERVING)
	// The binary goes in first, so a runtime that later sees the entry finds
	// the plugin; with no primary there is nothing to chain onto yet.
	if fi, err := os.Stat(binary); err != nil || fi.Mode().Perm() != 0o755 {
		t.Fatalf("mesh-cni binary not installed before the config: %v", err)
	}
	if entries, err := os.ReadDir(node.ConfDir); err != nil || len(entries) != 0 {
		t.Fatalf("agent wrote into the conf dir with no primary config: %v %v", entries, err)
	}

	pod := node.NewPod(t, "shop", "early")
	done := addAsync(ctx, t, node, pod, node.Conflist(t, "meshnet", a.meshEntry("60s")))
	waitPodInterface(t, pod)
	assertHeld(t, done, "while the node has no primary CNI config")
	a.wantHealth(ctx, healthpb.HealthCheckResponse_NOT_SERVING)

	written := time.Now()
	path := node.WriteConf(t, primaryFile, primaryConflist(t, node, 0))
	took, err := waitEntry(path, 0, written, 30*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("chain entry installed %v after the primary config appeared", took)
	st, _ := readConf(path)
	if !slices.Equal(st.plugins, []string{"bridge", "mesh-cni"}) {
		t.Fatalf("installed chain is %v, want [bridge mesh-cni]", st.plugins)
	}
	if st.mesh["socketPath"] != a.Socket {
		t.Fatalf("installed entry points at %v, want %s", st.mesh["socketPath"], a.Socket)
	}
	src, err := os.ReadFile(harness.Bins(t).Path("mesh-cni"))
	if err != nil {
		t.Fatal(err)
	}
	if got, err := os.ReadFile(binary); err != nil || !bytes.Equal(got, src) {
		t.Fatalf("installed mesh-cni binary differs from the build (%d vs %d bytes): %v", len(got), len(src), err)
	}

	r := awaitAdd(t, done, "held for the primary config")
	t.Logf("held ADD completed %v after the primary config was written", r.at.Sub(written))
	if err := harness.WaitForHealthy(ctx, a.Socket); err != nil {
		t.Fatal(err)
	}
	if !a.enrolled(ctx)[pod.ContainerID] {
		t.Fatal("the held pod completed ADD but the agent has no record of it")
	}

	// A runtime loading the node's config now gets the installed chain.
	list, file, err := node.LoadConflist()
	if err != nil || file != path || !listHasMesh(list) {
		t.Fatalf("runtime loads %s (mesh-cni: %v), want %s with mesh-cni: %v", file, list != nil && listHasMesh(list), path, err)
	}
	late := node.NewPod(t, "shop", "late")
	if _, err := node.Add(ctx, late, list); err != nil {
		t.Fatal(err)
	}
	if !a.enrolled(ctx)[late.ContainerID] {
		t.Fatal("pod added through the installed chain is not enrolled")
	}
}

// healthWatch follows the agent's readiness through grpc.health.v1 Watch.
type healthWatch struct {
	mu     sync.Mutex
	events []healthpb.HealthCheckResponse_ServingStatus
	err    error
}

func watchHealth(t testing.TB, socket string) *healthWatch {
	t.Helper()
	conn, err := gaterpc.Dial(socket)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	stream, err := healthpb.NewHealthClient(conn).Watch(ctx, &healthpb.HealthCheckRequest{}, grpc.WaitForReady(true))
	if err != nil {
		cancel()
		conn.Close()
		t.Fatalf("watch health: %v", err)
	}
	w := &healthWatch{}
	done := make(chan struct{})
	go func() {
		defer close(done)
		for {
			resp, err := stream.Recv()
			w.mu.Lock()
			if err != nil {
				if ctx.Err() == nil {
					w.err = err
				}
				w.mu.Unlock()
				return
			}
			w.events = append(w.events, resp.GetStatus())
			w.mu.Unlock()
		}
	}()
	t.Cleanup(func() {
		cancel()
		<-done
		conn.Close()
	})
	return w
}

// since returns the statuses received after the first n, and the total.
func (w *healthWatch) since(n int) ([]healthpb.HealthCheckResponse_ServingStatus, int, error) {
	w.mu.Lock()
	defer w.mu.Unlock()
	return slices.Clone(w.events[min(n, len(w.events)):]), len(w.events), w.err
}

// waitServing waits until the latest status received is SERVING.
func (w *healthWatch) waitServing(t testing.TB) {
	t.Helper()
	fixtures.WaitFor(t, 30*time.Second, "the agent to report SERVING again", func() bool {
		w.mu.Lock()
		defer w.mu.Unlock()
		if w.err != nil {
			t.Fatalf("health watch: %v", w.err)
		}
		return len(w.events) > 0 && w.events[len(w.events)-1] == healthpb.HealthCheckResponse_SERVING
	})
}

// rewriteCount is how often the primary rewrites its file in the rewrite loop.
const rewriteCount = 100

// TestChainEntryRewriteLoop: the primary CNI rewrites its conflist (without our
// entry) again and again, and right after each rewrite a runtime loads the
// config and ADDs a pod.
//
// In chain mode the entry lives in the primary's own file, so between the
// rewrite and the repair the file a runtime loads has no mesh-cni: a pod
// ADDed then starts unmeshed. What chain mode guarantees is that the window
// is short (the entry is back within a second), that the agent's readiness
// follows the entry, and that every pod whose chain did run mesh-cni is
// enrolled. The test logs how many ADDs fell into the window (all of them,
// since each loads right after a rewrite).
//
// In owned mode the runtime loads the agent's merged file, which sorts first
// and is never without the entry: no pod may ever start unmeshed.
func TestChainEntryRewriteLoop(t *testing.T) {
	t.Parallel()
	// The entry in the primary's file (chain) and in a merged file of its own.
	fixtures.Both(t, "chain", "owned", rewriteLoop)
}

func rewriteLoop(t *testing.T, owned bool) {
	ctx := testContext(t)
	node := installNode(t)
	var extra []string
	if owned {
		extra = append(extra, "--owned-config")
	}
	a := newInstallAgent(t, node, append(extra, "--datapath=none")...)
	primary := node.WriteConf(t, primaryFile, primaryConflist(t, node, 0))
	entryFile := primary
	if owned {
		entryFile = filepath.Join(node.ConfDir, ownedFile)
	}
	a.launchReady(ctx)
	if _, err := waitEntry(entryFile, 0, time.Now(), 30*time.Second); err != nil {
		t.Fatal(err)
	}
	health := watchHealth(t, a.Socket)
	health.waitServing(t)

	type addRecord struct {
		pod  *harness.Pod
		mesh bool   // the chain the runtime loaded runs mesh-cni
		file string // the file it loaded
	}
	var (
		adds       []addRecord
		unmeshed   int
		notDropped []int
		maxBack    time.Duration
		totalBack  time.Duration
	)
	start := time.Now()
	for i := 1; i <= rewriteCount; i++ {
		pod := node.NewPod(t, "rewrite", fmt.Sprintf("pod-%d", i))
		_, seen, _ := health.since(0)

		written := time.Now()
		node.WriteConf(t, primaryFile, primaryConflist(t, node, i))
		// A runtime creating a pod right now.
		list, file, err := node.LoadConflist()
		if err != nil {
			t.Fatalf("rewrite %d: runtime cannot load the config: %v", i, err)
		}
		rec := addRecord{pod: pod, mesh: listHasMesh(list), file: filepath.Base(file)}
		if !rec.mesh {
			unmeshed++
		}
		if owned && (!rec.mesh || rec.file != ownedFile) {
			t.Errorf("rewrite %d: the runtime loaded %s without mesh-cni (%v): the pod would start unmeshed", i, rec.file, rec.mesh)
		}
		done := addAsync(ctx, t, node, pod, list)

		back, err := waitEntry(entryFile, i, written, repairLimit)
		if err != nil {
			t.Errorf("rewrite %d: %v", i, err)
			if back, err = waitEntry(entryFile, i, written, 30*time.Second); err != nil {
				t.Fatal(err)
			}
		}
		maxBack = max(maxBack, back)
		totalBack += back
		awaitAdd(t, done, fmt.Sprintf("after rewrite %d", i))
		adds = append(adds, rec)

		health.waitServing(t)
		statuses, _, err := health.since(seen)
		if err != nil {
			t.Fatal(err)
		}
		if !slices.Contains(statuses, healthpb.HealthCheckResponse_NOT_SERVING) {
			notDropped = append(notDropped, i)
		}
	}
	elapsed := time.Since(start)

	enrolled := a.enrolled(ctx)
	for i, r := range adds {
		switch {
		case r.mesh && !enrolled[r.pod.ContainerID]:
			t.Errorf("pod %d completed ADD through mesh-cni but the agent has no record of it", i+1)
		case !r.mesh && enrolled[r.pod.ContainerID]:
			t.Errorf("pod %d never reached mesh-cni but the agent enrolled it", i+1)
		}
	}
	mode := "chain"
	if owned {
		mode = "owned"
	}
	t.Logf("%s mode: %d rewrites in %v; entry back after max %v, mean %v; %d/%d ADDs loaded a chain without mesh-cni (started unmeshed); readiness did not drop in %d rewrites %v",
		mode, rewriteCount, elapsed.Round(time.Millisecond), maxBack.Round(time.Microsecond), (totalBack / rewriteCount).Round(time.Microsecond),
		unmeshed, rewriteCount, len(notDropped), notDropped)
	// Readiness follows what the installer sees: it drops when the event of
	// the rewrite arrives and returns with the repair (waitServing above).
	// When a pass is already due (armed by the event of the installer's own
	// previous write) it may run before the rewrite's event is read and
	// repair at once, so readiness never drops for that (shorter) window;
	// that happens in a few percent of rewrites here. What must hold is
	// that readiness does follow the entry.
	if !owned && len(notDropped) == rewriteCount {
		t.Errorf("readiness never dropped while the entry was missing")
	}
	if owned && unmeshed > 0 {
		t.Errorf("owned mode: %d ADDs ran without mesh-cni", unmeshed)
	}
}

// TestChainEntryConcurrentReader: while the agent repairs its entry over and
// over, readers load the config as a runtime does in a tight loop and never see
// a truncated or unparsable file.
func TestChainEntryConcurrentReader(t *testing.T) {
	t.Parallel()
	fixtures.Both(t, "chain", "owned", concurrentReader)
}

func concurrentReader(t *testing.T, owned bool) {
	const rewrites = 50
	ctx := testContext(t)
	node := installNode(t)
	extra := []string{"--datapath=none"}
	if owned {
		extra = append(extra, "--owned-config")
	}
	a := newInstallAgent(t, node, extra...)
	node.WriteConf(t, primaryFile, primaryConflist(t, node, 0))
	entryFile := filepath.Join(node.ConfDir, primaryFile)
	if owned {
		entryFile = filepath.Join(node.ConfDir, ownedFile)
	}
	a.launchReady(ctx)
	if _, err := waitEntry(entryFile, 0, time.Now(), 30*time.Second); err != nil {
		t.Fatal(err)
	}

	type readerStats struct {
		reads, withEntry, withoutEntry atomic.Int64
		mu                             sync.Mutex
		failures                       []string
	}
	var fileStats, dirStats readerStats
	fail := func(s *readerStats, msg string) {
		s.mu.Lock()
		defer s.mu.Unlock()
		if len(s.failures) < 10 {
			s.failures = append(s.failures, msg)
		}
	}
	stop := make(chan struct{})
	var wg sync.WaitGroup
	// reader calls read in a loop of its own until the readers are stopped.
	reader := func(read func()) {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for {
				select {
				case <-stop:
					return
				default:
				}
				read()
			}
		}()
	}
	// The file carrying the entry, read and parsed as libcni does.
	reader(func() {
		data, err := os.ReadFile(entryFile)
		fileStats.reads.Add(1)
		if err != nil {
			fail(&fileStats, err.Error())
			return
		}
		if _, err := libcni.ConfListFromBytes(data); err != nil {
			fail(&fileStats, fmt.Sprintf("%v: %q", err, data))
			return
		}
		if parseConf(data).meshLast() {
			fileStats.withEntry.Add(1)
		} else {
			fileStats.withoutEntry.Add(1)
		}
	})
	// The whole directory, picked as a runtime picks its network.
	reader(func() {
		list, _, err := node.LoadConflist()
		dirStats.reads.Add(1)
		switch {
		case err != nil:
			fail(&dirStats, err.Error())
		case listHasMesh(list):
			dirStats.withEntry.Add(1)
		default:
			dirStats.withoutEntry.Add(1)
			if owned {
				fail(&dirStats, "owned mode: the runtime's config has no mesh-cni")
			}
		}
	})
	stopReaders := sync.OnceFunc(func() {
		close(stop)
		wg.Wait()
	})
	t.Cleanup(stopReaders)

	var maxBack time.Duration
	for i := 1; i <= rewrites; i++ {
		written := time.Now()
		node.WriteConf(t, primaryFile, primaryConflist(t, node, i))
		back, err := waitEntry(entryFile, i, written, 30*time.Second)
		if err != nil {
			t.Fatal(err)
		}
		maxBack = max(maxBack, back)
	}
	stopReaders()

	t.Logf("%d repairs (max %v): file reader %d reads (%d with the entry, %d without); directory reader %d loads (%d with mesh-cni, %d without)",
		rewrites, maxBack.Round(time.Microsecond), fileStats.reads.Load(), fileStats.withEntry.Load(), fileStats.withoutEntry.Load(),
		dirStats.reads.Load(), dirStats.withEntry.Load(), dirStats.withoutEntry.Load())
	for _, s := range []struct {
		name  string
		stats *readerStats
	}{{"file reader", &fileStats}, {"directory reader", &dirStats}} {
		if len(s.stats.failures) > 0 {
			t.Errorf("%s failed: %s", s.name, strings.Join(s.stats.failures, "\n"))
		}
		if s.stats.reads.Load() < rewrites {
			t.Errorf("%s read only %d times during %d repairs", s.name, s.stats.reads.Load(), rewrites)
		}
	}
}

// TestAgentRestartInstallKeepsEntry: stopping the agent (SIGTERM, then kill
// -9) leaves the chain entry and the pinned data path in place; pods created
// while the agent is away wait in mesh-cni and complete once it is back.
func TestAgentRestartInstallKeepsEntry(t *testing.T) {
	t.Parallel()
	ctx := testContext(t)
	node := installNode(t)
	a := newInstallAgent(t, node)
	path := node.WriteConf(t, primaryFile, primaryConflist(t, node, 0))
	a.launchReady(ctx)
	if _, err := waitEntry(path, 0, time.Now(), 30*time.Second); err != nil {
		t.Fatal(err)
	}
	list, _, err := node.LoadConflist()
	if err != nil {
		t.Fatal(err)
	}
	first := addMeshPod(ctx, t, node, list, "shop", "before")
	_, cookie := podPinDir(t, a, first.Pod)

	installed, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	inode := fixtures.Inode(t, path)
	binary := filepath.Join(node.BinDir, "mesh-cni")

	// checkInPlace: the entry, the binary and the data path are all still there.
	checkInPlace := func(when string) {
		t.Helper()
		if got, err := os.ReadFile(path); err != nil || !bytes.Equal(got, installed) {
			t.Fatalf("%s: the conf file changed (%v):\n%s", when, err, got)
		}
		if fixtures.Inode(t, path) != inode {
			t.Fatalf("%s: the conf file was rewritten (new inode)", when)
		}
		if _, err := os.Stat(binary); err != nil {
			t.Fatalf("%s: mesh-cni binary: %v", when, err)
		}
		for _, pin := range []string{"maps/pods", "links/connect4", "links/connect6"} {
			if _, err := os.Stat(filepath.Join(a.BPFFS, pin)); err != nil {
				t.Fatalf("%s: pin %s: %v", when, pin, err)
			}
		}
		podPinDir(t, a, first.Pod) // the records survive too (lists through the agent when it runs)
	}

	for _, stop := range []struct {
		name string
		fn   func()
	}{
		{"SIGTERM", func() { a.stop(ctx) }},
		{"SIGKILL", func() { a.kill() }},
	} {
		stop.fn()
		// podPinDir needs the agent; check the pins directly while it is down.
		if _, err := os.Stat(filepath.Join(a.BPFFS, "pods", fmt.Sprint(cookie))); err != nil {
			t.Fatalf("after %s: the enrolled pod's link pins: %v", stop.name, err)
		}
		if !settingsEntryExists(t, a, cookie) {
			t.Fatalf("after %s: the enrolled pod's settings entry is gone", stop.name)
		}
		if got, err := os.ReadFile(path); err != nil || !bytes.Equal(got, installed) {
			t.Fatalf("after %s: the conf file changed (%v):\n%s", stop.name, err, got)
		}

		// A runtime creating a pod meanwhile still loads the chain with
		// mesh-cni, and the pod waits.
		list, _, err := node.LoadConflist()
		if err != nil || !listHasMesh(list) {
			t.Fatalf("after %s the runtime loads a chain without mesh-cni: %v", stop.name, err)
		}
		pod := node.NewPod(t, "shop", "while-down-"+strings.ToLower(stop.name))
		done := addAsync(ctx, t, node, pod, list)
		waitPodInterface(t, pod)
		assertHeld(t, done, "with the agent down after "+stop.name)

		restarted := time.Now()
		a.launchReady(ctx)
		r := awaitAdd(t, done, "held across the restart after "+stop.name)
		t.Logf("after %s: held ADD completed %v after the agent was started again", stop.name, r.at.Sub(restarted))
		if !a.enrolled(ctx)[pod.ContainerID] {
			t.Fatalf("after %s: the held pod is not enrolled", stop.name)
		}
		checkInPlace("after restart from " + stop.name)
	}
}

// TestUninstallRestoresNode: `mesh-agent uninstall` with the agent's flags puts
// the node back as it was: the primary file has its original bytes (and name
// and mode), the owned file and the plugin binary are gone, and the pinned
// data path is removed.
func TestUninstallRestoresNode(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name  string
		file  string // the primary's file name
		owned bool
	}{
		{"chain", primaryFile, false},
		{"chain-conf", "10-meshnet.conf", false},
		{"owned", primaryFile, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			ctx := testContext(t)
			node := installNode(t)
			var extra []string
			if tc.owned {
				extra = append(extra, "--owned-config")
			}
			a := newInstallAgent(t, node, extra...)
			original := originalPrimary(t, node, tc.file)
			path := node.WriteConf(t, tc.file, original)
			if err := os.Chmod(path, 0o640); err != nil {
				t.Fatal(err)
			}
			a.launchReady(ctx)
			list, loaded, err := node.LoadConflist()
			if err != nil || !listHasMesh(list) {
				t.Fatalf("after install the runtime loads %s without mesh-cni: %v", loaded, err)
			}
			pod := addMeshPod(ctx, t, node, list, "shop", "app")
			podPinDir(t, a, pod.Pod)
			if _, err := os.Stat(filepath.Join(a.installStateDir(), "cni-install.json")); err != nil {
				t.Fatalf("install record: %v", err)
			}
			a.stop(ctx)

			a.uninstall(ctx)

			got, err := os.ReadFile(path)
			if err != nil {
				t.Fatal(err)
			}
			if !bytes.Equal(got, original) {
				t.Fatalf("primary file not restored to its original bytes:\n got %q\nwant %q", got, original)
			}
			if fi, err := os.Stat(path); err != nil || fi.Mode().Perm() != 0o640 {
				t.Fatalf("primary file mode not restored: %v %v", fi.Mode(), err)
			}
			if names := dirNames(t, node.ConfDir); !slices.Equal(names, []string{tc.file}) {
				t.Fatalf("conf dir holds %v after uninstall, want only %s", names, tc.file)
			}
			if binNames := dirNames(t, node.BinDir); !slices.Equal(binNames, harness.ReferencePluginNames()) {
				t.Fatalf("bin dir holds %v after uninstall, want only the reference plugins %v", binNames, harness.ReferencePluginNames())
			}
			if _, err := os.Stat(filepath.Join(a.installStateDir(), "cni-install.json")); !errors.Is(err, os.ErrNotExist) {
				t.Fatalf("install record still present after uninstall: %v", err)
			}
			assertNoPins(t, a.BPFFS)

			// The node works without the mesh: a runtime deletes the pod
			// through the restored config and adds a new one.
			restored, _, err := node.LoadConflist()
			if err != nil || listHasMesh(restored) {
				t.Fatalf("after uninstall the runtime loads mesh-cni or nothing: %v", err)
			}
			if err := node.Del(ctx, pod.Pod, restored); err != nil {
				t.Fatal(err)
			}
			if _, err := node.Add(ctx, node.NewPod(t, "shop", "after"), restored); err != nil {
				t.Fatalf("ADD through the restored config: %v", err)
			}
		})
	}
}

// originalPrimary is a primary config with formatting no encoder would
// produce (tabs, key order, blank lines), so only a byte-exact restore matches.
func originalPrimary(t testing.TB, node *harness.Node, name string) []byte {
	t.Helper()
	raw, err := node.ConflistJSON("meshnet")
	if err != nil {
		t.Fatal(err)
	}
	var parsed struct {
		Plugins []json.RawMessage `json:"plugins"`
	}
	if err := json.Unmarshal(raw, &parsed); err != nil {
		t.Fatal(err)
	}
	var bridge bytes.Buffer
	if err := json.Indent(&bridge, parsed.Plugins[0], "\t", "\t"); err != nil {
		t.Fatal(err)
	}
	if strings.HasSuffix(name, ".conf") {
		// A single-plugin config: the bridge with the network's name and version.
		plugin := strings.TrimPrefix(bridge.String(), "{")
		return fmt.Appendf(nil, "{\n\t\"name\":   \"meshnet\",\n\t\"cniVersion\": %q,%s\n\n", harness.CNIVersion, plugin)
	}
	return fmt.Appendf(nil, "{\n\t\"plugins\": [\n\t%s\n\t],\n\t\"name\":   \"meshnet\",\n\t\"cniVersion\": %q\n}\n\n", bridge.String(), harness.CNIVersion)
}

// dirNames is the names in dir, sorted as os.ReadDir sorts them.
func dirNames(t testing.TB, dir string) []string {
	t.Helper()
	entries, err := os.ReadDir(dir)
	if err != nil {
		t.Fatal(err)
	}
	var names []string
	for _, e := range entries {
		names = append(names, e.Name())
	}
	return names
}

// assertNoPins checks that the bpffs directory is gone, or empty and no longer
// a mount.
func assertNoPins(t testing.TB, dir string) {
	t.Helper()
	entries, err := os.ReadDir(dir)
	if err != nil && !errors.Is(err, os.ErrNotExist) {
		t.Fatal(err)
	}
	if len(entries) > 0 {
		var names []string
		for _, e := range entries {
			names = append(names, e.Name())
		}
		t.Fatalf("bpffs %s still holds %v after uninstall", dir, names)
	}
	f, err := os.Open("/proc/self/mountinfo")
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		if fields := strings.Fields(sc.Text()); len(fields) > 4 && fields[4] == dir {
			t.Fatalf("%s is still mounted after uninstall", dir)
		}
	}
	if err := sc.Err(); err != nil {
		t.Fatal(err)
	}
}
