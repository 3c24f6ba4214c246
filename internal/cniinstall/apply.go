package cniinstall

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"

	"go.uber.org/zap"

	"github.com/mesh-cni/mesh-cni/internal/atomicfile"
	"github.com/mesh-cni/mesh-cni/internal/cniinstall/cniconf"
)

// apply carries out a plan.
func (in *Installer) apply(p *plan) (changed bool, err error) {
	if p.primary != nil {
		next := &written{Mode: in.cfg.Mode.String(), File: p.target, Data: p.desired, Original: p.orig}
		if cur := in.rec.Current; cur != nil && (cur.Mode != next.Mode || cur.File != next.File) {
			in.rec.Stale = append(in.rec.Stale, *cur)
		}
		in.rec.Current = next
		// Saved before writing: see record.
		if err := in.saveRecord(); err != nil {
			return false, err
		}
		if !bytes.Equal(p.current, p.desired) {
			if err := in.writeIfUnchanged(p.target, p.current, p.desired, p.opts); err != nil {
				return false, err
			}
			changed = true
		}
		if p.removeConf {
			c, err := in.removeIfUnchanged(p.primary.name, p.primary.data)
			changed = changed || c
			if err != nil {
				return changed, err
			}
		}
	}
	for _, n := range p.removeOwned {
		if err := atomicfile.Remove(filepath.Join(in.cfg.ConfDir, n)); err != nil {
			return changed, err
		}
		in.log.Info("Removed owned CNI config", zap.String("file", n))
		changed = true
	}
	if p.primary == nil && in.cfg.Mode == ModeOwned && in.rec.Current != nil {
		in.rec.Current = nil
	}
	c, err := in.cleanStale(p)
	changed = changed || c
	if err != nil {
		return changed, err
	}
	return changed, in.saveRecord()
}

// cleanStale takes the entry out of files that no longer need it.
func (in *Installer) cleanStale(p *plan) (changed bool, err error) {
	var keep []written
	for _, w := range in.rec.Stale {
		if w.File == p.target || (w.Original != nil && w.Original.File == p.target) {
			// The same file is in use again; nothing to undo.
			continue
		}
		c, err := in.undo(w)
		changed = changed || c
		if err != nil {
			in.log.Warn("Cannot clean up a file that carried the mesh-cni entry", zap.String("file", w.File), zap.Error(err))
			keep = append(keep, w)
		}
	}
	in.rec.Stale = keep
	return changed, nil
}

// undo takes the entry out of one file the installer wrote: an owned config
// is deleted; a primary's file gets its original bytes back when nothing but
// the entry changed since, else only the entry is taken out.
func (in *Installer) undo(w written) (changed bool, err error) {
	path := filepath.Join(in.cfg.ConfDir, w.File)
	if w.Mode == ModeOwned.String() {
		if !in.cfg.isOwned(w.File) {
			return false, fmt.Errorf("record names %s as owned config, which is not an owned name", w.File)
		}
		if _, err := os.Lstat(path); errors.Is(err, os.ErrNotExist) {
			return false, nil
		}
		return true, atomicfile.Remove(path)
	}
	cur, err := os.ReadFile(path)
	if errors.Is(err, os.ErrNotExist) {
		// The primary removed its file: nothing of ours is left, and bringing
		// the file back would resurrect a network.
		return false, nil
	}
	if err != nil {
		return false, fmt.Errorf("read %s: %w", w.File, err)
	}
	if o := w.Original; o != nil && in.sameWithoutEntry(cur, w.Data) {
		if err := in.restore(o, w.File, cur); err != nil {
			return false, err
		}
		in.log.Info("Restored the primary CNI config to its original bytes", zap.String("file", o.File))
		return true, nil
	}
	return in.stripFile(w.File)
}

// restore writes the original file back and, when it was converted, removes
// the ".conflist" made from it. The original goes back first: it sorts before
// the ".conflist", so a runtime sees the original as soon as it exists.
func (in *Installer) restore(o *original, file string, cur []byte) error {
	opath := filepath.Join(in.cfg.ConfDir, o.File)
	if o.File == file {
		return in.writeIfUnchanged(o.File, cur, o.Data, o.options())
	}
	existing, err := os.ReadFile(opath)
	switch {
	case errors.Is(err, os.ErrNotExist):
		if err := atomicfile.WriteFile(opath, o.Data, o.options()); err != nil {
			return err
		}
	case err != nil:
		return fmt.Errorf("read %s: %w", o.File, err)
	case !bytes.Equal(existing, o.Data):
		// The primary wrote a new single-plugin file meanwhile: that one is
		// current; just drop the converted copy.
	}
	_, err = in.removeIfUnchanged(file, cur)
	return err
}

