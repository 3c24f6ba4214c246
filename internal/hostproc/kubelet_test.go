package hostproc

import (
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/mesh-cni/mesh-cni/test/fixtures"
	"github.com/mesh-cni/mesh-cni/test/harness"
)

// fakeHost is a procfs tree with a host (PID 1: its root directory, network
// namespace file and executables) and processes whose links lead into it or
// into a pod's, as the kernel's /proc links do.
type fakeHost struct {
	t                *testing.T
	proc, host, pod  string
	hostNet, podNet  string
	kubeletExe, pyth string
}

func newFakeHost(t *testing.T) *fakeHost {
	t.Helper()
	dir := t.TempDir()
	h := &fakeHost{t: t, proc: filepath.Join(dir, "proc"), host: filepath.Join(dir, "host"), pod: filepath.Join(dir, "pod"),
		hostNet: filepath.Join(dir, "net-host"), podNet: filepath.Join(dir, "net-pod")}
	h.kubeletExe = h.file(filepath.Join(h.host, "usr/bin/kubelet"))
	h.pyth = h.file(filepath.Join(h.host, "usr/bin/python3.11"))
	h.file(filepath.Join(h.pod, "kubelet"))
	h.file(h.hostNet)
	h.file(h.podNet)
	h.process(1, "systemd", h.host, h.hostNet, "0::/init.scope\n", filepath.Join(h.host, "usr/lib/systemd/systemd"), 1)
	return h
}

func (h *fakeHost) file(path string) string {
	h.t.Helper()
	if err := os.MkdirAll(filepath.Dir(path), 0o755); err != nil {
		h.t.Fatal(err)
	}
	if err := os.WriteFile(path, nil, 0o755); err != nil {
		h.t.Fatal(err)
	}
	return path
}

// process writes /proc/PID: its name, stat (parent 1, start time), cgroup
// file, and root, ns/net and exe links.
func (h *fakeHost) process(pid int, comm, root, netns, cgroup, exe string, start uint64) {
	h.t.Helper()
	dir := filepath.Join(h.proc, strconv.Itoa(pid))
	if err := os.MkdirAll(filepath.Join(dir, "ns"), 0o755); err != nil {
		h.t.Fatal(err)
	}
	stat := fmt.Sprintf("%d (%s) S 1%s %d 0 0\n", pid, comm, strings.Repeat(" 0", 17), start)
	for name, data := range map[string]string{"comm": comm + "\n", "stat": stat, "cgroup": cgroup} {
		if err := os.WriteFile(filepath.Join(dir, name), []byte(data), 0o644); err != nil {
			h.t.Fatal(err)
		}
	}
	for link, target := range map[string]string{"root": root, "ns/net": netns, "exe": exe} {
		if err := os.Symlink(target, filepath.Join(dir, link)); err != nil {
			h.t.Fatal(err)
		}
	}
}

func (h *fakeHost) finder(exes ...string) KubeletFinder {
	return KubeletFinder{Proc: Procfs{Root: h.proc}, Names: []string{"kubelet", "k3s-server", "k3s-agent", "kubelite"},
		Exes: exes, ExeNames: []string{"kubelet", "kubelite", "k3s"}}
}

// refusedBy maps each refused pid to the check it failed.
func refusedBy(refused []Refusal) map[int]Check {
	out := map[int]Check{}
	for _, r := range refused {
		out[r.PID] = r.Check
	}
	return out
}

