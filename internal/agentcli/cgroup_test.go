package agentcli

import (
	"bytes"
	"context"
	"net"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/mesh-cni/mesh-cni/internal/redirect"
	"github.com/mesh-cni/mesh-cni/test/fixtures"
)

func TestCgroupRoot(t *testing.T) {
	cg2, err := redirect.FindCgroup2()
	if err != nil {
		t.Skipf("no cgroup v2 mount here: %v", err)
	}
	if got, err := cgroupRoot(cg2); err != nil || got != cg2 {
		t.Errorf("cgroupRoot(%s) = %q, %v; want the mount itself", cg2, got, err)
	}
	if got, err := cgroupRoot(""); err != nil || got != "" {
		t.Errorf(`cgroupRoot("") = %q, %v; want "" (the data path finds the mount)`, got, err)
	}
	plain := t.TempDir()
	if got, err := cgroupRoot(plain); err == nil {
		t.Errorf("cgroupRoot(%s) = %q: want an error for a directory that is no cgroup v2 mount", plain, got)
	} else if !strings.Contains(err.Error(), "not a cgroup v2 mount") {
		t.Errorf("error %q does not say what is wrong", err)
	}

	// A hybrid node's layout: a tmpfs with the v2 hierarchy at unified/.
	fixtures.RequireRoot(t, "the hybrid layout needs mounts")
	hybrid := t.TempDir()
	if err := unix.Mount("tmpfs", hybrid, "tmpfs", 0, "mode=0755"); err != nil {
		t.Fatalf("mount tmpfs: %v", err)
	}
	t.Cleanup(func() {
		if err := unix.Unmount(hybrid, unix.MNT_DETACH); err != nil {
			t.Errorf("unmount %s: %v", hybrid, err)
		}
	})
	unified := filepath.Join(hybrid, "unified")
	if err := os.Mkdir(unified, 0o755); err != nil {
		t.Fatal(err)
	}
	if err := unix.Mount(cg2, unified, "", unix.MS_BIND, ""); err != nil {
		t.Fatalf("bind %s: %v", cg2, err)
	}
	t.Cleanup(func() {
		if err := unix.Unmount(unified, unix.MNT_DETACH); err != nil {
			t.Errorf("unmount %s: %v", unified, err)
		}
	})
	if got, err := cgroupRoot(hybrid); err != nil || got != unified {
		t.Errorf("cgroupRoot(%s) = %q, %v; want %s", hybrid, got, err, unified)
	}
}

// uninstall refuses while an agent listens on the gate socket: the agent would
// write the chain entry back at once.
func TestUninstallRefusesWhileAgentRuns(t *testing.T) {
	dir := t.TempDir()
	socket := filepath.Join(dir, "gate.sock")
	args := []string{"--socket", socket, "--cni-install=false", "--datapath=none", "--log-level", "error"}
	ln, err := net.Listen("unix", socket)
	if err != nil {
		t.Fatal(err)
	}
	var stderr bytes.Buffer
	if code := uninstallCommand(context.Background(), args, &stderr); code != 1 {
		t.Fatalf("uninstall with an agent listening exited %d, want 1:\n%s", code, stderr.String())
	}
	if !strings.Contains(stderr.String(), "still running") || !strings.Contains(stderr.String(), socket) {
		t.Errorf("the refusal does not say why or where:\n%s", stderr.String())
	}
	// Closing a Go listener removes its socket file; a stale file must not block
	// uninstall either, so leave one behind.
	ln.(*net.UnixListener).SetUnlinkOnClose(false)
	ln.Close()
	stderr.Reset()
	if code := uninstallCommand(context.Background(), args, &stderr); code != 0 {
		t.Fatalf("uninstall with no agent exited %d:\n%s", code, stderr.String())
	}
}
