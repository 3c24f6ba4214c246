// Package netns is the one place in mesh-cni that switches namespaces: network
// namespaces, and a cgroup namespace for reading a file as it renders there.
//
// A Linux thread's network namespace is per thread, while Go schedules goroutines on
// any thread. Every function here therefore runs the caller's work on a fresh
// goroutine locked to its OS thread, and if the thread cannot be switched back it is
// never returned to the runtime's pool: the goroutine exits while still locked, which
// makes the Go runtime terminate that thread.
//
// The switching itself (Do, DoFd) is containernetworking/plugins' pkg/ns, which
// keeps exactly that rule: it unlocks the thread only once it is back in its
// original namespace. What that package lacks stays here: namespaces named by an
// open descriptor (the data path checks a namespace and then uses the same
// file, so the path cannot be swapped in between), validation that a file is a
// network namespace and not just any nsfs file (Open, Validate), Create and
// Remove at a path of the caller's choosing, and the namespace cookie. A
// failed switch back is not reported by pkg/ns; the thread is discarded all
// the same, so fn's result stands.
package netns

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"runtime"

	"github.com/containernetworking/plugins/pkg/ns"
	"golang.org/x/sys/unix"
)

// ErrNotNetNS is returned (wrapped) when a path exists but is not a network namespace.
var ErrNotNetNS = errors.New("not a network namespace")

// nsfsMagic is the statfs f_type of nsfs, the filesystem that namespace files
// (/proc/PID/ns/net and their bind mounts) live on.
const nsfsMagic = 0x6e736673

// Validate reports whether path names a network namespace. It checks the
// filesystem type and then the namespace type, so a regular file, a directory or a
// mount namespace file are all rejected with an error that says which.
func Validate(path string) error {
	f, err := Open(path)
	if err != nil {
		return err
	}
	return f.Close()
}

// Open opens the network namespace at path and checks that the open file is one
// (nsfs, namespace type CLONE_NEWNET). Callers use the returned file for every later
// step, so the path cannot be swapped for another file between the check and the
// use. It never blocks: a FIFO at path is opened non-blocking and then rejected.
func Open(path string) (*os.File, error) {
	if path == "" {
		return nil, fmt.Errorf("netns path is empty")
	}
	fd, err := unix.Open(path, unix.O_RDONLY|unix.O_NONBLOCK|unix.O_CLOEXEC, 0)
	if err != nil {
		return nil, fmt.Errorf("open netns %q: %w", path, err)
	}
	f := os.NewFile(uintptr(fd), path)
	if err := ValidateFd(fd); err != nil {
		f.Close()
		return nil, fmt.Errorf("netns path %q: %w", path, err)
	}
	return f, nil
}

// ValidateFd reports whether fd refers to a network namespace.
func ValidateFd(fd int) error {
	var st unix.Statfs_t
	if err := unix.Fstatfs(fd, &st); err != nil {
		return fmt.Errorf("statfs: %w", err)
	}
	if st.Type != nsfsMagic {
		return fmt.Errorf("filesystem type %#x: %w", st.Type, ErrNotNetNS)
	}
	// NS_GET_NSTYPE tells which kind of namespace the file refers to.
	kind, err := unix.IoctlRetInt(fd, unix.NS_GET_NSTYPE)
	if err != nil {
		return fmt.Errorf("query namespace type: %w", err)
	}
	if kind != unix.CLONE_NEWNET {
		return fmt.Errorf("namespace type %#x: %w", kind, ErrNotNetNS)
	}
	return nil
}

// InodeFd returns the inode number of the namespace fd refers to: what a netns
// link reports as the namespace it is attached to.
func InodeFd(fd int) (uint64, error) {
	var st unix.Stat_t
	if err := unix.Fstat(fd, &st); err != nil {
		return 0, fmt.Errorf("stat netns: %w", err)
	}
	return st.Ino, nil
}

// Do runs fn with the calling thread inside the network namespace at path. fn runs on
// its own goroutine locked to an OS thread; sockets fn creates belong to that
// namespace and stay usable from any goroutine afterwards. Do returns fn's error.
func Do(path string, fn func() error) error {
	target, err := os.Open(path)
	if err != nil {
		return fmt.Errorf("open netns %q: %w", path, err)
	}
	defer target.Close()
	return DoFd(int(target.Fd()), fn)
}

