package atomicfile

import (
	"errors"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
)

func TestWriteFile(t *testing.T) {
	dir := t.TempDir()
	path := filepath.Join(dir, "f.conflist")
	old := syscall.Umask(0o077)
	defer syscall.Umask(old)
	if err := WriteFile(path, []byte("one"), Options{Mode: 0o644, Chown: true, UID: os.Geteuid(), GID: os.Getegid()}); err != nil {
		t.Fatal(err)
	}
	fi, err := os.Stat(path)
	if err != nil {
		t.Fatal(err)
	}
	if fi.Mode() != 0o644 {
		t.Errorf("mode %v despite umask", fi.Mode())
	}
	if uid, gid, ok := Owner(fi); !ok || uid != os.Geteuid() || gid != os.Getegid() {
		t.Errorf("owner %d:%d", uid, gid)
	}

	abort := errors.New("changed")
	err = WriteFile(path, []byte("two"), Options{Mode: 0o644, BeforeRename: func() error { return abort }})
	if !errors.Is(err, ErrAborted) || !errors.Is(err, abort) {
		t.Errorf("aborted write = %v", err)
	}
	if got, _ := os.ReadFile(path); string(got) != "one" {
		t.Errorf("aborted write changed the file: %q", got)
	}
	ents, _ := os.ReadDir(dir)
	for _, e := range ents {
		if strings.HasPrefix(e.Name(), TempPrefix) {
			t.Errorf("temporary file left: %s", e.Name())
		}
	}
	if err := Remove(path); err != nil {
		t.Fatal(err)
	}
	if err := Remove(path); err != nil {
		t.Errorf("removing a missing file: %v", err)
	}
	if err := WriteFile(filepath.Join(dir, "missing", "f"), nil, Options{Mode: 0o644}); err == nil {
		t.Error("write into a missing directory succeeded")
	}
}
