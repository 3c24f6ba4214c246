// Package hostproctest builds procfs trees for tests of what reads the host's
// processes: a host whose PID 1 is its init, and processes whose links lead
// into the host's root and network namespace or into a pod's, as the
// kernel's /proc links do.
package hostproctest

import (
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"

	"github.com/mesh-cni/mesh-cni/internal/hostproc"
)

// Node is a procfs (Proc) with a host: PID 1's root directory (Root, a
// directory of the test's) and network namespace (Netns, a file), and a
// pod's root and namespace for processes that run in one.
type Node struct {
	t                 *testing.T
	Proc, Root, Netns string
	PodRoot, PodNetns string
	// HostCgroup and PodCgroup are /proc/PID/cgroup contents: a service's
	// cgroup, and a pod container's (systemd driver).
	HostCgroup, PodCgroup string
}

// New makes a node with PID 1, everything removed with the test.
func New(t *testing.T) *Node {
	t.Helper()
	dir := t.TempDir()
	n := &Node{t: t, Proc: filepath.Join(dir, "proc"), Root: filepath.Join(dir, "host"), Netns: filepath.Join(dir, "net-host"),
		PodRoot: filepath.Join(dir, "pod"), PodNetns: filepath.Join(dir, "net-pod"),
		HostCgroup: "0::/system.slice/containerd.service\n",
		PodCgroup:  "0::/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod0f1e2d3c_aaaa_bbbb_cccc_123456789abc.slice/cri-containerd-" + strings.Repeat("ab", 32) + ".scope\n"}
	for _, d := range []string{n.Root, n.PodRoot} {
		if err := os.MkdirAll(d, 0o755); err != nil {
			t.Fatal(err)
		}
	}
	for _, f := range []string{n.Netns, n.PodNetns} {
		if err := os.WriteFile(f, nil, 0o644); err != nil {
			t.Fatal(err)
		}
	}
	n.Process(1, "systemd", []string{"/sbin/init"}, n.Root, n.Netns, "0::/init.scope\n")
	return n
}

// Process writes /proc/PID: name, command line, stat, cgroup, and the root
// and ns/net links.
func (n *Node) Process(pid int, comm string, args []string, root, netns, cgroup string) {
	n.t.Helper()
	dir := filepath.Join(n.Proc, strconv.Itoa(pid))
	if err := os.MkdirAll(filepath.Join(dir, "ns"), 0o755); err != nil {
		n.t.Fatal(err)
	}
	stat := fmt.Sprintf("%d (%s) S 1%s 100 0 0\n", pid, comm, strings.Repeat(" 0", 17))
	for name, data := range map[string]string{"comm": comm + "\n", "cmdline": strings.Join(args, "\x00") + "\x00", "stat": stat, "cgroup": cgroup} {
		if err := os.WriteFile(filepath.Join(dir, name), []byte(data), 0o644); err != nil {
			n.t.Fatal(err)
		}
	}
	for link, target := range map[string]string{"root": root, "ns/net": netns} {
		if err := os.Symlink(target, filepath.Join(dir, link)); err != nil {
			n.t.Fatal(err)
		}
	}
}

// Files writes files below root (a name ending in / is a directory).
func (n *Node) Files(root string, files map[string]string) {
	n.t.Helper()
	for name, data := range files {
		p := filepath.Join(root, name)
		if strings.HasSuffix(name, "/") {
			if err := os.MkdirAll(p, 0o755); err != nil {
				n.t.Fatal(err)
			}
			continue
		}
		if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil {
			n.t.Fatal(err)
		}
		if err := os.WriteFile(p, []byte(data), 0o644); err != nil {
			n.t.Fatal(err)
		}
	}
}

// Procfs is the node's procfs.
func (n *Node) Procfs() hostproc.Procfs { return hostproc.Procfs{Root: n.Proc} }

// Host is where the agent reaches the host's path p through PID 1's root.
func (n *Node) Host(p string) string { return filepath.Join(n.Proc, "1", "root", p) }

// Mount is the host's directory p as the agent sees it through a mount: the
// same directory by another path.
func (n *Node) Mount(p string) string { return filepath.Join(n.Root, p) }
