package enroll

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"sync"
	"time"

	"github.com/fsnotify/fsnotify"
	"go.uber.org/zap"

	"github.com/mesh-cni/mesh-cni/internal/agent"
	"github.com/mesh-cni/mesh-cni/pkg/gate/gatepb"
)

// Defaults of FileConfig.
const (
	DefaultFileDebounce = 100 * time.Millisecond
	DefaultFileResync   = 30 * time.Second
)

// FileConfig configures a FileSource.
type FileConfig struct {
	// Path of the policy file. Its directory must exist; the file itself may
	// appear later (the agent is not ready until it does).
	Path string
	// Profile is used when the file names none; default mesh-cni.
	Profile string
	Logger  *zap.Logger
	// Debounce is how long after the last change event the file is read, so a
	// write in several steps is read once, whole. Default DefaultFileDebounce.
	Debounce time.Duration
	// Resync re-reads the file this often even without an event (events can be
	// lost, e.g. on an inotify queue overflow). Default DefaultFileResync.
	Resync time.Duration
}

// FileSource is the standalone enrollment source: a policy file, watched and
// reloaded on change without a restart. An edit that does not parse or
// validate is logged and ignored: the last good policy stays in force. It
// implements agent.Policy and the agent's optional PolicyWatcher and
// PolicySyncer interfaces.
type FileSource struct {
	cfg     FileConfig
	log     *zap.Logger
	watcher *fsnotify.Watcher
	changed *notifier
	cancel  context.CancelFunc
	done    chan struct{}

	mu      sync.Mutex
	policy  *filePolicy // nil until a good policy was read
	raw     []byte      // the bytes last read, good or bad
	readErr error       // why the bytes last read are not in force; nil when they are
}

var (
	_ agent.Policy        = (*FileSource)(nil)
	_ agent.PolicyWatcher = (*FileSource)(nil)
	_ agent.PolicySyncer  = (*FileSource)(nil)
)

// StartFileSource reads the policy file and watches it until ctx is cancelled
// or Close is called. A missing or invalid file at start is not an error here:
// the source reports itself not synced, with the reason, until a good file is
// read. Only a missing directory (nothing to watch) fails.
func StartFileSource(ctx context.Context, cfg FileConfig) (*FileSource, error) {
	if cfg.Path == "" {
		return nil, errors.New("enrollment policy file: no path given")
	}
	if _, err := ProfileSelectors(cfg.Profile); err != nil {
		return nil, err
	}
	if cfg.Logger == nil {
		cfg.Logger = zap.NewNop()
	}
	if cfg.Debounce <= 0 {
		cfg.Debounce = DefaultFileDebounce
	}
	if cfg.Resync <= 0 {
		cfg.Resync = DefaultFileResync
	}
	abs, err := filepath.Abs(cfg.Path)
	if err != nil {
		return nil, fmt.Errorf("enrollment policy file %s: %w", cfg.Path, err)
	}
	cfg.Path = abs
	w, err := fsnotify.NewWatcher()
	if err != nil {
		return nil, fmt.Errorf("watch enrollment policy file: %w", err)
	}
	// The directory, not the file: editors and ConfigMap volumes replace the
	// file by rename (a ConfigMap swaps its ..data symlink), which a watch on
	// the file itself would lose.
	if err := w.Add(filepath.Dir(abs)); err != nil {
		w.Close()
		return nil, fmt.Errorf("watch directory of enrollment policy file %s: %w", abs, err)
	}
	ctx, cancel := context.WithCancel(ctx)
	f := &FileSource{
		cfg:     cfg,
		log:     cfg.Logger.With(zap.String("policy_file", abs)),
		watcher: w,
		changed: newNotifier(),
		cancel:  cancel,
		done:    make(chan struct{}),
	}
	f.reload()
	go f.run(ctx)
	return f, nil
}

// Close stops watching and waits until the watcher is gone. Decide keeps
// answering from the last good policy.
func (f *FileSource) Close() error {
	f.cancel()
	<-f.done
	return nil
}

func (f *FileSource) run(ctx context.Context) {
	defer close(f.done)
	defer f.watcher.Close()
	debounce := time.NewTimer(time.Hour)
	debounce.Stop()
	resync := time.NewTicker(f.cfg.Resync)
	defer resync.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case _, ok := <-f.watcher.Events:
			if !ok {
				return
			}
			// Any event in the directory may concern the file (symlink swaps,
			// renames over it); reading it is cheap and unchanged bytes are
			// ignored.
			debounce.Reset(f.cfg.Debounce)
		case err, ok := <-f.watcher.Errors:
			if !ok {
				return
			}
			f.log.Warn("watching the enrollment policy file: re-reading it", zap.Error(err))
			debounce.Reset(f.cfg.Debounce)
		case <-debounce.C:
			f.reload()
		case <-resync.C:
			f.reload()
		}
	}
}

// reload reads the file and puts it in force if it is new and valid.
func (f *FileSource) reload() {
	data, err := os.ReadFile(f.cfg.Path)
	f.mu.Lock()
	defer f.mu.Unlock()
	if err != nil {
		if errors.Is(err, fs.ErrNotExist) {
			err = fmt.Errorf("enrollment policy file %s does not exist", f.cfg.Path)
		}
		f.reject(err)
		// Whatever appears next is new, even if it has the old bytes.
		f.raw = nil
		return
	}
	if f.raw != nil && bytes.Equal(data, f.raw) {
		return
	}
	f.raw = data
	p, err := parsePolicy(data, f.cfg.Profile)
	if err != nil {
		f.reject(fmt.Errorf("enrollment policy file %s rejected: %w", f.cfg.Path, err))
		return
	}
	f.policy, f.readErr = p, nil
	f.log.Info("enrollment policy loaded",
		zap.String("profile", p.selectors.Profile),
		zap.Int("namespaces", len(p.spec.Namespaces)),
		zap.Int("pods", len(p.spec.Pods)),
		zap.Int("exclude", len(p.spec.Exclude)))
	f.changed.notify()
}

// reject records why the file on disk is not in force; called with f.mu held.
func (f *FileSource) reject(err error) {
	same := f.readErr != nil && f.readErr.Error() == err.Error()
	f.readErr = err
	if same {
		return // logged already: the periodic re-read must not repeat it
	}
	if f.policy != nil {
		f.log.Error("invalid enrollment policy edit ignored: the last good policy stays in force", zap.Error(err))
	} else {
		f.log.Error("no enrollment policy in force: pods wait at the gate until a valid policy file is written", zap.Error(err))
	}
}

// Decide implements agent.Policy.
func (f *FileSource) Decide(_ context.Context, pod *gatepb.PodIdentity) (agent.Decision, error) {
	f.mu.Lock()
	p, readErr := f.policy, f.readErr
	f.mu.Unlock()
	if p == nil {
		if readErr == nil {
			readErr = errors.New("the policy file was not read yet")
		}
		return agent.Decision{}, fmt.Errorf("no enrollment policy in force yet: %w", readErr)
	}
	return p.decide(pod), nil
}

// Changed implements agent.PolicyWatcher: the channel is closed whenever a new
// policy is put in force.
func (f *FileSource) Changed() <-chan struct{} { return f.changed.wait() }

// Synced implements agent.PolicySyncer: true once a good policy was read.
func (f *FileSource) Synced() (bool, string) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.policy != nil {
		return true, ""
	}
	if f.readErr != nil {
		return false, f.readErr.Error()
	}
	return false, "enrollment policy file not read yet"
}

// Err is why the file on disk is not in force (nil when it is): an invalid
// edit, or a missing file. The last good policy still answers.
func (f *FileSource) Err() error {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.readErr
}
