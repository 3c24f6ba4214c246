package gate

import (
	"context"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

func TestListenModesAndStaleSocket(t *testing.T) {
	dir := filepath.Join(t.TempDir(), "run")
	if err := os.MkdirAll(dir, 0o777); err != nil {
		t.Fatal(err)
	}
	if err := os.Chmod(dir, 0o777); err != nil {
		t.Fatal(err)
	}
	path := filepath.Join(dir, "gate.sock")
	ctx := context.Background()

	l, err := Listen(ctx, path)
	if err != nil {
		t.Fatal(err)
	}
	assertMode(t, dir, 0o700)
	assertMode(t, path, 0o600)

	// A live socket is never taken over.
	if _, err := Listen(ctx, path); err == nil || !strings.Contains(err.Error(), "in use") {
		t.Fatalf("Listen on a live socket = %v, want in-use error", err)
	}

	// A stale socket (left by a crashed agent: the file without a listener) is replaced.
	l.SetUnlinkOnClose(false)
	l.Close()
	if _, err := os.Lstat(path); err != nil {
		t.Fatalf("stale socket file should still exist: %v", err)
	}
	l2, err := Listen(ctx, path)
	if err != nil {
		t.Fatalf("Listen over a stale socket: %v", err)
	}
	l2.Close()

	// Something that is not a socket is never removed.
	if err := os.WriteFile(path, []byte("keep me"), 0o600); err != nil {
		t.Fatal(err)
	}
	if _, err := Listen(ctx, path); err == nil || !strings.Contains(err.Error(), "not a socket") {
		t.Fatalf("Listen over a regular file = %v, want not-a-socket error", err)
	}
	if data, _ := os.ReadFile(path); string(data) != "keep me" {
		t.Fatalf("regular file was modified: %q", data)
	}
	if _, err := Listen(ctx, "relative/gate.sock"); err == nil {
		t.Fatal("Listen accepted a relative path")
	}
}

func assertMode(t *testing.T, path string, want os.FileMode) {
	t.Helper()
	info, err := os.Stat(path)
	if err != nil {
		t.Fatal(err)
	}
	if got := info.Mode().Perm(); got != want {
		t.Fatalf("mode of %s = %o, want %o", path, got, want)
	}
}
