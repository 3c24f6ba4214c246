package nethook_test

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/mesh-cni/mesh-cni/internal/nethook"
)

func TestWriteRegistration(t *testing.T) {
	dir := filepath.Join(t.TempDir(), "net.d")
	path, err := nethook.WriteRegistration(dir, nethook.Registration{Name: "mesh-cni", Address: "/var/run/mesh-cni/hook.sock", DialTimeout: 1500 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	if path != filepath.Join(dir, "mesh-cni.json") {
		t.Fatalf("path = %s", path)
	}
	st, err := os.Stat(path)
	if err != nil || st.Mode().Perm() != 0o644 {
		t.Fatalf("registration file mode %v, %v; want 0644", st.Mode().Perm(), err)
	}
	data, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	want := `{
  "name": "mesh-cni",
  "address": "/var/run/mesh-cni/hook.sock",
  "primary": false,
  "priority": 200,
  "dial_timeout": 2
}
`
	if string(data) != want {
		t.Fatalf("registration file:\n%s\nwant\n%s", data, want)
	}

	// Rewriting replaces it; nothing else is left in the directory.
	if _, err := nethook.WriteRegistration(dir, nethook.Registration{Name: "mesh-cni", Address: "unix:///run/other.sock", ManagementAddress: "/run/mgmt.sock", Priority: 150}); err != nil {
		t.Fatal(err)
	}
	reg, err := nethook.ReadRegistration(path)
	if err != nil {
		t.Fatal(err)
	}
	wantReg := nethook.Registration{Name: "mesh-cni", Address: "unix:///run/other.sock", ManagementAddress: "/run/mgmt.sock", Priority: 150, DialTimeout: nethook.DefaultDialTimeout}
	if reg != wantReg {
		t.Fatalf("read back %+v, want %+v", reg, wantReg)
	}
	entries, err := os.ReadDir(dir)
	if err != nil || len(entries) != 1 {
		t.Fatalf("directory holds %v, %v; want only the registration", entries, err)
	}

	if err := nethook.RemoveRegistration(dir, "mesh-cni"); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(path); !os.IsNotExist(err) {
		t.Fatalf("registration still there: %v", err)
	}
	if err := nethook.RemoveRegistration(dir, "mesh-cni"); err != nil {
		t.Fatalf("removing twice: %v", err)
	}
}

func TestWriteRegistrationRejects(t *testing.T) {
	dir := t.TempDir()
	for _, reg := range []nethook.Registration{
		{Name: "", Address: "/run/x.sock"},
		{Name: "../evil", Address: "/run/x.sock"},
		{Name: "Mesh", Address: "/run/x.sock"},
		{Name: strings.Repeat("a", 64), Address: "/run/x.sock"},
		{Name: "mesh-cni", Address: "relative.sock"},
		{Name: "mesh-cni"},
	} {
		if _, err := nethook.WriteRegistration(dir, reg); err == nil {
			t.Errorf("WriteRegistration(%+v) succeeded", reg)
		}
	}
	if err := nethook.RemoveRegistration(dir, "../x"); err == nil {
		t.Error("RemoveRegistration accepted a path")
	}
	if entries, _ := os.ReadDir(dir); len(entries) != 0 {
		t.Fatalf("rejected registrations left %v", entries)
	}
}
