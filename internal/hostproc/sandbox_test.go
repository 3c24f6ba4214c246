package hostproc

import (
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/mesh-cni/mesh-cni/internal/redirect"
	"github.com/mesh-cni/mesh-cni/test/fixtures"
	"github.com/mesh-cni/mesh-cni/test/harness"
)

// fakeNode is the kubelet's cgroup layout on the cgroup v2 hierarchy mounted
// at mount, under a cgroupRoot of the test's, and the runtime's netns
// directory.
type fakeNode struct {
	t        *testing.T
	mount    string
	layout   PodCgroupLayout
	netnsDir string
}

// newFakeNode makes the layout's cgroupRoot: a test cgroup (cgroupfs), or the
// slices the systemd driver makes of its name.
func newFakeNode(t *testing.T, driver string) *fakeNode {
	t.Helper()
	mount, err := redirect.FindCgroup2()
	if err != nil {
		t.Fatal(err)
	}
	base := harness.NewCgroup(t, "hostproc")
	n := &fakeNode{t: t, mount: mount, layout: PodCgroupLayout{Driver: driver, Root: strings.TrimPrefix(base, mount)}, netnsDir: t.TempDir()}
	n.cgroup()
	return n
}

// cgroup makes the layout's cgroup for the kubelet's names (below the root),
// and every missing one above it.
func (n *fakeNode) cgroup(names ...string) string {
	n.t.Helper()
	var dir string
	for i := range len(names) + 1 {
		dir = filepath.Join(n.mount, n.layout.path(names[:i]...))
		if _, err := os.Stat(dir); err != nil {
			harness.MkCgroup(n.t, dir)
		}
	}
	return dir
}

// fakePod is a pod's cgroup at the node's layout and the network namespaces
// its runtime made, in the node's netns directory.
type fakePod struct {
	t         *testing.T
	node      *fakeNode
	podCgroup string
}

// newFakePod makes the pod's cgroup in QoS class qos ("" for guaranteed).
func newFakePod(n *fakeNode, uid, qos string) *fakePod {
	n.t.Helper()
	names := []string{kubepodsName}
	if qos != "" {
		names = append(names, qos)
	}
	return &fakePod{t: n.t, node: n, podCgroup: n.cgroup(append(names, podPrefix+uid)...)}
}

// containerName is the cgroup name the runtime gives a container.
func (p *fakePod) containerName(id string) string {
	if p.node.layout.Driver == DriverSystemd {
		return "cri-containerd-" + id + ".scope"
	}
	return id
}

// container is the cgroup of one container of the pod.
func (p *fakePod) container(id string) string {
	return harness.MkCgroup(p.t, filepath.Join(p.podCgroup, p.containerName(id)))
}

// runtimeNetns makes a network namespace in the runtime's directory.
func (p *fakePod) runtimeNetns(name string) string {
	p.t.Helper()
	return fixtures.NewNetns(p.t, filepath.Join(p.node.netnsDir, name)).Path
}

// sleepIn runs a process in cgroup and the network namespace at netnsPath
// ("": the test's), as a container of the pod.
func sleepIn(t *testing.T, cgroup, netnsPath string, argv ...string) {
	t.Helper()
	if len(argv) == 0 {
		argv = []string{"sleep", "1000"}
	}
	path, err := exec.LookPath(argv[0])
	if err != nil {
		t.Fatal(err)
	}
	harness.StartProcess(t, harness.ProcessOptions{Path: path, Args: argv[1:], Cgroup: cgroup, NetNSPath: netnsPath})
}

// waitNextTick waits until a process started now would have a later start
// time than pid: start times count in clock ticks (USER_HZ, 100 a second, as
// /proc/uptime's hundredths), so two processes started within one tick are as
// old as each other.
func waitNextTick(t *testing.T, pid int) {
	t.Helper()
	st, err := Procfs{Root: "/proc"}.Stat(pid)
	if err != nil {
		t.Fatal(err)
	}
	fixtures.WaitFor(t, 10*time.Second, fmt.Sprintf("a clock tick after process %d started", pid), func() bool {
		b, err := os.ReadFile("/proc/uptime")
		if err != nil {
			return false
		}
		ticks, err := strconv.ParseUint(strings.Replace(strings.Fields(string(b))[0], ".", "", 1), 10, 64)
		return err == nil && ticks > st.StartTime
	})
}