// stripFile takes every plugin of the entry's type out of a config list.
func (in *Installer) stripFile(name string) (bool, error) {
	c, err := in.load(name)
	if errors.Is(err, os.ErrNotExist) {
		return false, nil
	}
	if err != nil {
		return false, fmt.Errorf("cannot take the entry out of %s: %w", name, err)
	}
	l, found := c.list.Without(in.entry.Type)
	if !found {
		return false, nil
	}
	if len(l.Plugins)+len(c.filePlugins) == 0 {
		return false, fmt.Errorf("cannot take the entry out of %s: it is the only plugin", name)
	}
	out, err := l.Marshal()
	if err != nil {
		return false, err
	}
	if err := in.writeIfUnchanged(name, c.data, out, c.options()); err != nil {
		return false, err
	}
	in.log.Info("Took the mesh-cni entry out of a CNI config", zap.String("file", name))
	return true, nil
}

// writeIfUnchanged atomically replaces name with data unless its content is no
// longer prev (nil: the file must not exist), in which case it returns an
// error wrapping errChanged.
func (in *Installer) writeIfUnchanged(name string, prev, data []byte, opts atomicfile.Options) error {
	path := filepath.Join(in.cfg.ConfDir, name)
	opts.BeforeRename = func() error { return unchanged(path, prev) }
	err := atomicfile.WriteFile(path, data, opts)
	if errors.Is(err, atomicfile.ErrAborted) {
		return err
	}
	if err != nil {
		return fmt.Errorf("write %s: %w", name, err)
	}
	return nil
}

// removeIfUnchanged removes name if it still holds prev.
func (in *Installer) removeIfUnchanged(name string, prev []byte) (bool, error) {
	path := filepath.Join(in.cfg.ConfDir, name)
	if err := unchanged(path, prev); err != nil {
		if errors.Is(err, os.ErrNotExist) {
			return false, nil
		}
		return false, err
	}
	if err := atomicfile.Remove(path); err != nil {
		return false, err
	}
	return true, nil
}

func unchanged(path string, prev []byte) error {
	now, err := os.ReadFile(path)
	if errors.Is(err, os.ErrNotExist) {
		if prev == nil {
			return nil
		}
		return fmt.Errorf("%s: %w (removed): %w", path, errChanged, err)
	}
	if err != nil {
		return fmt.Errorf("re-read %s: %w", path, err)
	}
	if prev == nil || !bytes.Equal(now, prev) {
		return fmt.Errorf("%s: %w", path, errChanged)
	}
	return nil
}

// Remove uninstalls: the entry comes out of every config file that has it
// (the primary's file gets its exact original bytes back when nothing else
// changed it since the entry was added, and a converted ".conf" comes back
// under its old name), owned configs are deleted, and the record is
// dropped. The plugin binary stays (a pod being deleted may still need it for
// DEL). Stop Run before calling Remove.
func (in *Installer) Remove(ctx context.Context) error {
	in.mu.Lock()
	defer in.mu.Unlock()
	if err := ctx.Err(); err != nil {
		return err
	}
	in.loadRecord()
	var errs []error
	todo := append([]written(nil), in.rec.Stale...)
	if in.rec.Current != nil {
		todo = append(todo, *in.rec.Current)
	}
	in.rec.Stale = nil
	in.rec.Current = nil
	for _, w := range todo {
		if _, err := in.undo(w); err != nil {
			errs = append(errs, err)
			in.rec.Stale = append(in.rec.Stale, w)
		}
	}
	// Whatever the record did not cover (no StateDir across a restart, a
	// lost record): every owned config, and the entry in any other file.
	names, err := in.scan()
	if err != nil {
		errs = append(errs, err)
	}
	for _, n := range names {
		if err := ctx.Err(); err != nil {
			errs = append(errs, err)
			break
		}
		if in.cfg.isOwned(n) {
			if err := atomicfile.Remove(filepath.Join(in.cfg.ConfDir, n)); err != nil {
				errs = append(errs, err)
			}
			continue
		}
		if cniconf.KindOf(n) != cniconf.KindList {
			continue
		}
		// Files a runtime would not load are not ours to fix.
		if c, err := in.load(n); err != nil || c.list.Count(in.entry.Type) == 0 {
			continue
		}
		if _, err := in.stripFile(n); err != nil {
			errs = append(errs, err)
		}
	}
	if err := in.saveRecord(); err != nil {
		errs = append(errs, err)
	}
	in.wasReady = false
	in.updateStatus(func(s *Status) {
		s.Ready, s.Reason, s.File = false, "removed", ""
	})
	return errors.Join(errs...)
}
