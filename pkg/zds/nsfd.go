package zds

import (
	"fmt"

	"golang.org/x/sys/unix"

	"github.com/mesh-cni/mesh-cni/internal/netns"
)

// NetnsID identifies a network namespace by the device and inode of its nsfs
// file, the identity ztunnel compares to tell a re-added pod with a fresh
// namespace (sandbox recreated) from a repeated add. The namespace a proxy holds
// an fd of stays alive, so its inode is not reused meanwhile.
type NetnsID struct {
	Dev, Ino uint64
}

// IsZero reports whether id is the zero NetnsID (no namespace).
func (id NetnsID) IsZero() bool { return id == NetnsID{} }

// FdNetnsID returns the NetnsID of an open namespace fd after checking that it is
// a network namespace. It never switches namespaces.
func FdNetnsID(fd int) (NetnsID, error) {
	kind, err := unix.IoctlRetInt(fd, unix.NS_GET_NSTYPE)
	if err != nil {
		return NetnsID{}, fmt.Errorf("query namespace type: %w", err)
	}
	if kind != unix.CLONE_NEWNET {
		return NetnsID{}, fmt.Errorf("fd is a namespace of type %#x, not a network namespace", kind)
	}
	var st unix.Stat_t
	if err := unix.Fstat(fd, &st); err != nil {
		return NetnsID{}, fmt.Errorf("stat namespace fd: %w", err)
	}
	return NetnsID{Dev: st.Dev, Ino: st.Ino}, nil
}

// openNetns opens the network namespace at path for passing in SCM_RIGHTS. It is
// opened non-blocking so that a FIFO planted at the path cannot hang the server,
// and anything but a network namespace is refused.
func openNetns(path string) (int, NetnsID, error) {
	if path == "" {
		return -1, NetnsID{}, fmt.Errorf("netns path is empty")
	}
	fd, err := unix.Open(path, unix.O_RDONLY|unix.O_CLOEXEC|unix.O_NONBLOCK|unix.O_NOCTTY, 0)
	if err != nil {
		return -1, NetnsID{}, fmt.Errorf("open netns %q: %w", path, err)
	}
	id, err := FdNetnsID(fd)
	if err != nil {
		unix.Close(fd)
		return -1, NetnsID{}, fmt.Errorf("netns %q: %w", path, err)
	}
	return fd, id, nil
}

// podNetns is pod's namespace descriptor to hand over and close: a duplicate
// of the one its caller opened, else the path opened now.
func podNetns(pod Pod) (int, NetnsID, error) {
	if pod.Netns == nil {
		return openNetns(pod.NetnsPath)
	}
	fd, err := unix.FcntlInt(pod.Netns.Fd(), unix.F_DUPFD_CLOEXEC, 0)
	if err != nil {
		return -1, NetnsID{}, fmt.Errorf("duplicate netns %q: %w", pod.NetnsPath, err)
	}
	id, err := FdNetnsID(fd)
	if err != nil {
		unix.Close(fd)
		return -1, NetnsID{}, fmt.Errorf("netns %q: %w", pod.NetnsPath, err)
	}
	return fd, id, nil
}

// ErrNetnsReplaced is returned (wrapped) when a pod's netns path names another
// namespace than the one the agent enrolled.
var ErrNetnsReplaced = netns.ErrReplaced

// openPodNetns opens pod's namespace and, when the pod carries the enrolled
// namespace's cookie, checks that it is that namespace, on the descriptor that
// will be handed over, so the path cannot change in between.
func openPodNetns(pod Pod) (int, NetnsID, error) {
	fd, id, err := podNetns(pod)
	if err != nil || pod.NetnsCookie == 0 {
		return fd, id, err
	}
	cookie, err := netns.CookieFd(fd)
	if err != nil {
		unix.Close(fd)
		return -1, NetnsID{}, fmt.Errorf("netns %q: cookie: %w", pod.NetnsPath, err)
	}
	if cookie != pod.NetnsCookie {
		unix.Close(fd)
		return -1, NetnsID{}, fmt.Errorf("netns %q has cookie %d, the enrolled one %d: %w", pod.NetnsPath, cookie, pod.NetnsCookie, ErrNetnsReplaced)
	}
	return fd, id, nil
}
