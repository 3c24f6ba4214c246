package hostproc

import (
	"errors"
	"fmt"
	"slices"
)

// Check names what a process must show to be taken for one of the host's
// own (the kubelet, the container runtime) rather than a pod's.
type Check string

// The checks, in the order they are made. A pod can rename any of its
// processes (prctl PR_SET_NAME, or an executable so named), so the name
// only picks the candidates; these decide.
const (
	// CheckRoot: its root directory is the host's (PID 1's), not a
	// container's image.
	CheckRoot Check = "root"
	// CheckNetNS: it is in the host's network namespace (PID 1's).
	CheckNetNS Check = "netns"
	// CheckCgroup: no cgroup of it is in the pods' part of the hierarchy
	// (InPodCgroup), which no process of a pod can leave.
	CheckCgroup Check = "cgroup"
	// CheckExe (the kubelet's only): its executable is one of the
	// kubelet's: the same file as one of the configured host paths, or by
	// default a file named like it.
	CheckExe Check = "exe"
)

// Refusal is a candidate that failed a check.
type Refusal struct {
	PID       int
	Comm      string
	StartTime uint64
	Check     Check
	Err       error
}

func (r Refusal) Error() string {
	return fmt.Sprintf("process %d (%s) is not taken for the host's: %s check: %v", r.PID, r.Comm, r.Check, r.Err)
}

// HostProcess is a process that passed the checks of HostProcesses.
type HostProcess struct {
	PID  int
	Comm string
	// StartTime is when it started, in clock ticks after boot.
	StartTime uint64
}

// HostProcesses returns the processes named one of names (comm) that run as
// the host's own: their root directory and network namespace are PID 1's
// (the agent runs in the host's PID namespace, where PID 1 is the host's
// init) and no cgroup of theirs is a pod's; and every process so named that
// fails a check, with the first it failed. In pid order; it fails only when
// the procfs cannot be listed.
func (p Procfs) HostProcesses(names []string) (found []HostProcess, refused []Refusal, _ error) {
	pids, err := p.PIDs()
	if err != nil {
		return nil, nil, err
	}
	slices.Sort(pids)
	var host *hostRef
	for _, pid := range pids {
		comm, err := p.Comm(pid)
		if err != nil || !slices.Contains(names, comm) {
			continue
		}
		st, err := p.Stat(pid)
		if err != nil {
			continue // gone meanwhile
		}
		if host == nil {
			h := p.hostRef()
			host = &h
		}
		if check, err := p.checkHost(pid, *host); err != nil {
			refused = append(refused, Refusal{PID: pid, Comm: comm, StartTime: st.StartTime, Check: check, Err: err})
			continue
		}
		found = append(found, HostProcess{PID: pid, Comm: comm, StartTime: st.StartTime})
	}
	return found, refused, nil
}

// hostRef is what the host's init shows, read once per scan.
type hostRef struct {
	root, netns NamespaceID
	rootErr     error
	netnsErr    error
}

func (p Procfs) hostRef() hostRef {
	var h hostRef
	h.root, h.rootErr = statID(p.path(1, "root"))
	h.netns, h.netnsErr = statID(p.path(1, "ns", "net"))
	return h
}

// checkHost makes the checks in order and returns the first that fails.
func (p Procfs) checkHost(pid int, host hostRef) (Check, error) {
	if host.rootErr != nil {
		return CheckRoot, fmt.Errorf("the host's root directory: %w", host.rootErr)
	}
	root, err := statID(p.path(pid, "root"))
	if err != nil {
		return CheckRoot, err
	}
	if root != host.root {
		return CheckRoot, errors.New("its root directory is not the host's: it runs in a container's file system")
	}
	if host.netnsErr != nil {
		return CheckNetNS, fmt.Errorf("the host's network namespace: %w", host.netnsErr)
	}
	ns, err := statID(p.path(pid, "ns", "net"))
	if err != nil {
		return CheckNetNS, err
	}
	if ns != host.netns {
		return CheckNetNS, errors.New("it is not in the host's network namespace")
	}
	cgs, err := p.Cgroups(pid)
	if err != nil {
		return CheckCgroup, err
	}
	if len(cgs) == 0 {
		return CheckCgroup, errors.New("no cgroup")
	}
	for _, cg := range cgs {
		if InPodCgroup(cg) {
			return CheckCgroup, fmt.Errorf("its cgroup %s is a pod's", cg)
		}
	}
	return "", nil
}
