package k8s

import (
	"context"
	"fmt"
	"maps"
	"net"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/vishvananda/netlink"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"

	"github.com/mesh-cni/mesh-cni/internal/enroll"
	"github.com/mesh-cni/mesh-cni/internal/istiorules"
	"github.com/mesh-cni/mesh-cni/internal/netns"
	"github.com/mesh-cni/mesh-cni/internal/redirect"
	"github.com/mesh-cni/mesh-cni/test/fixtures"
	"github.com/mesh-cni/mesh-cni/test/harness"
	"github.com/mesh-cni/mesh-cni/test/ztunnel"
)

// Switching a running Istio ambient node from istio-cni to mesh-cni and back:
// the pods keep running, ztunnel keeps serving them, and every connection goes
// through ztunnel exactly once while the node agents change hands.

// podCgroups gives the node a pod cgroup tree at the kubelet's cgroupfs
// layout (kubepods/besteffort under a root of the test's) and returns the
// mesh-agent arguments that point its adoption there.
func (n *ambientNode) podCgroups(t *testing.T) (dir string, args []string) {
	t.Helper()
	mount, err := redirect.FindCgroup2()
	if err != nil {
		t.Fatal(err)
	}
	root := harness.NewCgroup(t, "swap")
	dir = harness.MkCgroup(t, filepath.Join(harness.MkCgroup(t, filepath.Join(root, "kubepods")), "besteffort"))
	return dir, []string{"--netns-dir", harness.NetnsDir, "--pod-cgroup-driver=cgroupfs", "--pod-cgroup-root", strings.TrimPrefix(root, mount)}
}

// runContainer puts a container process in the pod: in its network namespace,
// in the cgroup the kubelet names after the pod and the container, and in the
// node's PID namespace.
func (n *ambientNode) runContainer(t *testing.T, pods string, p *ambientPod) *harness.Process {
	t.Helper()
	dir := harness.MkCgroup(t, filepath.Join(harness.MkCgroup(t, filepath.Join(pods, "pod"+p.cni.UID)), p.cni.ContainerID))
	sleep, err := exec.LookPath("sleep")
	if err != nil {
		t.Fatal(err)
	}
	return harness.StartProcess(t, harness.ProcessOptions{Path: "nsenter", Args: []string{"--pid=" + n.pidNS, "--", sleep, "10000"},
		Cgroup: dir, NetNSPath: p.cni.NetNSPath, Name: "container-" + p.api.Name, Launcher: true})
}

// inPod runs a command in the pod's network namespace and returns its output.
func inPod(t *testing.T, p *ambientPod, args ...string) string {
	t.Helper()
	out, err := exec.Command("nsenter", append([]string{"--net=" + p.cni.NetNSPath}, args...)...).CombinedOutput()
	if err != nil {
		t.Fatalf("%v in %s: %v\n%s", args, p.api.Name, err, out)
	}
	return string(out)
}

// istioChains lists the lines of the pod's iptables rules of a backend (nft
// or legacy), both families, that name istio-cni's in-pod chains.
func istioChains(t *testing.T, p *ambientPod, backend string) []string {
	t.Helper()
	var out []string
	for _, save := range []string{"iptables-" + backend + "-save", "ip6tables-" + backend + "-save"} {
		for l := range strings.Lines(inPod(t, p, save)) {
			if strings.Contains(l, istiorules.ChainPrerouting) || strings.Contains(l, istiorules.ChainOutput) {
				out = append(out, save+": "+strings.TrimSpace(l))
			}
		}
	}
	return out
}

// replyRules counts the pod's fwmark 0x111/0xfff rules, per family.
func replyRules(t *testing.T, p *ambientPod) (v4, v6 int) {
	t.Helper()
	count := func(fam string) int {
		return strings.Count(inPod(t, p, "ip", fam, "rule", "list"), "fwmark 0x111/0xfff lookup 100")
	}
	return count("-4"), count("-6")
}

// stream connects each client to the server, on both families, one after the
// other until stopped, and counts what happened in each phase.
type stream struct {
	mu      sync.Mutex
	phase   string
	ok      map[string]int // by phase and client
	okTotal map[string]int // by client
	fails   []string
	stop    chan struct{}
	done    chan struct{}
}

type streamTarget struct {
	from   *ambientPod
	fromIP netip.Addr
	to     netip.AddrPort
}

