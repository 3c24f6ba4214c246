package cniinstall

import (
	"context"
	"errors"
	"fmt"
	"math"
	"os"
	"path/filepath"
	"time"

	"github.com/fsnotify/fsnotify"
	"go.uber.org/zap"
	"k8s.io/apimachinery/pkg/util/wait"

	"github.com/mesh-cni/mesh-cni/internal/cniinstall/cniconf"
)

// Back-off after failed passes: doubling from firstRetryDelay, capped at
// maxRetryDelay, reset by a pass that succeeds or finds no primary to chain
// onto.
const (
	firstRetryDelay = 100 * time.Millisecond
	maxRetryDelay   = 5 * time.Second
)

// retryDelays is a fresh back-off sequence.
func retryDelays() wait.DelayFunc {
	return wait.Backoff{Duration: firstRetryDelay, Factor: 2, Cap: maxRetryDelay, Steps: math.MaxInt32}.DelayFunc()
}

// Run installs the entry and keeps it in place until ctx ends: it watches
// ConfDir and, shortly after any change to a config file (the primary
// rewriting its file, the entry being removed, a new file that sorts first),
// makes another pass. While no primary config exists it waits for one. It
// returns nil when ctx ends, leaving the entry in place (a restarting agent
// keeps new pods waiting rather than unmeshed); use Remove to uninstall.
//
// Run never loops on its own writes: a pass writes only when a file differs
// from what it should be, so the events caused by a write lead to one more
// pass that finds everything in place and writes nothing.
func (in *Installer) Run(ctx context.Context) error {
	if err := os.MkdirAll(in.cfg.ConfDir, 0o755); err != nil {
		return fmt.Errorf("create CNI config directory: %w", err)
	}
	w, err := fsnotify.NewWatcher()
	if err != nil {
		return fmt.Errorf("watch CNI config directory: %w", err)
	}
	defer w.Close()
	if err := w.Add(in.cfg.ConfDir); err != nil {
		return fmt.Errorf("watch CNI config directory: %w", err)
	}
	in.log.Info("Watching the CNI config directory")

	l := loop{in: in, timer: time.NewTimer(0), armed: true} // first pass at once
	defer l.timer.Stop()
	resync := time.NewTicker(in.cfg.Resync)
	defer resync.Stop()

	for {
		select {
		case <-ctx.Done():
			return nil
		case ev, ok := <-w.Events:
			if !ok {
				return errors.New("CNI config directory watcher closed")
			}
			if filepath.Clean(ev.Name) == in.cfg.ConfDir && ev.Has(fsnotify.Remove|fsnotify.Rename) {
				// The directory itself went away: watch it again once it
				// is back (the resync ticker and retries cover the wait).
				in.log.Warn("CNI config directory removed")
				in.check(ctx)
				l.retryLater(in.cfg.Debounce)
				continue
			}
			if !in.relevant(ev) {
				continue
			}
			// Readiness follows at once; the repair after the debounce.
			in.check(ctx)
			l.changed()
		case err, ok := <-w.Errors:
			if !ok {
				return errors.New("CNI config directory watcher closed")
			}
			// Usually an event queue overflow: events were lost, so look.
			in.log.Warn("CNI config directory watcher error; re-checking", zap.Error(err))
			l.changed()
		case <-resync.C:
			l.retryLater(0)
		case <-l.timer.C:
			l.pending = false
			l.armed = false
			if err := in.rewatch(w); err != nil {
				l.failed(ctx, err)
				continue
			}
			if _, err := in.Install(ctx); err != nil {
				l.failed(ctx, err)
				continue
			}
			l.succeeded()
		}
	}
}

// relevant tells whether an event can change which config the runtime loads
// or what it contains. The installer's own temporary files end in ".tmp",
// and chmod-only events change nothing a runtime reads.
func (in *Installer) relevant(ev fsnotify.Event) bool {
	if ev.Op == fsnotify.Chmod {
		return false
	}
	return cniconf.KindOf(filepath.Base(ev.Name)) != cniconf.KindNone
}

// rewatch adds the directory again when it was removed and recreated.
func (in *Installer) rewatch(w *fsnotify.Watcher) error {
	for _, p := range w.WatchList() {
		if filepath.Clean(p) == in.cfg.ConfDir {
			return nil
		}
	}
	if err := os.MkdirAll(in.cfg.ConfDir, 0o755); err != nil {
		return fmt.Errorf("create CNI config directory: %w", err)
	}
	if err := w.Add(in.cfg.ConfDir); err != nil {
		return fmt.Errorf("watch CNI config directory: %w", err)
	}
	in.log.Info("Watching the CNI config directory again")
	return nil
}

// loop is Run's timer state: a debounce after changes, bounded by MaxDelay
// from the first change, and a back-off after failures.
type loop struct {
	in      *Installer
	timer   *time.Timer
	armed   bool           // timer set for a pass
	pending bool           // a change is waiting for the debounce
	first   time.Time      // when the pending change arrived
	retry   wait.DelayFunc // nil: no failure since the last success
	lastErr string
}

// changed debounces: the pass runs Debounce after the latest change, but no
// later than MaxDelay after the first one, so a steady stream of changes
// cannot postpone the repair.
func (l *loop) changed() {
	now := time.Now()
	if !l.pending {
		l.pending = true
		l.first = now
	}
	delay := l.in.cfg.Debounce
	if deadline := l.first.Add(l.in.cfg.MaxDelay); now.Add(delay).After(deadline) {
		delay = max(deadline.Sub(now), 0)
	}
	l.set(delay)
}

// retryLater schedules a pass after d unless one is due sooner.
func (l *loop) retryLater(d time.Duration) {
	if l.armed {
		return
	}
	l.set(d)
}

func (l *loop) set(d time.Duration) {
	l.timer.Stop()
	select {
	case <-l.timer.C:
	default:
	}
	l.timer.Reset(d)
	l.armed = true
}

func (l *loop) failed(ctx context.Context, err error) {
	if ctx.Err() != nil {
		return
	}
	switch {
	case errors.Is(err, ErrNoPrimary):
		// Nothing to do until a config file appears: its event wakes us.
		if l.lastErr != err.Error() {
			l.in.log.Info("Waiting for the primary CNI config", zap.Error(err))
		}
		l.lastErr = err.Error()
		l.retry = nil
		return
	case errors.Is(err, errChanged):
		// Someone wrote while we did; their event is on its way, but do
		// not rely on it.
		l.set(l.in.cfg.Debounce)
		return
	}
	if l.lastErr != err.Error() {
		l.in.log.Error("Cannot install the mesh-cni chain entry; will retry", zap.Error(err))
	}
	l.lastErr = err.Error()
	if l.retry == nil {
		l.retry = retryDelays()
	}
	l.set(l.retry())
}

func (l *loop) succeeded() {
	l.retry = nil
	l.lastErr = ""
}
