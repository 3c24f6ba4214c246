package hostproc

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
)

// Sandbox is a running pod's network namespace as its runtime made it.
type Sandbox struct {
	// UID is the pod's, as its cgroup names it.
	UID string
	// NetnsPath is the namespace's file in the runtime's netns directory:
	// the path the runtime gave CNI when it set the pod's network up.
	NetnsPath string
	// ContainerID is the pod sandbox's id as the runtime gave it to CNI
	// (CNI_CONTAINERID), as far as the host tells it: the id its containerd
	// shim runs under, else the container of the pod that started first (the
	// sandbox's own, where the runtime runs one).
	ContainerID string
	// PIDs are the pod's processes in that namespace.
	PIDs []int
}

// ErrNoSandbox is returned (wrapped) for a pod none of whose processes is in a
// namespace of the runtime's netns directory.
var ErrNoSandbox = errors.New("no network namespace of the pod's runtime found")

// podLevel is the pod's level of a kubelet cgroup path: "pod<uid>" (cgroupfs
// driver) or "kubepods-<class>-pod<uid>.slice" (systemd driver, with the uid's
// dashes written as underscores).
const podLevel = `(?:kubepods-(?:[a-z]+-)?)?pod([0-9a-fA-F_-]+)(?:\.slice)?`

// podLevelName matches one path element that is a pod's level.
var podLevelName = regexp.MustCompile(`^` + podLevel + `$`)

// InPodCgroup tells whether a cgroup path is in the kubelet's pods' part of the
// hierarchy: below its pod cgroup roots ("kubepods" with the cgroupfs driver,
// "kubepods.slice" and its "kubepods-*.slice" with the systemd driver, under
// whatever cgroupRoot the kubelet was given) or below a level named like a
// pod's. A path seen from a cgroup namespace of the reader's own
// ("/../../...") still names every level below the namespace's root, which is
// where a pod's levels are. A process in a pod cannot leave that part: the
// runtime puts it there, and a cgroupfs it may write is its own level's.
// Loose on purpose, unlike PodCgroupLayout.Pod: it refuses the kubelet's
// probe exemption to anything that merely looks like a pod's.
func InPodCgroup(path string) bool {
	for _, elem := range strings.Split(path, "/") {
		if elem == "kubepods" || strings.HasPrefix(elem, "kubepods.") || strings.HasPrefix(elem, "kubepods-") || podLevelName.MatchString(elem) {
			return true
		}
	}
	return false
}

// CgroupRefusal is a process whose cgroup looks like a pod's but is not at a
// pod container's place of the layout: a cgroup made below a container's,
// or a pod's name under another prefix. It is taken for no pod.
type CgroupRefusal struct {
	PID       int
	StartTime uint64
	Cgroup    string
	Err       error
}

func (r CgroupRefusal) Error() string {
	return fmt.Sprintf("process %d is taken for no pod: %v", r.PID, r.Err)
}

// SandboxScan is what Sandboxes found: the pods placed, the pods not placed
// and why, and the processes refused.
type SandboxScan struct {
	Found    map[string]Sandbox
	Problems map[string]error
	Refused  []CgroupRefusal
}