func startStream(t *testing.T, phase string, targets []streamTarget) *stream {
	s := &stream{phase: phase, ok: map[string]int{}, okTotal: map[string]int{}, stop: make(chan struct{}), done: make(chan struct{})}
	go func() {
		defer close(s.done)
		for {
			for _, tg := range targets {
				select {
				case <-s.stop:
					return
				default:
				}
				s.mu.Lock()
				phase := s.phase
				s.mu.Unlock()
				got, err := ask(t, tg.from.cni, tg.to)
				s.mu.Lock()
				if err != nil || got != tg.fromIP {
					s.fails = append(s.fails, fmt.Sprintf("%s: %s -> %s: the application saw %s (%v)", phase, tg.from.api.Name, tg.to, got, err))
				} else {
					s.ok[phase+" "+tg.from.api.Name]++
					s.okTotal[tg.from.api.Name]++
				}
				s.mu.Unlock()
			}
			time.Sleep(50 * time.Millisecond) // a steady stream, not a flood
		}
	}()
	t.Cleanup(s.end)
	return s
}

func (s *stream) setPhase(p string) {
	s.mu.Lock()
	s.phase = p
	s.mu.Unlock()
}

// waitOK waits until each client made n connections in the current phase.
func (s *stream) waitOK(t *testing.T, n int, clients ...string) {
	t.Helper()
	fixtures.WaitFor(t, time.Minute, fmt.Sprintf("%d connections of each client", n), func() bool {
		s.mu.Lock()
		defer s.mu.Unlock()
		for _, c := range clients {
			if s.ok[s.phase+" "+c] < n {
				return false
			}
		}
		return true
	})
}

func (s *stream) end() {
	select {
	case <-s.stop:
	default:
		close(s.stop)
	}
	<-s.done
}

// netnsInode is the inode of the network namespace at path.
func netnsInode(t *testing.T, path string) uint64 {
	t.Helper()
	var st syscall.Stat_t
	if err := syscall.Stat(path, &st); err != nil {
		t.Fatal(err)
	}
	return st.Ino
}

