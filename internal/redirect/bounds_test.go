package redirect

import (
	"bufio"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"
	"syscall"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/mesh-cni/mesh-cni/test/fixtures"
)

// What one pod can leave in the node-wide maps: the listeners map holds only
// enrolled pods' proxies, at most a few slots each; hand-over entries go with their
// connection.

// floodNamespaces is how many network namespaces TestHelperListenerFlood makes,
// with floodListeners listeners each: more listeners than the listeners map
// holds (TestSecurityFigures checks it against the map).
const (
	floodNamespaces = 2100
	floodListeners  = 8
)

// TestHelperListenerFlood is not a test: it is the process TestListenerFlood
// starts as an unprivileged user (nobody), which starts itself again in a user
// namespace of its own, as a pod could where unprivileged user namespaces are
// allowed. There each of its threads makes a network namespace and listens there
// on MESH_FLOOD_PORT floodListeners times (the sockets keep the namespaces alive
// after the thread is gone); it prints the number of listeners, then waits for
// stdin to close.
func TestHelperListenerFlood(t *testing.T) {
	port, err := strconv.Atoi(os.Getenv("MESH_FLOOD_PORT"))
	if err != nil {
		t.Skip("helper process of TestListenerFlood")
	}
	if os.Getenv("MESH_FLOOD_USERNS") == "" {
		uid, gid := os.Getuid(), os.Getgid()
		cmd := exec.Command(os.Args[0], os.Args[1:]...)
		cmd.Env = append(os.Environ(), "MESH_FLOOD_USERNS=1")
		cmd.Stdin, cmd.Stdout, cmd.Stderr = os.Stdin, os.Stdout, os.Stderr
		cmd.SysProcAttr = &syscall.SysProcAttr{
			Cloneflags:  unix.CLONE_NEWUSER,
			UidMappings: []syscall.SysProcIDMap{{ContainerID: 0, HostID: uid, Size: 1}},
			GidMappings: []syscall.SysProcIDMap{{ContainerID: 0, HostID: gid, Size: 1}},
		}
		if err := cmd.Run(); err != nil {
			fmt.Println("ERR userns", err)
		}
		return
	}
	listeners := 0
	for range floodNamespaces {
		done := make(chan int)
		go func() {
			// The thread stays in its namespace and ends with this goroutine.
			runtime.LockOSThread()
			n := 0
			defer func() { done <- n }()
			if err := unix.Unshare(unix.CLONE_NEWNET); err != nil {
				fmt.Println("ERR unshare", err)
				return
			}
			for range floodListeners {
				fd, err := unix.Socket(unix.AF_INET6, unix.SOCK_STREAM|unix.SOCK_CLOEXEC, 0)
				if err != nil {
					return
				}
				_ = unix.SetsockoptInt(fd, unix.SOL_SOCKET, unix.SO_REUSEPORT, 1)
				if unix.Bind(fd, &unix.SockaddrInet6{Port: port}) != nil || unix.Listen(fd, 16) != nil {
					unix.Close(fd)
					return
				}
				n++
			}
		}()
		listeners += <-done
	}
	fmt.Println("LISTENING", listeners)
	_, _ = bufio.NewReader(os.Stdin).ReadString('\n')
}

// A pod that makes thousands of network namespaces (user namespaces let an
// unprivileged one) and listens on the inbound port in each fills nothing: only
// enrolled pods' listeners are collected. A pod whose proxy starts listening
// afterwards is captured.
func TestListenerFlood(t *testing.T) {
	d, a, b := parallelRig(t)
	enroll(t, d, b, testSettings())

	// nobody must be able to run the test binary, which go test leaves in a
	// directory only root may enter.
	bin := worldExecutableCopy(t, os.Args[0])
	cmd := exec.Command(bin, "-test.run=^TestHelperListenerFlood$", "-test.v=false")
	cmd.Env = append(os.Environ(), "MESH_FLOOD_PORT=15006")
	cmd.SysProcAttr = &syscall.SysProcAttr{Credential: &syscall.Credential{Uid: 65534, Gid: 65534}}
	stdin, err := cmd.StdinPipe()
	if err != nil {
		t.Fatal(err)
	}
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatalf("start the flood helper as nobody: %v", err)
	}
	t.Cleanup(func() {
		stdin.Close()
		_ = cmd.Wait()
	})
	line, err := bufio.NewReader(stdout).ReadString('\n')
	if strings.HasPrefix(line, "ERR userns") {
		fixtures.RequireFeature(t, userNamespacesFeature(), errors.New(strings.TrimSpace(line)))
	}
	var n int
	if _, serr := fmt.Sscanf(line, "LISTENING %d", &n); err != nil || serr != nil {
		t.Fatalf("flood helper: %q (%v)", line, err)
	}
	if want := floodNamespaces * floodListeners; n != want {
		t.Fatalf("the flood made %d listeners, want %d (is the open-file limit, RLIMIT_NOFILE, below that?)", n, want)
	}
	if got := mapLen(t, d.objs.Listeners); got != 0 {
		t.Errorf("the listeners map holds %d entries after a flood of %d listeners in unenrolled namespaces", got, n)
	}
	startInboundProxy(t, b, 15006)
	for _, dst := range []netip.Addr{b.addr4, b.addr6} {
		target := hostPort(dst, appPort)
		expectLines(t, a, target, dialOpts{mark: testMark}, "IN "+target)
	}
}

