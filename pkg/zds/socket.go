package zds

import (
	"net"

	"golang.org/x/sys/unix"
)

// peerCred returns the connecting process's credentials.
func peerCred(c *net.UnixConn) (*unix.Ucred, error) {
	raw, err := c.SyscallConn()
	if err != nil {
		return nil, err
	}
	var (
		cred   *unix.Ucred
		optErr error
	)
	if err := raw.Control(func(fd uintptr) {
		cred, optErr = unix.GetsockoptUcred(int(fd), unix.SOL_SOCKET, unix.SO_PEERCRED)
	}); err != nil {
		return nil, err
	}
	return cred, optErr
}
