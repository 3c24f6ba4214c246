package redirect

import (
	"bufio"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strconv"
	"strings"

	"golang.org/x/sys/unix"
)

// ensureBPFFS makes dir exist on a bpffs, mounting a fresh one at dir when it is not
// on one already. mounted reports whether this call mounted it.
func ensureBPFFS(dir string) (mounted bool, err error) {
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return false, fmt.Errorf("create pin root %q: %w", dir, err)
	}
	onBPFFS, err := isBPFFS(dir)
	if err != nil {
		return false, err
	}
	if onBPFFS {
		return false, nil
	}
	if err := unix.Mount("bpf", dir, "bpf", 0, "mode=0700"); err != nil {
		return false, fmt.Errorf("mount bpffs at %q: %w", dir, err)
	}
	return true, nil
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
	var partial string
	sc := bufio.NewScanner(r)
	for sc.Scan() {
		// ID PARENT MAJ:MIN ROOT MOUNTPOINT OPTIONS [OPTIONAL...] - FSTYPE SOURCE SUPER
		fields := strings.Fields(sc.Text())
		sep := -1
		for i, f := range fields {
			if f == "-" && i >= 6 {
				sep = i
				break
			}
		}
		if sep < 0 || sep+1 >= len(fields) || fields[sep+1] != "cgroup2" {
			continue
		}
		mnt := unescapeMountinfo(fields[4])
		if fields[3] == "/" {
			return mnt, nil
		}
		if partial == "" {
			partial = mnt
		}
	}
	if err := sc.Err(); err != nil {
		return "", fmt.Errorf("read mountinfo: %w", err)
	}
	if partial != "" {
		return partial, nil
	}
	return "", errors.New("no cgroup2 filesystem mounted (set Config.CgroupRoot)")
}

// unescapeMountinfo undoes the octal escapes (\040 for a space) of mountinfo paths.
func unescapeMountinfo(s string) string {
	if !strings.Contains(s, `\`) {
		return s
	}
	var b strings.Builder
	for i := 0; i < len(s); i++ {
		if s[i] == '\\' && i+3 < len(s) {
			if v, err := strconv.ParseUint(s[i+1:i+4], 8, 8); err == nil {
				b.WriteByte(byte(v))
				i += 3
				continue
			}
		}
		b.WriteByte(s[i])
	}
	return b.String()
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