func hexID(n int) string { return fmt.Sprintf("%064x", n) }

func uid(n int) string { return fmt.Sprintf("%08x-0000-4000-8000-%012x", n, n) }

// waitProcesses waits until count processes run sleep in the cgroup (a shell
// or unshare has exec'd it, so they are where they will stay).
func waitProcesses(t *testing.T, cgroup string, count int) {
	t.Helper()
	fixtures.WaitFor(t, 10*time.Second, "processes in "+cgroup, func() bool {
		b, err := os.ReadFile(filepath.Join(cgroup, "cgroup.procs"))
		if err != nil || len(strings.Fields(string(b))) < count {
			return false
		}
		for _, pid := range strings.Fields(string(b)) {
			comm, err := os.ReadFile(filepath.Join("/proc", pid, "comm"))
			if err != nil || strings.TrimSpace(string(comm)) != "sleep" {
				return false
			}
		}
		return true
	})
}

// Pods' network namespaces are found from their processes: by the cgroup the
// runtime put them in, at the kubelet's layout (either driver, under a
// cgroupRoot), and the namespace the runtime bind mounted, whatever other
// namespace a process of the pod makes for itself; the sandbox's id from
// containerd's shim, else from the container that started first. A process
// of another pod in a cgroup it made inside its container's, named after a
// pod's, is taken for no pod: the pod it names is found by its own processes,
// or not at all.
func TestSandboxes(t *testing.T) {
	fixtures.RequireRoot(t, "makes cgroups and network namespaces")
	for _, driver := range []string{DriverCgroupfs, DriverSystemd} {
		t.Run(driver, func(t *testing.T) { testSandboxes(t, newFakeNode(t, driver)) })
	}
}

