package gateclient

import (
	"context"
	"errors"
	"fmt"
	"io"
	"sync"
	"syscall"
	"time"
)

// sockConn is a Unix stream socket used with plain blocking system calls,
// outside Go's network poller. A plugin process makes one call and exits; the
// poller would cost it an epoll instance, its registration and a hand-off
// between threads on every wait, for a socket that only ever has one reader.
// The context still bounds every step: connect by SO_SNDTIMEO, reads and
// writes by shutting the socket down when the context ends, which returns
// a blocked read or write at once.
type sockConn struct {
	fd     int
	mu     sync.Mutex // guards closed against the shutdown of the context's end
	closed bool
}

func dialUnix(ctx context.Context, path string) (*sockConn, error) {
	if err := ctx.Err(); err != nil {
		return nil, err
	}
	fd, err := syscall.Socket(syscall.AF_UNIX, syscall.SOCK_STREAM|syscall.SOCK_CLOEXEC, 0)
	if err != nil {
		return nil, fmt.Errorf("socket: %w", err)
	}
	if dl, ok := ctx.Deadline(); ok {
		// A connect to a listener whose backlog is full blocks until there
		// is room; the send timeout bounds that wait.
		tv := syscall.NsecToTimeval(max(int64(time.Until(dl)), int64(time.Microsecond)))
		if err := syscall.SetsockoptTimeval(fd, syscall.SOL_SOCKET, syscall.SO_SNDTIMEO, &tv); err != nil {
			syscall.Close(fd)
			return nil, fmt.Errorf("set send timeout: %w", err)
		}
	}
	sa := &syscall.SockaddrUnix{Name: path}
	for {
		err = syscall.Connect(fd, sa)
		if err != syscall.EINTR {
			break
		}
	}
	if err != nil {
		syscall.Close(fd)
		if errors.Is(err, syscall.EAGAIN) && ctx.Err() != nil {
			err = ctx.Err()
		}
		return nil, fmt.Errorf("dial unix %s: connect: %w", path, err)
	}
	return &sockConn{fd: fd}, nil
}

func (c *sockConn) Read(p []byte) (int, error) {
	if len(p) == 0 {
		return 0, nil
	}
	for {
		n, err := syscall.Read(c.fd, p)
		switch {
		case err == syscall.EINTR:
			continue
		case err != nil:
			return 0, fmt.Errorf("read: %w", err)
		case n == 0:
			return 0, io.EOF
		}
		return n, nil
	}
}

func (c *sockConn) Write(p []byte) (int, error) {
	written := 0
	for written < len(p) {
		n, err := syscall.Write(c.fd, p[written:])
		if err == syscall.EINTR {
			continue
		}
		if err != nil {
			return written, fmt.Errorf("write: %w", err)
		}
		written += n
	}
	return written, nil
}

// shutdown ends every blocked and later read and write on the socket.
func (c *sockConn) shutdown() {
	c.mu.Lock()
	defer c.mu.Unlock()
	if !c.closed {
		_ = syscall.Shutdown(c.fd, syscall.SHUT_RDWR)
	}
}

func (c *sockConn) Close() error {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.closed {
		return nil
	}
	c.closed = true
	return syscall.Close(c.fd)
}
