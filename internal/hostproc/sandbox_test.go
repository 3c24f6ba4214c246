package hostproc

import (
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/mesh-cni/mesh-cni/internal/netns"
	"github.com/mesh-cni/mesh-cni/test/fixtures"
	"github.com/mesh-cni/mesh-cni/test/harness"
)

func TestPodOf(t *testing.T) {
	const uid = "0f1e2d3c-aaaa-bbbb-cccc-123456789abc"
	const id = "4f2a0c6e9d1b3a5c7e9f0a2b4c6d8e0f1a3b5c7d9e1f2a4b6c8d0e2f4a6b8c0d"
	for _, c := range []struct {
		path, uid, container string
	}{
		{"/kubepods/besteffort/pod" + uid + "/" + id, uid, id},
		{"/kubepods/pod" + uid + "/" + id, uid, id},
		{"/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod" + strings.ReplaceAll(uid, "-", "_") + ".slice/cri-containerd-" + id + ".scope", uid, id},
		{"/kubepods.slice/kubepods-pod" + strings.ReplaceAll(uid, "-", "_") + ".slice/crio-" + id + ".scope", uid, id},
		// Seen from a cgroup namespace of the agent's own.
		{"/../../kubepods/besteffort/pod" + uid + "/" + id, uid, id},
		// A static pod: its uid is the config hash.
		{"/kubepods/burstable/pod5b1c7d0e2f3a4b5c6d7e8f9a0b1c2d3e/" + id, "5b1c7d0e2f3a4b5c6d7e8f9a0b1c2d3e", id},
		// The pod's own level (no container) and cgroups of no pod.
		{"/kubepods/besteffort/pod" + uid, "", ""},
		{"/system.slice/containerd.service", "", ""},
		{"/", "", ""},
		{"/user.slice/user-0.slice/session-1.scope", "", ""},
	} {
		gotUID, gotContainer, ok := podOf(c.path)
		if ok != (c.uid != "") || gotUID != c.uid || gotContainer != c.container {
			t.Errorf("podOf(%q) = %q, %q, %v; want %q, %q", c.path, gotUID, gotContainer, ok, c.uid, c.container)
		}
	}
}

// fakePod is a pod's cgroup (the kubelet's layout under a test cgroup) and the
// network namespaces its runtime made, in the test's netns directory.
type fakePod struct {
	t         *testing.T
	podCgroup string
	netnsDir  string
}

func newFakePod(t *testing.T, base, netnsDir, uid string, systemd bool) *fakePod {
	t.Helper()
	dir := filepath.Join(base, "pod"+uid)
	if systemd {
		dir = filepath.Join(base, "kubepods-besteffort-pod"+strings.ReplaceAll(uid, "-", "_")+".slice")
	}
	return &fakePod{t: t, podCgroup: harness.MkCgroup(t, dir), netnsDir: netnsDir}
}

// container is the cgroup of one container of the pod, named as the runtime
// names it.
func (p *fakePod) container(id string, systemd bool) string {
	if systemd {
		id = "cri-containerd-" + id + ".scope"
	}
	return harness.MkCgroup(p.t, filepath.Join(p.podCgroup, id))
}

// runtimeNetns makes a network namespace in the runtime's directory.
func (p *fakePod) runtimeNetns(name string) string {
	p.t.Helper()
	path := filepath.Join(p.netnsDir, name)
	if err := netns.Create(path); err != nil {
		p.t.Fatal(err)
	}
	p.t.Cleanup(func() { netns.Remove(path) })
	return path
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

func hexID(n int) string { return fmt.Sprintf("%064x", n) }

func uid(n int) string { return fmt.Sprintf("%08x-0000-4000-8000-%012x", n, n) }

// waitProcesses waits until count processes run sleep in the cgroup (a shell
// or unshare has exec'd it, so they are where they will stay).
func waitProcesses(t *testing.T, cgroup string, count int) {
	t.Helper()
	harness.WaitFor(t, 10*time.Second, "processes in "+cgroup, func() bool {
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
// runtime put them in and the namespace the runtime bind mounted, whatever
// other namespace a process of the pod makes for itself; the sandbox's id from
// containerd's shim, else from the container that started first.
func TestSandboxes(t *testing.T) {
	fixtures.RequireRoot(t, "makes cgroups and network namespaces")
	base := harness.NewCgroup(t, "hostproc")
	netnsDir := t.TempDir()
	proc := Procfs{Root: "/proc"}

	// Pod A, cgroupfs layout, run by a stand-in for containerd's shim (its
	// name and arguments as containerd starts it); one of its processes made a
	// network namespace of its own, as any pod can with a user namespace.
	a := newFakePod(t, base, netnsDir, uid(1), false)
	aNetns := a.runtimeNetns("cni-a")
	aSandbox, aApp := a.container(hexID(1), false), a.container(hexID(2), false)
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

	// Pod B, systemd layout, no shim: the container that started first is the
	// sandbox's.
	b := newFakePod(t, base, netnsDir, uid(2), true)
	bNetns := b.runtimeNetns("cni-b")
	bFirst := b.container(hexID(3), true)
	sleepIn(t, bFirst, bNetns)
	waitProcesses(t, bFirst, 1)
	time.Sleep(50 * time.Millisecond) // start times count in clock ticks
	bLater := b.container(hexID(4), true)
	sleepIn(t, bLater, bNetns)
	waitProcesses(t, bLater, 1)

	// Pod C: processes in two of the runtime's namespaces.
	c := newFakePod(t, base, netnsDir, uid(3), false)
	cOne, cTwo := c.runtimeNetns("cni-c1"), c.runtimeNetns("cni-c2")
	cCont := c.container(hexID(5), false)
	sleepIn(t, cCont, cOne)
	sleepIn(t, cCont, cTwo)
	waitProcesses(t, cCont, 2)

	// Pod D: no process. Pod E: a process only in a namespace of its own.
	newFakePod(t, base, netnsDir, uid(4), false)
	e := newFakePod(t, base, netnsDir, uid(5), false)
	eCont := e.container(hexID(6), false)
	sleepIn(t, eCont, "", "unshare", "--net", "sleep", "1000")
	waitProcesses(t, eCont, 1)

	found, problems, err := proc.Sandboxes(netnsDir, []string{uid(1), uid(2), uid(3), uid(4), uid(5)})
	if err != nil {
		t.Fatal(err)
	}
	if sb := found[uid(1)]; sb.NetnsPath != aNetns || sb.ContainerID != hexID(1) || len(sb.PIDs) != 2 {
		t.Errorf("pod A: %+v; want %s, sandbox %s (from the shim), 2 processes (the one in a namespace of its own passed over)", sb, aNetns, hexID(1))
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
	if len(found) != 2 || len(problems) != 3 {
		t.Errorf("found %d, problems %d; want 2 and 3", len(found), len(problems))
	}
}
