package zds

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
	// socketDirMode is used for a socket directory that does not exist yet.
	socketDirMode = 0o700
	// socketFileMode lets only root (ztunnel runs as root) connect: connecting to
	// a Unix socket needs write permission on it.
	socketFileMode = 0o600
	// maxSunPath is the size of sockaddr_un's sun_path on Linux.
	maxSunPath = 108
	// staleProbeTimeout bounds the connect that tells a live socket from a stale one.
	staleProbeTimeout = time.Second
)

// listenSocket creates the ZDS socket at path, mode 0600, and returns it with its
// file identity (so Close removes the path only while it is still ours).
//
// The parent directory is created 0700 when missing. An existing one is left as it
// is, because it is usually a hostPath shared with the proxy's pod, but refused
// when anyone may replace entries in it (world-writable without the sticky bit).
//
// The socket is bound inside a fresh 0700 directory next to path, made 0600 there
// and only then renamed into place, so there is no moment at which a non-root
// process could reach it with the default umask's mode. A socket file already at
// path is replaced only when nobody answers on it: a second agent must never steal
// a running one's socket. A path that exists and is not a socket is never replaced.
func listenSocket(ctx context.Context, path string) (*net.UnixListener, fileID, error) {
	if !filepath.IsAbs(path) {
		return nil, fileID{}, fmt.Errorf("zds socket path %q must be absolute", path)
	}
	dir := filepath.Dir(path)
	if err := prepareDir(dir); err != nil {
		return nil, fileID{}, err
	}
	if err := checkStale(ctx, path); err != nil {
		return nil, fileID{}, err
	}
	tmpDir, err := os.MkdirTemp(dir, ".zds")
	if err != nil {
		return nil, fileID{}, fmt.Errorf("create private bind directory in %q: %w", dir, err)
	}
	defer os.RemoveAll(tmpDir)
	tmpPath := filepath.Join(tmpDir, "s")
	if len(tmpPath) > maxSunPath || len(path) > maxSunPath {
		return nil, fileID{}, fmt.Errorf("zds socket path %q is too long: its directory must leave room for %q (at most %d bytes)", path, tmpPath, maxSunPath)
	}
	ln, err := net.ListenUnix("unixpacket", &net.UnixAddr{Name: tmpPath, Net: "unixpacket"})
	if err != nil {
		return nil, fileID{}, fmt.Errorf("listen on zds socket: %w", err)
	}
	// The listener's path changes below; the server removes it itself.
	ln.SetUnlinkOnClose(false)
	fail := func(err error) (*net.UnixListener, fileID, error) {
		ln.Close()
		return nil, fileID{}, err
	}
	if err := os.Chmod(tmpPath, socketFileMode); err != nil {
		return fail(fmt.Errorf("set mode of zds socket: %w", err))
	}
	var st unix.Stat_t
	if err := unix.Lstat(tmpPath, &st); err != nil {
		return fail(fmt.Errorf("stat zds socket: %w", err))
	}
	if err := os.Rename(tmpPath, path); err != nil {
		return fail(fmt.Errorf("move zds socket into place at %q: %w", path, err))
	}
	return ln, fileID{dev: st.Dev, ino: st.Ino}, nil
}

func prepareDir(dir string) error {
	info, err := os.Stat(dir)
	if errors.Is(err, os.ErrNotExist) {
		if err := os.MkdirAll(dir, socketDirMode); err != nil {
			return fmt.Errorf("create zds socket directory %q: %w", dir, err)
		}
		return nil
	}
	if err != nil {
		return fmt.Errorf("inspect zds socket directory %q: %w", dir, err)
	}
	if !info.IsDir() {
		return fmt.Errorf("zds socket directory %q is not a directory", dir)
	}
	if info.Mode().Perm()&0o002 != 0 && info.Mode()&os.ModeSticky == 0 {
		return fmt.Errorf("zds socket directory %q is world-writable (%s): anyone could replace the socket", dir, info.Mode())
	}
	return nil
}

// checkStale succeeds when path is free or holds a socket nobody listens on.
func checkStale(ctx context.Context, path string) error {
	info, err := os.Lstat(path)
	if errors.Is(err, os.ErrNotExist) {
		return nil
	}
	if err != nil {
		return fmt.Errorf("inspect zds socket path %q: %w", path, err)
	}
	if info.Mode().Type() != os.ModeSocket {
		return fmt.Errorf("zds socket path %q exists and is not a socket (%s); refusing to replace it", path, info.Mode().Type())
	}
	ctx, cancel := context.WithTimeout(ctx, staleProbeTimeout)
	defer cancel()
	var d net.Dialer
	conn, err := d.DialContext(ctx, "unixpacket", path)
	if err == nil {
		// A live server sees this as a proxy that left without a hello.
		conn.Close()
		return fmt.Errorf("zds socket %q is in use by another process (is another agent running?)", path)
	}
	switch {
	case errors.Is(err, unix.ECONNREFUSED), errors.Is(err, os.ErrNotExist):
		return nil // stale: the rename replaces it
	case errors.Is(err, unix.EPROTOTYPE):
		return fmt.Errorf("zds socket path %q is a live socket of another type; refusing to replace it", path)
	default:
		return fmt.Errorf("probe existing zds socket %q: %w", path, err)
	}
}

// fileID identifies a file by device and inode.
type fileID struct{ dev, ino uint64 }

// removeIfOurs removes path if it is still the socket file with identity id.
func removeIfOurs(path string, id fileID) error {
	var st unix.Stat_t
	if err := unix.Lstat(path, &st); err != nil {
		if errors.Is(err, unix.ENOENT) {
			return nil
		}
		return fmt.Errorf("stat zds socket %q: %w", path, err)
	}
	if st.Dev != id.dev || st.Ino != id.ino {
		return nil // replaced by someone else meanwhile: theirs now
	}
	if err := os.Remove(path); err != nil && !errors.Is(err, os.ErrNotExist) {
		return fmt.Errorf("remove zds socket %q: %w", path, err)
	}
	return nil
}

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
