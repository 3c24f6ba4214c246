package enroll

import (
	"context"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
	"go.uber.org/zap/zaptest/observer"

	"github.com/mesh-cni/mesh-cni/test/fixtures"
)

// waitLimit bounds every wait in these tests; a change is normally seen within
// the debounce.
const waitLimit = 10 * time.Second

func startFile(t *testing.T, path string) (*FileSource, *observer.ObservedLogs) {
	t.Helper()
	core, logs := observer.New(zapcore.InfoLevel)
	f, err := StartFileSource(context.Background(), FileConfig{Path: path, Logger: zap.New(core)})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { f.Close() })
	return f, logs
}

func writeFile(t *testing.T, path, data string) {
	t.Helper()
	if err := os.WriteFile(path, []byte(data), 0o644); err != nil {
		t.Fatal(err)
	}
}

// waitChanged waits for the channel taken before a change to close.
func waitChanged(t *testing.T, ch <-chan struct{}, what string) {
	t.Helper()
	select {
	case <-ch:
	case <-time.After(waitLimit):
		t.Fatalf("Changed did not fire after %s", what)
	}
}

func decideEnroll(t *testing.T, f *FileSource, namespace, name string) bool {
	t.Helper()
	d, err := f.Decide(context.Background(), pod(namespace, name))
	if err != nil {
		t.Fatalf("Decide %s/%s: %v", namespace, name, err)
	}
	return d.Enroll
}

func TestFileSourceReloadRejectKeep(t *testing.T) {
	path := filepath.Join(t.TempDir(), "enrollment.yaml")
	f, logs := startFile(t, path)

	// No file: not synced, and Decide refuses to guess.
	if ok, why := f.Synced(); ok || !strings.Contains(why, "does not exist") {
		t.Fatalf("Synced() = %v, %q before the file exists", ok, why)
	}
	if _, err := f.Decide(context.Background(), pod("shop", "web")); err == nil {
		t.Fatal("Decide answered with no policy in force")
	}

	ch := f.Changed()
	writeFile(t, path, "namespaces: [shop]\n")
	waitChanged(t, ch, "the file appeared")
	if ok, why := f.Synced(); !ok {
		t.Fatalf("not synced after a good file: %s", why)
	}
	if !decideEnroll(t, f, "shop", "web") || decideEnroll(t, f, "pay", "api") {
		t.Fatal("first policy not in force")
	}

	// A good edit is in force without a restart.
	ch = f.Changed()
	writeFile(t, path, "namespaces: [pay]\n")
	waitChanged(t, ch, "a good edit")
	if decideEnroll(t, f, "shop", "web") || !decideEnroll(t, f, "pay", "api") {
		t.Fatal("edited policy not in force")
	}

	// An invalid edit is rejected with a clear log; the last good policy stays.
	ch = f.Changed()
	writeFile(t, path, "namespaces: [shop\n")
	fixtures.WaitFor(t, waitLimit, "the invalid edit to be rejected", func() bool { return f.Err() != nil })
	select {
	case <-ch:
		t.Fatal("Changed fired for a rejected edit")
	default:
	}
	if !decideEnroll(t, f, "pay", "api") || decideEnroll(t, f, "shop", "web") {
		t.Fatal("the last good policy is not in force after an invalid edit")
	}
	if ok, _ := f.Synced(); !ok {
		t.Fatal("an invalid edit made the source unsynced; the last good policy should keep it ready")
	}
	rejected := logs.FilterMessageSnippet("last good policy stays in force").All()
	if len(rejected) != 1 || rejected[0].Level != zapcore.ErrorLevel {
		t.Fatalf("want one error log saying the last good policy stays, have %v", logs.All())
	}
	if msg := rejected[0].ContextMap()["error"]; !strings.Contains(msg.(string), path) {
		t.Fatalf("the rejection log does not name the file: %v", msg)
	}

	// Semantically invalid (unknown field), and an empty file: rejected too.
	for _, bad := range []string{"namespace: [shop]\n", ""} {
		writeFile(t, path, bad)
		fixtures.WaitFor(t, waitLimit, "the edit to be rejected", func() bool { return f.Err() != nil && !strings.Contains(f.Err().Error(), "[shop\n") })
		if !decideEnroll(t, f, "pay", "api") {
			t.Fatalf("last good policy lost after writing %q", bad)
		}
	}

	// Fixing the file puts the fix in force.
	ch = f.Changed()
	writeFile(t, path, "namespaces: [shop, pay]\n")
	waitChanged(t, ch, "fixing the file")
	if f.Err() != nil || !decideEnroll(t, f, "shop", "web") {
		t.Fatalf("fixed policy not in force: %v", f.Err())
	}

	// Removing the file keeps the last good policy.
	if err := os.Remove(path); err != nil {
		t.Fatal(err)
	}
	fixtures.WaitFor(t, waitLimit, "the removal to be noticed", func() bool { return f.Err() != nil })
	if !decideEnroll(t, f, "shop", "web") {
		t.Fatal("last good policy lost when the file was removed")
	}
}

