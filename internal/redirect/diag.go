package redirect

import (
	"encoding/binary"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"syscall"

	"golang.org/x/sys/unix"
)

// sock_diag, by hand: vishvananda/netlink's socket dumps ask for every state, which
// walks the node's whole connection table; these ask for listeners only.

const (
	diagReqLen = 56 // struct inet_diag_req_v2
	diagMsgLen = 72 // struct inet_diag_msg
)

// diagSocket is a listener sock_diag reported.
type diagSocket struct {
	family uint8
	inode  uint32
	cookie uint64 // the socket cookie, what a SOCKHASH answers user space with
}

// listenerOnPort reports whether a TCP socket listens on the wildcard address at
// port in the calling thread's netns (IPv6 [::], or IPv4 0.0.0.0 which a
// dual-stack [::] listener also answers for).
func listenerOnPort(port uint16) (bool, error) {
	fd, err := unix.Socket(unix.AF_NETLINK, unix.SOCK_RAW|unix.SOCK_CLOEXEC, unix.NETLINK_SOCK_DIAG)
	if err != nil {
		return false, fmt.Errorf("sock_diag socket: %w", err)
	}
	defer unix.Close(fd)
	for _, fam := range []uint8{unix.AF_INET6, unix.AF_INET} {
		found, err := diagLookupListener(fd, fam, port)
		if err != nil || found {
			return found, err
		}
	}
	return false, nil
}

// diagLookupListener sends one SOCK_DIAG_BY_FAMILY exact lookup (not a dump, which
// would walk the node's whole listening hash) for a TCP socket with local address
// any:port. The kernel resolves it like an incoming connection would be.
func diagLookupListener(fd int, family uint8, port uint16) (bool, error) {
	buf := diagRequest(family, unix.NLM_F_REQUEST, port)
	ne := binary.NativeEndian
	if err := unix.Sendto(fd, buf, 0, &unix.SockaddrNetlink{Family: unix.AF_NETLINK}); err != nil {
		return false, fmt.Errorf("sock_diag request: %w", err)
	}
	resp := make([]byte, 4096)
	n, _, err := unix.Recvfrom(fd, resp, 0)
	if err != nil {
		return false, fmt.Errorf("sock_diag response: %w", err)
	}
	msgs, err := syscall.ParseNetlinkMessage(resp[:n])
	if err != nil || len(msgs) == 0 {
		return false, fmt.Errorf("sock_diag response: %w", errors.Join(err, errors.New("no message")))
	}
	m := msgs[0]
	switch m.Header.Type {
	case unix.SOCK_DIAG_BY_FAMILY:
		return true, nil
	case unix.NLMSG_ERROR:
		if len(m.Data) < 4 {
			return false, errors.New("sock_diag: short error message")
		}
		errno := syscall.Errno(-int32(ne.Uint32(m.Data)))
		if errno == unix.ENOENT {
			return false, nil
		}
		return false, fmt.Errorf("sock_diag lookup: %w", errno)
	}
	return false, fmt.Errorf("sock_diag: unexpected message type %d", m.Header.Type)
}

// listenersOnPort lists the TCP listeners of port in the calling thread's netns,
// both families. A dump of listening sockets only walks the listening hash.
func listenersOnPort(port uint16) ([]diagSocket, error) {
	fd, err := unix.Socket(unix.AF_NETLINK, unix.SOCK_RAW|unix.SOCK_CLOEXEC, unix.NETLINK_SOCK_DIAG)
	if err != nil {
		return nil, fmt.Errorf("sock_diag socket: %w", err)
	}
	defer unix.Close(fd)
	var out []diagSocket
	for _, fam := range []uint8{unix.AF_INET6, unix.AF_INET} {
		req := diagRequest(fam, unix.NLM_F_REQUEST|unix.NLM_F_DUMP, 0)
		if err := unix.Sendto(fd, req, 0, &unix.SockaddrNetlink{Family: unix.AF_NETLINK}); err != nil {
			return nil, fmt.Errorf("sock_diag dump: %w", err)
		}
		buf := make([]byte, 32<<10)
	read:
		for {
			n, _, err := unix.Recvfrom(fd, buf, 0)
			if err != nil {
				return nil, fmt.Errorf("sock_diag dump: %w", err)
			}
			msgs, err := syscall.ParseNetlinkMessage(buf[:n])
			if err != nil {
				return nil, fmt.Errorf("sock_diag dump: %w", err)
			}
			for _, m := range msgs {
				switch m.Header.Type {
				case unix.NLMSG_DONE:
					break read
				case unix.NLMSG_ERROR:
					return nil, errors.New("sock_diag dump: the kernel answered an error")
				case unix.SOCK_DIAG_BY_FAMILY:
					if len(m.Data) < diagMsgLen {
						continue
					}
					if binary.BigEndian.Uint16(m.Data[4:]) == port {
						// inet_diag_msg: the socket cookie as two 32-bit halves,
						// low first, at 44; the inode at 68.
						cookie := uint64(binary.NativeEndian.Uint32(m.Data[44:])) | uint64(binary.NativeEndian.Uint32(m.Data[48:]))<<32
						out = append(out, diagSocket{family: m.Data[0], inode: binary.NativeEndian.Uint32(m.Data[68:]), cookie: cookie})
					}
				}
			}
		}
	}
	return out, nil
}

