package runtimecni

import (
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"slices"
	"strings"

	"github.com/mesh-cni/mesh-cni/internal/hostproc"
)

// Want is what the agent was told about its CNI directories: the flags'
// values, as paths the agent opens (in a DaemonSet, its mounts), and which of
// them the operator set.
type Want struct {
	BinDirs []string
	ConfDir string
	// ExplicitBin and ExplicitConf: the operator named the directory. It
	// wins: the agent installs there, wherever the runtime loads from (a
	// meta plugin such as Multus may read another directory than the
	// runtime; the agent cannot tell), and Place.Notes says when the runtime
	// does not load from it.
	ExplicitBin, ExplicitConf bool
	// Check installs into the flags' directories only, and only once the
	// runtime loads CNI from them (--runtime-cni-check): never through the
	// host's root.
	Check bool
}

// Via says how the agent reaches a directory it installs into.
type Via string

const (
	// ViaFlag: the directory the operator named (Want.ExplicitBin,
	// ExplicitConf).
	ViaFlag Via = "flag"
	// ViaMount: the flag's directory (its default) is the runtime's own:
	// the same directory, whatever the names.
	ViaMount Via = "mount"
	// ViaHostRoot: the runtime's directory, reached through the host's root
	// (/proc/1/root), because the flag's directory is not it.
	ViaHostRoot Via = "host root"
	// ViaDefault: no runtime was found or read; the flag's default.
	ViaDefault Via = "default"
)

// Place is where the agent installs the plugin and its chain entry: the
// directories as the agent reaches them, and why there.
type Place struct {
	BinDirs  []string
	ConfDir  string
	Bin      Via
	Conf     Via
	Runtime  *Dirs
	Refused  []hostproc.Refusal
	Notes    []string
	procRoot string
}

func (p Place) String() string {
	s := fmt.Sprintf("the plugin into %s (%s), the chain entry into %s (%s)", strings.Join(p.BinDirs, ", "), p.Bin, p.ConfDir, p.Conf)
	if p.Runtime != nil {
		s += "; " + p.Runtime.String()
	}
	return s
}

// Decide finds the node's container runtime (FindAll) and says where the
// agent installs, directory by directory:
//
//   - a directory the operator named (Want.Explicit*) is used as named;
//   - with Want.Check, the flags' directories, and an error (the agent
//     stays not ready) while the runtime does not load CNI from them;
//   - otherwise the runtime's own: through the flag's directory when it is
//     that directory (the DaemonSet mounts the platform's there), else
//     through the host's root, PID 1's, which the agent reaches in the host's
//     PID namespace; an error while that directory is missing or is another
//     one in PID 1's mount namespace than in the runtime's;
//   - with no runtime found or read, the flags' directories, and a note.
//
// Several runtimes that load from different directories are an error unless
// the flags' directories are one's.
func Decide(proc hostproc.Procfs, w Want) (Place, error) {
	p := Place{BinDirs: w.BinDirs, ConfDir: w.ConfDir, Bin: ViaFlag, Conf: ViaFlag, procRoot: proc.Root}
	runtimes, refused, err := FindAll(proc)
	p.Refused = refused
	if len(runtimes) == 0 {
		if !w.ExplicitBin {
			p.Bin = ViaDefault
		}
		if !w.ExplicitConf {
			p.Conf = ViaDefault
		}
		if p.Bin == ViaDefault || p.Conf == ViaDefault {
			p.Notes = append(p.Notes, fmt.Sprintf("the container runtime's CNI directories are unknown (%v): installing into %s and %s, the flags' directories", err, strings.Join(w.BinDirs, ", "), w.ConfDir))
		}
		return p, nil
	}
	if err != nil {
		p.Notes = append(p.Notes, "a container runtime's CNI directories could not be read: "+err.Error())
	}
	if w.Check {
		if why := Serves(runtimes, w.BinDirs, w.ConfDir); why != "" {
			return p, errors.New(why)
		}
		p.Runtime = &runtimes[slices.IndexFunc(runtimes, func(d Dirs) bool { return d.Mismatch(w.BinDirs, w.ConfDir) == "" })]
		p.Bin, p.Conf = ViaMount, ViaMount
		return p, nil
	}
	r, err := theRuntime(runtimes, w)
	if err != nil {
		return p, err
	}
	p.Runtime = &r

	if w.ExplicitConf {
		if !r.same(r.ConfDir, w.ConfDir) {
			p.Notes = append(p.Notes, fmt.Sprintf("--cni-conf-dir %s, as set, is not %s, where %s loads configs from: only a meta plugin that reads it runs the chain entry", w.ConfDir, r.ConfDir, r.Runtime))
		}
	} else if r.same(r.ConfDir, w.ConfDir) {
		p.Conf = ViaMount
	} else {
		dir, err := p.hostDir(r, r.ConfDir)
		if err != nil {
			return p, fmt.Errorf("%s loads CNI configs from %s, which the agent cannot reach: %w", r.Runtime, r.ConfDir, err)
		}
		p.ConfDir, p.Conf = dir, ViaHostRoot
	}

	if w.ExplicitBin {
		if !slices.ContainsFunc(w.BinDirs, func(b string) bool { return r.binDir(b) }) {
			p.Notes = append(p.Notes, fmt.Sprintf("--cni-bin-dir %s, as set, is none of %s, where %s loads plugins from", strings.Join(w.BinDirs, ", "), strings.Join(r.BinDirs, ", "), r.Runtime))
		}
		return p, nil
	}
	if mounted := slices.DeleteFunc(slices.Clone(w.BinDirs), func(b string) bool { return !r.binDir(b) }); len(mounted) > 0 {
		p.BinDirs, p.Bin = mounted, ViaMount
		return p, nil
	}
	// The runtime looks for a plugin in its directories in order: its first
	// that exists is where it finds mesh-cni.
	var errs []error
	for _, b := range r.BinDirs {
		dir, err := p.hostDir(r, b)
		if err == nil {
			p.BinDirs, p.Bin = []string{dir}, ViaHostRoot
			return p, nil
		}
		errs = append(errs, err)
	}
	return p, fmt.Errorf("%s loads CNI plugins from %s, which the agent cannot reach: %w", r.Runtime, strings.Join(r.BinDirs, ", "), errors.Join(errs...))
}

