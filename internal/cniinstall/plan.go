package cniinstall

import (
	"bytes"
	"errors"
	"fmt"
	"os"
	"path/filepath"

	"github.com/mesh-cni/mesh-cni/internal/atomicfile"
	"github.com/mesh-cni/mesh-cni/internal/cniinstall/cniconf"
)

// plan is what a pass found and what it would change.
type plan struct {
	names   []string   // config file names in ConfDir, sorted
	primary *candidate // nil: none
	target  string     // the file that must carry the entry
	desired []byte     // its content
	current []byte     // its content now (nil: missing)
	opts    atomicfile.Options
	// orig is the primary's file without the entry, for the record (chain).
	orig *original
	// removeConf: the primary is a single-plugin file converted to target;
	// remove it once target is in place.
	removeConf bool
	// removeOwned are owned-config files to delete (stale names, or any of
	// them in chain mode, where they would shadow the primary).
	removeOwned []string
	// reason says what is not in place ("" when nothing is).
	reason string
}

func (p *plan) reasonOrNoPrimary() string {
	if p.primary == nil {
		return "waiting for a primary CNI config"
	}
	return p.reason
}

func (in *Installer) plan() (*plan, error) {
	names, err := in.scan()
	if err != nil {
		return nil, err
	}
	p := &plan{names: names}
	if p.primary, err = in.findPrimary(names); err != nil {
		return p, err
	}
	if p.primary != nil {
		if err := cniconf.CheckVersion(p.primary.list.CNIVersion, in.cfg.MinCNIVersion, in.cfg.MaxCNIVersion); err != nil {
			return p, fmt.Errorf("primary CNI config %s: %w", p.primary.name, err)
		}
	}
	switch in.cfg.Mode {
	case ModeOwned:
		err = in.planOwned(p)
	default:
		err = in.planChain(p)
	}
	if err != nil || p.primary == nil {
		return p, err
	}
	if !bytes.Equal(p.current, p.desired) {
		p.reason = in.describe(p)
	} else if p.removeConf {
		p.reason = fmt.Sprintf("%s is a single-plugin config shadowing %s", p.primary.name, p.target)
	} else if len(p.removeOwned) > 0 {
		p.reason = fmt.Sprintf("stale owned config %s", p.removeOwned[0])
	}
	return p, nil
}

// describe says why the target does not hold the desired bytes.
func (in *Installer) describe(p *plan) string {
	if rec := in.rec.Current; rec != nil && rec.File != p.target {
		return fmt.Sprintf("the entry moves from %s to %s", rec.File, p.target)
	}
	if p.current == nil {
		return fmt.Sprintf("%s is missing", p.target)
	}
	l, err := cniconf.ParseList(p.current)
	switch {
	case err != nil:
		return fmt.Sprintf("%s is not a valid config list", p.target)
	case l.Count(in.entry.Type) == 0:
		return fmt.Sprintf("entry missing from %s", p.target)
	case l.Count(in.entry.Type) > 1:
		return fmt.Sprintf("entry duplicated in %s", p.target)
	case !l.HasEntryLast(in.entry):
		return fmt.Sprintf("entry not last or outdated in %s", p.target)
	default:
		return fmt.Sprintf("%s differs from the merged config", p.target)
	}
}

func (in *Installer) planChain(p *plan) error {
	// Owned configs sort first and would shadow the primary's file.
	for _, n := range p.names {
		if in.cfg.isOwned(n) {
			p.removeOwned = append(p.removeOwned, n)
		}
	}
	pr := p.primary
	if pr == nil {
		return nil
	}
	if pr.link {
		return fmt.Errorf("primary CNI config %s is a symbolic link (managed elsewhere, replacing it would break the link); use the owned-config mode", pr.name)
	}
	if len(pr.filePlugins) > 0 {
		return fmt.Errorf("primary CNI config %s loads plugins from %s, which run after its inline plugins, so mesh-cni cannot be last; use the owned-config mode",
			pr.name, filepath.Join(in.cfg.ConfDir, pr.list.Name))
	}
	p.target = pr.name
	p.opts = pr.options()
	p.current = pr.data
	if pr.kind == cniconf.KindConf {
		if err := in.planConversion(p); err != nil {
			return err
		}
	}
	var err error
	if p.desired, err = pr.list.WithEntry(in.entry).Marshal(); err != nil {
		return err
	}
	p.orig = in.originalOf(p)
	return nil
}

