package agent

import (
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"go.uber.org/zap"
	"go.uber.org/zap/zaptest/observer"

	"github.com/mesh-cni/mesh-cni/internal/netns"
	"github.com/mesh-cni/mesh-cni/test/fixtures"
	"github.com/mesh-cni/mesh-cni/test/harness"
)

// fakeProbeDatapath records the probe cgroups set; the test says which cgroup
// path the kubelet's process is in and which id that path has.
type fakeProbeDatapath struct {
	mu     sync.Mutex
	cgroup string
	ids    map[string]uint64
	calls  []probeCall
	reads  int // of the kubelet's cgroup: one a pass of the watch
}

type probeCall struct {
	netns   uint64
	cgroups []string
	id      uint64
}

func (d *fakeProbeDatapath) SetProbeCgroups(netns uint64, cgroups []string) error {
	d.mu.Lock()
	defer d.mu.Unlock()
	d.calls = append(d.calls, probeCall{netns, slices.Clone(cgroups), d.ids[cgroups[0]]})
	return nil
}

func (d *fakeProbeDatapath) ProcessCgroup(int) (string, error) {
	d.mu.Lock()
	defer d.mu.Unlock()
	d.reads++
	return d.cgroup, nil
}

func (d *fakeProbeDatapath) CgroupID(path string) (uint64, error) {
	d.mu.Lock()
	defer d.mu.Unlock()
	return d.ids[path], nil
}

func (d *fakeProbeDatapath) set(cgroup string, id uint64) {
	d.mu.Lock()
	defer d.mu.Unlock()
	d.cgroup = cgroup
	d.ids[cgroup] = id
}

func (d *fakeProbeDatapath) readCount() int {
	d.mu.Lock()
	defer d.mu.Unlock()
	return d.reads
}

func (d *fakeProbeDatapath) callList() []probeCall {
	d.mu.Lock()
	defer d.mu.Unlock()
	return slices.Clone(d.calls)
}

// startKubeletNamed starts sleep under the name kubelet (a link so named), in
// netnsPath ("": the test's), and waits until the kernel names it so.
func startKubeletNamed(t *testing.T, netnsPath string) int {
	t.Helper()
	sleep, err := exec.LookPath("sleep")
	if err != nil {
		t.Fatal(err)
	}
	link := filepath.Join(t.TempDir(), "kubelet")
	if err := os.Symlink(sleep, link); err != nil {
		t.Fatal(err)
	}
	p := harness.StartProcess(t, harness.ProcessOptions{Path: link, Args: []string{"1000"}, NetNSPath: netnsPath})
	fixtures.WaitFor(t, 10*time.Second, "a process named kubelet", func() bool {
		comm, err := os.ReadFile(filepath.Join("/proc", strconv.Itoa(p.Pid()), "comm"))
		return err == nil && strings.TrimSpace(string(comm)) == "kubelet"
	})
	return p.Pid()
}

// The watch exempts the kubelet's probes by its cgroup's id, as the data path
// holds it: a kubelet restarted into its cgroup made again at the same path
// (a new id) gets its probes exempted again. A process named kubelet that
// started first, with a lower pid, in a network namespace of its own (a
// pod's) is refused, logged once, and never exempted; nor is a kubelet whose
// cgroup, as the data path reads it, is a pod's.
func TestProbeWatch(t *testing.T) {
	fixtures.RequireRoot(t, "makes a network namespace")
	sleep, err := exec.LookPath("sleep")
	if err != nil {
		t.Fatal(err)
	}
	podNetns := fixtures.NewNetns(t, filepath.Join(t.TempDir(), "pod"))
	attacker := startKubeletNamed(t, podNetns.Path)
	kubelet := startKubeletNamed(t, "")
	hostCookie, err := netns.Cookie("/proc/self/ns/net")
	if err != nil {
		t.Fatal(err)
	}

	const cgroup = "/sys/fs/cgroup/unified/system.slice/kubelet.service"
	dp := &fakeProbeDatapath{ids: map[string]uint64{}}
	dp.set(cgroup, 100)
	core, logs := observer.New(zap.InfoLevel)
	// The test process stands in for the host's init (see harness.ProcView);
	// the executable is the host's sleep, which the link runs.
	stop := ProbeWatch{Log: zap.New(core), Datapath: dp, ProcRoot: harness.ProcView(t, os.Getpid(), attacker, kubelet),
		Names: KubeletProcessNames(), Exes: []string{sleep}, ExeNames: KubeletExeNames(), Interval: 10 * time.Millisecond}.Start(context.Background())
	defer stop()

	waitCalls := func(n int, what string) []probeCall {
		t.Helper()
		fixtures.WaitFor(t, 10*time.Second, what, func() bool { return len(dp.callList()) >= n })
		return dp.callList()
	}
	calls := waitCalls(1, "the kubelet's probe cgroups")
	if c := calls[0]; c.netns != hostCookie || !slices.Equal(c.cgroups, []string{cgroup}) || c.id != 100 {
		t.Fatalf("set %+v; want the host's namespace (%d, not the pod's %d) and %s", c, hostCookie, podNetns.Cookie, cgroup)
	}

	// The kubelet restarts in place: systemd removes its cgroup and makes it
	// again, at the same path, with a new id.
	dp.set(cgroup, 101)
	calls = waitCalls(2, "the kubelet's cgroup made again set")
	if c := calls[1]; c.netns != hostCookie || !slices.Equal(c.cgroups, []string{cgroup}) || c.id != 101 {
		t.Fatalf("set %+v; want %s again, id 101", c, cgroup)
	}

	// The data path reads the kubelet's cgroup as a pod's: refused.
	pod := "/sys/fs/cgroup/unified/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod0f1e2d3c_aaaa_bbbb_cccc_123456789abc.slice/cri-containerd-x.scope"
	dp.set(pod, 200)
	fixtures.WaitFor(t, 10*time.Second, "the pod cgroup refused", func() bool {
		return logs.FilterMessageSnippet("is a pod's").Len() > 0
	})
	// Nothing is set for it, however many passes the watch makes.
	passes := dp.readCount() + 20
	fixtures.WaitFor(t, 10*time.Second, "twenty more passes of the watch", func() bool { return dp.readCount() >= passes })
	for _, c := range dp.callList() {
		if c.netns != hostCookie || c.cgroups[0] == pod {
			t.Errorf("set %+v: the pod's namespace or cgroup", c)
		}
	}
	if n := len(dp.callList()); n != 2 {
		t.Errorf("%d calls, want 2", n)
	}
	refusals := logs.FilterMessageSnippet("not taken for it").FilterField(zap.Int("pid", attacker)).All()
	if len(refusals) != 1 || refusals[0].ContextMap()["check"] != "netns" {
		t.Errorf("the process in the pod's namespace: %d refusals logged (%v), want one, by the netns check", len(refusals), refusals)
	}
}
