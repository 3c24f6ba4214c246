package zds_test

import (
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"

	"github.com/mesh-cni/mesh-cni/pkg/zds"
	"github.com/mesh-cni/mesh-cni/test/fixtures"
)

// TestNonRootProxyRejected: every connection is handed every pod's netns, so a
// peer that is not an allowed uid gets nothing, even when the socket's file mode
// would let it in.
func TestNonRootProxyRejected(t *testing.T) {
	fixtures.RequireRoot(t, rootReason)
	dir := t.TempDir()
	socket := filepath.Join(dir, "zds.sock")
	victim := pod(t, "victim")
	srv, _ := startServer(t, zds.SnapshotFunc(func(context.Context) ([]zds.Pod, error) { return []zds.Pod{victim}, nil }), zds.Config{SocketPath: socket})
	for _, p := range []string{filepath.Dir(dir), dir, socket} {
		if err := os.Chmod(p, 0o777); err != nil {
			t.Fatal(err)
		}
	}
	// A proxy running as nobody: hello (ZdsHello{version: V1} is 0x08 0x01), then
	// read what the server sends. It must see the connection closed, no snapshot.
	script := `
import socket, sys
s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
s.connect(sys.argv[1])
try:
    s.send(b"\x08\x01")
    data, anc, flags, addr = s.recvmsg(2048, socket.CMSG_SPACE(64))
except (ConnectionResetError, BrokenPipeError):
    data, anc = b"", []  # closed by the agent: what must happen
print("got %d bytes %d fds" % (len(data), len(anc)))
`
	cmd := exec.Command("/usr/bin/python3", "-c", script, socket)
	cmd.SysProcAttr = &syscall.SysProcAttr{Credential: &syscall.Credential{Uid: 65534, Gid: 65534}}
	cmd.Dir = "/"
	out, err := cmd.CombinedOutput()
	if err != nil {
		t.Fatalf("non-root proxy: %v\n%s", err, out)
	}
	if got := strings.TrimSpace(string(out)); got != "got 0 bytes 0 fds" {
		t.Fatalf("non-root proxy received %q, want the connection closed with nothing sent", got)
	}
	if srv.Connected() != 0 || srv.EverConnected() {
		t.Fatalf("server counts the rejected peer as a proxy (connected %d)", srv.Connected())
	}
}
