package e2e

import (
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/cilium/ebpf"

	"github.com/mesh-cni/mesh-cni/internal/netns"
	"github.com/mesh-cni/mesh-cni/test/harness"
)

// enrolledCookies maps each pod's container id to its netns cookie.
func enrolledCookies(t *testing.T, pods ...*meshPod) map[string]uint64 {
	t.Helper()
	out := map[string]uint64{}
	for _, p := range pods {
		out[p.ContainerID] = cookieOf(t, p.Pod)
	}
	return out
}

// TestStaleNamespacesReleased is a node whose pods vanish without DEL (a crash,
// a runtime that lost track): their namespaces are deleted and nobody tells the
// agent. The periodic reconcile releases them while the agent runs, the start-up
// reconcile those that went while it was down; records, settings entries and
// pins return to exactly the live pods, which stay intact.
func TestStaleNamespacesReleased(t *testing.T) {
	t.Parallel()
	ctx := testContext(t)
	a, node, list := meshedNode(ctx, t, "30s", "--reconcile-interval", "1s")
	var pods []*meshPod
	for i := range 8 {
		pods = append(pods, addMeshPod(ctx, t, node, list, "shop", fmt.Sprintf("p%d", i)))
	}
	addMeshPod(ctx, t, node, list, "kube-system", "system") // never enrolled
	waitMeshState(ctx, t, a, enrolledCookies(t, pods...), 10*time.Second)

	// While the agent runs: three namespaces vanish.
	for _, p := range pods[:3] {
		if err := netns.Remove(p.NetNSPath); err != nil {
			t.Fatal(err)
		}
	}
	st := waitMeshState(ctx, t, a, enrolledCookies(t, pods[3:]...), 15*time.Second)
	t.Logf("periodic reconcile: 3 namespaces deleted, agent now holds %v", st)

	// While the agent is down: three more.
	a.kill()
	for _, p := range pods[3:6] {
		if err := netns.Remove(p.NetNSPath); err != nil {
			t.Fatal(err)
		}
	}
	a.start(ctx)
	live := pods[6:]
	st = readMeshState(ctx, t, a) // the start-up reconcile ran before ready
	if d := st.diff(enrolledCookies(t, live...)); d != "" {
		t.Fatalf("after the start-up reconcile: %s", d)
	}
	t.Logf("start-up reconcile: 3 more deleted while the agent was down, agent now holds %v", st)

	// The live pods are intact, and the runtime's late DELs for the vanished
	// ones (the namespace path no longer exists) succeed.
	for _, p := range live {
		if err := node.Check(ctx, p.Pod, list); err != nil {
			t.Fatalf("live pod after reconcile: %v", err)
		}
	}
	for _, p := range pods[:6] {
		if err := node.Del(ctx, p.Pod, list); err != nil {
			t.Fatalf("late DEL of a vanished pod: %v", err)
		}
	}
	if d := readMeshState(ctx, t, a).diff(enrolledCookies(t, live...)); d != "" {
		t.Fatalf("after the late DELs: %s", d)
	}
}

