// Package atomicfile is mesh-cni's one way of replacing a file: a concurrent
// reader sees either the old content or the new content, never a truncated or
// half-written file.
//
// Readers of CNI configuration (kubelet, containerd, CRI-O), executors of CNI
// plugins, a runtime's plugin registrations and a restarted agent reading its
// pod records read files at any moment, so install/, the hook's registration
// and the pod store all write through here: a temporary file in the same
// directory (rename is only atomic within one filesystem), mode and owner set,
// fsync, rename over the target, fsync of the directory so the rename itself
// survives a crash. Options.NoSync leaves out both fsyncs for files that must
// be whole but need not survive a crash of the machine.
//
// github.com/google/renameio/v2 does the temporary-file-and-rename part too,
// but does not fit: it always fsyncs the file (the pod store documents why it
// must not) and never the directory; it names temporary files "."+name plus
// digits, where this package's end in ".tmp", an extension no CNI runtime
// loads whatever the target's name; it has no hook between the fsync and the
// rename (the installer's check that nobody rewrote the target meanwhile), no
// owner and no cancellable copy; and without WithTempDir it probes
// os.TempDir with test renames for every file.
package atomicfile

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"syscall"
)

// TempPrefix starts the name of every temporary file this package creates. The
// temporary files also end in ".tmp", an extension no CNI runtime loads, so a
// runtime scanning the directory never picks up a file that is still being
// written.
const TempPrefix = ".mesh-cni-"

// ErrAborted is returned (wrapped) when Options.BeforeRename refused the rename.
var ErrAborted = errors.New("write aborted before rename")

// Options say how the new file looks.
type Options struct {
	// Mode is the permission of the new file.
	Mode os.FileMode
	// UID and GID, when Chown is set, become the owner of the new file (so a
	// replaced file keeps the owner it had). The owner is only changed when it
	// differs, so an unprivileged caller replacing its own files needs no
	// CAP_CHOWN.
	Chown    bool
	UID, GID int
	// NoSync leaves out the fsync of the file and of the directory: the
	// rename still keeps the file whole for every reader, but after a crash of
	// the machine it may be the old one or empty. For files that describe the
	// current boot only.
	NoSync bool
	// BeforeRename runs after the new content is durable (written, with
	// NoSync) and just before it replaces the target. Returning an error leaves the target untouched; the
	// error is returned wrapped together with ErrAborted. It lets a caller check
	// that nobody rewrote the target since it was read (the window that remains
	// is the few microseconds between the check and the rename).
	BeforeRename func() error
}

// WriteFile atomically replaces path with data.
func WriteFile(path string, data []byte, opts Options) error {
	return write(context.Background(), path, bytes.NewReader(data), opts)
}

// Copy atomically replaces path with everything read from r. ctx is checked
// between chunks so a large copy can be cancelled.
func Copy(ctx context.Context, path string, r io.Reader, opts Options) error {
	return write(ctx, path, r, opts)
}

func write(ctx context.Context, path string, r io.Reader, opts Options) (err error) {
	dir, base := filepath.Split(path)
	if dir == "" {
		dir = "."
	}
	tmp, err := os.CreateTemp(dir, TempPrefix+base+".*.tmp")
	if err != nil {
		return fmt.Errorf("create temporary file for %s: %w", path, err)
	}
	tmpName := tmp.Name()
	defer func() {
		if err != nil {
			_ = tmp.Close()
			_ = os.Remove(tmpName)
		}
	}()

	if _, err := io.Copy(tmp, ctxReader{ctx: ctx, r: r}); err != nil {
		return fmt.Errorf("write %s: %w", tmpName, err)
	}
	// Chmod on the descriptor: CreateTemp made the file 0600 and the umask must
	// not decide the final mode.
	if err := tmp.Chmod(opts.Mode.Perm()); err != nil {
		return fmt.Errorf("chmod %s: %w", tmpName, err)
	}
	if opts.Chown {
		if err := chown(tmp, opts.UID, opts.GID); err != nil {
			return fmt.Errorf("chown %s: %w", tmpName, err)
		}
	}
	if !opts.NoSync {
		if err := tmp.Sync(); err != nil {
			return fmt.Errorf("fsync %s: %w", tmpName, err)
		}
	}
	if err := tmp.Close(); err != nil {
		return fmt.Errorf("close %s: %w", tmpName, err)
	}
	if err := ctx.Err(); err != nil {
		return fmt.Errorf("write %s: %w", path, err)
	}
	if opts.BeforeRename != nil {
		if err := opts.BeforeRename(); err != nil {
			return fmt.Errorf("replace %s: %w: %w", path, ErrAborted, err)
		}
	}
	if err := os.Rename(tmpName, path); err != nil {
		return fmt.Errorf("rename %s to %s: %w", tmpName, path, err)
	}
	if opts.NoSync {
		return nil
	}
	return SyncDir(dir)
}

// Remove deletes path (a missing file is fine) and makes the removal durable.
func Remove(path string) error {
	if err := os.Remove(path); err != nil && !errors.Is(err, os.ErrNotExist) {
		return fmt.Errorf("remove %s: %w", path, err)
	}
	return SyncDir(filepath.Dir(path))
}

// SyncDir fsyncs a directory so that renames and removals in it are durable.
func SyncDir(dir string) error {
	d, err := os.Open(dir)
	if err != nil {
		return fmt.Errorf("open directory %s: %w", dir, err)
	}
	defer d.Close()
	if err := d.Sync(); err != nil {
		return fmt.Errorf("fsync directory %s: %w", dir, err)
	}
	return nil
}

type ctxReader struct {
	ctx context.Context
	r   io.Reader
}

func (c ctxReader) Read(p []byte) (int, error) {
	if err := c.ctx.Err(); err != nil {
		return 0, err
	}
	return c.r.Read(p)
}

func chown(f *os.File, uid, gid int) error {
	fi, err := f.Stat()
	if err != nil {
		return err
	}
	if st, ok := fi.Sys().(*syscall.Stat_t); ok && int(st.Uid) == uid && int(st.Gid) == gid {
		return nil
	}
	return f.Chown(uid, gid)
}

// Owner returns the owner of a file described by fi (from os.Stat / Lstat).
func Owner(fi os.FileInfo) (uid, gid int, ok bool) {
	st, ok := fi.Sys().(*syscall.Stat_t)
	if !ok {
		return 0, 0, false
	}
	return int(st.Uid), int(st.Gid), true
}
