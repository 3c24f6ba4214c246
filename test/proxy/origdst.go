package proxy

import (
	"encoding/binary"
	"fmt"
	"net"
	"net/netip"
	"unsafe"

	"golang.org/x/sys/unix"
)

// ip6tSOOriginalDst is IP6T_SO_ORIGINAL_DST from linux/netfilter_ipv6/ip6_tables.h;
// x/sys/unix only defines the IPv4 name (SO_ORIGINAL_DST), which has the same value.
const ip6tSOOriginalDst = 80

// originalDst asks the kernel for the destination the client originally connected to,
// the way iptables-era proxies (Envoy, ztunnel) do: SOL_IP/SO_ORIGINAL_DST answered
// with a sockaddr_in for IPv4 connections (including IPv4-mapped ones accepted on an
// AF_INET6 socket), SOL_IPV6/IP6T_SO_ORIGINAL_DST answered with a sockaddr_in6 for
// IPv6. Conntrack answers after a REDIRECT; mesh-cni's cgroup/getsockopt program
// answers after an eBPF redirect.
func originalDst(conn *net.TCPConn, local netip.AddrPort) (netip.AddrPort, error) {
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
			dst, optErr = getOrigDst4(int(fd))
		} else {
			dst, optErr = getOrigDst6(int(fd))
		}
	})
	if ctrlErr != nil {
		return netip.AddrPort{}, fmt.Errorf("raw conn control: %w", ctrlErr)
	}
	return dst, optErr
}

func getOrigDst4(fd int) (netip.AddrPort, error) {
	var buf [unix.SizeofSockaddrInet4]byte
	n, err := getsockoptBytes(fd, unix.SOL_IP, unix.SO_ORIGINAL_DST, buf[:])
	if err != nil {
		return netip.AddrPort{}, fmt.Errorf("getsockopt(SOL_IP, SO_ORIGINAL_DST): %w", err)
	}
	return parseSockaddr(buf[:n])
}

func getOrigDst6(fd int) (netip.AddrPort, error) {
	var buf [unix.SizeofSockaddrInet6]byte
	n, err := getsockoptBytes(fd, unix.SOL_IPV6, ip6tSOOriginalDst, buf[:])
	if err != nil {
		return netip.AddrPort{}, fmt.Errorf("getsockopt(SOL_IPV6, IP6T_SO_ORIGINAL_DST): %w", err)
	}
	return parseSockaddr(buf[:n])
}

// getsockoptBytes is getsockopt(2) into a caller-provided buffer; x/sys/unix has no
// generic form for options that return a sockaddr.
func getsockoptBytes(fd, level, opt int, buf []byte) (int, error) {
	size := uint32(len(buf))
	_, _, errno := unix.Syscall6(unix.SYS_GETSOCKOPT, uintptr(fd), uintptr(level), uintptr(opt),
		uintptr(unsafe.Pointer(&buf[0])), uintptr(unsafe.Pointer(&size)), 0)
	if errno != 0 {
		return 0, errno
	}
	if int(size) > len(buf) {
		return 0, fmt.Errorf("kernel returned %d bytes for a %d-byte buffer", size, len(buf))
	}
	return int(size), nil
}

// parseSockaddr decodes a raw sockaddr_in or sockaddr_in6: the family is in host byte
// order, the port in network byte order.
func parseSockaddr(b []byte) (netip.AddrPort, error) {
	if len(b) < 2 {
		return netip.AddrPort{}, fmt.Errorf("sockaddr too short (%d bytes)", len(b))
	}
	family := binary.NativeEndian.Uint16(b[0:2])
	switch family {
	case unix.AF_INET:
		if len(b) < 8 {
			return netip.AddrPort{}, fmt.Errorf("sockaddr_in too short (%d bytes)", len(b))
		}
		addr := netip.AddrFrom4([4]byte(b[4:8]))
		return netip.AddrPortFrom(addr, binary.BigEndian.Uint16(b[2:4])), nil
	case unix.AF_INET6:
		if len(b) < 24 {
			return netip.AddrPort{}, fmt.Errorf("sockaddr_in6 too short (%d bytes)", len(b))
		}
		addr := netip.AddrFrom16([16]byte(b[8:24])).Unmap()
		return netip.AddrPortFrom(addr, binary.BigEndian.Uint16(b[2:4])), nil
	default:
		return netip.AddrPort{}, fmt.Errorf("unexpected address family %d in original destination", family)
	}
}
