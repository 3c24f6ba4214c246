package cniinstall

import (
	"bytes"
	"context"
	"crypto/rand"
	"os"
	"os/exec"
	"path/filepath"
	"syscall"
	"testing"
)

func TestInstallBinary(t *testing.T) {
	ctx := context.Background()
	root := t.TempDir()
	src := filepath.Join(root, "mesh-cni")
	bin := make([]byte, 300<<10)
	if _, err := rand.Read(bin); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(src, bin, 0o600); err != nil {
		t.Fatal(err)
	}
	dirs := []string{filepath.Join(root, "opt-cni-bin"), filepath.Join(root, "missing", "bin")}
	if err := os.Mkdir(dirs[0], 0o755); err != nil {
		t.Fatal(err)
	}
	check := func(want []byte) {
		t.Helper()
		for _, d := range dirs {
			p := filepath.Join(d, "mesh-cni")
			fi, err := os.Stat(p)
			if err != nil {
				t.Fatal(err)
			}
			if fi.Mode() != 0o755 {
				t.Errorf("%s mode %v", p, fi.Mode())
			}
			if got := readFile(t, p); !bytes.Equal(got, want) {
				t.Errorf("%s content differs", p)
			}
			noTempFiles(t, d)
		}
	}

	if changed, err := InstallBinary(ctx, src, dirs); err != nil || !changed {
		t.Fatalf("InstallBinary = %v, %v", changed, err)
	}
	check(bin)
	dst := filepath.Join(dirs[0], "mesh-cni")
	ino := inode(t, dst)
	if changed, err := InstallBinary(ctx, src, dirs); err != nil || changed {
		t.Errorf("same binary: InstallBinary = %v, %v", changed, err)
	}
	if inode(t, dst) != ino {
		t.Error("unchanged binary was rewritten")
	}

	// Mode drift is repaired.
	if err := os.Chmod(dst, 0o700); err != nil {
		t.Fatal(err)
	}
	if changed, err := InstallBinary(ctx, src, dirs); err != nil || !changed {
		t.Errorf("mode drift: InstallBinary = %v, %v", changed, err)
	}
	check(bin)

	// New content (same size) replaces the file by rename.
	ino = inode(t, dst)
	bin[len(bin)-1] ^= 0xff
	if err := os.WriteFile(src, bin, 0o600); err != nil {
		t.Fatal(err)
	}
	if changed, err := InstallBinary(ctx, src, dirs); err != nil || !changed {
		t.Errorf("new binary: InstallBinary = %v, %v", changed, err)
	}
	check(bin)
	if inode(t, dst) == ino {
		t.Error("binary replaced in place instead of renamed")
	}
}

func TestInstallBinaryErrors(t *testing.T) {
	root := t.TempDir()
	if _, err := InstallBinary(context.Background(), filepath.Join(root, "nope"), []string{root}); err == nil {
		t.Error("missing source accepted")
	}
	src := filepath.Join(root, "mesh-cni")
	if err := os.WriteFile(src, []byte("x"), 0o755); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	dir := filepath.Join(root, "bin")
	if changed, err := InstallBinary(ctx, src, []string{dir}); err == nil || changed {
		t.Errorf("cancelled: InstallBinary = %v, %v", changed, err)
	}
	if _, err := os.Stat(filepath.Join(dir, "mesh-cni")); err == nil {
		t.Error("installed despite cancellation")
	}
	// A bin "dir" that is a file.
	if _, err := InstallBinary(context.Background(), src, []string{src}); err == nil {
		t.Error("file as bin dir accepted")
	}
}

// A plugin process running from the installed binary keeps running while the
// binary is replaced (no ETXTBSY, no crash), and new executions get the new
// binary.
func TestInstallBinaryWhileRunning(t *testing.T) {
	sleep, err := exec.LookPath("sleep")
	if err != nil {
		t.Fatal(err)
	}
	truePath, err := exec.LookPath("true")
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	root := t.TempDir()
	dir := filepath.Join(root, "bin")
	src := filepath.Join(root, "plugin")
	if err := os.WriteFile(src, readFile(t, sleep), 0o755); err != nil {
		t.Fatal(err)
	}
	if _, err := InstallBinary(ctx, src, []string{dir}); err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command(filepath.Join(dir, "plugin"), "60")
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		_ = cmd.Process.Kill()
		_ = cmd.Wait()
	})

	if err := os.WriteFile(src, readFile(t, truePath), 0o755); err != nil {
		t.Fatal(err)
	}
	if changed, err := InstallBinary(ctx, src, []string{dir}); err != nil || !changed {
		t.Fatalf("replacing a running binary: %v, %v", changed, err)
	}
	if err := cmd.Process.Signal(syscall.Signal(0)); err != nil {
		t.Errorf("running plugin died: %v", err)
	}
	if err := exec.Command(filepath.Join(dir, "plugin"), "60").Run(); err != nil {
		t.Errorf("new binary (true) did not run: %v", err)
	}
}
