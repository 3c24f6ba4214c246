package hostproc

import (
	"errors"
	"fmt"
	"path"
	"regexp"
	"strings"
)

// The kubelet's cgroup drivers: how it names the cgroups it makes.
const (
	DriverCgroupfs = "cgroupfs"
	DriverSystemd  = "systemd"
)

// ErrNoPodCgroupLayout is returned (wrapped) when the node's pod cgroup layout
// cannot be learned: running pods are then not adopted at all, rather than
// taken by a cgroup path whose place in the hierarchy is a guess.
var ErrNoPodCgroupLayout = errors.New("the node's pod cgroup layout is unknown")

// PodCgroupLayout is where the kubelet puts pods' cgroups: its cgroup driver
// and its cgroupRoot. A pod's cgroup is at exactly one place of it, and a
// container's one level below; the runtime puts a pod's processes there and a
// pod can only make cgroups below that (with a delegated, writable cgroupfs),
// so a path is taken for a pod's container only when it is exactly at that
// place, never when a pod's level appears deeper or elsewhere.
type PodCgroupLayout struct {
	// Driver is DriverCgroupfs or DriverSystemd.
	Driver string
	// Root is the kubelet's cgroupRoot, in cgroupfs form ("/", "/a/b"),
	// as the kubelet reads it with either driver.
	Root string
}

func (l PodCgroupLayout) String() string {
	return fmt.Sprintf("driver %s, cgroupRoot %s: pods under %s", l.Driver, l.Root, l.podsCgroup())
}

// rootNames are Root's components, as the kubelet splits it.
func (l PodCgroupLayout) rootNames() []string {
	r := strings.Trim(path.Clean("/"+l.Root), "/")
	if r == "" {
		return nil
	}
	return strings.Split(r, "/")
}

// Validate checks the driver and the root.
func (l PodCgroupLayout) Validate() error {
	switch l.Driver {
	case DriverCgroupfs, DriverSystemd:
	default:
		return fmt.Errorf("cgroup driver %q: want %s or %s", l.Driver, DriverCgroupfs, DriverSystemd)
	}
	if !strings.HasPrefix(l.Root, "/") {
		return fmt.Errorf("cgroup root %q: want an absolute cgroup path", l.Root)
	}
	for _, c := range strings.Split(l.Root, "/") {
		if c == "." || c == ".." {
			return fmt.Errorf("cgroup root %q: %q is not a cgroup's name", l.Root, c)
		}
	}
	return nil
}

// The kubelet's names: its node allocatable cgroup, the QoS classes with a
// cgroup of their own (guaranteed pods are right below kubepods), and the
// prefix of a pod's cgroup before its uid.
const (
	kubepodsName = "kubepods"
	podPrefix    = "pod"
)

var qosNames = []string{"burstable", "besteffort"}

// podUID is what the kubelet writes after "pod": a pod's uid, or a static
// pod's config hash.
var podUID = regexp.MustCompile(`^[0-9a-fA-F][0-9a-fA-F-]*$`)

// systemdPath is the cgroup path the systemd driver makes for a cgroup name:
// every component's dashes written as underscores, joined by dashes into one
// slice name, and that slice expanded into the path of its parent slices.
func systemdPath(names []string) string {
	var b strings.Builder
	prefix := ""
	for _, n := range names {
		n = strings.ReplaceAll(n, "-", "_")
		b.WriteString("/" + prefix + n + ".slice")
		prefix += n + "-"
	}
	if b.Len() == 0 {
		return "/"
	}
	return b.String()
}

func (l PodCgroupLayout) path(names ...string) string {
	all := append(l.rootNames(), names...)
	if l.Driver == DriverSystemd {
		return systemdPath(all)
	}
	return "/" + strings.Join(all, "/")
}

// podsCgroup is the kubelet's node allocatable cgroup, all pods' ancestor.
func (l PodCgroupLayout) podsCgroup() string { return l.path(kubepodsName) }

// ErrNotPodCgroup is returned (wrapped) by Pod for a path that is nowhere in the
// pods' part of the layout, as the node's own processes are.
var ErrNotPodCgroup = errors.New("not in the pods' cgroups")

