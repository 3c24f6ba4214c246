package gate

import (
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"time"

	"golang.org/x/sys/unix"
)

const (
	socketDirMode  = 0o700
	socketFileMode = 0o600
)

// Listen creates the gate's Unix socket at path. The parent directory is created
// with mode 0700 (an existing one is tightened to 0700) and the socket gets 0600,
// so only root reaches it through the filesystem; SO_PEERCRED checks come on top.
//
// A socket file left behind by a crashed agent is replaced, but only after
// checking that nobody answers on it: a second agent must never steal the socket
// of a running one. A path that exists and is not a socket is never removed.
func Listen(ctx context.Context, path string) (*net.UnixListener, error) {
	if !filepath.IsAbs(path) {
		return nil, fmt.Errorf("gate socket path %q must be absolute", path)
	}
	dir := filepath.Dir(path)
	if err := os.MkdirAll(dir, socketDirMode); err != nil {
		return nil, fmt.Errorf("create gate socket directory %q: %w", dir, err)
	}
	if err := os.Chmod(dir, socketDirMode); err != nil {
		return nil, fmt.Errorf("set mode of gate socket directory %q: %w", dir, err)
	}
	if err := removeStaleSocket(ctx, path); err != nil {
		return nil, err
	}
	l, err := net.ListenUnix("unix", &net.UnixAddr{Name: path, Net: "unix"})
	if err != nil {
		return nil, fmt.Errorf("listen on gate socket %q: %w", path, err)
	}
	// The directory is 0700, so nobody else can reach the socket in the short
	// window before the chmod.
	if err := os.Chmod(path, socketFileMode); err != nil {
		l.Close()
		return nil, fmt.Errorf("set mode of gate socket %q: %w", path, err)
	}
	return l, nil
}

func removeStaleSocket(ctx context.Context, path string) error {
	info, err := os.Lstat(path)
	if errors.Is(err, os.ErrNotExist) {
		return nil
	}
	if err != nil {
		return fmt.Errorf("inspect gate socket path %q: %w", path, err)
	}
	if info.Mode().Type() != os.ModeSocket {
		return fmt.Errorf("gate socket path %q exists and is not a socket (%s); refusing to replace it", path, info.Mode().Type())
	}
	dialCtx, cancel := context.WithTimeout(ctx, time.Second)
	defer cancel()
	var d net.Dialer
	conn, err := d.DialContext(dialCtx, "unix", path)
	if err == nil {
		conn.Close()
		return fmt.Errorf("gate socket %q is in use by another process (is another mesh-agent running?)", path)
	}
	if !errors.Is(err, unix.ECONNREFUSED) && !errors.Is(err, os.ErrNotExist) {
		return fmt.Errorf("probe existing gate socket %q: %w", path, err)
	}
	if err := os.Remove(path); err != nil && !errors.Is(err, os.ErrNotExist) {
		return fmt.Errorf("remove stale gate socket %q: %w", path, err)
	}
	return nil
}