// DoFd is Do for an already-open namespace file descriptor. pkg/ns takes a
// path: the descriptor's own /proc entry, which opens the same namespace
// whatever has happened to the path it was opened by.
func DoFd(fd int, fn func() error) error {
	target, err := ns.GetNS(fmt.Sprintf("/proc/self/fd/%d", fd))
	if err != nil {
		return fmt.Errorf("netns descriptor %d: %w", fd, err)
	}
	defer target.Close()
	return target.Do(func(ns.NetNS) error { return fn() })
}

// Create makes a new, empty network namespace and bind-mounts it at path (whose
// parent directory is created if needed), the way `ip netns add` does. The namespace
// lives until Remove unmounts it and no process or socket holds it.
func Create(path string) error {
	if err := ensureNetNSDir(filepath.Dir(path)); err != nil {
		return err
	}
	f, err := os.OpenFile(path, os.O_RDONLY|os.O_CREATE|os.O_EXCL, 0o444)
	if err != nil {
		return fmt.Errorf("create netns mount point %q: %w", path, err)
	}
	f.Close()

	result := make(chan error, 1)
	go func() {
		// The thread goes back to its namespace once the new one is mounted, and
		// is handed back to the runtime only then. A thread left locked would be
		// ended when the goroutine returns, except the process's main thread,
		// which the runtime keeps, wedged, in the new namespace: /proc/self/ns/net
		// would then name the pod's namespace.
		runtime.LockOSThread()
		origin, err := os.Open(threadNetNSPath())
		if err != nil {
			runtime.UnlockOSThread()
			result <- fmt.Errorf("open current netns: %w", err)
			return
		}
		defer origin.Close()
		if err := unix.Unshare(unix.CLONE_NEWNET); err != nil {
			runtime.UnlockOSThread()
			result <- fmt.Errorf("unshare network namespace: %w", err)
			return
		}
		err = unix.Mount(threadNetNSPath(), path, "none", unix.MS_BIND, "")
		if err != nil {
			err = fmt.Errorf("bind-mount new netns at %q: %w", path, err)
		}
		if serr := unix.Setns(int(origin.Fd()), unix.CLONE_NEWNET); serr == nil {
			runtime.UnlockOSThread()
		}
		result <- err
	}()
	if err := <-result; err != nil {
		os.Remove(path)
		return err
	}
	return nil
}

// Remove unmounts and deletes a namespace made by Create. A path that is already
// gone is not an error.
func Remove(path string) error {
	if err := unix.Unmount(path, unix.MNT_DETACH); err != nil && !errors.Is(err, unix.EINVAL) && !errors.Is(err, unix.ENOENT) {
		return fmt.Errorf("unmount netns %q: %w", path, err)
	}
	if err := os.Remove(path); err != nil && !errors.Is(err, os.ErrNotExist) {
		return fmt.Errorf("remove netns mount point %q: %w", path, err)
	}
	return nil
}

// Cookie returns the kernel's cookie for the network namespace at path: the value
// BPF programs see from bpf_get_netns_cookie for sockets in that namespace.
func Cookie(path string) (uint64, error) {
	f, err := Open(path)
	if err != nil {
		return 0, err
	}
	defer f.Close()
	cookie, err := CookieFd(int(f.Fd()))
	if err != nil {
		return 0, fmt.Errorf("netns cookie of %q: %w", path, err)
	}
	return cookie, nil
}

// Handle is a network namespace opened once for a request: the descriptor
// every later step uses, the path it was opened from (for records and logs)
// and its cookie, read on that descriptor.
type Handle struct {
	File   *os.File
	Path   string
	Cookie uint64
}

// OpenHandle opens and checks the namespace at path (as Open) and reads its
// cookie. The caller closes it.
func OpenHandle(path string) (*Handle, error) {
	f, err := Open(path)
	if err != nil {
		return nil, err
	}
	cookie, err := CookieFd(int(f.Fd()))
	if err != nil {
		f.Close()
		return nil, fmt.Errorf("netns cookie of %q: %w", path, err)
	}
	return &Handle{File: f, Path: path, Cookie: cookie}, nil
}

// Close closes the namespace's descriptor.
func (h *Handle) Close() error { return h.File.Close() }

// ErrReplaced is returned (wrapped) when a path names another namespace than
// the one expected: a path reused after a node crash, or swapped.
var ErrReplaced = errors.New("the netns path names another namespace than the one expected")

