package hostproc

import (
	"os"
	"path/filepath"
	"testing"
)

// A process is found by its name (the kubelet, or k3s' and MicroK8s' binaries
// that run it in-process); the lowest pid wins, and a procfs without any says so.
func TestFindByName(t *testing.T) {
	proc := t.TempDir()
	for pid, comm := range map[string]string{"1": "init", "40": "kubelite", "7": "containerd", "90": "kubelet", "self": "kubelet"} {
		if err := os.MkdirAll(filepath.Join(proc, pid), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(filepath.Join(proc, pid, "comm"), []byte(comm+"\n"), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	if pid, err := (Procfs{Root: proc}).FindByName([]string{"kubelet", "k3s-server", "k3s-agent", "kubelite"}); err != nil || pid != 40 {
		t.Errorf("found %d, %v; want 40 (kubelite, the lowest pid among the names)", pid, err)
	}
	if pid, err := (Procfs{Root: proc}).FindByName([]string{"kubelet"}); err != nil || pid != 90 {
		t.Errorf("found %d, %v; want 90", pid, err)
	}
	if _, err := (Procfs{Root: proc}).FindByName([]string{"k3s-agent"}); err == nil {
		t.Error("found a process no entry is named after")
	}
}
