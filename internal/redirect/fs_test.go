package redirect

import (
	"context"
	"os"
	"os/exec"
	"strings"
	"syscall"
	"testing"

	"go.uber.org/zap/zaptest"
	"golang.org/x/sys/unix"
)

// TestHelperSharedBPFFS is not a test: TestMountsSharedBPFFS runs it in a mount
// namespace of its own, where nothing is mounted at /sys/fs/bpf.
func TestHelperSharedBPFFS(t *testing.T) {
	if os.Getenv("MESH_HELPER_BPFFS") == "" {
		t.Skip("helper process of TestMountsSharedBPFFS")
	}
	if on, _ := isBPFFS(sharedBPFFS); on {
		if err := unix.Unmount(sharedBPFFS, unix.MNT_DETACH); err != nil {
			t.Fatal(err)
		}
	}
	ctx := context.Background()
	cfg := Config{PinRoot: DefaultPinRoot, Logger: zaptest.NewLogger(t)}
	d, err := Open(ctx, cfg)
	if err != nil {
		t.Fatalf("open with nothing mounted at %s: %v", sharedBPFFS, err)
	}
	if on, err := isBPFFS(sharedBPFFS); err != nil || !on {
		t.Errorf("%s is not a bpffs after open (%v)", sharedBPFFS, err)
	}
	if mnt, err := isMountPoint(cfg.PinRoot); err != nil || mnt {
		t.Errorf("the pin root is a mount of its own (%v): want a directory of the shared bpffs", err)
	}
	d.Close()
	if err := Uninstall(ctx, cfg); err != nil {
		t.Fatal(err)
	}
}

// A node whose /sys/fs/bpf is not mounted (some distributions leave it to systemd,
// containers often lack it): Open mounts the shared bpffs there, as other eBPF agents
// do, and pins below it.
func TestMountsSharedBPFFS(t *testing.T) {
	t.Parallel()
	requireRoot(t)
	cmd := exec.Command(os.Args[0], "-test.run=^TestHelperSharedBPFFS$", "-test.v")
	cmd.Env = append(os.Environ(), "MESH_HELPER_BPFFS=1")
	// A private mount namespace: the mount, and everything pinned in it, go away
	// with the helper, whatever happens to it.
	cmd.SysProcAttr = &syscall.SysProcAttr{Unshareflags: syscall.CLONE_NEWNS}
	out, err := cmd.CombinedOutput()
	if err != nil || !strings.Contains(string(out), "--- PASS: TestHelperSharedBPFFS") {
		t.Fatalf("helper: %v\n%s", err, out)
	}
}
