package cniinstall

import (
	"context"
	"time"

	"go.uber.org/zap"
)

// Status is the installer's view of the CNI config directory.
type Status struct {
	// Ready is true while the file the runtime loads carries the mesh-cni
	// entry as its last plugin. False before the first install, while no
	// primary config exists, while the entry is missing (until repaired) and
	// after Remove.
	Ready bool
	// Mode is the installation mode.
	Mode Mode
	// Primary is the base name of the primary CNI's config file ("" when none).
	Primary string
	// File is the base name of the file carrying the entry.
	File string
	// Network is the network name of the chain carrying the entry: what the
	// runtime passes as CNI's network name for pods set up with it.
	Network string
	// Reason says why the installer is not ready ("" when ready).
	Reason string
	// Repairs counts how often the entry was put back after it had been in
	// place (initial installation does not count); LastRepair is when that
	// last happened.
	Repairs    uint64
	LastRepair time.Time
	// Writes counts the passes that wrote or removed a file (installation,
	// repairs, clean-up).
	Writes uint64
}

// Status returns the current status.
func (in *Installer) Status() Status {
	in.smu.Lock()
	defer in.smu.Unlock()
	return in.status
}

// Ready reports whether the runtime's config carries the mesh-cni entry.
func (in *Installer) Ready() bool { return in.Status().Ready }

// Changed returns a channel that is closed at the next change of Status. Take
// the channel before reading Status to not miss a change in between:
//
//	for ch := in.Changed(); !cond(in.Status()); ch = in.Changed() { <-ch }
func (in *Installer) Changed() <-chan struct{} {
	in.smu.Lock()
	defer in.smu.Unlock()
	return in.changed
}

// WaitReady blocks until Ready is true or ctx ends.
func (in *Installer) WaitReady(ctx context.Context) error {
	for {
		ch := in.Changed()
		if in.Ready() {
			return nil
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-ch:
		}
	}
}

// updateStatus applies fn to the status and, when that changed anything,
// wakes waiters and calls OnChange.
func (in *Installer) updateStatus(fn func(*Status)) {
	in.smu.Lock()
	old := in.status
	fn(&in.status)
	st := in.status
	if st == old {
		in.smu.Unlock()
		return
	}
	close(in.changed)
	in.changed = make(chan struct{})
	in.smu.Unlock()
	if st.Ready != old.Ready {
		if st.Ready {
			in.log.Info("mesh-cni chain entry in place", zap.String("file", st.File), zap.String("primary", st.Primary))
		} else {
			in.log.Info("mesh-cni chain entry not in place", zap.String("reason", st.Reason))
		}
	}
	if in.cfg.OnChange != nil {
		in.cfg.OnChange(st)
	}
}

// countRepair records one repair and warns when repairs come too often:
// something (usually the primary CNI's own agent) keeps reverting the config,
// and until that stops pods created in each short window start unmeshed.
func (in *Installer) countRepair(reason string) {
	now := time.Now()
	cutoff := now.Add(-in.cfg.RepairWarnWindow)
	kept := in.recent[:0]
	for _, t := range in.recent {
		if t.After(cutoff) {
			kept = append(kept, t)
		}
	}
	in.recent = append(kept, now)
	st := in.Status()
	in.log.Info("Repaired the mesh-cni chain entry", zap.String("reason", reason), zap.String("file", st.File), zap.Uint64("repairs", st.Repairs+1))
	if len(in.recent) > in.cfg.RepairWarnCount && now.Sub(in.lastWarn) >= in.cfg.RepairWarnWindow {
		in.lastWarn = now
		in.log.Warn("The CNI config keeps being reverted; another agent is probably rewriting it (consider the owned-config mode)",
			zap.Int("repairs", len(in.recent)), zap.Duration("within", in.cfg.RepairWarnWindow), zap.String("file", st.File))
	}
	in.updateStatus(func(s *Status) {
		s.Repairs++
		s.LastRepair = now
	})
}