func testSandboxes(t *testing.T, n *fakeNode) {
	proc := Procfs{Root: "/proc"}

	// Pod A, run by a stand-in for containerd's shim (its name and arguments
	// as containerd starts it); one of its processes made a network
	// namespace of its own, as any pod can with a user namespace.
	a := newFakePod(n, uid(1), "besteffort")
	aNetns := a.runtimeNetns("cni-a")
	aSandbox, aApp := a.container(hexID(1)), a.container(hexID(2))
	shimDir := t.TempDir()
	shim := filepath.Join(shimDir, "containerd-shim-runc-v2")
	script := "#!/bin/sh\n" +
		"( echo 0 > \"$1/cgroup.procs\"; exec nsenter --net=\"$3\" sleep 1000 ) &\n" +
		"( echo 0 > \"$2/cgroup.procs\"; exec nsenter --net=\"$3\" sleep 1000 ) &\n" +
		"( echo 0 > \"$2/cgroup.procs\"; exec unshare --net sleep 1000 ) &\n" +
		"wait\n"
	if err := os.WriteFile(shim, []byte(script), 0o755); err != nil {
		t.Fatal(err)
	}
	harness.StartProcess(t, harness.ProcessOptions{Path: shim, Args: []string{aSandbox, aApp, aNetns, "-namespace", "k8s.io", "-id", hexID(1), "-address", "/run/containerd/containerd.sock"}})
	waitProcesses(t, aSandbox, 1)
	waitProcesses(t, aApp, 2)

	// Pod B, no shim: the container that started first is the sandbox's.
	b := newFakePod(n, uid(2), "burstable")
	bNetns := b.runtimeNetns("cni-b")
	bFirst := b.container(hexID(3))
	sleepIn(t, bFirst, bNetns)
	waitProcesses(t, bFirst, 1)
	procs, err := os.ReadFile(filepath.Join(bFirst, "cgroup.procs"))
	if err != nil {
		t.Fatal(err)
	}
	first, err := strconv.Atoi(strings.Fields(string(procs))[0])
	if err != nil {
		t.Fatal(err)
	}
	waitNextTick(t, first)
	bLater := b.container(hexID(4))
	sleepIn(t, bLater, bNetns)
	waitProcesses(t, bLater, 1)

	// Pod C: processes in two of the runtime's namespaces.
	c := newFakePod(n, uid(3), "")
	cOne, cTwo := c.runtimeNetns("cni-c1"), c.runtimeNetns("cni-c2")
	cCont := c.container(hexID(5))
	sleepIn(t, cCont, cOne)
	sleepIn(t, cCont, cTwo)
	waitProcesses(t, cCont, 2)

	// Pod D: no process. Pod E: a process only in a namespace of its own.
	newFakePod(n, uid(4), "")
	e := newFakePod(n, uid(5), "besteffort")
	eCont := e.container(hexID(6))
	sleepIn(t, eCont, "", "unshare", "--net", "sleep", "1000")
	waitProcesses(t, eCont, 1)

	// Pod F, whose container can write its own cgroup (delegation): below
	// it, cgroups named exactly like A's and E's containers', each with a
	// process in a runtime namespace of F's. Taken for A's, A would be in
	// two namespaces and refused; taken for E's, E would get F's namespace.
	f := newFakePod(n, uid(6), "besteffort")
	fNetns, fEvil := f.runtimeNetns("cni-f"), f.runtimeNetns("cni-f-evil")
	fCont := f.container(hexID(7))
	sleepIn(t, fCont, fNetns)
	waitProcesses(t, fCont, 1)
	var nested []string
	for _, victim := range []*fakePod{a, e} {
		dir := harness.MkCgroup(t, filepath.Join(fCont, filepath.Base(victim.podCgroup)))
		dir = harness.MkCgroup(t, filepath.Join(dir, victim.containerName(hexID(8))))
		sleepIn(t, dir, fEvil)
		waitProcesses(t, dir, 1)
		nested = append(nested, strings.TrimPrefix(dir, n.mount))
	}

	scan, err := proc.Sandboxes(n.layout, n.netnsDir, []string{uid(1), uid(2), uid(3), uid(4), uid(5), uid(6)})
	if err != nil {
		t.Fatal(err)
	}
	found, problems := scan.Found, scan.Problems
	if sb := found[uid(1)]; sb.NetnsPath != aNetns || sb.ContainerID != hexID(1) || len(sb.PIDs) != 2 {
		t.Errorf("pod A: %+v (%v); want %s, sandbox %s (from the shim), 2 processes (the one in a namespace of its own and the one in F's cgroup passed over)", sb, problems[uid(1)], aNetns, hexID(1))
	}
	if sb := found[uid(2)]; sb.NetnsPath != bNetns || sb.ContainerID != hexID(3) || len(sb.PIDs) != 2 {
		t.Errorf("pod B: %+v; want %s, sandbox %s (started first), 2 processes", sb, bNetns, hexID(3))
	}
	if err := problems[uid(3)]; err == nil || errors.Is(err, ErrNoSandbox) || !strings.Contains(err.Error(), "2 of the runtime's network namespaces") {
		t.Errorf("pod C, in two namespaces: %v (found %+v)", err, found[uid(3)])
	}
	for _, u := range []string{uid(4), uid(5)} {
		if err := problems[u]; !errors.Is(err, ErrNoSandbox) {
			t.Errorf("pod %s: %v, want ErrNoSandbox (found %+v)", u, err, found[u])
		}
	}
	if sb := found[uid(6)]; sb.NetnsPath != fNetns || len(sb.PIDs) != 1 {
		t.Errorf("pod F: %+v; want %s, its one process in its container's cgroup", sb, fNetns)
	}
	if len(found) != 3 || len(problems) != 3 {
		t.Errorf("found %d, problems %d; want 3 and 3", len(found), len(problems))
	}
	for _, cg := range nested {
		if !slices.ContainsFunc(scan.Refused, func(r CgroupRefusal) bool { return strings.Contains(r.Cgroup, cg) }) {
			t.Errorf("the process in %s is not reported refused: %v", cg, scan.Refused)
		}
	}
}