// planConversion handles a single-plugin primary: the merged list is written
// as <name>.conflist and the old file removed after that. Between the two
// steps both files exist; the old one sorts first (".conf" is a prefix of
// ".conflist"), so a runtime reading then still loads the primary's original,
// unchained network (correct, only unmeshed), never a half-converted one.
func (in *Installer) planConversion(p *plan) error {
	pr := p.primary
	p.target = cniconf.ListName(pr.name)
	p.removeConf = true
	p.current = nil
	t, err := in.load(p.target)
	switch {
	case err == nil:
		if t.list.Count(in.entry.Type) == 0 {
			return fmt.Errorf("cannot convert %s to %s: %s exists and is not ours", pr.name, p.target, p.target)
		}
		p.current = t.data
	case errors.Is(err, os.ErrNotExist):
	default:
		return fmt.Errorf("cannot convert %s to %s: %s exists and is not ours (%v)", pr.name, p.target, p.target, err)
	}
	if in.cfg.PrimaryFile != "" {
		return nil
	}
	// A valid file sorting between "x.conf" and "x.conflist" (such as
	// "x.conf.json") would become the runtime's choice after the conversion.
	for _, n := range p.names {
		if n > pr.name && n < p.target && !in.cfg.isOwned(n) {
			if c, _ := in.load(n); c != nil {
				return fmt.Errorf("cannot convert %s to %s: %s would then sort first; rename it or use the owned-config mode", pr.name, p.target, n)
			}
		}
	}
	return nil
}

// originalOf returns the primary's content without the entry when known.
func (in *Installer) originalOf(p *plan) *original {
	pr := p.primary
	if pr.list.Count(in.entry.Type) == 0 {
		return &original{File: pr.name, Data: pr.data, Mode: pr.mode, UID: pr.uid, GID: pr.gid}
	}
	// The file already has an entry: ours from before. The recorded original
	// still holds if nothing but the entry changed since we wrote it.
	rec := in.rec.Current
	if rec != nil && rec.Mode == ModeChain.String() && rec.File == p.target && rec.Original != nil && in.sameWithoutEntry(p.current, rec.Data) {
		return rec.Original
	}
	return nil
}

// sameWithoutEntry reports whether two config lists are equal once the entry
// is taken out of both.
func (in *Installer) sameWithoutEntry(a, b []byte) bool {
	strip := func(d []byte) []byte {
		l, err := cniconf.ParseList(d)
		if err != nil {
			return nil
		}
		l, _ = l.Without(in.entry.Type)
		out, err := l.Marshal()
		if err != nil {
			return nil
		}
		return out
	}
	sa, sb := strip(a), strip(b)
	return sa != nil && sb != nil && cniconf.Equal(sa, sb)
}

func (in *Installer) planOwned(p *plan) error {
	var owned []string
	first := ""
	for _, n := range p.names {
		if in.cfg.isOwned(n) {
			owned = append(owned, n)
		} else if first == "" {
			first = n
		}
	}
	pr := p.primary
	if pr == nil {
		// Without a primary the owned copy would be a network nobody runs.
		p.removeOwned = owned
		return nil
	}
	// Keep the current name while it still sorts first, so a restart or a
	// resync does not rename the file.
	p.target = ""
	if rec := in.rec.Current; rec != nil && rec.Mode == ModeOwned.String() && contains(owned, rec.File) && (first == "" || rec.File < first) {
		p.target = rec.File
	}
	if p.target == "" && len(owned) > 0 && (first == "" || owned[0] < first) {
		p.target = owned[0]
	}
	if p.target == "" {
		p.target = in.cfg.ownedNameBefore(first)
	}
	for _, n := range owned {
		if n != p.target {
			p.removeOwned = append(p.removeOwned, n)
		}
	}
	l := pr.list
	if len(pr.filePlugins) > 0 {
		l = l.Inline(pr.filePlugins)
	}
	var err error
	if p.desired, err = l.WithEntry(in.entry).Marshal(); err != nil {
		return err
	}
	p.opts = pr.options()
	if contains(owned, p.target) {
		data, err := os.ReadFile(filepath.Join(in.cfg.ConfDir, p.target))
		if err != nil && !errors.Is(err, os.ErrNotExist) {
			return fmt.Errorf("read owned config: %w", err)
		}
		p.current = data
	}
	return nil
}

func contains(list []string, s string) bool {
	for _, x := range list {
		if x == s {
			return true
		}
	}
	return false
}
