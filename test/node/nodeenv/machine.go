package nodeenv

import (
	"bufio"
	"context"
	"crypto/rand"
	"encoding/binary"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/containernetworking/plugins/pkg/netlinksafe"
	"github.com/vishvananda/netlink"

	"github.com/mesh-cni/mesh-cni/internal/netns"
	"github.com/mesh-cni/mesh-cni/test/fixtures"
	"github.com/mesh-cni/mesh-cni/test/harness"
)

// Machine is what the node runs on: a network namespace joined to the host by
// a veth pair, a mount namespace (held open by one process) with the node's
// view of the file system, a cgroup in every cgroup hierarchy for its pods,
// and a directory of the test's.
type Machine struct {
	// Name is unique per machine: the node's name, and the prefix of its
	// interfaces and cgroups.
	Name string
	// Dir holds the node's files (overlay upper layers, containerd's and
	// kubelet's roots, records the test's pods write).
	Dir string
	// NetNS is the node's network namespace (a mount under /run/netns).
	NetNS string
	// HostIP and NodeIP are the two ends of the veth pair: the API server
	// listens on HostIP, kubelet on NodeIP.
	HostIP, NodeIP netip.Addr
	// CgroupParent is the cgroup kubelet puts its pods under (cgroupRoot),
	// the same path in every hierarchy.
	CgroupParent string

	holder *harness.Process
	mntNS  string // the holder's /proc/PID/ns/mnt, what "the node" means for a process
	pidNS  string // the holder's /proc/PID/ns/pid_for_children: the node's PID namespace
}

// overlays are the host directories the node sees with a writable layer of
// its own, so what its software writes there stays in the test's directory.
func overlays() []string { return []string{"/etc", "/home", "/opt", "/var/lib", "/var/log"} }

// newMachine makes the node's namespaces, veth pair, directories and cgroups;
// everything is removed in tb's cleanup.
func newMachine(tb testing.TB) *Machine {
	tb.Helper()
	suffix := fixtures.RandomHex(3)
	m := &Machine{Name: "mesh-node-" + suffix, CgroupParent: "/mesh-node-" + suffix}
	dir, err := os.MkdirTemp("", m.Name+"-")
	if err != nil {
		tb.Fatal(err)
	}
	m.Dir = dir
	tb.Cleanup(func() {
		if err := os.RemoveAll(dir); err != nil {
			tb.Errorf("cleanup: remove %s: %v", dir, err)
		}
	})
	for _, d := range []string{"containerd", "kubelet", "records"} {
		if err := os.MkdirAll(filepath.Join(dir, d), 0o755); err != nil {
			tb.Fatal(err)
		}
	}
	for _, o := range overlays() {
		for _, layer := range []string{"upper", "work"} {
			if err := os.MkdirAll(m.overlayDir(o, layer), 0o755); err != nil {
				tb.Fatal(err)
			}
		}
	}

	m.NetNS = fixtures.NewNetns(tb, filepath.Join(harness.NetnsDir, harness.NetnsPrefix()+"node-"+suffix)).Path
	m.link(tb, suffix)
	m.cgroups(tb)
	m.mounts(tb)
	return m
}

func (m *Machine) overlayDir(dir, layer string) string {
	return filepath.Join(m.Dir, "fs", strings.ReplaceAll(strings.TrimPrefix(dir, "/"), "/", "-")+"."+layer)
}

