package cniinstall

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/containernetworking/cni/libcni"
	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
	"go.uber.org/zap/zaptest/observer"

	"github.com/mesh-cni/mesh-cni/test/fixtures"
)

// The primary rewrites its file without the entry 100 times; each time the
// entry is back. Half the rewrites are in place (truncate and write, as many
// agents do), half are atomic renames.
func TestRunRepairsRewrites(t *testing.T) {
	dir := copyCase(t, "portmap-tuning")
	path := filepath.Join(dir, "10-calico.conflist")
	orig := readFile(t, path)
	in := newInstaller(t, Config{ConfDir: dir, StateDir: t.TempDir()})
	startRun(t, in)

	var slowest time.Duration
	for i := range 100 {
		prev := in.Status().Repairs
		start := time.Now()
		if i%2 == 0 {
			writeFile(t, path, orig)
		} else {
			writeAtomic(t, path, orig)
		}
		st := waitFor(t, in, fmt.Sprintf("repair %d", i), func(s Status) bool {
			return s.Ready && s.Repairs > prev
		})
		slowest = max(slowest, time.Since(start))
		if !hasEntryLast(path) {
			t.Fatalf("rewrite %d: ready (%+v) but the entry is not in the file", i, st)
		}
		checkMerged(t, "10-calico.conflist", orig, readFile(t, path))
	}
	st := in.Status()
	if st.Repairs < 100 || st.LastRepair.IsZero() {
		t.Errorf("status %+v", st)
	}
	t.Logf("100 rewrites repaired; slowest repair %v", slowest)
	noTempFiles(t, dir)
}

// Readers in a tight loop never see a missing, truncated or invalid config
// while the installer repairs and converts: one reads the merged file, one
// loads the directory the way a runtime does and must always find the same
// network.
func TestRunReadersSeeWholeFiles(t *testing.T) {
	for _, tc := range []struct{ caseName, primary, target, network string }{
		{"bridge-conflist", "10-bridge.conflist", "10-bridge.conflist", "mynet"},
		{"single-conf", "10-bridge.conf", "10-bridge.conflist", "mynet"},
	} {
		t.Run(tc.caseName, func(t *testing.T) {
			t.Parallel()
			dir := copyCase(t, tc.caseName)
			orig := readFile(t, filepath.Join(dir, tc.primary))
			in := newInstaller(t, Config{ConfDir: dir, StateDir: t.TempDir()})
			startRun(t, in)

			var stop atomic.Bool
			var wg sync.WaitGroup
			var fileReads, dirReads atomic.Int64
			errs := make(chan error, 2)
			wg.Add(2)
			go func() {
				defer wg.Done()
				for !stop.Load() {
					data, err := os.ReadFile(filepath.Join(dir, tc.target))
					if err == nil {
						_, err = libcni.ConfListFromBytes(data)
					}
					if err != nil {
						errs <- fmt.Errorf("reader saw a bad %s: %w\n%s", tc.target, err, data)
						return
					}
					fileReads.Add(1)
				}
			}()
			go func() {
				defer wg.Done()
				for !stop.Load() {
					_, list, err := runtimePick(dir)
					if err == nil && list.Name != tc.network {
						err = fmt.Errorf("network %q", list.Name)
					}
					if err != nil {
						errs <- fmt.Errorf("runtime view: %w", err)
						return
					}
					dirReads.Add(1)
				}
			}()
			for i := range 30 {
				prev := in.Status().Repairs
				// The primary writes atomically here: a truncated file
				// would be its fault, not the installer's.
				writeAtomic(t, filepath.Join(dir, tc.primary), orig)
				waitFor(t, in, fmt.Sprintf("repair %d", i), func(s Status) bool { return s.Ready && s.Repairs > prev })
			}
			stop.Store(true)
			wg.Wait()
			close(errs)
			for err := range errs {
				t.Error(err)
			}
			if fileReads.Load() == 0 || dirReads.Load() == 0 {
				t.Errorf("readers did not run: %d %d", fileReads.Load(), dirReads.Load())
			}
			t.Logf("%d file reads, %d directory loads", fileReads.Load(), dirReads.Load())
		})
	}
}