// Pod reads a cgroup path, as the host's cgroup namespace shows it: the pod
// uid (dashed) and the container id. It fails with ErrNotPodCgroup for a path
// outside the layout's pods' cgroup and with another error for one below it
// that is not exactly a container's (a pod's own level, or deeper than a
// container: a cgroup a process made below its container's).
func (l PodCgroupLayout) Pod(cg string) (uid, container string, err error) {
	pods := l.podsCgroup()
	rest, ok := strings.CutPrefix(cg, pods+"/")
	if !ok {
		return "", "", fmt.Errorf("cgroup %s is not below %s: %w", cg, pods, ErrNotPodCgroup)
	}
	elems := strings.Split(rest, "/")
	// [qos/]pod/container
	var qos string
	if len(elems) > 0 && l.qosLevel(elems[0]) != "" {
		qos = l.qosLevel(elems[0])
		elems = elems[1:]
	}
	if len(elems) == 0 {
		return "", "", fmt.Errorf("cgroup %s is a QoS class's, not a container's", cg)
	}
	uid, ok = l.podLevel(elems[0], qos)
	if !ok {
		return "", "", fmt.Errorf("cgroup %s: %q is no pod's cgroup of the layout (%s)", cg, elems[0], l)
	}
	switch {
	case len(elems) == 1:
		return "", "", fmt.Errorf("cgroup %s is the pod's own level, not a container's", cg)
	case len(elems) > 2:
		return "", "", fmt.Errorf("cgroup %s is below the container %s of pod %s: a cgroup made inside the container is not taken for any pod's", cg, elems[1], uid)
	}
	container, ok = l.containerLevel(elems[1])
	if !ok {
		return "", "", fmt.Errorf("cgroup %s: %q is not a container's cgroup with the %s driver", cg, elems[1], l.Driver)
	}
	return uid, container, nil
}

// qosLevel is the QoS class whose cgroup elem is, or "".
func (l PodCgroupLayout) qosLevel(elem string) string {
	for _, q := range qosNames {
		if elem == path.Base(l.path(kubepodsName, q)) {
			return q
		}
	}
	return ""
}

// podLevel reads a pod's cgroup name below the QoS class's (qos: "" for
// guaranteed pods).
func (l PodCgroupLayout) podLevel(elem, qos string) (uid string, ok bool) {
	names := []string{kubepodsName}
	if qos != "" {
		names = append(names, qos)
	}
	// The name made for the pod "pod" + uid, with the uid cut out.
	prefix := path.Base(l.path(append(names, podPrefix)...))
	suffix := ""
	if l.Driver == DriverSystemd {
		prefix, suffix = strings.TrimSuffix(prefix, ".slice"), ".slice"
	}
	u, ok := strings.CutPrefix(elem, prefix)
	if !ok {
		return "", false
	}
	if u, ok = strings.CutSuffix(u, suffix); !ok {
		return "", false
	}
	if l.Driver == DriverSystemd {
		if strings.Contains(u, "-") {
			return "", false
		}
		u = strings.ReplaceAll(u, "_", "-")
	}
	return u, podUID.MatchString(u)
}

// namesPod tells whether an element of a path is named like a pod's cgroup
// of the layout, wherever it is.
func (l PodCgroupLayout) namesPod(cg string) bool {
	for _, elem := range strings.Split(cg, "/") {
		for _, q := range append([]string{""}, qosNames...) {
			if _, ok := l.podLevel(elem, q); ok {
				return true
			}
		}
	}
	return false
}

// containerPrefixes are how runtimes name a container's systemd scope.
var containerPrefixes = []string{"cri-containerd-", "crio-conmon-", "crio-", "docker-", "containerd-"}

// containerLevel reads a container's cgroup name: the id itself with the
// cgroupfs driver, "<runtime>-<id>.scope" with systemd.
func (l PodCgroupLayout) containerLevel(elem string) (string, bool) {
	if l.Driver != DriverSystemd {
		return elem, elem != ""
	}
	c, ok := strings.CutSuffix(elem, ".scope")
	if !ok {
		return "", false
	}
	for _, p := range containerPrefixes {
		if id, ok := strings.CutPrefix(c, p); ok {
			return id, id != ""
		}
	}
	return c, c != ""
}

// ContainerCgroups are the cgroup paths (as the host's cgroup namespace shows
// them) where the kubelet and the runtime put a container of a pod: one per
// QoS class and, with the systemd driver, per runtime's scope name. Exactly one
// exists for a running container; which one is for the caller to find out.
func (l PodCgroupLayout) ContainerCgroups(podUID, containerID string) []string {
	var out []string
	for _, qos := range append([]string{""}, qosNames...) {
		names := []string{kubepodsName}
		if qos != "" {
			names = append(names, qos)
		}
		pod := l.path(append(names, podPrefix+podUID)...)
		if l.Driver != DriverSystemd {
			out = append(out, pod+"/"+containerID)
			continue
		}
		for _, p := range containerPrefixes {
			out = append(out, pod+"/"+p+containerID+".scope")
		}
	}
	return out
}