// link makes the veth pair: a random /30 in 172.31.0.0/16, which nothing on
// this machine uses, host end first.
func (m *Machine) link(tb testing.TB, suffix string) {
	tb.Helper()
	var b [2]byte
	if _, err := rand.Read(b[:]); err != nil {
		tb.Fatal(err)
	}
	base := binary.BigEndian.Uint16(b[:]) &^ 3
	m.HostIP = netip.AddrFrom4([4]byte{172, 31, byte(base >> 8), byte(base) + 1})
	m.NodeIP = m.HostIP.Next()
	hostName, nodeName := "mn"+suffix+"h", "mn"+suffix+"n"
	nsFile, err := netns.Open(m.NetNS)
	if err != nil {
		tb.Fatal(err)
	}
	defer nsFile.Close()
	veth := &netlink.Veth{LinkAttrs: netlink.LinkAttrs{Name: hostName}, PeerName: nodeName, PeerNamespace: netlink.NsFd(int(nsFile.Fd()))}
	if err := netlink.LinkAdd(veth); err != nil {
		tb.Fatalf("veth pair %s/%s: %v", hostName, nodeName, err)
	}
	tb.Cleanup(func() {
		// Deleting the namespace deletes the pair; this is for a failure
		// before that.
		if l, err := netlinksafe.LinkByName(hostName); err == nil {
			_ = netlink.LinkDel(l)
		}
	})
	configure := func(name string, addr netip.Addr) error {
		l, err := netlinksafe.LinkByName(name)
		if err != nil {
			return err
		}
		a := &netlink.Addr{IPNet: &net.IPNet{IP: addr.AsSlice(), Mask: net.CIDRMask(30, 32)}}
		if err := netlink.AddrAdd(l, a); err != nil {
			return fmt.Errorf("address %s on %s: %w", addr, name, err)
		}
		return netlink.LinkSetUp(l)
	}
	if err := configure(hostName, m.HostIP); err != nil {
		tb.Fatal(err)
	}
	err = netns.Do(m.NetNS, func() error {
		if err := configure(nodeName, m.NodeIP); err != nil {
			return err
		}
		// The node's way to everything that is not its own: the host end
		// (which forwards nothing; the API server is on it).
		return netlink.RouteAdd(&netlink.Route{Gw: m.HostIP.AsSlice()})
	})
	if err != nil {
		tb.Fatalf("node end of the veth pair: %v", err)
	}
}

// cgroupMounts lists the mount points of every cgroup hierarchy (v1 and v2).
func cgroupMounts() ([]string, error) {
	f, err := os.Open("/proc/self/mountinfo")
	if err != nil {
		return nil, err
	}
	defer f.Close()
	var out []string
	sc := bufio.NewScanner(f)
	sc.Buffer(make([]byte, 0, 64*1024), 1024*1024)
	for sc.Scan() {
		// ID PARENT MAJ:MIN ROOT MOUNTPOINT OPTIONS [OPTIONAL...] - FSTYPE SOURCE SUPER
		fields := strings.Fields(sc.Text())
		for i, f := range fields {
			if f == "-" && i+1 < len(fields) && i >= 6 {
				if t := fields[i+1]; (t == "cgroup" || t == "cgroup2") && fields[3] == "/" {
					out = append(out, fields[4])
				}
				break
			}
		}
	}
	return out, sc.Err()
}

// cgroups makes CgroupParent in every hierarchy: kubelet refuses a cgroupRoot
// that does not exist, and a cpuset cgroup without cpus and mems cannot take
// tasks.
func (m *Machine) cgroups(tb testing.TB) {
	tb.Helper()
	mounts, err := cgroupMounts()
	if err != nil || len(mounts) == 0 {
		tb.Fatalf("cgroup hierarchies: %v (found %d)", err, len(mounts))
	}
	tb.Cleanup(func() {
		if err := removeCgroups(mounts, m.CgroupParent); err != nil {
			tb.Errorf("cleanup: %v", err)
		}
	})
	for _, mp := range mounts {
		dir := filepath.Join(mp, m.CgroupParent)
		if err := os.Mkdir(dir, 0o755); err != nil {
			tb.Fatalf("cgroup %s: %v", dir, err)
		}
		for _, f := range []string{"cpuset.cpus", "cpuset.mems"} {
			v, err := os.ReadFile(filepath.Join(mp, f))
			if err != nil {
				continue // not the cpuset hierarchy
			}
			if err := os.WriteFile(filepath.Join(dir, f), v, 0o644); err != nil {
				tb.Fatalf("cgroup %s: %v", filepath.Join(dir, f), err)
			}
		}
	}
}

// removeCgroups kills whatever still runs in parent's subtree and removes it,
// deepest first, in every hierarchy.
func removeCgroups(mounts []string, parent string) error {
	var errs []error
	for _, mp := range mounts {
		root := filepath.Join(mp, parent)
		var dirs []string
		_ = filepath.WalkDir(root, func(p string, d os.DirEntry, err error) error {
			if err == nil && d.IsDir() {
				dirs = append(dirs, p)
			}
			return nil
		})
		for _, d := range dirs {
			killPidsIn(filepath.Join(d, "cgroup.procs"))
		}
		for i := len(dirs) - 1; i >= 0; i-- {
			if err := rmdirRetry(dirs[i]); err != nil {
				errs = append(errs, err)
			}
		}
	}
	return errors.Join(errs...)
}