// A listener of a namespace that is not enrolled, or of another port than its
// pod's inbound port, is not collected; a released pod's listeners leave the map.
func TestListenersOnlyOfEnrolledPods(t *testing.T) {
	t.Parallel()
	requireRoot(t)
	d, _ := testDatapath(t)
	_, b := newPodPair(t)
	c := newNetns(t, "c")
	startInboundProxy(t, c, 15006)
	startInboundProxy(t, b, 15106) // not b's inbound port
	e := enroll(t, d, b, testSettings())
	startInboundProxy(t, b, 15006)
	if n, err := d.Listeners(e.Cookie); err != nil || n != 2 {
		t.Errorf("b's listeners: %d (%v), want its one dual-stack listener in both families' slots", n, err)
	}
	if got := mapLen(t, d.objs.Listeners); got != 2 {
		t.Errorf("the listeners map holds %d entries, want only b's two", got)
	}
	if err := d.Release(t.Context(), e.Cookie); err != nil {
		t.Fatal(err)
	}
	if got := mapLen(t, d.objs.Listeners); got != 0 {
		t.Errorf("after release the listeners map holds %d entries", got)
	}
}

// A listener refused because every slot was taken is captured once one frees up,
// by the next Recollect (the agent's reconcile), without the proxy listening again.
func TestRecollectRefusedListener(t *testing.T) {
	d, a, b := parallelRig(t)
	e := enroll(t, d, b, testSettings())
	var lns []net.Listener
	for n := range listenerSlots + 1 {
		lns = append(lns, listenReusePort(t, b, 15006, n))
	}
	if refusals, _ := d.Refusals(); len(refusals) != 1 {
		t.Fatalf("refusals %+v, want the ninth listener's", refusals)
	}
	// Close every slotted listener: only the refused one is left open.
	for _, ln := range lns[:listenerSlots] {
		ln.Close()
	}
	if err := d.Recollect(t.Context(), b.path); err != nil {
		t.Fatal(err)
	}
	if refusals, _ := d.Refusals(); len(refusals) != 0 {
		t.Errorf("refusals after recollecting: %+v", refusals)
	}
	if n, _ := d.Listeners(e.Cookie); n != 2 {
		t.Errorf("b's listeners after recollecting: %d, want the last one in both families' slots", n)
	}
	target := hostPort(b.addr4, appPort)
	expectLines(t, a, target, dialOpts{mark: testMark}, fmt.Sprintf("IN%d %s", listenerSlots, target))
}

// A pod that connects and resets over and over leaves nothing in the node-wide
// hand-over map, even when its proxy's side of the connection is never
// established: an entry goes with its connection. The proxy here listens with
// TCP_DEFER_ACCEPT (as nginx can), so its side waits for data that never comes:
// every handshake completes on the client's side only, and the client resets.
func TestHandoffEntriesGoWithConnections(t *testing.T) {
	d, a, b := parallelRig(t)
	var lfd int
	a.do(t, func() error {
		var err error
		if lfd, err = unix.Socket(unix.AF_INET6, unix.SOCK_STREAM|unix.SOCK_CLOEXEC, 0); err != nil {
			return err
		}
		if err := unix.SetsockoptInt(lfd, unix.IPPROTO_TCP, unix.TCP_DEFER_ACCEPT, 30); err != nil {
			return err
		}
		if err := unix.Bind(lfd, &unix.SockaddrInet6{Port: 15001}); err != nil {
			return err
		}
		return unix.Listen(lfd, 4096)
	})
	t.Cleanup(func() { unix.Close(lfd) })
	enroll(t, d, a, testSettings())
	const connects = handoffConnects
	target := netip.AddrPortFrom(b.addr4, appPort)
	a.do(t, func() error {
		sa := &unix.SockaddrInet4{Port: int(target.Port()), Addr: target.Addr().As4()}
		for range connects {
			fd, err := unix.Socket(unix.AF_INET, unix.SOCK_STREAM|unix.SOCK_CLOEXEC, 0)
			if err != nil {
				return err
			}
			if err := unix.Connect(fd, sa); err != nil {
				unix.Close(fd)
				return fmt.Errorf("connect: %w", err)
			}
			// Close with a reset (SO_LINGER 0).
			_ = unix.SetsockoptLinger(fd, unix.SOL_SOCKET, unix.SO_LINGER, &unix.Linger{Onoff: 1, Linger: 0})
			unix.Close(fd)
		}
		return nil
	})
	if n := mapLen(t, d.objs.OrigDsts); n != 0 {
		t.Errorf("orig_dsts holds %d entries after %d connects were reset", n, connects)
	}
	if n := mapLen(t, d.objs.ProxyConns); n != 0 {
		t.Errorf("proxy_conns holds %d entries", n)
	}
}

// handoffConnects is how many connects TestHandoffEntriesGoWithConnections
// resets.
const handoffConnects = 5000

// worldExecutableCopy copies the executable at path into a directory anyone may
// enter, so a test can run it as another user.
func worldExecutableCopy(t *testing.T, path string) string {
	t.Helper()
	dir, err := os.MkdirTemp("", "mesh-cni-bin-")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	if err := os.Chmod(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	dst := filepath.Join(dir, filepath.Base(path))
	if err := os.WriteFile(dst, b, 0o755); err != nil {
		t.Fatal(err)
	}
	return dst
}
