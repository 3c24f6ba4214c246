package containerdhook

import (
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc"

	"github.com/mesh-cni/mesh-cni/test/fixtures"
)

// plugin is a PodNetworkLifecycle server that answers an empty setup and a
// health check with ready.
func servePlugin(t *testing.T, dir, name string, ready bool) string {
	t.Helper()
	sock := filepath.Join(dir, name+".sock")
	l, err := net.Listen("unix", sock)
	if err != nil {
		t.Fatal(err)
	}
	srv := grpc.NewServer(grpc.ForceServerCodec(rawCodec{}))
	empty := func(context.Context, *Primary, []byte) ([]byte, error) { return nil, nil }
	srv.RegisterService(&grpc.ServiceDesc{
		ServiceName: primaryService.ServiceName,
		HandlerType: (*any)(nil),
		Methods: []grpc.MethodDesc{
			rawMethod("SetupPodNetwork", empty),
			rawMethod("TeardownPodNetwork", empty),
			rawMethod("CheckHealth", func(context.Context, *Primary, []byte) ([]byte, error) {
				return encodeHealth(ready, name+" answers"), nil
			}),
		},
	}, &Primary{})
	go func() { _ = srv.Serve(l) }()
	t.Cleanup(srv.Stop)
	return sock
}

func register(t *testing.T, dir, file, name, address string, primary bool, priority int) {
	t.Helper()
	data := fmt.Sprintf(`{"name": %q, "address": %q, "primary": %v, "priority": %d, "dial_timeout": 1}`, name, address, primary, priority)
	if err := writeRename(filepath.Join(dir, file), []byte(data)); err != nil {
		t.Fatal(err)
	}
}

func newLoader(t *testing.T, dir string) *Loader {
	t.Helper()
	l, err := NewLoader(dir)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { l.Close() })
	return l
}

// loadAfter waits for the load that follows a change made after n loads.
func loadAfter(t *testing.T, l *Loader, n int) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if _, err := l.WaitLoads(ctx, n+1); err != nil {
		t.Fatal(err)
	}
}

// TestLoaderAsTheFork: the loader's behaviour that the hook's design rests
// on, each as grpc_plugin_syncer.go at the fork commit does it.
func TestLoaderAsTheFork(t *testing.T) {
	ctx := fixtures.Context(t, time.Minute)
	dir := t.TempDir()
	plugins := filepath.Join(dir, "net.d")
	if err := os.Mkdir(plugins, 0o755); err != nil {
		t.Fatal(err)
	}
	primary := servePlugin(t, dir, "primary", true)
	register(t, plugins, "10-primary.json", "primary", primary, true, 10)
	// A registration whose socket nobody serves: a hook that crashed, or an
	// agent-served hook with its agent down.
	dead := filepath.Join(dir, "dead.sock")
	register(t, plugins, "50-dead.json", "dead", dead, false, 200)

	// At the start, one failed dial leaves no chain at all: the primary's
	// pods get no network and NetworkReady is false.
	l := newLoader(t, plugins)
	if l.Chain() != nil || l.LastStatus() == nil || !strings.Contains(l.LastStatus().Error(), `"dead"`) {
		t.Fatalf("first load with a dead plugin: chain %v, status %v; want none and an error naming it", l.Names(), l.LastStatus())
	}
	if _, err := l.Setup(ctx, Pod{SandboxID: "s1"}); !errors.Is(err, ErrNoPlugins) {
		t.Fatalf("setup without a chain = %v, want %v", err, ErrNoPlugins)
	}
	if err := l.NetworkReady(ctx); !errors.Is(err, ErrNoPlugins) {
		t.Fatalf("NetworkReady without a chain = %v", err)
	}

	// Removing the dead registration loads the primary alone.
	n := l.Loads()
	if err := os.Remove(filepath.Join(plugins, "50-dead.json")); err != nil {
		t.Fatal(err)
	}
	loadAfter(t, l, n)
	if got := l.Names(); !slices.Equal(got, []string{"primary"}) || l.LastStatus() != nil {
		t.Fatalf("after removing the dead registration: chain %v, status %v", got, l.LastStatus())
	}

	// A dead plugin registered later fails that load and keeps the chain in
	// place before it, whose health still holds.
	n = l.Loads()
	register(t, plugins, "50-dead.json", "dead", dead, false, 200)
	// A file renamed into place is written under its temporary name first:
	// two loads, the second one sees it.
	waitLoadsUntil(t, func() bool { return l.LastStatus() != nil }, n, l)
	if l.LastStatus() == nil || !slices.Equal(l.Names(), []string{"primary"}) {
		t.Fatalf("a dead plugin added: chain %v, status %v; want the old chain and an error", l.Names(), l.LastStatus())
	}
	if err := l.NetworkReady(ctx); err != nil {
		t.Fatalf("NetworkReady of the kept chain: %v", err)
	}
	if err := os.Remove(filepath.Join(plugins, "50-dead.json")); err != nil {
		t.Fatal(err)
	}

	// A live hook is ordered after the primary by priority; a file written in
	// place (Create, then Write) is loaded on its Write.
	hook := servePlugin(t, dir, "hook", true)
	data := fmt.Sprintf(`{"name": "hook", "address": %q, "priority": 200}`, hook)
	if err := os.WriteFile(filepath.Join(plugins, "mesh.json"), []byte(data), 0o644); err != nil {
		t.Fatal(err)
	}
	if err := l.WaitChain(ctx, "primary", "hook"); err != nil {
		t.Fatal(err)
	}
	if err := l.SettledNetworkReady(ctx); err != nil {
		t.Fatalf("NetworkReady with both: %v", err)
	}

	// A hook answering not-ready makes NetworkReady false.
	sad := servePlugin(t, dir, "sad", false)
	register(t, plugins, "60-sad.json", "sad", sad, false, 300)
	if err := l.WaitChain(ctx, "primary", "hook", "sad"); err != nil {
		t.Fatal(err)
	}
	if err := l.SettledNetworkReady(ctx); err == nil || !strings.Contains(err.Error(), "sad answers") {
		t.Fatalf("NetworkReady with a not-ready plugin = %v, want its message", err)
	}

	// Every file gone: no chain, no error.
	for _, f := range []string{"10-primary.json", "mesh.json", "60-sad.json"} {
		n = l.Loads()
		if err := os.Remove(filepath.Join(plugins, f)); err != nil {
			t.Fatal(err)
		}
		loadAfter(t, l, n)
	}
	if l.Chain() != nil || l.LastStatus() != nil {
		t.Fatalf("empty directory: chain %v, status %v", l.Names(), l.LastStatus())
	}
}

// waitLoadsUntil waits for cond, which a load after n must make true.
func waitLoadsUntil(t *testing.T, cond func() bool, n int, l *Loader) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	for !cond() {
		n++
		if _, err := l.WaitLoads(ctx, n); err != nil {
			t.Fatalf("%v (chain %v, status %v)", err, l.Names(), l.LastStatus())
		}
	}
}