func killPidsIn(procs string) {
	data, err := os.ReadFile(procs)
	if err != nil {
		return
	}
	for _, f := range strings.Fields(string(data)) {
		if pid, err := strconv.Atoi(f); err == nil && pid > 1 {
			_ = syscall.Kill(pid, syscall.SIGKILL)
		}
	}
}

// rmdirRetry removes an empty cgroup, waiting up to 5 s for killed tasks to
// be gone. It runs in cleanups, after the test's context has ended: the
// wait has its own bound.
func rmdirRetry(dir string) error {
	var err error
	if fixtures.Eventually(context.Background(), 5*time.Second, 100*time.Millisecond, func() bool {
		if err = os.Remove(dir); err == nil || errors.Is(err, os.ErrNotExist) {
			return true
		}
		killPidsIn(filepath.Join(dir, "cgroup.procs"))
		return false
	}) {
		return nil
	}
	return fmt.Errorf("remove cgroup %s: %w", dir, err)
}

// mountScript sets up the node's mount namespace, then holds it.
func (m *Machine) mountScript() string {
	var b strings.Builder
	b.WriteString("set -e\n")
	for _, o := range overlays() {
		fmt.Fprintf(&b, "mount -t overlay overlay -o lowerdir=%s,upperdir=%s,workdir=%s %s\n", o, m.overlayDir(o, "upper"), m.overlayDir(o, "work"), o)
	}
	// containerd's root holds overlayfs snapshots, which cannot live on an
	// overlay; kubelet's root is bound the same way for its disk accounting.
	fmt.Fprintf(&b, "mkdir -p /var/lib/containerd /var/lib/kubelet\n")
	fmt.Fprintf(&b, "mount --bind %s /var/lib/containerd\n", filepath.Join(m.Dir, "containerd"))
	fmt.Fprintf(&b, "mount --bind %s /var/lib/kubelet\n", filepath.Join(m.Dir, "kubelet"))
	// A fresh /run (and so /var/run): the node's sockets, netns mounts and
	// mesh-cni state are its own. A fresh bpffs instance: pins are the node's.
	b.WriteString("mount -t tmpfs -o mode=0755 tmpfs /run\n")
	b.WriteString("mount -t bpf bpf /sys/fs/bpf\n")
	// Shared within the node, as on a systemd host: containers' Bidirectional
	// and HostToContainer mounts (bpffs, /var/run/netns) need it.
	b.WriteString("mount --make-rshared /\n")
	b.WriteString("echo ready\nexec sleep infinity\n")
	return b.String()
}

func (m *Machine) mounts(tb testing.TB) {
	tb.Helper()
	// A PID namespace of the node's own, with its /proc, as a machine has:
	// its PID 1 (the holder's shell, then sleep) is the node's init, whose
	// root and network namespace the agent compares the kubelet's with.
	m.holder = harness.StartProcess(tb, harness.ProcessOptions{
		Path:      "unshare",
		Args:      []string{"--mount", "--propagation", "private", "--pid", "--fork", "--mount-proc", "--", "sh", "-ec", m.mountScript()},
		NetNSPath: m.NetNS,
		Name:      m.Name + "-mounts",
		Launcher:  true,
	})
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if _, err := m.holder.WaitForLine(ctx, "ready"); err != nil {
		tb.Fatalf("node mount namespace: %v", err)
	}
	m.mntNS = fmt.Sprintf("/proc/%d/ns/mnt", m.holder.Pid())
	m.pidNS = fmt.Sprintf("/proc/%d/ns/pid_for_children", m.holder.Pid())
	// Registered after the holder's own cleanup, so this runs first: nothing
	// may outlive the node, whoever started it (shims are reparented away
	// from containerd, containers are the shims' children).
	tb.Cleanup(func() { m.killLeftovers(tb, false) })
}

// Path is where the test reaches the node's file p (its /etc/cni/net.d, its
// bpffs) from the host.
func (m *Machine) Path(p string) string {
	return filepath.Join(fmt.Sprintf("/proc/%d/root", m.holder.Pid()), p)
}

