package agentcli

import (
	"errors"
	"fmt"
	"net"
	"path/filepath"
	"syscall"
	"time"

	"golang.org/x/sys/unix"
)

// hybridSubdir is where systemd's hybrid cgroup mode mounts the cgroup v2
// hierarchy, next to the v1 controllers under a tmpfs at /sys/fs/cgroup.
const hybridSubdir = "unified"

// cgroupRoot returns the directory the socket programs attach to for
// --cgroup-root=dir: dir itself when it is a cgroup v2 mount, or dir/unified
// when dir is the tmpfs of a node with hybrid cgroups (v1 controllers in
// dir/<controller>, v2 in dir/unified). Both are the root of the node's one v2
// hierarchy, so a DaemonSet that mounts the host's /sys/fs/cgroup works on
// either kind of node unchanged. Anything else is refused, naming what was
// found: programs attached to some other directory would miss the pods. An
// empty dir stays empty (the data path then finds the cgroup2 mount itself).
func cgroupRoot(dir string) (string, error) {
	if dir == "" {
		return "", nil
	}
	fsType, err := statfsType(dir)
	if err != nil {
		return "", fmt.Errorf("--cgroup-root %s: %w", dir, err)
	}
	if fsType == unix.CGROUP2_SUPER_MAGIC {
		return dir, nil
	}
	hybrid := filepath.Join(dir, hybridSubdir)
	if sub, err := statfsType(hybrid); err == nil && sub == unix.CGROUP2_SUPER_MAGIC {
		return hybrid, nil
	}
	return "", fmt.Errorf("--cgroup-root %s is not a cgroup v2 mount (filesystem magic %#x) and holds none at %s (hybrid cgroups)", dir, fsType, hybrid)
}

func statfsType(path string) (int64, error) {
	var st unix.Statfs_t
	if err := unix.Statfs(path, &st); err != nil {
		return 0, fmt.Errorf("statfs %s: %w", path, err)
	}
	return int64(st.Type), nil
}

// agentListening reports whether a process accepts connections on the gate
// socket at path: a connect succeeds only while a listener holds it (a socket
// file left by a stopped agent refuses).
func agentListening(path string) (bool, error) {
	conn, err := net.DialTimeout("unix", path, 2*time.Second)
	if err == nil {
		conn.Close()
		return true, nil
	}
	if errors.Is(err, syscall.ECONNREFUSED) || errors.Is(err, syscall.ENOENT) {
		return false, nil
	}
	return false, fmt.Errorf("probe the gate socket %s: %w", path, err)
}
