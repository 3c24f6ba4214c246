package netns_test

import (
	"errors"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"runtime"
	"strconv"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/mesh-cni/mesh-cni/internal/netns"
	"github.com/mesh-cni/mesh-cni/test/fixtures"
)

func newNS(t *testing.T) string {
	t.Helper()
	path := filepath.Join("/run/netns", fmt.Sprintf("meshtest-netns-%s-%d", t.Name(), os.Getpid()))
	if err := netns.Create(path); err != nil {
		t.Fatalf("create netns: %v", err)
	}
	t.Cleanup(func() {
		if err := netns.Remove(path); err != nil {
			t.Errorf("remove netns: %v", err)
		}
	})
	return path
}

func TestValidate(t *testing.T) {
	path := newNS(t)
	if err := netns.Validate(path); err != nil {
		t.Fatalf("Validate(new netns) = %v", err)
	}
	if err := netns.Validate("/proc/self/ns/net"); err != nil {
		t.Fatalf("Validate(/proc/self/ns/net) = %v", err)
	}
	if err := netns.Validate("/proc/self/ns/mnt"); !errors.Is(err, netns.ErrNotNetNS) {
		t.Fatalf("Validate(mnt ns) = %v, want ErrNotNetNS", err)
	}
	regular := filepath.Join(t.TempDir(), "file")
	if err := os.WriteFile(regular, nil, 0o600); err != nil {
		t.Fatal(err)
	}
	if err := netns.Validate(regular); !errors.Is(err, netns.ErrNotNetNS) {
		t.Fatalf("Validate(regular file) = %v, want ErrNotNetNS", err)
	}
	if err := netns.Validate(filepath.Join(t.TempDir(), "missing")); !errors.Is(err, os.ErrNotExist) {
		t.Fatalf("Validate(missing) = %v, want not-exist", err)
	}
	if err := netns.Validate(""); err == nil {
		t.Fatal("Validate(\"\") succeeded")
	}
}

func TestDoAndCookie(t *testing.T) {
	path := newNS(t)
	// The calling thread's namespace: /proc/self/ns/net is the main thread's,
	// which a test that wedges it may have left elsewhere.
	hostCookie, err := netns.CurrentCookie()
	if err != nil {
		t.Fatal(err)
	}
	podCookie, err := netns.Cookie(path)
	if err != nil {
		t.Fatal(err)
	}
	if hostCookie == podCookie || podCookie == 0 {
		t.Fatalf("cookies: host %d pod %d, want distinct non-zero", hostCookie, podCookie)
	}
	// Inside a fresh namespace only lo exists, and it is down.
	var names []string
	if err := netns.Do(path, func() error {
		ifs, err := net.Interfaces()
		for _, i := range ifs {
			names = append(names, i.Name)
		}
		return err
	}); err != nil {
		t.Fatal(err)
	}
	if len(names) != 1 || names[0] != "lo" {
		t.Fatalf("interfaces in new netns = %v, want [lo]", names)
	}
	again, err := netns.CurrentCookie()
	if err != nil || again != hostCookie {
		t.Fatalf("host cookie changed after Do: %d -> %d (%v)", hostCookie, again, err)
	}
}

// TestThreadThatCannotReturnIsDiscarded: fn leaves its thread unable to switch
// back (capabilities are per thread, and setns needs CAP_SYS_ADMIN), and that
// thread must then end instead of running other goroutines in the pod's
// namespace.
func TestThreadThatCannotReturnIsDiscarded(t *testing.T) {
	path := newNS(t)
	var tid int
	err := netns.Do(path, func() error {
		tid = unix.Gettid()
		hdr := unix.CapUserHeader{Version: unix.LINUX_CAPABILITY_VERSION_3}
		var data [2]unix.CapUserData
		if err := unix.Capget(&hdr, &data[0]); err != nil {
			return fmt.Errorf("capget: %w", err)
		}
		data[0].Effective &^= 1 << unix.CAP_SYS_ADMIN
		if err := unix.Capset(&hdr, &data[0]); err != nil {
			return fmt.Errorf("capset: %w", err)
		}
		return nil
	})
	if err != nil {
		t.Fatalf("Do = %v, want fn's nil: the failed switch back is the thread's end, not the caller's error", err)
	}
	if tid == os.Getpid() {
		// The runtime wedges the main thread rather than ending it; it is not
		// reused either, but there is no exit to see.
		t.Skip("fn ran on the process's main thread")
	}
	task := fmt.Sprintf("/proc/self/task/%d", tid)
	fixtures.WaitFor(t, 10*time.Second, "thread "+strconv.Itoa(tid)+", stuck in the pod's namespace, to end", func() bool {
		_, err := os.Stat(task)
		return errors.Is(err, os.ErrNotExist)
	})
}

// The caller's own namespace has its cookie read without a switch, so without
// the privilege to make one: the same cookie as a socket made here sees, by
// path (Cookie), on a kept descriptor (OpenHandle), and as an expected one
// (OpenExpected, which refuses any other cookie). /proc/self/ns/net is not
// used: it names the main thread's namespace, where an earlier test may have
// left that thread wedged.
func TestCookieOfOwnNamespace(t *testing.T) {
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	const own = "/proc/thread-self/ns/net"
	want, err := netns.CurrentCookie()
	if err != nil {
		t.Fatal(err)
	}
	if got, err := netns.Cookie(own); err != nil || got != want {
		t.Errorf("Cookie(%s) = %d, %v; want %d", own, got, err, want)
	}
	h, err := netns.OpenHandle(own)
	if err != nil {
		t.Fatal(err)
	}
	defer h.Close()
	if got, err := netns.CookieFd(int(h.File.Fd())); err != nil || got != want || h.Cookie != want || h.Path != own {
		t.Errorf("handle %+v, its descriptor's cookie %d, %v; want %d", h, got, err, want)
	}
	e, err := netns.OpenExpected(own, want)
	if err != nil {
		t.Fatalf("OpenExpected with its own cookie: %v", err)
	}
	e.Close()
	if _, err := netns.OpenExpected(own, want+1); !errors.Is(err, netns.ErrReplaced) {
		t.Errorf("OpenExpected with another cookie: %v, want ErrReplaced", err)
	}
	for _, open := range []func() error{
		func() error { _, err := netns.Cookie("/proc/self/ns/mnt"); return err },
		func() error { _, err := netns.OpenHandle("/proc/self/ns/mnt"); return err },
	} {
		if err := open(); !errors.Is(err, netns.ErrNotNetNS) {
			t.Errorf("a mount namespace: %v, want ErrNotNetNS", err)
		}
	}
}