// TestFileSourceConfigMapSwap: a ConfigMap volume updates by swapping its
// ..data symlink, never writing the file the agent was pointed at.
func TestFileSourceConfigMapSwap(t *testing.T) {
	dir := t.TempDir()
	publish := func(version, content string) {
		t.Helper()
		v := filepath.Join(dir, version)
		if err := os.Mkdir(v, 0o755); err != nil {
			t.Fatal(err)
		}
		writeFile(t, filepath.Join(v, "enrollment.yaml"), content)
		tmp := filepath.Join(dir, "..data_tmp")
		if err := os.Symlink(version, tmp); err != nil {
			t.Fatal(err)
		}
		if err := os.Rename(tmp, filepath.Join(dir, "..data")); err != nil {
			t.Fatal(err)
		}
	}
	publish("..v1", "namespaces: [shop]\n")
	path := filepath.Join(dir, "enrollment.yaml")
	if err := os.Symlink("..data/enrollment.yaml", path); err != nil {
		t.Fatal(err)
	}
	f, _ := startFile(t, path)
	if ok, why := f.Synced(); !ok {
		t.Fatalf("not synced with the file present at start: %s", why)
	}
	ch := f.Changed()
	publish("..v2", "namespaces: [pay]\n")
	waitChanged(t, ch, "the ConfigMap swap")
	if decideEnroll(t, f, "shop", "web") || !decideEnroll(t, f, "pay", "api") {
		t.Fatal("swapped policy not in force")
	}
}

func TestFileSourceInvalidAtStart(t *testing.T) {
	path := filepath.Join(t.TempDir(), "enrollment.yaml")
	writeFile(t, path, "pods: [{namespace: shop}]\n")
	f, _ := startFile(t, path)
	ok, why := f.Synced()
	if ok || !strings.Contains(why, "name is required") {
		t.Fatalf("Synced() = %v, %q for an invalid file at start", ok, why)
	}
	_, err := f.Decide(context.Background(), pod("shop", "web"))
	if err == nil || !strings.Contains(err.Error(), "no enrollment policy in force") {
		t.Fatalf("Decide with no good policy: %v", err)
	}
}

func TestStartFileSourceErrors(t *testing.T) {
	ctx := context.Background()
	if _, err := StartFileSource(ctx, FileConfig{}); err == nil {
		t.Fatal("no path accepted")
	}
	if _, err := StartFileSource(ctx, FileConfig{Path: filepath.Join(t.TempDir(), "missing", "p.yaml")}); err == nil {
		t.Fatal("a missing directory accepted")
	}
	if _, err := StartFileSource(ctx, FileConfig{Path: filepath.Join(t.TempDir(), "p.yaml"), Profile: "nope"}); err == nil {
		t.Fatal("an unknown profile accepted")
	}
}
