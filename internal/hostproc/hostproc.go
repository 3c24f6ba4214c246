// Package hostproc reads the host's processes from its procfs. The agent runs
// in the host's PID namespace; it finds the kubelet there (whose probes pass the
// inbound capture by their socket) and the network namespaces of pods that were
// already running when it was installed.
//
// Everything here decides by what a process cannot forge about itself from
// inside a pod: its cgroup (set by the runtime, read-only to a pod), its
// network namespace's inode, its root directory, its executable file and its
// parent. Names and command lines only pick candidates (a pod can rename its
// processes): the kubelet is the process so named that also passes
// KubeletFinder's checks, the container runtime one that passes
// HostProcesses', and the containerd shim only names a sandbox of a pod
// already found by its cgroup.
package hostproc

import (
	"bytes"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"

	"github.com/mesh-cni/mesh-cni/internal/netns"
)

// Procfs is a procfs mount: /proc, as the agent sees the host's.
type Procfs struct {
	Root string
}

// PIDs lists the processes, in no particular order.
func (p Procfs) PIDs() ([]int, error) {
	entries, err := os.ReadDir(p.Root)
	if err != nil {
		return nil, fmt.Errorf("list processes in %s: %w", p.Root, err)
	}
	pids := make([]int, 0, len(entries))
	for _, e := range entries {
		if pid, err := strconv.Atoi(e.Name()); err == nil && pid > 0 {
			pids = append(pids, pid)
		}
	}
	return pids, nil
}

func (p Procfs) path(pid int, elem ...string) string {
	return filepath.Join(append([]string{p.Root, strconv.Itoa(pid)}, elem...)...)
}

// Comm is the process's name as the kernel keeps it (at most 15 bytes).
func (p Procfs) Comm(pid int) (string, error) {
	b, err := os.ReadFile(p.path(pid, "comm"))
	if err != nil {
		return "", err
	}
	return strings.TrimSuffix(string(b), "\n"), nil
}

// Stat is what the process's stat file says about its place in the tree.
type Stat struct {
	PPID int
	// StartTime is when the process started, in clock ticks after boot.
	StartTime uint64
}

// Stat reads the process's parent and start time.
func (p Procfs) Stat(pid int) (Stat, error) {
	b, err := os.ReadFile(p.path(pid, "stat"))
	if err != nil {
		return Stat{}, err
	}
	// The name, in parentheses, may hold spaces and parentheses itself: the
	// fields start after the last ')'.
	i := bytes.LastIndexByte(b, ')')
	if i < 0 {
		return Stat{}, fmt.Errorf("%s: no ')' in stat", p.path(pid, "stat"))
	}
	// After the name: state(3) ppid(4) ... starttime(22).
	f := strings.Fields(string(b[i+1:]))
	if len(f) < 20 {
		return Stat{}, fmt.Errorf("%s: %d fields after the name, want at least 20", p.path(pid, "stat"), len(f))
	}
	ppid, err := strconv.Atoi(f[1])
	if err != nil {
		return Stat{}, fmt.Errorf("%s: ppid: %w", p.path(pid, "stat"), err)
	}
	start, err := strconv.ParseUint(f[19], 10, 64)
	if err != nil {
		return Stat{}, fmt.Errorf("%s: starttime: %w", p.path(pid, "stat"), err)
	}
	return Stat{PPID: ppid, StartTime: start}, nil
}

// Cmdline is the process's argument vector.
func (p Procfs) Cmdline(pid int) ([]string, error) {
	b, err := os.ReadFile(p.path(pid, "cmdline"))
	if err != nil {
		return nil, err
	}
	return strings.Split(strings.TrimRight(string(b), "\x00"), "\x00"), nil
}

// Cgroups are the process's cgroup paths, one per hierarchy (cgroup v2 has one,
// a hybrid host one per v1 controller more), as the reader's cgroup namespace
// sees them: relative ones start with "/..".
func (p Procfs) Cgroups(pid int) ([]string, error) {
	b, err := os.ReadFile(p.path(pid, "cgroup"))
	if err != nil {
		return nil, err
	}
	return parseCgroups(b), nil
}

// HostCgroups reads the processes' cgroup paths as the host's cgroup
// namespace (PID 1's) shows them: whole paths from the hierarchy's root,
// where Cgroups, in an agent container with a cgroup namespace of its own,
// reads "/../../..." relative to the agent's. All on one thread that joins
// that namespace for the reads. A process gone meanwhile is left out.
func (p Procfs) HostCgroups(pids []int) (map[int][]string, error) {
	out := make(map[int][]string, len(pids))
	err := netns.InCgroupNamespace(p.path(1, "ns", "cgroup"), func() error {
		for _, pid := range pids {
			b, err := os.ReadFile(p.path(pid, "cgroup"))
			if err != nil {
				continue
			}
			out[pid] = parseCgroups(b)
		}
		return nil
	})
	if err != nil {
		return nil, fmt.Errorf("read processes' cgroups in the host's cgroup namespace: %w", err)
	}
	return out, nil
}

// parseCgroups reads a /proc/PID/cgroup file.
func parseCgroups(b []byte) []string {
	var paths []string
	for _, line := range strings.Split(string(b), "\n") {
		// hierarchy-ID:controllers:path
		parts := strings.SplitN(line, ":", 3)
		if len(parts) == 3 && parts[2] != "" {
			paths = append(paths, parts[2])
		}
	}
	return paths
}

// NamespaceID tells namespaces apart: the device and inode of their nsfs file.
type NamespaceID struct {
	Dev, Ino uint64
}

// NetNS is the network namespace the process is in. Reading it takes ptrace
// access to the process (CAP_SYS_PTRACE for another user's).
func (p Procfs) NetNS(pid int) (NamespaceID, error) {
	return statID(p.path(pid, "ns", "net"))
}

// statID is the device and inode of the file at path, following links (the
// /proc links lead to a namespace's nsfs file, a root directory, an
// executable).
func statID(path string) (NamespaceID, error) {
	fi, err := os.Stat(path)
	if err != nil {
		return NamespaceID{}, err
	}
	st, ok := fi.Sys().(*syscall.Stat_t)
	if !ok {
		return NamespaceID{}, errors.New("no stat_t for " + path)
	}
	return NamespaceID{Dev: st.Dev, Ino: st.Ino}, nil
}
