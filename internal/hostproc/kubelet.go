package hostproc

import (
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"

	"golang.org/x/sys/unix"
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
	hosts, refused, err := f.Proc.HostProcesses(f.Names)
	if err != nil {
		return nil, nil, err
	}
	for _, h := range hosts {
		exe, err := f.exe(h.PID)
		if err != nil {
			refused = append(refused, Refusal{PID: h.PID, Comm: h.Comm, StartTime: h.StartTime, Check: CheckExe, Err: err})
			continue
		}
		found = append(found, Kubelet{PID: h.PID, Comm: h.Comm, StartTime: h.StartTime, Exe: exe})
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

// exe reads the candidate's executable and checks it.
func (f KubeletFinder) exe(pid int) (string, error) {
	exe, err := os.Readlink(f.Proc.path(pid, "exe"))
	if err != nil {
		return "", err
	}
	return exe, f.checkExe(pid, exe)
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
		// Symbolic links resolve in that root too (/usr/bin/kubelet linking
		// to /opt/bin/kubelet names the host's /opt/bin).
		want, err := statInRoot(f.Proc.path(1, "root"), p)
		if err == nil && want == id {
			return nil
		}
	}
	return fmt.Errorf("its executable %s is none of the host's %s", exe, strings.Join(f.Exes, ", "))
}

// statInRoot is statID of path as seen with root as the root directory:
// absolute symbolic links and ".." stay in root (openat2 RESOLVE_IN_ROOT).
func statInRoot(root, path string) (NamespaceID, error) {
	dir, err := unix.Open(root, unix.O_PATH|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
	if err != nil {
		return NamespaceID{}, &os.PathError{Op: "open", Path: root, Err: err}
	}
	defer unix.Close(dir)
	fd, err := unix.Openat2(dir, path, &unix.OpenHow{Flags: unix.O_PATH | unix.O_CLOEXEC, Resolve: unix.RESOLVE_IN_ROOT})
	if err != nil {
		return NamespaceID{}, &os.PathError{Op: "openat2", Path: filepath.Join(root, path), Err: err}
	}
	defer unix.Close(fd)
	var st unix.Stat_t
	if err := unix.Fstat(fd, &st); err != nil {
		return NamespaceID{}, &os.PathError{Op: "fstat", Path: filepath.Join(root, path), Err: err}
	}
	return NamespaceID{Dev: st.Dev, Ino: st.Ino}, nil
}
