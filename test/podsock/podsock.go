// Package podsock makes the sockets a proxy makes inside a pod's network
// namespace from outside it, as a node proxy does (ztunnel in its inpod mode):
// listeners and onward connections created in the namespace given as a
// descriptor, with a socket mark, SO_REUSEPORT, IP_TRANSPARENT and a bound source
// as asked, and the original destination of an accepted connection as
// iptables-era proxies read it. Only the socket(2) call runs inside the namespace
// (a socket belongs to the namespace it was created in, whatever thread uses it
// later), so no OS thread stays in a pod while a handshake is in flight.
package podsock

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"os"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"

	"github.com/mesh-cni/mesh-cni/internal/netns"
)

// DialOptions tune an onward connection.
type DialOptions struct {
	// Mark is set with SO_MARK before the SYN leaves.
	Mark uint32
	// Source, when valid, is bound (port 0) with IP_TRANSPARENT and IP_FREEBIND
	// first: the connection keeps another host's address as its source, as a
	// proxy preserving its client's address connects.
	Source netip.Addr
	// Timeout bounds the handshake; 0 means 10 s.
	Timeout time.Duration
}

// Dial connects to dst from the network namespace nsFd (nsFd < 0: the calling
// thread's).
func Dial(ctx context.Context, nsFd int, dst netip.AddrPort, o DialOptions) (*net.TCPConn, error) {
	family := unix.AF_INET
	if dst.Addr().Is6() {
		family = unix.AF_INET6
	}
	fd, err := socketIn(nsFd, family, unix.SOCK_STREAM)
	if err != nil {
		return nil, err
	}
	// From here the descriptor is f's: registering the non-blocking socket with the
	// poller lets the connect wait honour deadlines.
	f := os.NewFile(uintptr(fd), "dial "+dst.String())
	defer f.Close()
	if err := unix.SetsockoptInt(fd, unix.SOL_SOCKET, unix.SO_MARK, int(o.Mark)); err != nil {
		return nil, fmt.Errorf("set SO_MARK %#x: %w", o.Mark, err)
	}
	if o.Source.IsValid() {
		if err := setTransparent(fd, family, true); err != nil {
			return nil, err
		}
		if err := unix.Bind(fd, sockaddr(netip.AddrPortFrom(o.Source, 0))); err != nil {
			return nil, fmt.Errorf("bind to source %s: %w", o.Source, err)
		}
	}
	timeout := o.Timeout
	if timeout == 0 {
		timeout = 10 * time.Second
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

// ListenOptions tune a listener.
type ListenOptions struct {
	Mark      uint32
	ReusePort bool
	// Transparent sets IP_TRANSPARENT on the listener (best effort, as ztunnel
	// does: Transparent reports whether it took).
	Transparent bool
}

// Listen opens a TCP listener on addr in the network namespace nsFd. transparent
// reports whether IP_TRANSPARENT was set.
func Listen(nsFd int, addr netip.AddrPort, o ListenOptions) (ln *net.TCPListener, transparent bool, _ error) {
	fd, err := bound(nsFd, addr, unix.SOCK_STREAM, o)
	if err != nil {
		return nil, false, err
	}
	f := os.NewFile(uintptr(fd), "listen "+addr.String())
	defer f.Close()
	if o.Transparent {
		transparent = setTransparent(fd, unix.AF_INET, false) == nil
	}
	if err := unix.Listen(fd, 128); err != nil {
		return nil, false, fmt.Errorf("listen on %s: %w", addr, err)
	}
	l, err := net.FileListener(f)
	if err != nil {
		return nil, false, err
	}
	return l.(*net.TCPListener), transparent, nil
}

// ListenUDP opens a UDP socket bound to addr in the network namespace nsFd.
func ListenUDP(nsFd int, addr netip.AddrPort, o ListenOptions) (*net.UDPConn, error) {
	fd, err := bound(nsFd, addr, unix.SOCK_DGRAM, o)
	if err != nil {
		return nil, err
	}
	f := os.NewFile(uintptr(fd), "udp "+addr.String())
	defer f.Close()
	c, err := net.FilePacketConn(f)
	if err != nil {
		return nil, err
	}
	return c.(*net.UDPConn), nil
}

func bound(nsFd int, addr netip.AddrPort, typ int, o ListenOptions) (int, error) {
	family := unix.AF_INET
	if addr.Addr().Is6() {
		family = unix.AF_INET6
	}
	fd, err := socketIn(nsFd, family, typ)
	if err != nil {
		return -1, err
	}
	fail := func(err error) (int, error) {
		unix.Close(fd)
		return -1, err
	}
	if err := unix.SetsockoptInt(fd, unix.SOL_SOCKET, unix.SO_MARK, int(o.Mark)); err != nil {
		return fail(fmt.Errorf("set SO_MARK %#x: %w", o.Mark, err))
	}
	if o.ReusePort {
		if err := unix.SetsockoptInt(fd, unix.SOL_SOCKET, unix.SO_REUSEPORT, 1); err != nil {
			return fail(fmt.Errorf("set SO_REUSEPORT: %w", err))
		}
	}
	if err := unix.Bind(fd, sockaddr(addr)); err != nil {
		return fail(fmt.Errorf("bind %s: %w", addr, err))
	}
	return fd, nil
}

func socketIn(nsFd, family, typ int) (int, error) {
	var fd int
	mk := func() error {
		var err error
		fd, err = unix.Socket(family, typ|unix.SOCK_NONBLOCK|unix.SOCK_CLOEXEC, 0)
		return err
	}
	var err error
	if nsFd < 0 {
		err = mk()
	} else {
		err = netns.DoFd(nsFd, mk)
	}
	if err != nil {
		return -1, fmt.Errorf("create socket in pod netns: %w", err)
	}
	return fd, nil
}

// setTransparent sets IP_TRANSPARENT (and for a connecting socket IP_FREEBIND) at
// the level of family, as ztunnel sets the IPv4 option on its dual-stack
// listeners and the family's on its sockets that connect from a client's address.
func setTransparent(fd, family int, freebind bool) error {
	level, transparent, free := unix.SOL_IP, unix.IP_TRANSPARENT, unix.IP_FREEBIND
	if family == unix.AF_INET6 {
		level, transparent, free = unix.SOL_IPV6, unix.IPV6_TRANSPARENT, unix.IPV6_FREEBIND
	}
	if err := unix.SetsockoptInt(fd, level, transparent, 1); err != nil {
		return fmt.Errorf("set IP_TRANSPARENT: %w", err)
	}
	if freebind {
		if err := unix.SetsockoptInt(fd, level, free, 1); err != nil {
			return fmt.Errorf("set IP_FREEBIND: %w", err)
		}
	}
	return nil
}

func sockaddr(a netip.AddrPort) unix.Sockaddr {
	if a.Addr().Is4() {
		return &unix.SockaddrInet4{Port: int(a.Port()), Addr: a.Addr().As4()}
	}
	return &unix.SockaddrInet6{Port: int(a.Port()), Addr: a.Addr().As16()}
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

// ip6tSOOriginalDst is IP6T_SO_ORIGINAL_DST from linux/netfilter_ipv6/ip6_tables.h;
// x/sys/unix only defines the IPv4 name (SO_ORIGINAL_DST), which has the same value.
const ip6tSOOriginalDst = 80

// OriginalDst asks the kernel for the destination the client originally connected
// to, the way iptables-era proxies (Envoy, ztunnel) do: SOL_IP/SO_ORIGINAL_DST
// answered with a sockaddr_in for IPv4 connections (including IPv4-mapped ones
// accepted on an AF_INET6 socket), SOL_IPV6/IP6T_SO_ORIGINAL_DST answered with a
// sockaddr_in6 for IPv6. Conntrack answers after a REDIRECT; mesh-cni's
// cgroup/getsockopt program answers after an eBPF redirect.
func OriginalDst(conn *net.TCPConn) (netip.AddrPort, error) {
	local, _ := netip.ParseAddrPort(conn.LocalAddr().String())
	raw, err := conn.SyscallConn()
	if err != nil {
		return netip.AddrPort{}, fmt.Errorf("raw conn: %w", err)
	}
	var (
		dst    netip.AddrPort
		optErr error
	)
	ctrlErr := raw.Control(func(fd uintptr) {
		if local.Addr().Unmap().Is4() {
			dst, optErr = getOrigDst(int(fd), unix.SOL_IP, unix.SO_ORIGINAL_DST, unix.SizeofSockaddrInet4)
		} else {
			dst, optErr = getOrigDst(int(fd), unix.SOL_IPV6, ip6tSOOriginalDst, unix.SizeofSockaddrInet6)
		}
	})
	if ctrlErr != nil {
		return netip.AddrPort{}, fmt.Errorf("raw conn control: %w", ctrlErr)
	}
	return dst, optErr
}

func getOrigDst(fd, level, opt, size int) (netip.AddrPort, error) {
	buf := make([]byte, size)
	n := uint32(len(buf))
	_, _, errno := unix.Syscall6(unix.SYS_GETSOCKOPT, uintptr(fd), uintptr(level), uintptr(opt),
		uintptr(unsafe.Pointer(&buf[0])), uintptr(unsafe.Pointer(&n)), 0)
	if errno != 0 {
		return netip.AddrPort{}, fmt.Errorf("getsockopt(%d, %d): %w", level, opt, errno)
	}
	if int(n) > len(buf) {
		return netip.AddrPort{}, fmt.Errorf("kernel returned %d bytes for a %d-byte buffer", n, len(buf))
	}
	return parseSockaddr(buf[:n])
}

// parseSockaddr decodes a raw sockaddr_in or sockaddr_in6: the family is in host
// byte order, the port in network byte order.
func parseSockaddr(b []byte) (netip.AddrPort, error) {
	if len(b) < 2 {
		return netip.AddrPort{}, fmt.Errorf("sockaddr too short (%d bytes)", len(b))
	}
	switch binary.NativeEndian.Uint16(b[0:2]) {
	case unix.AF_INET:
		if len(b) < 8 {
			return netip.AddrPort{}, fmt.Errorf("sockaddr_in too short (%d bytes)", len(b))
		}
		return netip.AddrPortFrom(netip.AddrFrom4([4]byte(b[4:8])), binary.BigEndian.Uint16(b[2:4])), nil
	case unix.AF_INET6:
		if len(b) < 24 {
			return netip.AddrPort{}, fmt.Errorf("sockaddr_in6 too short (%d bytes)", len(b))
		}
		return netip.AddrPortFrom(netip.AddrFrom16([16]byte(b[8:24])).Unmap(), binary.BigEndian.Uint16(b[2:4])), nil
	default:
		return netip.AddrPort{}, fmt.Errorf("unexpected address family %d in original destination", binary.NativeEndian.Uint16(b[0:2]))
	}
}
