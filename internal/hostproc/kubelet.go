package hostproc

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"
)

// KubeletCheck names what a process named like the kubelet must show to be
// taken for it.
type KubeletCheck string

// The checks, in the order they are made. A pod can rename any of its
// processes (prctl PR_SET_NAME, or an executable named kubelet), so the name
// only picks the candidates; these decide.
const (
	// CheckRoot: its root directory is the host's (PID 1's), not a
	// container's image.
	CheckRoot KubeletCheck = "root"
	// CheckNetNS: it is in the host's network namespace (PID 1's).
	CheckNetNS KubeletCheck = "netns"
	// CheckCgroup: no cgroup of it is in the pods' part of the hierarchy
	// (InPodCgroup), which no process of a pod can leave.
	CheckCgroup KubeletCheck = "cgroup"
	// CheckExe: its executable is one of the kubelet's: the same file as one
	// of the configured host paths, or by default a file named like it.
	CheckExe KubeletCheck = "exe"
)

// Kubelet is a process that passed every check.
type Kubelet struct {
	PID  int
	Comm string
	// StartTime is when it started, in clock ticks after boot.
	StartTime uint64
	// Exe is its executable as /proc/PID/exe reads.
	Exe string
}

// Refusal is a process named like the kubelet that failed a check.
type Refusal struct {
	PID       int
	Comm      string
	StartTime uint64
	Check     KubeletCheck
	Err       error
}

func (r Refusal) Error() string {
	return fmt.Sprintf("process %d (%s) is not taken for the kubelet: %s check: %v", r.PID, r.Comm, r.Check, r.Err)
}

// KubeletFinder finds the kubelet among the host's processes by what a pod
// cannot fake about one of its processes: its root directory, its network
// namespace, its cgroup and its executable file. PID 1 of Proc is the host's
// reference: the agent runs in the host's PID namespace, where PID 1 is the
// host's init.
type KubeletFinder struct {
	Proc Procfs
	// Names are the process names (comm) that make a process a candidate.
	Names []string
	// Exes are the kubelet's executables, as paths in the host's root
	// directory: a candidate's executable must be one of these files (the
	// same device and inode). Empty: any executable whose file name is one of
	// ExeNames.
	Exes []string
	// ExeNames are the file names of the kubelet's executables, used when
	// Exes is empty. A name of a deleted file (" (deleted)") counts.
	ExeNames []string
}

// Scan returns every candidate that passes the checks and every one that
// fails one, with the first check it failed. It fails only when the procfs
// cannot be listed.
func (f KubeletFinder) Scan() (found []Kubelet, refused []Refusal, _ error) {
	pids, err := f.Proc.PIDs()
	if err != nil {
		return nil, nil, err
	}
	slices.Sort(pids)
	var host *hostRef
	for _, pid := range pids {
		comm, err := f.Proc.Comm(pid)
		if err != nil || !slices.Contains(f.Names, comm) {
			continue
		}
		st, err := f.Proc.Stat(pid)
		if err != nil {
			continue // gone meanwhile
		}
		if host == nil {
			h := f.hostRef()
			host = &h
		}
		exe, check, err := f.check(pid, *host)
		if err != nil {
			refused = append(refused, Refusal{PID: pid, Comm: comm, StartTime: st.StartTime, Check: check, Err: err})
			continue
		}
		found = append(found, Kubelet{PID: pid, Comm: comm, StartTime: st.StartTime, Exe: exe})
	}
	return found, refused, nil
}

// Find returns the kubelet: of the processes that pass every check, the one
// that started first, and the candidates it refused (for the caller to log).
// The oldest, because a kubelet that restarts replaces its predecessor, so two
// at once are the node's long-running one and a later one (an operator's
// `kubelet --version`, a second instance started by hand) that must not take
// the probes' exemption from it; and by start time, not pid, because pids
// wrap.
func (f KubeletFinder) Find() (Kubelet, []Refusal, error) {
	found, refused, err := f.Scan()
	if err != nil {
		return Kubelet{}, nil, err
	}
	if len(found) == 0 {
		return Kubelet{}, refused, fmt.Errorf("no process named %s in %s passes the kubelet's checks (%d refused)", strings.Join(f.Names, " or "), f.Proc.Root, len(refused))
	}
	best := found[0]
	for _, k := range found[1:] {
		if k.StartTime < best.StartTime {
			best = k
		}
	}
	return best, refused, nil
}

// hostRef is what the host's init shows, read once per scan.
type hostRef struct {
	root, netns NamespaceID
	rootErr     error
	netnsErr    error
}

func (f KubeletFinder) hostRef() hostRef {
	var h hostRef
	h.root, h.rootErr = statID(f.Proc.path(1, "root"))
	h.netns, h.netnsErr = statID(f.Proc.path(1, "ns", "net"))
	return h
}

// check makes the checks in order and returns the first that fails.
func (f KubeletFinder) check(pid int, host hostRef) (exe string, _ KubeletCheck, _ error) {
	if host.rootErr != nil {
		return "", CheckRoot, fmt.Errorf("the host's root directory: %w", host.rootErr)
	}
	root, err := statID(f.Proc.path(pid, "root"))
	if err != nil {
		return "", CheckRoot, err
	}
	if root != host.root {
		return "", CheckRoot, errors.New("its root directory is not the host's: it runs in a container's file system")
	}
	if host.netnsErr != nil {
		return "", CheckNetNS, fmt.Errorf("the host's network namespace: %w", host.netnsErr)
	}
	ns, err := statID(f.Proc.path(pid, "ns", "net"))
	if err != nil {
		return "", CheckNetNS, err
	}
	if ns != host.netns {
		return "", CheckNetNS, errors.New("it is not in the host's network namespace")
	}
	cgs, err := f.Proc.Cgroups(pid)
	if err != nil {
		return "", CheckCgroup, err
	}
	if len(cgs) == 0 {
		return "", CheckCgroup, errors.New("no cgroup")
	}
	for _, cg := range cgs {
		if InPodCgroup(cg) {
			return "", CheckCgroup, fmt.Errorf("its cgroup %s is a pod's", cg)
		}
	}
	exe, err = os.Readlink(f.Proc.path(pid, "exe"))
	if err != nil {
		return "", CheckExe, err
	}
	if err := f.checkExe(pid, exe); err != nil {
		return "", CheckExe, err
	}
	return exe, "", nil
}

// checkExe checks the executable: by file against the configured host
// paths, or by name.
func (f KubeletFinder) checkExe(pid int, exe string) error {
	if len(f.Exes) == 0 {
		if name := filepath.Base(strings.TrimSuffix(exe, " (deleted)")); !slices.Contains(f.ExeNames, name) {
			return fmt.Errorf("its executable %s is not named %s", exe, strings.Join(f.ExeNames, " or "))
		}
		return nil
	}
	id, err := statID(f.Proc.path(pid, "exe"))
	if err != nil {
		return err
	}
	for _, p := range f.Exes {
		// Through PID 1's root: the agent's own file system is its image.
		want, err := statID(filepath.Join(f.Proc.path(1, "root"), p))
		if err == nil && want == id {
			return nil
		}
	}
	return fmt.Errorf("its executable %s is none of the host's %s", exe, strings.Join(f.Exes, ", "))
}
