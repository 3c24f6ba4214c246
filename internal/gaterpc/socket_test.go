package gaterpc

import (
	"context"
	"net"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

func TestListenModesAndStaleSocket(t *testing.T) {
	dir := filepath.Join(t.TempDir(), "run")
	path := filepath.Join(dir, "gate.sock")
	ctx := context.Background()

	l, err := Listen(ctx, path)
	if err != nil {
		t.Fatal(err)
	}
	assertMode(t, dir, 0o700) // created by Listen
	assertMode(t, path, 0o600)
	if got := l.Addr().String(); got != path {
		t.Fatalf("Addr() = %q, want %q", got, path)
	}

	// A live socket is never taken over.
	if _, err := Listen(ctx, path); err == nil || !strings.Contains(err.Error(), "in use") {
		t.Fatalf("Listen on a live socket = %v, want in-use error", err)
	}

	// Close removes the socket file.
	if err := l.Close(); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Lstat(path); !os.IsNotExist(err) {
		t.Fatalf("socket file after Close: %v, want it gone", err)
	}

	// A stale socket (left by a crashed agent: the file without a listener) is replaced.
	l2, err := Listen(ctx, path)
	if err != nil {
		t.Fatal(err)
	}
	l2.(*listener).UnixListener.Close() // the process died: the file stays
	if _, err := os.Lstat(path); err != nil {
		t.Fatalf("stale socket file should still exist: %v", err)
	}
	l3, err := Listen(ctx, path)
	if err != nil {
		t.Fatalf("Listen over a stale socket: %v", err)
	}
	l3.Close()

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

// TestListenLeavesExistingDirectory: Listen never changes the mode of a parent
// directory it did not create (a runtime's socket directory, a shared
// hostPath), and refuses one where anyone could replace the socket.
func TestListenLeavesExistingDirectory(t *testing.T) {
	ctx := context.Background()
	for _, tc := range []struct {
		name    string
		mode    os.FileMode
		wantErr string
	}{
		{"shared 0755", 0o755, ""},
		{"sticky world-writable", 0o777 | os.ModeSticky, ""},
		{"world-writable", 0o777, "world-writable"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			dir := filepath.Join(t.TempDir(), "shared")
			if err := os.Mkdir(dir, 0o700); err != nil {
				t.Fatal(err)
			}
			if err := os.Chmod(dir, tc.mode); err != nil {
				t.Fatal(err)
			}
			path := filepath.Join(dir, "gate.sock")
			l, err := Listen(ctx, path)
			if tc.wantErr != "" {
				if err == nil || !strings.Contains(err.Error(), tc.wantErr) {
					t.Fatalf("Listen in a %s directory = %v, want an error mentioning %q", tc.mode, err, tc.wantErr)
				}
			} else {
				if err != nil {
					t.Fatal(err)
				}
				defer l.Close()
				assertMode(t, path, 0o600)
			}
			info, err := os.Stat(dir)
			if err != nil {
				t.Fatal(err)
			}
			if got := info.Mode() & (os.ModePerm | os.ModeSticky); got != tc.mode {
				t.Fatalf("directory mode changed from %s to %s", tc.mode, got)
			}
			entries, _ := os.ReadDir(dir)
			for _, e := range entries {
				if e.Name() != "gate.sock" {
					t.Errorf("Listen left %s behind", e.Name())
				}
			}
		})
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

// TestListenTakingOver: a successor replaces a live socket in one rename; the
// old listener learns it was superseded, and closing it leaves the
// successor's socket in place. A regular file is still never replaced.
func TestListenTakingOver(t *testing.T) {
	path := filepath.Join(t.TempDir(), "hook.sock")
	ctx := context.Background()
	old, err := ListenTakingOver(ctx, path)
	if err != nil {
		t.Fatal(err)
	}
	if s, err := Superseded(old); err != nil || s {
		t.Fatalf("Superseded before any successor = %v, %v", s, err)
	}
	succ, err := ListenTakingOver(ctx, path)
	if err != nil {
		t.Fatalf("take over a live socket: %v", err)
	}
	defer succ.Close()
	assertMode(t, path, 0o600)
	if s, err := Superseded(old); err != nil || !s {
		t.Fatalf("Superseded after a successor took over = %v, %v; want true", s, err)
	}
	if s, err := Superseded(succ); err != nil || s {
		t.Fatalf("the successor is superseded = %v, %v", s, err)
	}
	if err := old.Close(); err != nil {
		t.Fatal(err)
	}
	conn, err := net.Dial("unix", path)
	if err != nil {
		t.Fatalf("the successor's socket after the old listener closed: %v", err)
	}
	conn.Close()

	if err := succ.Close(); err != nil {
		t.Fatal(err)
	}
	if s, err := Superseded(succ); err != nil || s {
		t.Fatalf("Superseded once its socket is removed = %v, %v; want false (nobody took over)", s, err)
	}
	if err := os.WriteFile(path, []byte("keep me"), 0o600); err != nil {
		t.Fatal(err)
	}
	if _, err := ListenTakingOver(ctx, path); err == nil || !strings.Contains(err.Error(), "not a socket") {
		t.Fatalf("take over a regular file = %v, want not-a-socket error", err)
	}
}