// stopIstioCNI stops istio-cni's node agent as the kubelet does when its
// DaemonSet is deleted: SIGTERM to install-cni (process 1 of its PID
// namespace, under unshare), which then finds its DaemonSet gone and
// uninstalls: its plugin and chain entry, its host rules and ipset. The pods'
// rules stay, and ztunnel keeps serving them.
func (n *ambientNode) stopIstioCNI(t *testing.T) {
	t.Helper()
	kids := n.istioCNI.Children()
	if len(kids) != 1 {
		t.Fatalf("istio-cni: want one child of unshare, got %v", kids)
	}
	if err := syscall.Kill(kids[0], syscall.SIGTERM); err != nil {
		t.Fatalf("SIGTERM to install-cni: %v", err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	if err := n.istioCNI.Wait(ctx); err != nil && ctx.Err() != nil {
		t.Fatalf("istio-cni did not stop: %v\n%s", err, n.istioCNI.Output())
	}
}

// hostLeftovers lists what istio-cni keeps on the host: its nat chain and
// its probe ipsets.
func (n *ambientNode) hostLeftovers(t *testing.T) []string {
	t.Helper()
	var left []string
	err := netns.Do(n.node.NetNSPath, func() error {
		for _, save := range []string{"iptables-nft-save", "ip6tables-nft-save", "iptables-legacy-save", "ip6tables-legacy-save"} {
			out, err := exec.Command(save).CombinedOutput()
			if err != nil {
				continue // that backend is not there
			}
			for l := range strings.Lines(string(out)) {
				if strings.Contains(l, "ISTIO_POSTRT") {
					left = append(left, save+": "+strings.TrimSpace(l))
				}
			}
		}
		sets, err := netlink.IpsetListAll()
		if err != nil {
			return fmt.Errorf("list ipsets: %w", err)
		}
		for _, s := range sets {
			if strings.HasPrefix(s.SetName, "istio-") {
				left = append(left, "ipset "+s.SetName)
			}
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	return left
}

// streamRecords counts ztunnel's records of the stream's connections (to the
// server's port 8080, completed): outbound HBONE by client pod, and the
// server's inbound HBONE.
func (n *ambientNode) streamRecords(t *testing.T) (out map[string]int, in int) {
	t.Helper()
	recs, err := ztunnel.ReadRecords(n.records)
	if err != nil {
		t.Fatal(err)
	}
	out = map[string]int{}
	for _, r := range recs {
		if r.Dst.Port() != 8080 || r.Err != "" {
			continue
		}
		switch {
		case r.Dir == "outbound" && r.Proto == "hbone":
			out[strings.TrimPrefix(r.Pod, n.ambient+"/")]++
		case r.Dir == "inbound" && r.Proto == "hbone" && r.Pod == n.ambient+"/server":
			in++
		}
	}
	return out, in
}

// checkHBONE checks istiod's view of the pods: HBONE for each, as its
// redirection annotation says.
func (n *ambientNode) checkHBONE(t *testing.T, phase string, all []*ambientPod) {
	t.Helper()
	ctx, cancel := context.WithTimeout(apiContext(t), 30*time.Second)
	defer cancel()
	err := harness.PollUntil(ctx, nil, 200*time.Millisecond, func(ctx context.Context) error {
		ws, err := ztunnel.FetchAmbient(ctx, n.istiod)
		if err != nil {
			return err
		}
		for _, p := range all {
			i := slices.IndexFunc(ws, func(w ztunnel.Workload) bool { return w.Namespace == p.api.Namespace && w.Name == p.api.Name })
			if i < 0 || !ws[i].HBONE {
				return fmt.Errorf("%s: not an HBONE workload", p.api.Name)
			}
		}
		return nil
	})
	if err != nil {
		t.Errorf("%s: istiod's ambient index: %v", phase, err)
	}
	for _, p := range all {
		got, err := n.admin.CoreV1().Pods(p.api.Namespace).Get(apiContext(t), p.api.Name, metav1.GetOptions{})
		if err != nil {
			t.Fatal(err)
		}
		if v := got.Annotations[enroll.IstioAnnotationRedirection]; v != "enabled" {
			t.Errorf("%s: %s: %s=%q, want enabled", phase, p.api.Name, enroll.IstioAnnotationRedirection, v)
		}
	}
}

// TestIstioSwap switches a running ambient node from istio-cni to mesh-cni:
// a node on istio-cni with meshed pods, a connection held open and a steady
// stream of new ones; istio-cni's node agent stopped as its DaemonSet's
// deletion stops it (its chain entry and plugin go); mesh-agent installed
// with the istio profile and its chain entry. No pod restarts, ztunnel never
// drops a pod's proxy, every connection of every phase goes through the
// client's and the server's ztunnel exactly once and none fails, istiod keeps
// the pods HBONE, and istio-cni's rules are gone from the pods but for what a
// pod's root made of its own. A pod whose root added its own jump to
// ISTIO_OUTPUT is captured all the same, the chain kept empty, the agent
// saying so.
//
// Both of istio-cni's iptables backends: with iptables-nft its chains are
// removed; with iptables-legacy, which the agent cannot change, they stay, the
// agent says so, and the same assertions hold with both captures in place for
// the rest of the test: the eBPF capture sends a connection to ztunnel's
// ports before istio-cni's rules see it, and those rules leave alone what
// goes to loopback or carries ztunnel's mark.
//
// Then the node switches back to istio-cni (switchBack), with the same
// assertions.
func TestIstioSwap(t *testing.T) {
	for _, backend := range []string{"nft", "legacy"} {
		t.Run("iptables-"+backend, func(t *testing.T) {
			t.Parallel()
			testIstioSwap(t, backend)
		})
	}
}

func testIstioSwap(t *testing.T, backend string) {
	n := newAmbientNode(t)
	n.istioCNIEnv = []string{"FORCE_IPTABLES_BINARY=" + backend}
	pods, adoptArgs := n.podCgroups(t)
	list := n.startIstioCNI(t)
	zt := n.startZtunnel(t)

	client := n.addPod(t, list, n.ambient, "client")
	server := n.addPod(t, list, n.ambient, "server")
	rooted := n.addPod(t, list, n.ambient, "rooted")
	all := []*ambientPod{client, server, rooted}
	// Labelled out of the mesh while no node agent runs.
	leaver := n.addPod(t, list, n.ambient, "leaver")
	n.runContainer(t, pods, leaver)
	inodes := map[string]uint64{}
	for _, p := range all {
		n.runContainer(t, pods, p)
		inodes[p.api.Name] = netnsInode(t, p.cni.NetNSPath)
	}
	server.cni.ServeEcho(t, 8081)

	hbone := func(phase string) { t.Helper(); n.checkHBONE(t, phase, all) }
	hbone("istio-cni")

	// istio-cni captured each pod with its chains in the backend it was
	// told, and its policy route.
	for _, p := range all {
		if rules := istioChains(t, p, backend); len(rules) == 0 {
			t.Fatalf("%s: no istio-cni chain in iptables-%s: %s", p.api.Name, backend, inPod(t, p, "iptables-"+backend+"-save"))
		}
		if v4, v6 := replyRules(t, p); v4 != 1 || v6 != 1 {
			t.Fatalf("%s: %d and %d fwmark rules, want istio-cni's one of each family", p.api.Name, v4, v6)
		}
	}
	// The pod's root adds a jump of its own to istio-cni's chain.
	inPod(t, rooted, "iptables-"+backend, "-t", "nat", "-I", "OUTPUT", "-p", "tcp", "--dport", "9", "-j", istiorules.ChainOutput)

	n.node.WaitAddressesUsable(apiContext(t), t)
	targets := swapTargets(t, server, client, rooted)
	held := holdConnection(t, client, server, "on istio-cni")
	defer held.Close()
	st := startStream(t, "istio-cni", targets)
	st.waitOK(t, 3, "client", "rooted")
	marks := []int{n.recordCount(t)}

	// istio-cni's node agent goes, as its DaemonSet's deletion makes it go.
	st.setPhase("no node agent")
	n.stopIstioCNI(t)
	conf, err := os.ReadFile(filepath.Join(n.node.ConfDir, "10-"+n.listName+".conflist"))
	if err != nil || strings.Contains(string(conf), "istio-cni") {
		t.Errorf("istio-cni's chain entry after its uninstall: %s (%v)", conf, err)
	}
	if _, err := os.Stat(filepath.Join(n.node.BinDir, "istio-cni")); err == nil {
		t.Error("istio-cni's plugin binary is still installed after its uninstall")
	}
	if left := n.hostLeftovers(t); len(left) > 0 {
		t.Errorf("istio-cni left on the host: %v", left)
	}
	st.waitOK(t, 3, "client", "rooted")
	if err := echoOn(held, "without a node agent"); err != nil {
		t.Errorf("held connection without a node agent: %v", err)
	}
	hbone("no node agent")
	marks = append(marks, n.recordCount(t))
	if len(istioChains(t, leaver, backend)) == 0 {
		t.Fatal("leaver: no istio-cni chain")
	}
	patch := []byte(`{"metadata":{"labels":{"` + enroll.IstioLabelDataplaneMode + `":"` + enroll.IstioValueNone + `"}}}`)
	if _, err := n.admin.CoreV1().Pods(n.ambient).Patch(apiContext(t), "leaver", types.MergePatchType, patch, metav1.PatchOptions{}); err != nil {
		t.Fatal(err)
	}

	// mesh-cni in its place: the agent with the istio profile, installing its
	// chain entry, adopting the pods.
	st.setPhase("swap")
	install := append(installArgs(t, n.node), "--owned-config=false")
	a := n.runMeshAgent(t, append(append(slices.Clone(install), "--reconcile-interval", "2s"), adoptArgs...)...)
	waitChainEntry(t, n.node, true)
	fixtures.WaitFor(t, time.Minute, "the running pods adopted", func() bool {
		return a.enrolledUID(client.cni.UID) && a.enrolledUID(server.cni.UID) && a.enrolledUID(rooted.cni.UID)
	})
	marks = append(marks, n.recordCount(t))
	st.setPhase("mesh-cni")
	st.waitOK(t, 3, "client", "rooted")
	if err := echoOn(held, "on mesh-cni"); err != nil {
		t.Errorf("held connection on mesh-cni: %v", err)
	}
	hbone("mesh-cni")
	st.end()

	// With iptables-legacy, whose chains stay, both captures are in place
	// from mesh-cni's start on: see refusedAsSelfCalls.
	var exposed []string
	if backend == "legacy" {
		exposed = []string{"swap", "mesh-cni"}
	}
	refused := n.refusedAsSelfCalls(t, st, exposed, marks[0])
	st.mu.Lock()
	okTotal := maps.Clone(st.okTotal)
	st.mu.Unlock()

	// Exactly once: as many outbound records of each client, and inbound
	// records of the server, as connections made, and as many connections
	// at the server's application: none went around ztunnel, none through
	// it twice.
	counts := func() (map[string]int, int) { return n.streamRecords(t) }
	total := okTotal["client"] + okTotal["rooted"]
	st.mu.Lock()
	t.Logf("connections made, by phase and client: %v; refused: %d", st.ok, refused)
	st.mu.Unlock()
	fixtures.WaitFor(t, 20*time.Second, "ztunnel's records of every connection", func() bool {
		out, in := counts()
		return out["client"] >= okTotal["client"] && out["rooted"] >= okTotal["rooted"] && in >= total
	})
	if out, in := counts(); out["client"] != okTotal["client"] || out["rooted"] != okTotal["rooted"] || in != total || server.app.count() != total {
		t.Errorf("connections: client %d, rooted %d; ztunnel: outbound %v, the server's inbound %d; the server's application accepted %d: want each once",
			okTotal["client"], okTotal["rooted"], out, in, server.app.count())
	}

	// Every pod in ztunnel's records in every phase.
	recs, err := ztunnel.ReadRecords(n.records)
	if err != nil {
		t.Fatal(err)
	}
	marks = append([]int{0}, append(marks, len(recs))...)
	for i, phase := range []string{"istio-cni", "no node agent", "swap", "mesh-cni"} {
		if phase == "swap" {
			continue // as long as the agent's start takes: maybe no connection completed
		}
		for _, p := range all {
			if !slices.ContainsFunc(recs[marks[i]:marks[i+1]], func(r ztunnel.Record) bool { return r.Pod == p.api.Namespace+"/"+p.api.Name && r.Err == "" }) {
				t.Errorf("%s: no record of %s in ztunnel", phase, p.api.Name)
			}
		}
	}

	// The pod labelled out of the mesh while no agent ran leaves it as
	// istio-cni would have taken it out: istiod told, with iptables-nft its
	// rules removed and ztunnel told to drop it, its next connection direct;
	// with iptables-legacy, whose rules stay, ztunnel keeps serving it.
	fixtures.WaitFor(t, 30*time.Second, "the leaver's "+enroll.IstioAnnotationRedirection+" removed", func() bool {
		got, err := n.admin.CoreV1().Pods(n.ambient).Get(apiContext(t), "leaver", metav1.GetOptions{})
		_, ok := got.Annotations[enroll.IstioAnnotationRedirection]
		return err == nil && !ok
	})
	leaverStopped := func() bool {
		for line := range strings.Lines(zt.Output()) {
			if strings.Contains(line, "pod proxy stopped") && strings.Contains(line, leaver.cni.UID) {
				return true
			}
		}
		return false
	}
	before, recsBefore := server.app.count(), n.recordCount(t)
	if backend == "nft" {
		fixtures.WaitFor(t, 30*time.Second, "ztunnel to stop the leaver's proxy", leaverStopped)
		if left := istioChains(t, leaver, backend); len(left) > 0 {
			t.Errorf("leaver: istio-cni's rules left: %v", left)
		}
		if got, err := ask(t, leaver.cni, netip.AddrPortFrom(server.cni.IPv4(t), 8080)); err != nil || got != leaver.cni.IPv4(t) {
			t.Errorf("leaver -> server: the application saw %s (%v)", got, err)
		}
		// Past the leaver's own ztunnel; through the server's, as plaintext
		// from outside the mesh.
		n.waitRecord(t, "the server's inbound plaintext from the leaver", func(r ztunnel.Record) bool {
			return r.Pod == n.ambient+"/server" && r.Dir == "inbound" && r.Proto == "tcp" && r.Src.Addr() == leaver.cni.IPv4(t) && r.Err == ""
		})
		recs, _ := ztunnel.ReadRecords(n.records)
		if server.app.count() != before+1 || slices.ContainsFunc(recs[recsBefore:], func(r ztunnel.Record) bool { return r.Pod == n.ambient+"/leaver" }) {
			t.Errorf("leaver -> server: %d at the application, the leaver's ztunnel in the records since: %v; want one, not past the leaver's ztunnel", server.app.count()-before, recs[recsBefore:])
		}
	} else {
		if got, err := ask(t, leaver.cni, netip.AddrPortFrom(server.cni.IPv4(t), 8080)); err != nil || got != leaver.cni.IPv4(t) {
			t.Errorf("leaver -> server: the application saw %s (%v)", got, err)
		}
		n.waitRecord(t, "the leaver's connection through ztunnel", func(r ztunnel.Record) bool {
			return r.Pod == n.ambient+"/leaver" && r.Dir == "outbound" && r.Err == ""
		})
		if leaverStopped() {
			t.Error("ztunnel stopped the leaver's proxy while iptables-legacy rules still send its traffic there")
		}
	}

	// No pod restarted, none handed to ztunnel in another namespace, no
	// proxy dropped and started again.
	for _, p := range all {
		if got := netnsInode(t, p.cni.NetNSPath); got != inodes[p.api.Name] {
			t.Errorf("%s: network namespace changed", p.api.Name)
		}
		if got := a.enrolledNetns(p.cni.UID); got != p.cni.NetNSPath {
			t.Errorf("%s: enrolled in %q, want %s", p.api.Name, got, p.cni.NetNSPath)
		}
		for line := range strings.Lines(zt.Output()) {
			if strings.Contains(line, "pod proxy stopped") && strings.Contains(line, p.cni.UID) {
				t.Errorf("ztunnel stopped %s's proxy: %s", p.api.Name, line)
			}
		}
	}

	// The agent removes istio-cni's rules from a pod just after adopting it,
	// which the wait above saw: wait until it said what it did for each, so
	// that what is left is not a removal half done.
	fixtures.WaitFor(t, 30*time.Second, "the agent's word on istio-cni's rules in every pod", func() bool {
		done := map[string]bool{}
		for line := range strings.Lines(a.Proc.Output()) {
			if !strings.Contains(line, "the replaced node agent's capture removed from an adopted pod") &&
				!strings.Contains(line, "the replaced node agent's capture not fully removed from an adopted pod") {
				continue
			}
			for _, p := range all {
				if strings.Contains(line, `"pod":"`+p.api.Namespace+"/"+p.api.Name+`"`) {
					done[p.api.Name] = true
				}
			}
		}
		return len(done) == len(all)
	})
	if backend == "legacy" {
		// Nothing removed, nothing of istio-cni's in nftables, and the
		// agent said why.
		for _, p := range all {
			if len(istioChains(t, p, "legacy")) == 0 {
				t.Errorf("%s: istio-cni's iptables-legacy chains are gone; nothing here removes them", p.api.Name)
			}
			if left := istioChains(t, p, "nft"); len(left) > 0 {
				t.Errorf("%s: istio-cni's chains in iptables-nft: %v", p.api.Name, left)
			}
		}
		if got := strings.Count(a.Proc.Output(), istiorules.ErrLegacyTables.Error()); got < len(all) {
			t.Errorf("the agent reported iptables-legacy tables %d times, want once for each of the %d pods", got, len(all))
		}
	} else {
		// istio-cni's rules are gone, but for mangle ISTIO_OUTPUT in the pods
		// at both ends of the held connection, which ztunnel carried before
		// the switch (its sockets' mark gave it istio-cni's connmark): the
		// chain restores its replies' mark. It goes once that closes. The
		// rooted pod keeps its own jump and the chain it names, empty, and
		// the agent said so.
		// (IPv6's may stay as well, for a connection of the stream not
		// closed yet.)
		for _, p := range []*ambientPod{client, server} {
			left := istioChains(t, p, backend)
			restoreOnly := !slices.ContainsFunc(left, func(l string) bool {
				_, rule, _ := strings.Cut(l, ": ")
				return rule != ":ISTIO_OUTPUT - [0:0]" && rule != "-A OUTPUT -j ISTIO_OUTPUT" && !strings.HasPrefix(rule, "-A ISTIO_OUTPUT -m connmark --mark 0x111/0xfff -j CONNMARK --restore-mark")
			})
			if !restoreOnly || !slices.Contains(left, "iptables-nft-save: -A OUTPUT -j ISTIO_OUTPUT") {
				t.Errorf("%s with the held connection open: left %q, want mangle ISTIO_OUTPUT alone", p.api.Name, left)
			}
		}
		held.Close()
		for _, p := range []*ambientPod{client, server} {
			fixtures.WaitFor(t, 30*time.Second, p.api.Name+"'s mangle ISTIO_OUTPUT removed once the held connection closed", func() bool {
				return len(istioChains(t, p, backend)) == 0
			})
		}
		wantRooted := []string{
			"iptables-nft-save: :" + istiorules.ChainOutput + " - [0:0]",
			"iptables-nft-save: -A OUTPUT -p tcp -m tcp --dport 9 -j " + istiorules.ChainOutput,
		}
		if left := istioChains(t, rooted, backend); !slices.Equal(left, wantRooted) {
			t.Errorf("rooted: left %q, want only %q", left, wantRooted)
		}
		if !strings.Contains(a.Proc.Output(), "ip nat ISTIO_OUTPUT emptied but kept") {
			t.Error("the agent did not report the rooted pod's kept chain")
		}
	}
	// The policy route is mesh-cni's, once per family.
	for _, p := range all {
		if v4, v6 := replyRules(t, p); v4 != 1 || v6 != 1 {
			t.Errorf("%s: %d and %d fwmark rules, want one of each family", p.api.Name, v4, v6)
		}
	}

	n.switchBack(t, a, zt, install, backend, server, client, rooted)
}

// switchBack switches the node from mesh-cni back to istio-cni in the order
// docs/istio.md gives: mesh-agent stopped as its DaemonSet's deletion stops
// it (no uninstall: its pinned capture stays, and with it the proxy's
// exemption), istio-cni installed again with its in-pod rules reconciled on
// startup (both captures in place), then mesh-cni's node state removed by
// `mesh-agent uninstall`. A connection held open across it and a steady
// stream of new ones each go through the client's and the server's ztunnel
// exactly once; no pod restarts, ztunnel drops no pod's proxy and has every
// pod in its records in every phase, and istiod keeps the pods HBONE.
// refusedAsSelfCalls fails t for each connection of st that failed, but for
// those made in the exposed phases, and returns how many of those there were.
// While both captures are in place (istio-cni's iptables-legacy rules, which
// the agent cannot remove, and mesh-cni's), ztunnel at times finds no original
// destination mesh-cni handed over for a connection its connect hook sent to
// ztunnel's port, takes it for a call to itself and refuses it: the connection
// fails and reaches no server, around ztunnel or through it. So each failure
// in an exposed phase must be one of ztunnel's refusals of a call to itself
// (its records from mark on); any other failure is an error.
func (n *ambientNode) refusedAsSelfCalls(t *testing.T, st *stream, exposed []string, mark int) int {
	t.Helper()
	recs, err := ztunnel.ReadRecords(n.records)
	if err != nil {
		t.Fatal(err)
	}
	selfCalls := 0
	for _, r := range recs[mark:] {
		if r.Dir == "outbound" && r.Proto == "refused" && r.Err == "self call" {
			selfCalls++
			t.Logf("ztunnel refused a call to itself: %+v", r)
		}
	}
	st.mu.Lock()
	defer st.mu.Unlock()
	refused := 0
	for _, f := range st.fails {
		if slices.ContainsFunc(exposed, func(p string) bool { return strings.HasPrefix(f, p+": ") }) {
			refused++
			t.Logf("connection refused: %s", f)
			continue
		}
		t.Errorf("connection failed: %s", f)
	}
	if selfCalls != refused {
		t.Errorf("%v: %d connections failed, ztunnel refused %d as calls to itself: want each failure to be one", exposed, refused, selfCalls)
	}
	// Rare, not a steady loss: at most one connection in twenty of those
	// phases.
	made := 0
	for key, n := range st.ok {
		if slices.ContainsFunc(exposed, func(p string) bool { return strings.HasPrefix(key, p+" ") }) {
			made += n
		}
	}
	if refused*20 > made+refused {
		t.Errorf("%v: %d connections refused of %d: more than one in twenty", exposed, refused, made+refused)
	}
	return refused
}

func (n *ambientNode) switchBack(t *testing.T, a *agent, zt *harness.Process, install []string, backend string, server, client, rooted *ambientPod) {
	t.Helper()
	all := []*ambientPod{client, server, rooted}
	inodes := map[string]uint64{}
	for _, p := range all {
		inodes[p.api.Name] = netnsInode(t, p.cni.NetNSPath)
	}
	outBefore, inBefore := n.streamRecords(t)
	appBefore := server.app.count()

	targets := swapTargets(t, server, client, rooted)
	held := holdConnection(t, client, server, "back: on mesh-cni")
	defer held.Close()
	phases := []string{"back: mesh-cni", "back: no node agent", "back: both", "back: istio-cni"}
	marks := []int{n.recordCount(t)}
	st := startStream(t, phases[0], targets)
	st.waitOK(t, 3, "client", "rooted")
	marks = append(marks, n.recordCount(t))
	step := func(phase string) {
		t.Helper()
		st.waitOK(t, 3, "client", "rooted")
		if err := echoOn(held, phase); err != nil {
			t.Errorf("held connection, %s: %v", phase, err)
		}
		n.checkHBONE(t, phase, all)
		marks = append(marks, n.recordCount(t))
	}

	// mesh-agent's DaemonSet deleted: the agent stops, its pins stay.
	st.setPhase(phases[1])
	ctx, cancel := context.WithTimeout(apiContext(t), time.Minute)
	defer cancel()
	if err := a.Proc.Stop(ctx); err != nil {
		t.Fatalf("stop mesh-agent: %v", err)
	}
	if pins, err := os.ReadDir(a.BPFFS); err != nil || len(pins) == 0 {
		t.Fatalf("mesh-agent's pins after it stopped: %v (%v)", pins, err)
	}
	step(phases[1])

	// istio-cni installed again: it serves ZDS, its snapshot lists the
	// annotated pods it finds through the node's procfs, and it writes its
	// rules into each pod's namespace.
	st.setPhase(phases[2])
	connected := strings.Count(zt.Output(), "connected to the node agent")
	n.istioCNIEnv = append(n.istioCNIEnv, "AMBIENT_RECONCILE_POD_RULES_ON_STARTUP=true")
	n.startIstioCNI(t)
	fixtures.WaitFor(t, time.Minute, "ztunnel connected to istio-cni", func() bool {
		return strings.Count(zt.Output(), "connected to the node agent") > connected
	})
	for _, p := range all {
		fixtures.WaitFor(t, time.Minute, p.api.Name+"'s in-pod rules from istio-cni", func() bool {
			return strings.Contains(inPod(t, p, "iptables-"+backend+"-save", "-t", "nat"), "--to-ports 15001")
		})
	}
	step(phases[2])

	// mesh-cni's node state removed: chain entry, plugin, pins and programs;
	// the pods' annotations are istio-cni's now. Connections made while the
	// uninstall runs still count in the phase before: until it has detached
	// the programs both captures are in place.
	args := append([]string{"uninstall", "--socket", a.Socket, "--bpffs-root", a.BPFFS, "--log-level", "info"}, install[1:]...)
	if out, err := exec.CommandContext(ctx, harness.Bins(t).Path("mesh-agent"), args...).CombinedOutput(); err != nil {
		t.Fatalf("mesh-agent uninstall: %v\n%s", err, out)
	}
	l, _, err := n.node.LoadConflist()
	if err != nil {
		t.Fatal(err)
	}
	var chain []string
	for _, p := range l.Plugins {
		chain = append(chain, p.Network.Type)
	}
	if slices.Contains(chain, "mesh-cni") || chain[len(chain)-1] != "istio-cni" {
		t.Errorf("the node's chain after the uninstall: %v, want istio-cni's entry last and none of mesh-cni's", chain)
	}
	if pins, err := os.ReadDir(a.BPFFS); err == nil && len(pins) > 0 {
		t.Errorf("mesh-agent's pins after the uninstall: %v", pins)
	}
	st.setPhase(phases[3])
	step(phases[3])
	st.end()

	// With iptables-legacy, whose chains the switch to mesh-cni left, both
	// captures are in place until the uninstall: see refusedAsSelfCalls.
	var exposed []string
	if backend == "legacy" {
		exposed = phases[:3]
	}
	refused := n.refusedAsSelfCalls(t, st, exposed, marks[0])
	st.mu.Lock()
	okTotal := maps.Clone(st.okTotal)
	t.Logf("switching back: connections made, by phase and client: %v; refused: %d", st.ok, refused)
	st.mu.Unlock()

	// Exactly once, as on the way there.
	total := okTotal["client"] + okTotal["rooted"]
	delta := func() (out map[string]int, in, app int) {
		o, i := n.streamRecords(t)
		out = map[string]int{}
		for k, v := range o {
			out[k] = v - outBefore[k]
		}
		return out, i - inBefore, server.app.count() - appBefore
	}
	fixtures.WaitFor(t, 20*time.Second, "ztunnel's records of every connection", func() bool {
		out, in, _ := delta()
		return out["client"] >= okTotal["client"] && out["rooted"] >= okTotal["rooted"] && in >= total
	})
	if out, in, app := delta(); out["client"] != okTotal["client"] || out["rooted"] != okTotal["rooted"] || in != total || app != total {
		t.Errorf("switching back: connections: client %d, rooted %d; ztunnel: outbound %v, the server's inbound %d; the server's application accepted %d: want each once",
			okTotal["client"], okTotal["rooted"], out, in, app)
	}

	// Every pod in ztunnel's records in every phase; no pod restarted; no
	// proxy dropped.
	recs, err := ztunnel.ReadRecords(n.records)
	if err != nil {
		t.Fatal(err)
	}
	for i, phase := range phases {
		for _, p := range all {
			if !slices.ContainsFunc(recs[marks[i]:marks[i+1]], func(r ztunnel.Record) bool { return r.Pod == p.api.Namespace+"/"+p.api.Name && r.Err == "" }) {
				t.Errorf("%s: no record of %s in ztunnel", phase, p.api.Name)
			}
		}
	}
	for _, p := range all {
		if got := netnsInode(t, p.cni.NetNSPath); got != inodes[p.api.Name] {
			t.Errorf("%s: network namespace changed", p.api.Name)
		}
		for line := range strings.Lines(zt.Output()) {
			if strings.Contains(line, "pod proxy stopped") && strings.Contains(line, p.cni.UID) {
				t.Errorf("ztunnel stopped %s's proxy: %s", p.api.Name, line)
			}
		}
	}
}

// swapTargets is the stream of a switch: each client to the server's 8080,
// from its own address of each family.
func swapTargets(t *testing.T, server *ambientPod, clients ...*ambientPod) []streamTarget {
	t.Helper()
	var targets []streamTarget
	for _, from := range clients {
		targets = append(targets,
			streamTarget{from, from.cni.IPv4(t), netip.AddrPortFrom(server.cni.IPv4(t), 8080)},
			streamTarget{from, from.cni.IPv6(t), netip.AddrPortFrom(server.cni.IPv6(t), 8080)})
	}
	return targets
}

// holdConnection opens the connection a switch holds open, client to the
// server's 8081, and checks that it carries data (marked with what).
func holdConnection(t *testing.T, client, server *ambientPod, what string) net.Conn {
	t.Helper()
	held, err := client.cni.Dial(apiContext(t), "tcp", netip.AddrPortFrom(server.cni.IPv4(t), 8081).String())
	if err != nil {
		t.Fatalf("client -> server, held: %v", err)
	}
	if err := echoOn(held, what); err != nil {
		held.Close()
		t.Fatalf("held connection: %v", err)
	}
	return held
}
