// Package unixsock creates the agent's Unix listening sockets (gate, KNI,
// hook, ZDS) so that only root can reach them from the moment they exist, and
// without changing directories the agent did not create.
package unixsock

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
	// dirMode is used for a socket directory that does not exist yet.
	dirMode = 0o700
	// fileMode lets only root connect: connecting to a Unix socket needs write
	// permission on it.
	fileMode = 0o600
	// maxSunPath is the size of sockaddr_un's sun_path on Linux.
	maxSunPath = 108
	// staleProbeTimeout bounds the connect that tells a live socket from a stale one.
	staleProbeTimeout = time.Second
)

// ID identifies a socket file by device and inode.
type ID struct{ dev, ino uint64 }

// Listen creates a listening socket of network ("unix" or "unixpacket") at
// path, mode 0600, and returns it with the file's identity (for RemoveIfOurs).
// The listener does not unlink path on Close: the path may belong to a newer
// listener by then.
//
// The parent directory is created 0700 when missing. An existing one is left
// as it is (it may be the runtime's or a hostPath shared with another pod:
// changing its mode would break them), but refused when anyone may replace
// entries in it (world-writable without the sticky bit).
//
// The socket is bound inside a fresh 0700 directory next to path, made 0600
// there and only then renamed into place, so at no moment can a non-root
// process reach it with the mode the umask gives. A socket already at path is
// replaced only when nobody answers on it (a second agent must never take over
// a running one's socket); a path that is not a socket is never replaced.
func Listen(ctx context.Context, network, path string) (*net.UnixListener, ID, error) {
	return listen(ctx, network, path, false)
}

// ListenTakingOver is Listen for a server whose successor starts before it
// stops (the network-plugin hook's hand-over): a socket at path is replaced
// whether or not someone answers on it, in one rename, so a client dialing
// path reaches the old listener or the new one and never finds nothing. The
// old server learns it was replaced with Replaced. A path that is not a socket is
// still never replaced.
func ListenTakingOver(ctx context.Context, network, path string) (*net.UnixListener, ID, error) {
	return listen(ctx, network, path, true)
}

func listen(ctx context.Context, network, path string, takeOver bool) (*net.UnixListener, ID, error) {
	if !filepath.IsAbs(path) {
		return nil, ID{}, fmt.Errorf("socket path %q must be absolute", path)
	}
	dir := filepath.Dir(path)
	if err := prepareDir(dir); err != nil {
		return nil, ID{}, err
	}
	check := checkStale
	if takeOver {
		check = checkSocketOrFree
	}
	if err := check(ctx, network, path); err != nil {
		return nil, ID{}, err
	}
	tmpDir, err := os.MkdirTemp(dir, ".bind")
	if err != nil {
		return nil, ID{}, fmt.Errorf("create private bind directory in %q: %w", dir, err)
	}
	defer os.RemoveAll(tmpDir)
	tmpPath := filepath.Join(tmpDir, "s")
	if len(tmpPath) > maxSunPath || len(path) > maxSunPath {
		return nil, ID{}, fmt.Errorf("socket path %q is too long: its directory must leave room for %q (at most %d bytes)", path, tmpPath, maxSunPath)
	}
	ln, err := net.ListenUnix(network, &net.UnixAddr{Name: tmpPath, Net: network})
	if err != nil {
		return nil, ID{}, fmt.Errorf("listen on %s: %w", path, err)
	}
	ln.SetUnlinkOnClose(false)
	fail := func(err error) (*net.UnixListener, ID, error) {
		ln.Close()
		return nil, ID{}, err
	}
	if err := os.Chmod(tmpPath, fileMode); err != nil {
		return fail(fmt.Errorf("set mode of socket %s: %w", path, err))
	}
	var st unix.Stat_t
	if err := unix.Lstat(tmpPath, &st); err != nil {
		return fail(fmt.Errorf("stat socket %s: %w", path, err))
	}
	if err := os.Rename(tmpPath, path); err != nil {
		return fail(fmt.Errorf("move socket into place at %q: %w", path, err))
	}
	return ln, ID{dev: st.Dev, ino: st.Ino}, nil
}

