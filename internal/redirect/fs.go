package redirect

import (
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strings"

	"github.com/moby/sys/mountinfo"
	"go.uber.org/zap"
	"golang.org/x/sys/unix"
)

// sharedBPFFS is where a node's bpffs is mounted by convention.
const sharedBPFFS = "/sys/fs/bpf"

// ensurePinRoot makes dir exist on a bpffs. When dir is below /sys/fs/bpf and nothing
// is mounted there, it mounts the shared bpffs there first (and leaves it: other
// eBPF agents expect it); when dir is elsewhere and not on a bpffs, it mounts a bpffs
// of its own at dir. What it mounted or created is pushed onto undo for a start
// that fails.
func ensurePinRoot(dir string, log *zap.Logger, undo *undoStack) error {
	if rel, err := filepath.Rel(sharedBPFFS, dir); err == nil && rel != ".." && !strings.HasPrefix(rel, "../") {
		if err := mountBPFFS(log, undo, sharedBPFFS); err != nil {
			return err
		}
	}
	created, err := mkdirNew(dir)
	if err != nil {
		return fmt.Errorf("create pin root %q: %w", dir, err)
	}
	if created {
		undo.push(func() error { return removeIfExists(dir) })
	}
	return mountBPFFS(log, undo, dir)
}

// MountSharedBPFFS mounts a bpffs at /sys/fs/bpf unless one is there already: what
// the DaemonSet's init container does, from the node's mount namespace (the mount
// propagates back to the host), so that the agent itself needs no mount.
func MountSharedBPFFS(log *zap.Logger) error {
	var undo undoStack
	return mountBPFFS(log, &undo, sharedBPFFS)
}

// mountBPFFS mounts a bpffs at dir unless one is there already, and pushes its
// unmount onto undo.
func mountBPFFS(log *zap.Logger, undo *undoStack, dir string) error {
	on, err := isBPFFS(dir)
	if err != nil {
		return err
	}
	if on {
		return nil
	}
	if err := unix.Mount("bpf", dir, "bpf", 0, "mode=0700"); err != nil {
		return fmt.Errorf("mount bpffs at %q (nothing is mounted there): %w", dir, err)
	}
	log.Info("mounted bpffs", zap.String("path", dir))
	undo.push(func() error { return unmount(dir) })
	return nil
}

func isBPFFS(dir string) (bool, error) {
	var st unix.Statfs_t
	if err := unix.Statfs(dir, &st); err != nil {
		return false, fmt.Errorf("statfs %q: %w", dir, err)
	}
	return st.Type == unix.BPF_FS_MAGIC, nil
}

// isMountPoint reports whether dir is the root of a mount (its device differs from
// its parent's).
func isMountPoint(dir string) (bool, error) {
	var self, parent unix.Stat_t
	if err := unix.Stat(dir, &self); err != nil {
		return false, fmt.Errorf("stat %q: %w", dir, err)
	}
	if err := unix.Stat(filepath.Dir(filepath.Clean(dir)), &parent); err != nil {
		return false, fmt.Errorf("stat parent of %q: %w", dir, err)
	}
	return self.Dev != parent.Dev, nil
}

// findCgroup2 returns the mount point of the cgroup v2 hierarchy's root. A cgroup2
// mount of a sub-tree (a container with its own cgroup namespace) is used only when
// nothing better exists: programs attached there miss processes outside it.
func findCgroup2() (string, error) {
	f, err := os.Open("/proc/self/mountinfo")
	if err != nil {
		return "", fmt.Errorf("find cgroup2 mount: %w", err)
	}
	defer f.Close()
	return parseCgroup2Mount(f)
}

func parseCgroup2Mount(r io.Reader) (string, error) {
	mounts, err := mountinfo.GetMountsFromReader(r, mountinfo.FSTypeFilter("cgroup2"))
	if err != nil {
		return "", fmt.Errorf("read mountinfo: %w", err)
	}
	for _, m := range mounts {
		if m.Root == "/" {
			return m.Mountpoint, nil
		}
	}
	if len(mounts) > 0 {
		return mounts[0].Mountpoint, nil
	}
	return "", errors.New("no cgroup2 filesystem mounted (set Config.CgroupRoot)")
}

// unmount unmounts dir, lazily when something still holds it busy (the pins are
// already gone, so nothing can use it any more).
func unmount(dir string) error {
	err := unix.Unmount(dir, 0)
	if errors.Is(err, unix.EBUSY) {
		err = unix.Unmount(dir, unix.MNT_DETACH)
	}
	if err != nil {
		return fmt.Errorf("unmount %s: %w", dir, err)
	}
	return nil
}

// FindCgroup2 returns the host's cgroup v2 mount point, where the socket programs
// attach unless configured otherwise.
func FindCgroup2() (string, error) { return findCgroup2() }

// IsBPFFS reports whether dir is on a bpffs.
func IsBPFFS(dir string) (bool, error) { return isBPFFS(dir) }
