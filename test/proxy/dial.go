package proxy

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"os"
	"time"

	"golang.org/x/sys/unix"

	"github.com/mesh-cni/mesh-cni/internal/netns"
)

// dialFrom connects to dst from the network namespace nsFd, with SO_MARK set
// before the SYN. Only the socket(2) call runs inside the namespace (a socket
// belongs to the namespace it was created in, whatever thread uses it later);
// the connect then waits in Go's poller like any dial, so no OS thread stays
// locked in a pod's namespace while a handshake is in flight. The benchmarks in
// dial_test.go compare this with dialing entirely inside netns.DoFd.
func dialFrom(ctx context.Context, nsFd int, dst netip.AddrPort, mark uint32, timeout time.Duration) (*net.TCPConn, error) {
	family := unix.AF_INET
	if dst.Addr().Is6() {
		family = unix.AF_INET6
	}
	var fd int
	err := netns.DoFd(nsFd, func() error {
		var err error
		fd, err = unix.Socket(family, unix.SOCK_STREAM|unix.SOCK_NONBLOCK|unix.SOCK_CLOEXEC, unix.IPPROTO_TCP)
		return err
	})
	if err != nil {
		return nil, fmt.Errorf("create socket in pod netns: %w", err)
	}
	// From here the descriptor is f's: registering the non-blocking socket with the
	// poller lets the connect wait honour deadlines.
	f := os.NewFile(uintptr(fd), "dial "+dst.String())
	defer f.Close()
	if err := unix.SetsockoptInt(fd, unix.SOL_SOCKET, unix.SO_MARK, int(mark)); err != nil {
		return nil, fmt.Errorf("set SO_MARK %#x: %w", mark, err)
	}
	if err := connectWait(ctx, f, sockaddr(dst), timeout); err != nil {
		return nil, fmt.Errorf("dial %s: %w", dst, err)
	}
	c, err := net.FileConn(f) // a dup; f's own descriptor is closed on return
	if err != nil {
		return nil, fmt.Errorf("wrap connected socket: %w", err)
	}
	tc, ok := c.(*net.TCPConn)
	if !ok {
		c.Close()
		return nil, fmt.Errorf("connected socket is a %T, not TCP", c)
	}
	return tc, nil
}

func sockaddr(dst netip.AddrPort) unix.Sockaddr {
	if dst.Addr().Is4() {
		return &unix.SockaddrInet4{Port: int(dst.Port()), Addr: dst.Addr().As4()}
	}
	return &unix.SockaddrInet6{Port: int(dst.Port()), Addr: dst.Addr().As16()}
}

// connectWait runs a non-blocking connect and waits for it in the poller, the way
// the net package does: the socket turning writable means the handshake ended,
// SO_ERROR says how, and getpeername guards against spurious wake-ups.
func connectWait(ctx context.Context, f *os.File, sa unix.Sockaddr, timeout time.Duration) error {
	raw, err := f.SyscallConn()
	if err != nil {
		return err
	}
	var connErr error
	if err := raw.Control(func(fd uintptr) { connErr = unix.Connect(int(fd), sa) }); err != nil {
		return err
	}
	switch {
	case connErr == nil:
		return nil
	case !errors.Is(connErr, unix.EINPROGRESS):
		return os.NewSyscallError("connect", connErr)
	}
	deadline := time.Now().Add(timeout)
	if d, ok := ctx.Deadline(); ok && d.Before(deadline) {
		deadline = d
	}
	if err := f.SetWriteDeadline(deadline); err != nil {
		return err
	}
	stop := context.AfterFunc(ctx, func() { _ = f.SetWriteDeadline(time.Now()) })
	defer stop()
	var soErr error
	err = raw.Write(func(fd uintptr) bool {
		v, err := unix.GetsockoptInt(int(fd), unix.SOL_SOCKET, unix.SO_ERROR)
		if err != nil {
			soErr = os.NewSyscallError("getsockopt SO_ERROR", err)
			return true
		}
		switch e := unix.Errno(v); e {
		case unix.EINPROGRESS, unix.EALREADY, unix.EINTR:
			return false
		case 0, unix.EISCONN:
			_, err := unix.Getpeername(int(fd))
			return err == nil
		default:
			soErr = os.NewSyscallError("connect", e)
			return true
		}
	})
	if err != nil {
		if ctx.Err() != nil {
			return ctx.Err()
		}
		return fmt.Errorf("connect: %w", err)
	}
	return soErr
}