// diagRequest is a SOCK_DIAG_BY_FAMILY request for TCP listeners of family. An exact
// lookup (no NLM_F_DUMP) names the local port and some remote port; a dump names
// neither (a remote port would make the kernel skip the listeners).
func diagRequest(family uint8, flags uint16, port uint16) []byte {
	buf := make([]byte, unix.SizeofNlMsghdr+diagReqLen)
	ne := binary.NativeEndian
	ne.PutUint32(buf[0:], uint32(len(buf)))
	ne.PutUint16(buf[4:], unix.SOCK_DIAG_BY_FAMILY)
	ne.PutUint16(buf[6:], flags)
	ne.PutUint32(buf[8:], 1) // sequence
	req := buf[unix.SizeofNlMsghdr:]
	req[0] = family
	req[1] = unix.IPPROTO_TCP
	ne.PutUint32(req[4:], 1<<unix.BPF_TCP_LISTEN)
	id := req[8:] // struct inet_diag_sockid
	if flags&unix.NLM_F_DUMP == 0 {
		binary.BigEndian.PutUint16(id[0:], port)
		binary.BigEndian.PutUint16(id[2:], 1) // a remote port no listener lookup uses
	}
	ne.PutUint32(id[36:], 0)          // any interface
	ne.PutUint32(id[40:], ^uint32(0)) // INET_DIAG_NOCOOKIE
	ne.PutUint32(id[44:], ^uint32(0))
	return buf
}

// socketsByInode finds the processes holding the sockets (by their /proc fd links)
// and takes a descriptor of each with pidfd_getfd. Sockets no process holds any
// more are left out.
func socketsByInode(socks []diagSocket) (map[uint32]*os.File, error) {
	want := map[string]uint32{}
	for _, s := range socks {
		want["socket:["+strconv.FormatUint(uint64(s.inode), 10)+"]"] = s.inode
	}
	out := map[uint32]*os.File{}
	procs, err := os.ReadDir("/proc")
	if err != nil {
		return out, fmt.Errorf("list processes: %w", err)
	}
	var errs []error
	for _, p := range procs {
		pid, err := strconv.Atoi(p.Name())
		if err != nil || len(out) == len(want) {
			continue
		}
		fdDir := filepath.Join("/proc", p.Name(), "fd")
		fds, err := os.ReadDir(fdDir)
		if err != nil {
			continue // gone, or a kernel thread
		}
		for _, fd := range fds {
			target, err := os.Readlink(filepath.Join(fdDir, fd.Name()))
			if err != nil {
				continue
			}
			inode, ok := want[target]
			if !ok || out[inode] != nil {
				continue
			}
			num, err := strconv.Atoi(fd.Name())
			if err != nil {
				continue
			}
			f, err := takeFd(pid, num)
			if err != nil {
				errs = append(errs, err)
				continue
			}
			out[inode] = f
		}
	}
	return out, errors.Join(errs...)
}

// takeFd duplicates process pid's descriptor fd into this process.
func takeFd(pid, fd int) (*os.File, error) {
	pidfd, err := unix.PidfdOpen(pid, 0)
	if err != nil {
		return nil, fmt.Errorf("pidfd_open %d: %w", pid, err)
	}
	defer unix.Close(pidfd)
	nfd, err := unix.PidfdGetfd(pidfd, fd, 0)
	if err != nil {
		return nil, fmt.Errorf("pidfd_getfd %d/%d: %w", pid, fd, err)
	}
	return os.NewFile(uintptr(nfd), fmt.Sprintf("listener of %d", pid)), nil
}