// A process named like the kubelet is taken for it only when its root
// directory and network namespace are the host's, no cgroup of it is a pod's
// and its executable is the kubelet's; each refusal names the check it failed,
// whatever its pid or start time.
func TestKubeletFinderRefusals(t *testing.T) {
	const uid = "0f1e2d3c_aaaa_bbbb_cccc_123456789abc"
	h := newFakeHost(t)
	hostCg := "0::/system.slice/kubelet.service\n"
	h.process(500, "kubelet", h.host, h.hostNet, hostCg, h.kubeletExe, 900)
	// Each attacker started before the genuine kubelet and has a lower pid,
	// as after a kubelet restart.
	h.process(10, "kubelet", h.pod, h.podNet, "0::/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod"+uid+".slice/cri-containerd-"+hexID(1)+".scope\n", filepath.Join(h.pod, "kubelet"), 100)
	h.process(11, "kubelet", h.pod, h.hostNet, hostCg, filepath.Join(h.pod, "kubelet"), 100)
	h.process(12, "kubelet", h.host, h.podNet, hostCg, h.kubeletExe, 100)
	h.process(13, "kubelet", h.host, h.hostNet, "0::/kubepods.slice/kubepods-pod"+uid+".slice/cri-containerd-"+hexID(2)+".scope\n", h.kubeletExe, 100)
	// cgroupfs driver under a cgroupRoot of its own, seen from the agent's
	// cgroup namespace; the pod's own level; a QoS level.
	h.process(14, "kubelet", h.host, h.hostNet, "0::/../../node/kubepods/besteffort/pod"+strings.ReplaceAll(uid, "_", "-")+"/"+hexID(3)+"\n", h.kubeletExe, 100)
	h.process(15, "kubelet", h.host, h.hostNet, "0::/kubepods/pod"+strings.ReplaceAll(uid, "_", "-")+"\n", h.kubeletExe, 100)
	h.process(16, "kubelet", h.host, h.hostNet, "0::/kubepods.slice/kubepods-burstable.slice\n", h.kubeletExe, 100)
	// Hybrid: the v2 cgroup is the host's, a v1 one is a pod's.
	h.process(17, "kubelet", h.host, h.hostNet, hostCg+"4:memory:/kubepods/burstable/pod"+strings.ReplaceAll(uid, "_", "-")+"/"+hexID(4)+"\n", h.kubeletExe, 100)
	// A host process renamed with prctl(PR_SET_NAME): its executable says
	// what it is.
	h.process(18, "kubelet", h.host, h.hostNet, hostCg, h.pyth, 100)
	// Not a candidate at all.
	h.process(19, "containerd", h.host, h.hostNet, hostCg, h.kubeletExe, 50)

	want := map[int]Check{10: CheckRoot, 11: CheckRoot, 12: CheckNetNS, 13: CheckCgroup, 14: CheckCgroup, 15: CheckCgroup, 16: CheckCgroup, 17: CheckCgroup, 18: CheckExe}
	k, refused, err := h.finder().Find()
	if err != nil || k.PID != 500 || k.Exe != h.kubeletExe {
		t.Fatalf("found %+v, %v; want pid 500, the only process that passes", k, err)
	}
	got := refusedBy(refused)
	for pid, check := range want {
		if got[pid] != check {
			t.Errorf("pid %d: refused by %q, want %q", pid, got[pid], check)
		}
	}
	if len(got) != len(want) {
		t.Errorf("refused %v, want %v", got, want)
	}
	for _, r := range refused {
		if r.Err == nil || !strings.Contains(r.Error(), string(r.Check)+" check") {
			t.Errorf("refusal %+v does not say why", r)
		}
	}
}