// Sandboxes finds the network namespaces of the pods whose uids are given,
// from their processes: a process belongs to the pod whose container cgroup
// it is in, at exactly the place the layout gives a pod's container (read in
// the host's cgroup namespace), and the pod's namespace is the one of its
// processes that the runtime bind mounted under netnsDir. A process whose
// cgroup looks like a pod's anywhere else (a cgroup it made below its
// container's, named after another pod) is refused, not taken for a pod.
// Namespaces anywhere but netnsDir are not the runtime's (a process in a pod
// can make its own with an unprivileged user namespace) and are passed over.
// A pod with processes in more than one of the runtime's namespaces, or in
// none, gets a problem instead of a sandbox.
func (p Procfs) Sandboxes(layout PodCgroupLayout, netnsDir string, uids []string) (SandboxScan, error) {
	if err := layout.Validate(); err != nil {
		return SandboxScan{}, fmt.Errorf("%w: %w", ErrNoPodCgroupLayout, err)
	}
	runtimeNS, err := runtimeNamespaces(netnsDir)
	if err != nil {
		return SandboxScan{}, err
	}
	wanted := map[string]bool{}
	for _, u := range uids {
		wanted[strings.ToLower(u)] = true
	}
	pids, err := p.PIDs()
	if err != nil {
		return SandboxScan{}, err
	}
	slices.Sort(pids)
	cgroups, err := p.HostCgroups(pids)
	if err != nil {
		return SandboxScan{}, err
	}
	var scan SandboxScan
	members := map[string][]podProcess{}
	for _, pid := range pids {
		cgs, ok := cgroups[pid]
		if !ok {
			continue // gone meanwhile
		}
		uid, container, err := processPod(layout, cgs)
		if err != nil {
			var start uint64
			if st, err := p.Stat(pid); err == nil {
				start = st.StartTime
			}
			scan.Refused = append(scan.Refused, CgroupRefusal{PID: pid, StartTime: start, Cgroup: strings.Join(cgs, ", "), Err: err})
			continue
		}
		if uid == "" || !wanted[strings.ToLower(uid)] {
			continue
		}
		ns, err := p.NetNS(pid)
		if err != nil {
			continue
		}
		members[strings.ToLower(uid)] = append(members[strings.ToLower(uid)], podProcess{pid, container, ns})
	}
	scan.Found, scan.Problems = map[string]Sandbox{}, map[string]error{}
	found, problems := scan.Found, scan.Problems
	for _, u := range uids {
		uid := strings.ToLower(u)
		var paths []string
		var inNS []podProcess
		for _, m := range members[uid] {
			path, ok := runtimeNS[m.ns]
			if !ok {
				continue
			}
			if !slices.Contains(paths, path) {
				paths = append(paths, path)
			}
			inNS = append(inNS, m)
		}
		switch {
		case len(members[uid]) == 0:
			problems[u] = fmt.Errorf("pod %s: no process in its cgroup: %w", u, ErrNoSandbox)
			continue
		case len(paths) == 0:
			problems[u] = fmt.Errorf("pod %s: none of its %d processes is in a namespace under %s: %w", u, len(members[uid]), netnsDir, ErrNoSandbox)
			continue
		case len(paths) > 1:
			problems[u] = fmt.Errorf("pod %s: its processes are in %d of the runtime's network namespaces (%s): refusing to pick one", u, len(paths), strings.Join(paths, ", "))
			continue
		}
		sb := Sandbox{UID: u, NetnsPath: paths[0]}
		containers := map[string]bool{}
		for _, m := range inNS {
			sb.PIDs = append(sb.PIDs, m.pid)
			containers[m.container] = true
		}
		slices.Sort(sb.PIDs)
		sb.ContainerID = p.sandboxID(inNS[0].pid, containers)
		if sb.ContainerID == "" {
			sb.ContainerID = p.firstStarted(inNS)
		}
		found[u] = sb
	}
	return scan, nil
}

// processPod reads a process's cgroups, one per hierarchy: the pod and
// container they put it in ("" for none), or an error when one of them looks
// like a pod's but is not at a container's place of the layout, or they
// disagree. Paths outside the pods' part that look like no pod's (a v1
// controller the runtime left at the root) say nothing.
func processPod(layout PodCgroupLayout, cgs []string) (uid, container string, _ error) {
	for _, cg := range cgs {
		u, c, err := layout.Pod(cg)
		if errors.Is(err, ErrNotPodCgroup) && !InPodCgroup(cg) && !layout.namesPod(cg) {
			continue
		}
		if err != nil {
			return "", "", err
		}
		if uid != "" && (u != uid || c != container) {
			return "", "", fmt.Errorf("its cgroups name two containers: %s/%s and %s/%s", uid, container, u, c)
		}
		uid, container = u, c
	}
	return uid, container, nil
}

// podProcess is a process in a pod's cgroup.
type podProcess struct {
	pid       int
	container string
	ns        NamespaceID
}

// sandboxID is the id of the containerd shim that pid runs under, when it is
// one of the pod's containers: containerd runs all of a pod's containers under
// one shim started with the sandbox's id.
func (p Procfs) sandboxID(pid int, containers map[string]bool) string {
	for range 8 {
		st, err := p.Stat(pid)
		if err != nil || st.PPID <= 1 {
			return ""
		}
		pid = st.PPID
		comm, err := p.Comm(pid)
		if err != nil {
			return ""
		}
		if !strings.HasPrefix(comm, "containerd-shim") {
			continue
		}
		args, err := p.Cmdline(pid)
		if err != nil {
			return ""
		}
		for i, a := range args {
			if (a == "-id" || a == "--id") && i+1 < len(args) && containers[args[i+1]] {
				return args[i+1]
			}
		}
		return ""
	}
	return ""
}

// firstStarted is the container of the member that started first.
func (p Procfs) firstStarted(members []podProcess) string {
	best, bestStart := "", ^uint64(0)
	for _, m := range members {
		st, err := p.Stat(m.pid)
		if err != nil {
			continue
		}
		if st.StartTime < bestStart {
			best, bestStart = m.container, st.StartTime
		}
	}
	return best
}

// runtimeNamespaces maps the namespaces bind mounted in dir to their paths.
func runtimeNamespaces(dir string) (map[NamespaceID]string, error) {
	entries, err := os.ReadDir(dir)
	if err != nil {
		return nil, fmt.Errorf("list the runtime's network namespaces: %w", err)
	}
	out := map[NamespaceID]string{}
	for _, e := range entries {
		path := filepath.Join(dir, e.Name())
		id, err := statID(path)
		if err != nil {
			continue
		}
		out[id] = path
	}
	return out, nil
}