func prepareDir(dir string) error {
	info, err := os.Stat(dir)
	if errors.Is(err, os.ErrNotExist) {
		if err := os.MkdirAll(dir, dirMode); err != nil {
			return fmt.Errorf("create socket directory %q: %w", dir, err)
		}
		return nil
	}
	if err != nil {
		return fmt.Errorf("inspect socket directory %q: %w", dir, err)
	}
	if !info.IsDir() {
		return fmt.Errorf("socket directory %q is not a directory", dir)
	}
	if info.Mode().Perm()&0o002 != 0 && info.Mode()&os.ModeSticky == 0 {
		return fmt.Errorf("socket directory %q is world-writable (%s): anyone could replace the socket", dir, info.Mode())
	}
	return nil
}

// checkSocketOrFree succeeds when path is free or holds a socket.
func checkSocketOrFree(_ context.Context, _, path string) error {
	info, err := os.Lstat(path)
	if errors.Is(err, os.ErrNotExist) {
		return nil
	}
	if err != nil {
		return fmt.Errorf("inspect socket path %q: %w", path, err)
	}
	if info.Mode().Type() != os.ModeSocket {
		return fmt.Errorf("socket path %q exists and is not a socket (%s); refusing to replace it", path, info.Mode().Type())
	}
	return nil
}

// checkStale succeeds when path is free or holds a socket nobody listens on.
func checkStale(ctx context.Context, network, path string) error {
	if err := checkSocketOrFree(ctx, network, path); err != nil {
		return err
	}
	if _, err := os.Lstat(path); errors.Is(err, os.ErrNotExist) {
		return nil
	}
	ctx, cancel := context.WithTimeout(ctx, staleProbeTimeout)
	defer cancel()
	var d net.Dialer
	conn, err := d.DialContext(ctx, network, path)
	if err == nil {
		conn.Close()
		return fmt.Errorf("socket %q is in use by another process (is another mesh-agent running?)", path)
	}
	switch {
	case errors.Is(err, unix.ECONNREFUSED), errors.Is(err, os.ErrNotExist):
		return nil // stale: the rename replaces it
	case errors.Is(err, unix.EPROTOTYPE):
		return fmt.Errorf("socket path %q is a live socket of another type; refusing to replace it", path)
	default:
		return fmt.Errorf("probe existing socket %q: %w", path, err)
	}
}

// Replaced reports whether path now holds a socket file other than the one
// with identity id: a successor took it over (ListenTakingOver). A path that
// is gone is not replaced: nobody serves there.
func Replaced(path string, id ID) (bool, error) {
	var st unix.Stat_t
	if err := unix.Lstat(path, &st); err != nil {
		if errors.Is(err, unix.ENOENT) {
			return false, nil
		}
		return false, fmt.Errorf("stat socket %q: %w", path, err)
	}
	return st.Mode&unix.S_IFMT == unix.S_IFSOCK && (st.Dev != id.dev || st.Ino != id.ino), nil
}

// RemoveIfOurs removes path if it is still the socket file with identity id.
func RemoveIfOurs(path string, id ID) error {
	var st unix.Stat_t
	if err := unix.Lstat(path, &st); err != nil {
		if errors.Is(err, unix.ENOENT) {
			return nil
		}
		return fmt.Errorf("stat socket %q: %w", path, err)
	}
	if st.Dev != id.dev || st.Ino != id.ino {
		return nil // replaced by someone else meanwhile: theirs now
	}
	if err := os.Remove(path); err != nil && !errors.Is(err, os.ErrNotExist) {
		return fmt.Errorf("remove socket %q: %w", path, err)
	}
	return nil
}