// With the kubelet's executables configured, the executable must be one of
// those files of the host's root, whatever its name.
func TestKubeletFinderExes(t *testing.T) {
	h := newFakeHost(t)
	hostCg := "0::/system.slice/kubelet.service\n"
	other := h.file(filepath.Join(h.host, "tmp/kubelet"))
	h.process(20, "kubelet", h.host, h.hostNet, hostCg, other, 100)
	h.process(30, "kubelet", h.host, h.hostNet, hostCg, h.kubeletExe, 200)

	if k, _, err := h.finder().Find(); err != nil || k.PID != 20 {
		t.Errorf("by name: found %+v, %v; want 20 (named kubelet, started first)", k, err)
	}
	k, refused, err := h.finder("/usr/bin/kubelet").Find()
	if err != nil || k.PID != 30 {
		t.Errorf("by file: found %+v, %v; want 30", k, err)
	}
	if got := refusedBy(refused); len(got) != 1 || got[20] != CheckExe {
		t.Errorf("by file: refused %v, want 20 by %q", got, CheckExe)
	}
	if _, _, err := h.finder("/usr/bin/no-such-kubelet").Find(); err == nil {
		t.Error("found a kubelet though no configured executable exists")
	}
	// A configured path that is an absolute link on the host resolves in the
	// host's root, not in the agent's.
	link := filepath.Join(h.host, "usr/local/bin/kubelet")
	if err := os.MkdirAll(filepath.Dir(link), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.Symlink("/usr/bin/kubelet", link); err != nil {
		t.Fatal(err)
	}
	if k, _, err := h.finder("/usr/local/bin/kubelet").Find(); err != nil || k.PID != 30 {
		t.Errorf("by a link to the file: found %+v, %v; want 30", k, err)
	}
}

// Of several that pass, the one that started first is the kubelet, not the
// lowest pid; without a readable host reference, none passes.
func TestKubeletFinderOldest(t *testing.T) {
	h := newFakeHost(t)
	hostCg := "0::/system.slice/kubelet.service\n"
	h.process(40, "kubelet", h.host, h.hostNet, hostCg, h.kubeletExe, 800)
	h.process(900, "k3s-agent", h.host, h.hostNet, hostCg, h.file(filepath.Join(h.host, "var/lib/rancher/k3s/data/x/bin/k3s")), 300)
	if k, _, err := h.finder().Find(); err != nil || k.PID != 900 {
		t.Errorf("found %+v, %v; want 900, which started first", k, err)
	}
	if err := os.RemoveAll(filepath.Join(h.proc, "1")); err != nil {
		t.Fatal(err)
	}
	k, refused, err := h.finder().Find()
	if err == nil {
		t.Errorf("found %+v without a host to compare with", k)
	}
	if got := refusedBy(refused); len(got) != 2 || got[40] != CheckRoot || got[900] != CheckRoot {
		t.Errorf("refused %v, want both by %q", got, CheckRoot)
	}
}

// copyFile copies src to dst, executable.
func copyFile(t *testing.T, src, dst string) {
	t.Helper()
	b, err := os.ReadFile(src)
	if err != nil {
		t.Fatal(err)
	}
	if err := os.MkdirAll(filepath.Dir(dst), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(dst, b, 0o755); err != nil {
		t.Fatal(err)
	}
}

// containerRoot is a root directory for a program named kubelet, as a
// container's image is: sleep and the shared libraries it loads.
func containerRoot(t *testing.T, sleep string) string {
	t.Helper()
	root := t.TempDir()
	copyFile(t, sleep, filepath.Join(root, "kubelet"))
	out, err := exec.Command("ldd", sleep).Output()
	if err != nil {
		t.Fatalf("ldd %s: %v", sleep, err)
	}
	for _, f := range strings.Fields(string(out)) {
		if strings.HasPrefix(f, "/") {
			copyFile(t, f, filepath.Join(root, f))
		}
	}
	return root
}

// On the real kernel: processes named kubelet in a pod's network namespace
// and cgroup, in the host's namespace but a pod's cgroup, in a pod's
// namespace but a host cgroup, in a container's root directory, and a host
// process renamed with prctl(PR_SET_NAME) are all refused, each by the check
// it fails, though every one of them started first; the host's kubelet (its
// root directory and network namespace, a cgroup outside the pods') is found.
func TestKubeletFinderRealProcesses(t *testing.T) {
	fixtures.RequireRoot(t, "makes cgroups, network namespaces and chroots")
	sleep, err := exec.LookPath("sleep")
	if err != nil {
		t.Fatal(err)
	}
	kubelet := filepath.Join(t.TempDir(), "kubelet")
	copyFile(t, sleep, kubelet)
	imageRoot := containerRoot(t, sleep)
	chroot, err := exec.LookPath("chroot")
	if err != nil {
		t.Fatal(err)
	}
	python, err := exec.LookPath("python3")
	if err != nil {
		t.Fatal(err)
	}

	base := harness.NewCgroup(t, "kubelet-id")
	service := harness.MkCgroup(t, filepath.Join(harness.MkCgroup(t, filepath.Join(base, "system.slice")), "kubelet.service"))
	pod := harness.MkCgroup(t, filepath.Join(harness.MkCgroup(t, filepath.Join(harness.MkCgroup(t, filepath.Join(base, "kubepods.slice")), "kubepods-besteffort.slice")),
		"kubepods-besteffort-pod"+strings.ReplaceAll(uid(7), "-", "_")+".slice"))
	podNetns := fixtures.NewNetns(t, filepath.Join(t.TempDir(), "pod")).Path

	start := func(name, cgroup, netnsPath, path string, args ...string) int {
		t.Helper()
		p := harness.StartProcess(t, harness.ProcessOptions{Name: name, Path: path, Args: args,
			Cgroup: harness.MkCgroup(t, filepath.Join(cgroup, name+".scope")), NetNSPath: netnsPath})
		fixtures.WaitFor(t, 10*time.Second, name+" named kubelet", func() bool {
			comm, err := os.ReadFile(filepath.Join("/proc", strconv.Itoa(p.Pid()), "comm"))
			return err == nil && strings.TrimSpace(string(comm)) == "kubelet"
		})
		// The host's kubelet, started last, is the youngest.
		waitNextTick(t, p.Pid())
		return p.Pid()
	}
	attackers := map[int]Check{
		start("pod", pod, podNetns, chroot, imageRoot, "/kubelet", "1000"): CheckRoot,
		start("image", service, "", chroot, imageRoot, "/kubelet", "1000"): CheckRoot,
		start("hostnet-podcgroup", pod, "", kubelet, "1000"):               CheckCgroup,
		start("podnet-hostcgroup", service, podNetns, kubelet, "1000"):     CheckNetNS,
		start("renamed", service, "", python, "-c",
			"import ctypes, time; ctypes.CDLL(None).prctl(15, b'kubelet', 0, 0, 0); time.sleep(1000)"): CheckExe,
	}
	genuine := start("host", service, "", kubelet, "1000")

	pids := []int{genuine}
	for pid := range attackers {
		pids = append(pids, pid)
	}
	slices.Sort(pids)
	// The test's own process is the host's reference: this machine's init
	// may be out of the test's reach, and a view of these processes only
	// leaves out whatever else runs here named kubelet (a node test's).
	finder := KubeletFinder{Proc: Procfs{Root: harness.ProcView(t, os.Getpid(), pids...)}, Names: []string{"kubelet"}, ExeNames: []string{"kubelet"}}
	k, refused, err := finder.Find()
	if err != nil || k.PID != genuine {
		t.Fatalf("found %+v, %v; want the host's kubelet, pid %d (refused: %v)", k, err, genuine, refused)
	}
	got := refusedBy(refused)
	for pid, check := range attackers {
		if got[pid] != check {
			t.Errorf("pid %d: refused by %q, want %q (%v)", pid, got[pid], check, refused)
		}
	}
	if len(got) != len(attackers) {
		t.Errorf("refused %v, want %v", got, attackers)
	}
	// With the executable configured, only that file of the host's root is
	// the kubelet's.
	finder.Exes = []string{kubelet}
	if k, _, err := finder.Find(); err != nil || k.PID != genuine {
		t.Errorf("by file %s: found %+v, %v; want %d", kubelet, k, err, genuine)
	}
	finder.Exes = []string{"/usr/bin/kubelet-not-here"}
	if k, refused, err := finder.Find(); err == nil || refusedBy(refused)[genuine] != CheckExe {
		t.Errorf("by a file that is not its executable: found %+v, refused %v", k, refused)
	}
}