// A new file that sorts first becomes the primary: the entry moves there
// and the old primary gets its original bytes back; when the new file goes,
// the entry returns.
func TestRunFollowsNewFirstFile(t *testing.T) {
	dir := copyCase(t, "bridge-conflist")
	oldPath := filepath.Join(dir, "10-bridge.conflist")
	orig := readFile(t, oldPath)
	in := newInstaller(t, Config{ConfDir: dir, StateDir: t.TempDir()})
	startRun(t, in)

	newPath := filepath.Join(dir, "05-other.conflist")
	writeAtomic(t, newPath, []byte(`{"cniVersion":"1.0.0","name":"other","plugins":[{"type":"ptp"}]}`))
	waitFor(t, in, "entry moved", func(s Status) bool { return s.Ready && s.File == "05-other.conflist" })
	if !hasEntryLast(newPath) {
		t.Error("entry missing from the new primary")
	}
	waitFor(t, in, "old primary restored", func(Status) bool { return string(readFile(t, oldPath)) == string(orig) })

	if err := os.Remove(newPath); err != nil {
		t.Fatal(err)
	}
	waitFor(t, in, "entry back", func(s Status) bool { return s.Ready && s.File == "10-bridge.conflist" })
	if !hasEntryLast(oldPath) {
		t.Error("entry missing after the new file went away")
	}
}

// With no primary config Run waits, not ready, and installs once one
// appears. When ctx ends, Run returns and the entry stays.
func TestRunWaitsForPrimary(t *testing.T) {
	dir := filepath.Join(t.TempDir(), "net.d") // Run creates it
	var calls atomic.Int64
	in := newInstaller(t, Config{ConfDir: dir, OnChange: func(Status) { calls.Add(1) }})
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- in.Run(ctx) }()
	t.Cleanup(func() {
		cancel()
		<-done
	})
	waitFor(t, in, "waiting status", func(s Status) bool { return !s.Ready && strings.Contains(s.Reason, "waiting") })

	path := filepath.Join(dir, "10-bridge.conflist")
	writeAtomic(t, path, []byte(`{"cniVersion":"1.0.0","name":"late","plugins":[{"type":"bridge"}]}`))
	wctx := fixtures.Context(t, waitBound)
	if err := in.WaitReady(wctx); err != nil {
		t.Fatal(err)
	}
	if calls.Load() == 0 {
		t.Error("OnChange never called")
	}
	if st := in.Status(); st.Repairs != 0 {
		t.Errorf("first install counted as a repair: %+v", st)
	}

	cancel()
	if err := <-done; err != nil {
		t.Errorf("Run = %v", err)
	}
	done <- nil // for the cleanup
	if !hasEntryLast(path) {
		t.Error("entry gone after Run returned")
	}
}

// Reverting the file again and again logs a warning.
func TestRunWarnsWhenReverted(t *testing.T) {
	core, logs := observer.New(zapcore.InfoLevel)
	dir := copyCase(t, "bridge-conflist")
	path := filepath.Join(dir, "10-bridge.conflist")
	orig := readFile(t, path)
	in := newInstaller(t, Config{ConfDir: dir, Logger: zap.New(core), RepairWarnCount: 5, RepairWarnWindow: time.Hour})
	startRun(t, in)
	for i := range 7 {
		prev := in.Status().Repairs
		writeAtomic(t, path, orig)
		waitFor(t, in, fmt.Sprintf("repair %d", i), func(s Status) bool { return s.Ready && s.Repairs > prev })
	}
	warns := logs.FilterLevelExact(zapcore.WarnLevel).FilterMessageSnippet("keeps being reverted").Len()
	if warns != 1 {
		t.Errorf("%d warnings, want 1 (once per window)", warns)
	}
	if n := logs.FilterMessage("Repaired the mesh-cni chain entry").Len(); n < 7 {
		t.Errorf("%d repair logs, want 7", n)
	}
}

// The installer's own writes do not feed back into more writes.
func TestRunQuietAfterInstall(t *testing.T) {
	dir := copyCase(t, "single-conf")
	in := newInstaller(t, Config{ConfDir: dir})
	st := startRun(t, in)
	// Trigger a few no-op passes: a chmod-free event on an unrelated file
	// and a resync-like pass through Install.
	writeAtomic(t, filepath.Join(dir, "99-unrelated.conflist"), []byte(`{"cniVersion":"1.0.0","name":"z","plugins":[{"type":"ptp"}]}`))
	if changed, err := in.Install(context.Background()); err != nil || changed {
		t.Errorf("Install = %v, %v", changed, err)
	}
	if now := in.Status(); now.Writes != st.Writes || now.Repairs != 0 {
		t.Errorf("writes %d -> %d, repairs %d", st.Writes, now.Writes, now.Repairs)
	}
	if _, err := os.Stat(filepath.Join(dir, "10-bridge.conf")); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("converted .conf still there: %v", err)
	}
}
