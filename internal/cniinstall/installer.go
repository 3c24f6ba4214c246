// Package cniinstall puts mesh-cni into a node's CNI configuration and keeps it
// there.
//
// InstallBinary copies the plugin into the CNI bin directories. An Installer
// adds the mesh-cni entry as the last plugin of the primary CNI's config (chain
// mode) or writes a merged copy that sorts first (owned mode), repairs it when
// the primary rewrites its file (Run), reports readiness, and takes everything
// out again (Remove).
//
// # Which config is the primary
//
// Runtimes list the CNI config directory, sort the ".conf", ".conflist" and
// ".json" names lexically and use the first one (".conflist" as a list, the
// others as a single plugin converted to a list). CRI-O skips files that do not
// load; containerd fails the whole load instead (no network until the file is
// fixed). Either way, whenever pod networking works the runtime uses the first
// file that loads, so that is the primary here: the installer loads the files
// with libcni, skips those that fail (logging why, once per file and reason)
// and never takes a file named like its own owned config
// ("*-mesh-cni.conflist") as the primary. Config.PrimaryFile overrides the
// choice for runtimes told which network to use.
//
// # What a runtime can see
//
// Every file is replaced atomically (temporary file in the same directory with
// an extension no runtime loads, fsync, rename, fsync of the directory), so a
// reader sees a complete old or a complete new file, never a partial one.
// Multi-file changes are ordered so that the runtime's choice is always a
// whole, correct network:
//
//   - converting "x.conf" (or "x.json"): "x.conflist" is written first, then
//     "x.conf" removed. In between, "x.conf" still sorts first and the runtime
//     uses the primary's original network without mesh-cni (unmeshed for that
//     instant, never broken). Remove reverses it: "x.conf" comes back first,
//     then "x.conflist" goes.
//   - owned mode: the owned file is written (or renamed to a name that sorts
//     first) before stale owned files are removed.
//   - the entry moving to another primary: the new primary gets it before the
//     old one is restored.
//
// Before each rename the installer re-reads the file it is replacing and gives
// up (and retries) when someone rewrote it since it was read, so it does not
// overwrite a concurrent edit by the primary's agent with stale content; only
// the microseconds between that check and the rename remain unprotected. A
// primary that rewrites its file in place (truncate, write) can be caught half
// written; the installer then sees an invalid file, as a runtime would, and
// the next event (the end of the write) brings another pass.
//
// # Uninstall
//
// Remove restores the primary's exact original bytes (and name, mode, owner)
// when nothing but the entry changed since it was added: the original is kept
// in a record in Config.StateDir (or in memory without one), saved before every
// write. When the primary changed its file meanwhile, or the original is not
// known (the entry was already there when the installer first saw the file and
// no record says what it was), Remove only takes the mesh-cni plugin out,
// keeping everything else.
package cniinstall

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"time"

	"go.uber.org/zap"

	"github.com/mesh-cni/mesh-cni/internal/cniinstall/cniconf"
)

// ErrNoPrimary is returned (wrapped) while the config directory has no valid
// primary CNI config to chain onto.
var ErrNoPrimary = errors.New("no primary CNI config")

// errChanged means a file changed while the installer was writing; the pass is
// retried.
var errChanged = errors.New("file changed during the update")

// Installer installs and maintains the mesh-cni chain entry in one CNI config
// directory. Its methods are safe for concurrent use, but Remove while Run is
// active would be undone by Run: stop Run first.
type Installer struct {
	cfg   Config
	entry cniconf.Entry
	log   *zap.Logger

	// mu serializes passes over the directory and guards the fields below.
	mu        sync.Mutex
	rec       record
	recLoaded bool
	saved     []byte            // the record as last written to StateDir
	hadFile   bool              // a record file exists in StateDir (saved may be nil)
	skipped   map[string]string // invalid file -> reason last logged
	wasReady  bool              // the entry has been in place at least once
	recent    []time.Time       // repair times within RepairWarnWindow
	lastWarn  time.Time

	smu     sync.Mutex
	status  Status
	changed chan struct{}
}

// New checks cfg and returns an Installer. It touches no file.
func New(cfg Config) (*Installer, error) {
	cfg.applyDefaults()
	if err := cfg.validate(); err != nil {
		return nil, err
	}
	e, err := cniconf.NewEntry(cfg.Entry)
	if err != nil {
		return nil, fmt.Errorf("install: %w", err)
	}
	return &Installer{
		cfg:     cfg,
		entry:   e,
		log:     cfg.Logger.With(zap.String("confDir", cfg.ConfDir), zap.Stringer("mode", cfg.Mode)),
		skipped: map[string]string{},
		status:  Status{Mode: cfg.Mode, Reason: "not installed yet"},
		changed: make(chan struct{}),
	}, nil
}

// Install makes one pass: it finds the primary config and writes whatever is
// needed for the entry to be in place. changed reports whether a file was
// written or removed. It returns an error wrapping ErrNoPrimary when there is
// no primary config yet (Run waits for one instead).
func (in *Installer) Install(ctx context.Context) (changed bool, err error) {
	in.mu.Lock()
	defer in.mu.Unlock()
	// A concurrent writer can make a pass give up (errChanged); the next pass
	// sees its result.
	for attempt := 0; ; attempt++ {
		c, err := in.pass(ctx, true)
		changed = changed || c
		if !errors.Is(err, errChanged) || attempt == 4 {
			return changed, err
		}
	}
}

// check refreshes the status without writing anything.
func (in *Installer) check(ctx context.Context) {
	in.mu.Lock()
	defer in.mu.Unlock()
	_, _ = in.pass(ctx, false)
}

// pass plans and, when write is set, applies. It updates the status.
func (in *Installer) pass(ctx context.Context, write bool) (changed bool, err error) {
	if err := ctx.Err(); err != nil {
		return false, err
	}
	in.loadRecord()
	p, err := in.plan()
	if err != nil {
		in.setNotReady(p, err.Error())
		return false, err
	}
	if !write {
		if p.reason == "" && p.primary != nil {
			in.setReady(p)
		} else {
			in.setNotReady(p, p.reasonOrNoPrimary())
		}
		return false, nil
	}
	changed, err = in.apply(p)
	if changed {
		in.updateStatus(func(s *Status) { s.Writes++ })
	}
	if err != nil {
		in.setNotReady(p, err.Error())
		return changed, err
	}
	if p.primary == nil {
		in.setNotReady(p, p.reasonOrNoPrimary())
		return changed, fmt.Errorf("%w in %s", ErrNoPrimary, in.cfg.ConfDir)
	}
	if changed && p.reason != "" && in.wasReady {
		in.countRepair(p.reason)
	}
	in.setReady(p)
	return changed, nil
}

func (in *Installer) setReady(p *plan) {
	in.wasReady = true
	in.updateStatus(func(s *Status) {
		s.Ready, s.Reason = true, ""
		s.Primary, s.File, s.Network = p.primary.name, p.target, ""
		if p.primary.list != nil {
			s.Network = p.primary.list.Name
		}
	})
}

func (in *Installer) setNotReady(p *plan, reason string) {
	in.updateStatus(func(s *Status) {
		s.Ready, s.Reason = false, reason
		if p != nil {
			s.Primary, s.File = "", p.target
			if p.primary != nil {
				s.Primary = p.primary.name
			}
		}
	})
}