// theRuntime is the runtime whose directories the agent installs into: the
// only one, or the one of several whose directories the flags' are, or the
// first when all load from the same directories.
func theRuntime(runtimes []Dirs, w Want) (Dirs, error) {
	if len(runtimes) == 1 {
		return runtimes[0], nil
	}
	for _, r := range runtimes {
		if r.Mismatch(w.BinDirs, w.ConfDir) == "" {
			return r, nil
		}
	}
	for _, r := range runtimes[1:] {
		if !r.sameDirs(runtimes[0]) {
			var all []string
			for _, d := range runtimes {
				all = append(all, d.String())
			}
			return Dirs{}, fmt.Errorf("%d container runtimes load CNI from different directories (%s): name the one the kubelet uses with --cni-conf-dir and --cni-bin-dir", len(runtimes), strings.Join(all, "; "))
		}
	}
	return runtimes[0], nil
}

// binDir: the agent's directory ours is one of the runtime's bin dirs.
func (d Dirs) binDir(ours string) bool {
	return slices.ContainsFunc(d.BinDirs, func(r string) bool { return d.same(r, ours) })
}

// sameDirs: the two runtimes load configs from the same directory and
// plugins first from the same one.
func (d Dirs) sameDirs(o Dirs) bool {
	if len(d.BinDirs) == 0 || len(o.BinDirs) == 0 {
		return false
	}
	return d.same(d.ConfDir, o.fs.path(o.ConfDir)) && d.same(d.BinDirs[0], o.fs.path(o.BinDirs[0]))
}

// hostDir is the runtime's directory dir as the agent reaches it through the
// host's root: PID 1's root directory, which stays while the runtime
// restarts (its own /proc entry would go with it). The runtime's links are
// followed in its root; the directory must exist (the agent makes none of
// the runtime's: the runtime or the primary CNI does) and be the same one in
// PID 1's mount namespace as in the runtime's.
func (p Place) hostDir(r Dirs, dir string) (string, error) {
	in, err := r.fs.resolve(dir)
	if errors.Is(err, fs.ErrNotExist) {
		return "", fmt.Errorf("%s does not exist (yet)", dir)
	}
	if err != nil {
		return "", err
	}
	theirs, err := os.Stat(filepath.Join(r.fs.root(), in))
	if err != nil {
		return "", err
	}
	if !theirs.IsDir() {
		return "", fmt.Errorf("%s is not a directory", dir)
	}
	host := filepath.Join(p.procRoot, "1", "root", in)
	ours, err := os.Stat(host)
	if err != nil || !os.SameFile(theirs, ours) {
		return "", fmt.Errorf("%s is another directory (or none) in the host's root (PID 1's) than in %s's: it runs in a mount namespace of its own", dir, r.Runtime)
	}
	return host, nil
}