// TestLeftoversFromOlderRun starts an agent on a node an older run left in a
// mess: redirection pinned for a pod no record knows (its agent was killed, its
// records lost, its namespace deleted), the pin dir of an enrollment that never
// finished, an interrupted record write and a truncated record. The agent comes
// up ready and clean, keeps the pod that is still there, and does not keep
// tripping over what it cleaned.
func TestLeftoversFromOlderRun(t *testing.T) {
	t.Parallel()
	ctx := testContext(t)
	a, node, list := meshedNode(ctx, t, "30s", "--reconcile-interval", "1s")
	lost := addMeshPod(ctx, t, node, list, "shop", "lost")
	kept := addMeshPod(ctx, t, node, list, "shop", "kept")
	later := []*meshPod{addMeshPod(ctx, t, node, list, "shop", "later-0"), addMeshPod(ctx, t, node, list, "shop", "later-1")}
	lostCookie := cookieOf(t, lost.Pod)
	waitMeshState(ctx, t, a, enrolledCookies(t, append([]*meshPod{lost, kept}, later...)...), 10*time.Second)

	a.kill()
	// The lost pod: its record and its namespace go, its pins stay. Records
	// are named by a hash of their key: find the file by its content.
	entries, err := os.ReadDir(a.StateDir)
	if err != nil {
		t.Fatal(err)
	}
	removed := 0
	for _, e := range entries {
		path := filepath.Join(a.StateDir, e.Name())
		data, err := os.ReadFile(path)
		if err != nil {
			t.Fatal(err)
		}
		if strings.Contains(string(data), lost.ContainerID) {
			if err := os.Remove(path); err != nil {
				t.Fatal(err)
			}
			removed++
		}
	}
	if removed != 1 {
		t.Fatalf("removed %d record files of the lost pod, want 1", removed)
	}
	if err := netns.Remove(lost.NetNSPath); err != nil {
		t.Fatal(err)
	}
	// An enrollment interrupted before its settings entry was written.
	unfinished := filepath.Join(a.BPFFS, "pods", "987654321")
	if err := os.Mkdir(unfinished, 0o700); err != nil {
		t.Fatal(err)
	}
	// An interrupted write and a truncated record.
	tmp := filepath.Join(a.StateDir, ".tmp-0123456789abcdef0123456789abcdef.json-42")
	if err := os.WriteFile(tmp, []byte(`{"key":{"netw`), 0o600); err != nil {
		t.Fatal(err)
	}
	truncated := filepath.Join(a.StateDir, "fedcba9876543210fedcba9876543210.json")
	if err := os.WriteFile(truncated, []byte(`{"key":{"network":"meshnet","containerID":"abc","ifname":"eth0"},"namespace":"sh`), 0o600); err != nil {
		t.Fatal(err)
	}
	if !settingsCookies(t, a)[lostCookie] {
		t.Fatal("the lost pod's settings entry is not there to begin with")
	}

	a.start(ctx)
	st := readMeshState(ctx, t, a) // the start-up reconcile ran before ready
	if d := st.diff(enrolledCookies(t, append([]*meshPod{kept}, later...)...)); d != "" {
		t.Fatalf("after start on leftovers: %s", d)
	}
	if _, err := os.Stat(tmp); !os.IsNotExist(err) {
		t.Fatalf("interrupted write still there: %v", err)
	}
	if _, err := os.Stat(truncated); !os.IsNotExist(err) {
		t.Fatalf("truncated record still under its name: %v", err)
	}
	if _, err := os.Stat(truncated + ".corrupt"); err != nil {
		t.Fatalf("truncated record not moved aside: %v", err)
	}
	if _, err := os.Stat(unfinished); !os.IsNotExist(err) {
		t.Fatalf("pin dir of an unfinished enrollment still there: %v", err)
	}
	if err := node.Check(ctx, kept.Pod, list); err != nil {
		t.Fatalf("kept pod after start on leftovers: %v", err)
	}

	// Two more periodic passes, each waited for by what only it can do
	// (release a pod whose namespace went): the agent does not trip over what
	// it cleaned at start.
	for i, p := range later {
		if err := netns.Remove(p.NetNSPath); err != nil {
			t.Fatal(err)
		}
		waitMeshState(ctx, t, a, enrolledCookies(t, append([]*meshPod{kept}, later[i+1:]...)...), 15*time.Second)
	}
	out := a.Proc.Output()
	for _, bad := range []string{"reconcile finished with errors", "pod redirection broken", "panic"} {
		if n := strings.Count(out, bad); n != 0 {
			t.Errorf("agent log has %q %d times", bad, n)
		}
	}
	for _, line := range strings.Split(out, "\n") {
		switch {
		case strings.Contains(line, `"level":"error"`):
			t.Errorf("agent logged an error: %s", line)
		case strings.Contains(line, `"level":"warn"`):
			t.Logf("agent warned (once, at start, is expected): %s", line)
		}
	}
	if n := strings.Count(out, "pod state problem repaired at start"); n != 1 {
		t.Errorf("agent reported %d state problems at start, want 1 (the truncated record)", n)
	}
	if n := strings.Count(out, "orphan redirection released"); n != 1 {
		t.Errorf("agent released %d orphans, want 1 (the lost pod)", n)
	}
	if _, err := os.Stat(truncated + ".corrupt"); err != nil {
		t.Fatalf("the moved-aside record went away: %v", err)
	}
	t.Logf("leftovers: start-up reconcile released the lost pod (cookie %d), removed 1 unfinished pin dir, 1 interrupted write, moved 1 truncated record aside; agent holds %v",
		lostCookie, readMeshState(ctx, t, a))
}

// TestReconcileRacingAdd: reconcile passes running back to back while pods are
// added must never take an ADD's fresh redirection for an orphan. Every pod is
// redirected when its ADD returns, and the agent neither releases orphans nor
// repairs anything, since nothing was ever broken.
func TestReconcileRacingAdd(t *testing.T) {
	t.Parallel()
	ctx := testContext(t)
	a, node, list := meshedNode(ctx, t, "30s", "--reconcile-interval", "2ms", "--log-level", "info")
	const workers, perWorker = 4, 15
	type added struct {
		id     string
		cookie uint64
		entry  bool // settings entry present right after ADD returned
	}
	results := make(chan added, workers*perWorker)
	errs := make(chan error, workers*perWorker)
	var pods []*harness.Pod
	for i := range workers * perWorker {
		pods = append(pods, node.NewPod(t, "shop", fmt.Sprintf("race-%d", i)))
	}
	m, err := ebpf.LoadPinnedMap(filepath.Join(a.BPFFS, "maps", "pods"), &ebpf.LoadPinOptions{ReadOnly: true})
	if err != nil {
		t.Fatal(err)
	}
	defer m.Close()
	var wg sync.WaitGroup
	for w := range workers {
		wg.Go(func() {
			for _, p := range pods[w*perWorker : (w+1)*perWorker] {
				if _, err := node.Add(ctx, p, list); err != nil {
					errs <- err
					continue
				}
				c, err := netns.Cookie(p.NetNSPath)
				if err != nil {
					errs <- err
					continue
				}
				value := make([]byte, m.ValueSize())
				results <- added{id: p.ContainerID, cookie: c, entry: m.Lookup(c, value) == nil}
			}
		})
	}
	wg.Wait()
	close(results)
	close(errs)
	for err := range errs {
		t.Error(err)
	}
	missing := 0
	for r := range results {
		if !r.entry {
			missing++
		}
	}
	out := a.Proc.Output()
	orphans, repairs := strings.Count(out, "orphan redirection released"), strings.Count(out, "pod redirection broken")
	t.Logf("%d pods added under back-to-back reconciles: %d had no redirection when ADD returned; agent released %d orphans, repaired %d pods",
		workers*perWorker, missing, orphans, repairs)
	if missing+orphans+repairs != 0 {
		t.Fatal("reconcile took a fresh enrollment for an orphan")
	}
}
