package cniinstall

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"

	"github.com/mesh-cni/mesh-cni/internal/atomicfile"
)

// binaryMode is the mode of an installed plugin binary: runtimes execute it as
// root, nobody needs to write it.
const binaryMode os.FileMode = 0o755

// InstallBinary copies the plugin binary src into each CNI bin directory (under
// the same base name), creating missing directories. A copy is only replaced
// when its content or mode differs, and always atomically: a runtime executing
// the plugin at that moment runs either the old or the new binary, never a
// half-written file, and a running plugin process keeps its old inode (no
// ETXTBSY). changed reports whether any directory was written.
func InstallBinary(ctx context.Context, src string, dirs []string) (changed bool, err error) {
	want, err := os.ReadFile(src)
	if err != nil {
		return false, fmt.Errorf("read plugin binary: %w", err)
	}
	name := filepath.Base(src)
	for _, dir := range dirs {
		if err := ctx.Err(); err != nil {
			return changed, fmt.Errorf("install %s: %w", name, err)
		}
		c, err := installOne(ctx, want, filepath.Join(dir, name))
		changed = changed || c
		if err != nil {
			return changed, err
		}
	}
	return changed, nil
}

func installOne(ctx context.Context, want []byte, dst string) (bool, error) {
	same, err := sameContent(dst, want)
	if err != nil {
		return false, err
	}
	if same {
		return false, nil
	}
	if err := os.MkdirAll(filepath.Dir(dst), 0o755); err != nil {
		return false, fmt.Errorf("create CNI bin directory: %w", err)
	}
	if err := atomicfile.Copy(ctx, dst, bytes.NewReader(want), atomicfile.Options{Mode: binaryMode}); err != nil {
		return false, fmt.Errorf("install plugin binary: %w", err)
	}
	return true, nil
}

// sameContent reports whether dst is a regular file with mode 0755 holding
// exactly want. It reads dst in chunks so a different binary is noticed early.
func sameContent(dst string, want []byte) (bool, error) {
	f, err := os.Open(dst)
	if errors.Is(err, os.ErrNotExist) {
		return false, nil
	}
	if err != nil {
		return false, fmt.Errorf("open installed plugin: %w", err)
	}
	defer f.Close()
	fi, err := f.Stat()
	if err != nil {
		return false, fmt.Errorf("stat installed plugin: %w", err)
	}
	if !fi.Mode().IsRegular() || fi.Mode().Perm() != binaryMode || fi.Size() != int64(len(want)) {
		return false, nil
	}
	buf := make([]byte, 64<<10)
	rest := want
	for {
		n, err := f.Read(buf)
		if n > len(rest) || !bytes.Equal(buf[:n], rest[:n]) {
			return false, nil
		}
		rest = rest[n:]
		if err == io.EOF {
			return len(rest) == 0, nil
		}
		if err != nil {
			return false, fmt.Errorf("read installed plugin: %w", err)
		}
	}
}

// RemoveBinary deletes the installed plugin binary name from each CNI bin
// directory (uninstall). A binary that is already gone is not an error.
func RemoveBinary(dirs []string, name string) error {
	if name == "" || filepath.Base(name) != name {
		return fmt.Errorf("plugin binary name %q must be a plain file name", name)
	}
	var errs []error
	for _, dir := range dirs {
		if err := os.Remove(filepath.Join(dir, name)); err != nil && !errors.Is(err, os.ErrNotExist) {
			errs = append(errs, fmt.Errorf("remove plugin binary: %w", err))
		}
	}
	return errors.Join(errs...)
}