// onNode is nsenter's argv that runs path with args on the node: in its
// network, mount and PID namespaces (nsenter forks into the last).
func (m *Machine) onNode(path string, args ...string) []string {
	return append([]string{"--mount=" + m.mntNS, "--net=" + m.NetNS, "--pid=" + m.pidNS, "--", path}, args...)
}

// Start runs a long-lived process on the node until the test ends.
func (m *Machine) Start(tb testing.TB, name, path string, args ...string) *harness.Process {
	tb.Helper()
	return harness.StartProcess(tb, harness.ProcessOptions{Path: "nsenter", Args: m.onNode(path, args...), Dir: "/", Name: name, Launcher: true})
}

// StartInOwnCgroup is Start in a cgroup v2 of the process's own, as a node's
// systemd runs kubelet in kubelet.service's.
func (m *Machine) StartInOwnCgroup(tb testing.TB, name, path string, args ...string) *harness.Process {
	tb.Helper()
	return harness.StartProcess(tb, harness.ProcessOptions{Path: "nsenter", Args: m.onNode(path, args...), Dir: "/", Name: name, OwnCgroup: true, Launcher: true})
}

// StartInCgroup is Start in the existing cgroup v2 directory dir.
func (m *Machine) StartInCgroup(tb testing.TB, name, dir, path string, args ...string) *harness.Process {
	tb.Helper()
	return harness.StartProcess(tb, harness.ProcessOptions{Path: "nsenter", Args: m.onNode(path, args...), Dir: "/", Name: name, Cgroup: dir, Launcher: true})
}

// Command is a command that runs on the node, with env added to the test's
// environment.
func (m *Machine) Command(ctx context.Context, env []string, path string, args ...string) *exec.Cmd {
	cmd := exec.CommandContext(ctx, "nsenter", m.onNode(path, args...)...)
	cmd.Dir = "/"
	cmd.Env = append(os.Environ(), env...)
	return cmd
}

// killLeftovers kills every process in the node's mount namespace but the
// holder, by pid, and waits for them to go; with keepInit, the node's init
// (the holder's child, PID 1 of the node's PID namespace) stays too.
func (m *Machine) killLeftovers(tb testing.TB, keepInit bool) {
	tb.Helper()
	want, err := os.Readlink(m.mntNS)
	if err != nil {
		return // the holder is gone: so is the namespace
	}
	keep := map[int]bool{m.holder.Pid(): true, os.Getpid(): true}
	if keepInit {
		for _, pid := range m.holder.Children() {
			keep[pid] = true
		}
	}
	// A cleanup, or a reboot: tb's context may have ended, so the wait has
	// only its own bound.
	if fixtures.Eventually(context.Background(), 5*time.Second, 100*time.Millisecond, func() bool {
		var left []int
		entries, _ := os.ReadDir("/proc")
		for _, e := range entries {
			pid, err := strconv.Atoi(e.Name())
			if err != nil || keep[pid] {
				continue
			}
			if ns, err := os.Readlink(filepath.Join("/proc", e.Name(), "ns/mnt")); err == nil && ns == want {
				left = append(left, pid)
				_ = syscall.Kill(pid, syscall.SIGKILL)
			}
		}
		return len(left) == 0
	}) {
		return
	}
	tb.Errorf("cleanup: processes still in node %s's mount namespace", m.Name)
}

// Processes lists the pids of processes in the node's mount namespace whose
// command is comm (a CNI plugin the runtime runs, say).
func (m *Machine) Processes(comm string) []int {
	want, err := os.Readlink(m.mntNS)
	if err != nil {
		return nil
	}
	return HostProcesses(comm, func(dir string) bool {
		ns, err := os.Readlink(filepath.Join(dir, "ns/mnt"))
		return err == nil && ns == want
	})
}

// HostProcesses lists the pids of the host's processes whose command is comm
// and for whose /proc directory keep holds.
func HostProcesses(comm string, keep func(procDir string) bool) []int {
	var out []int
	entries, _ := os.ReadDir("/proc")
	for _, e := range entries {
		pid, err := strconv.Atoi(e.Name())
		if err != nil {
			continue
		}
		dir := filepath.Join("/proc", e.Name())
		c, err := os.ReadFile(filepath.Join(dir, "comm"))
		if err != nil || strings.TrimSpace(string(c)) != comm {
			continue
		}
		if keep(dir) {
			out = append(out, pid)
		}
	}
	return out
}