// OpenExpected is OpenHandle for a namespace known by its cookie: it refuses
// the path when it now names another one.
func OpenExpected(path string, cookie uint64) (*Handle, error) {
	h, err := OpenHandle(path)
	if err != nil {
		return nil, err
	}
	if h.Cookie != cookie {
		h.Close()
		return nil, fmt.Errorf("netns %q has cookie %d, not %d: %w", path, h.Cookie, cookie, ErrReplaced)
	}
	return h, nil
}

// CookieFd is Cookie for an already-open namespace file descriptor. The
// calling thread's own namespace needs no switch (nor the privilege to make
// one): its cookie is read where the caller is.
func CookieFd(fd int) (uint64, error) {
	if cookie, own, err := ownCookie(fd); err != nil || own {
		return cookie, err
	}
	var cookie uint64
	err := DoFd(fd, func() error {
		var err error
		cookie, err = currentCookie()
		return err
	})
	return cookie, err
}

// ownCookie returns the cookie of fd's namespace when it is the calling
// thread's, read on that thread.
func ownCookie(fd int) (uint64, bool, error) {
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	var target, own unix.Stat_t
	if err := unix.Fstat(fd, &target); err != nil {
		return 0, false, fmt.Errorf("stat netns: %w", err)
	}
	if err := unix.Stat(threadNetNSPath(), &own); err != nil {
		return 0, false, nil
	}
	if target.Dev != own.Dev || target.Ino != own.Ino {
		return 0, false, nil
	}
	cookie, err := currentCookie()
	return cookie, true, err
}

func currentCookie() (uint64, error) {
	sock, err := unix.Socket(unix.AF_UNIX, unix.SOCK_DGRAM|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		return 0, fmt.Errorf("socket for SO_NETNS_COOKIE: %w", err)
	}
	defer unix.Close(sock)
	cookie, err := unix.GetsockoptUint64(sock, unix.SOL_SOCKET, unix.SO_NETNS_COOKIE)
	if err != nil {
		return 0, fmt.Errorf("getsockopt SO_NETNS_COOKIE: %w", err)
	}
	return cookie, nil
}

func threadNetNSPath() string {
	return fmt.Sprintf("/proc/%d/task/%d/ns/net", os.Getpid(), unix.Gettid())
}

// ensureNetNSDir creates the directory that holds namespace mount points.
func ensureNetNSDir(dir string) error {
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return fmt.Errorf("create netns dir %q: %w", dir, err)
	}
	return nil
}

// CurrentCookie returns the cookie of the calling process's own network namespace.
// Threads of this package that are inside another namespace are never handed back
// to the Go scheduler, so any other goroutine runs in the process's namespace.
func CurrentCookie() (uint64, error) { return currentCookie() }

// ReadInCgroupNamespace reads file as a process in the cgroup namespace at
// nsPath sees it (cgroup paths in /proc/<pid>/cgroup are written relative to
// the reader's cgroup namespace); see InCgroupNamespace.
func ReadInCgroupNamespace(nsPath, file string) ([]byte, error) {
	var b []byte
	err := InCgroupNamespace(nsPath, func() error {
		var err error
		b, err = os.ReadFile(file)
		return err
	})
	return b, err
}

// InCgroupNamespace runs fn on a thread that joins the cgroup namespace at
// nsPath and is thrown away after, so no other goroutine ever runs there; fn
// must not start goroutines of its own to do its reads. Without cgroup
// namespaces to cross (nsPath unreadable, or the caller's own), it runs fn
// where the caller is.
func InCgroupNamespace(nsPath string, fn func() error) error {
	target, err := os.Open(nsPath)
	if err != nil {
		return fn()
	}
	defer target.Close()
	var targetSt, ownSt unix.Stat_t
	if unix.Fstat(int(target.Fd()), &targetSt) != nil || unix.Stat("/proc/thread-self/ns/cgroup", &ownSt) != nil || targetSt.Ino == ownSt.Ino {
		return fn()
	}
	ch := make(chan error, 1)
	go func() {
		// Never unlocked: the thread ends with the goroutine.
		runtime.LockOSThread()
		if err := unix.Setns(int(target.Fd()), unix.CLONE_NEWCGROUP); err != nil {
			ch <- fmt.Errorf("join the cgroup namespace %s: %w", nsPath, err)
			return
		}
		ch <- fn()
	}()
	return <-ch
}
