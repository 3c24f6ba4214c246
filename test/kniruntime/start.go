package kniruntime

import (
	"context"
	"net"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/containernetworking/cni/libcni"
	"go.uber.org/zap/zaptest"

	"github.com/mesh-cni/mesh-cni/test/harness"
)

// Started is a runtime serving on a socket for one test.
type Started struct {
	*Runtime
	// Socket is the runtime's Unix socket.
	Socket string
}

// Start serves a runtime for node's network list on a fresh socket. In the
// test's cleanup every sandbox still attached is detached (CNI DEL) and the
// server stopped.
func Start(tb testing.TB, node *harness.Node, list *libcni.NetworkConfigList) *Started {
	tb.Helper()
	return start(tb, node, list, (*Runtime).Serve)
}

// StartLibkni is Start for a runtime that serves only the method names of
// libkni, the published reference runtime (see libkniService).
func StartLibkni(tb testing.TB, node *harness.Node, list *libcni.NetworkConfigList) *Started {
	tb.Helper()
	return start(tb, node, list, (*Runtime).ServeLibkni)
}

// StartFromConfDir is StartLibkni for a runtime that runs the node's own CNI
// configuration, as libkni does: at each attach and detach, the conflist
// node.ConfDir holds then (harness.Node.LoadConflist, the runtimes' pick).
func StartFromConfDir(tb testing.TB, node *harness.Node) *Started {
	tb.Helper()
	return start(tb, node, nil, (*Runtime).ServeLibkni)
}

func start(tb testing.TB, node *harness.Node, list *libcni.NetworkConfigList, serve func(*Runtime, net.Listener) func()) *Started {
	tb.Helper()
	// Not tb.TempDir(): its paths grow with the test name and a Unix socket
	// path must stay under 108 bytes.
	dir, err := os.MkdirTemp("", "kniruntime-")
	if err != nil {
		tb.Fatal(err)
	}
	tb.Cleanup(func() { os.RemoveAll(dir) })
	sock := filepath.Join(dir, "kni.sock")
	l, err := net.Listen("unix", sock)
	if err != nil {
		tb.Fatalf("kniruntime listen: %v", err)
	}
	cfg := Config{CNI: node.CNI, Network: list, PluginNetns: node.NetNSPath, Log: zaptest.NewLogger(tb).Named("kniruntime")}
	if list == nil {
		cfg.Load = func() (*libcni.NetworkConfigList, error) {
			l, _, err := node.LoadConflist()
			return l, err
		}
	}
	r := New(cfg)
	stop := serve(r, l)
	tb.Cleanup(func() {
		stop()
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		if err := r.DetachAll(ctx); err != nil {
			tb.Errorf("kniruntime cleanup: %v", err)
		}
	})
	return &Started{Runtime: r, Socket: sock}
}
