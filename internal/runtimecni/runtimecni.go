// Package runtimecni reads where the node's container runtime loads CNI plugins
// and network configs from: its process (found in the host's procfs), its
// command line and its config files, read through the process's own root so
// that the paths mean what they mean to the runtime. The agent installs its
// chain entry and plugin where it is told; a platform that keeps them
// elsewhere (GKE's /home/kubernetes/bin, k3s' directories) would have every
// pod start without the mesh, so the agent compares and says so instead.
package runtimecni

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"sort"
	"strings"

	"github.com/BurntSushi/toml"

	"github.com/mesh-cni/mesh-cni/internal/hostproc"
)

// Dirs is where a runtime loads CNI from.
type Dirs struct {
	// Runtime is "containerd" or "crio".
	Runtime string
	PID     int
	// Configs are the files read, as the runtime names them, main one first.
	Configs []string
	BinDirs []string
	ConfDir string

	fs runtimeFS
}

func (d Dirs) String() string {
	return fmt.Sprintf("%s (pid %d, %s) loads CNI plugins from %s and configs from %s",
		d.Runtime, d.PID, strings.Join(d.Configs, ", "), strings.Join(d.BinDirs, ", "), d.ConfDir)
}

// ErrNoRuntime is returned when no containerd or CRI-O process runs.
var ErrNoRuntime = errors.New("no container runtime process (containerd, crio) found")

// FindAll reads the CNI dirs of every containerd and CRI-O process: a node
// runs one, but a test machine may run several, and only the one whose
// directories are the agent's own matters (Serves).
func FindAll(proc hostproc.Procfs) ([]Dirs, error) {
	pids, err := proc.PIDs()
	if err != nil {
		return nil, err
	}
	slices.Sort(pids)
	var out []Dirs
	var errs []error
	for _, pid := range pids {
		comm, err := proc.Comm(pid)
		if err != nil {
			continue
		}
		var d Dirs
		switch comm {
		case "containerd":
			d, err = containerd(proc, pid)
		case "crio":
			d, err = crio(proc, pid)
		default:
			continue
		}
		if err != nil {
			errs = append(errs, fmt.Errorf("%s (pid %d): %w", comm, pid, err))
			continue
		}
		out = append(out, d)
	}
	if len(out) == 0 && len(errs) == 0 {
		return nil, ErrNoRuntime
	}
	return out, errors.Join(errs...)
}

// Serves returns "" when one of runtimes loads CNI from where the agent
// installs (binDirs, confDir), else why none does.
func Serves(runtimes []Dirs, binDirs []string, confDir string) string {
	var why []string
	for _, d := range runtimes {
		w := d.Mismatch(binDirs, confDir)
		if w == "" {
			return ""
		}
		why = append(why, w)
	}
	return strings.Join(why, "; ")
}

// Mismatch says how the runtime's dirs differ from where the agent installs:
// the conf dir must be the runtime's, and one of the bin dirs one of its. ""
// when they agree. A directory is the runtime's when it is the same directory
// (device and inode) as the runtime sees at its path, whatever the names: the
// agent sees the host through its mounts, the runtime through its own root.
func (d Dirs) Mismatch(binDirs []string, confDir string) string {
	var why []string
	if !d.same(d.ConfDir, confDir) {
		why = append(why, fmt.Sprintf("the agent writes its chain entry to %s", confDir))
	}
	if !slices.ContainsFunc(binDirs, func(b string) bool {
		return slices.ContainsFunc(d.BinDirs, func(r string) bool { return d.same(r, b) })
	}) {
		why = append(why, fmt.Sprintf("installs the plugin into %s", strings.Join(binDirs, ", ")))
	}
	if len(why) == 0 {
		return ""
	}
	return d.String() + ", but " + strings.Join(why, " and ") + ": pods would start without the mesh (set the platform, or --cni-conf-dir and --cni-bin-dir)"
}

// same: the runtime's directory at path theirs is the agent's at ours.
func (d Dirs) same(theirs, ours string) bool {
	a, errA := os.Stat(d.fs.path(theirs))
	b, errB := os.Stat(ours)
	if errA != nil || errB != nil {
		return false
	}
	return os.SameFile(a, b)
}

// runtimeFS reads files as the runtime process sees them.
type runtimeFS struct {
	proc hostproc.Procfs
	pid  int
}

func (r runtimeFS) path(p string) string {
	if !filepath.IsAbs(p) {
		return filepath.Join(r.proc.Root, fmt.Sprint(r.pid), "cwd", p)
	}
	return filepath.Join(r.proc.Root, fmt.Sprint(r.pid), "root", p)
}

func (r runtimeFS) read(p string) ([]byte, error) { return os.ReadFile(r.path(p)) }

// glob expands pattern in the runtime's filesystem, sorted, as runtime names.
func (r runtimeFS) glob(pattern string) ([]string, error) {
	root := r.path("/")
	matches, err := filepath.Glob(r.path(pattern))
	if err != nil {
		return nil, err
	}
	out := make([]string, 0, len(matches))
	for _, m := range matches {
		rel, err := filepath.Rel(root, m)
		if err != nil {
			continue
		}
		out = append(out, "/"+rel)
	}
	sort.Strings(out)
	return out, nil
}

// flagValue is the value of the first of names on the command line, given as
// "-n v", "--n v" or "--n=v".
func flagValue(args []string, names ...string) (string, bool) {
	for i, a := range args {
		for _, n := range names {
			if a == n && i+1 < len(args) {
				return args[i+1], true
			}
			if v, ok := strings.CutPrefix(a, n+"="); ok {
				return v, true
			}
		}
	}
	return "", false
}

// flagValues is every value of names on the command line.
func flagValues(args []string, names ...string) []string {
	var out []string
	for i, a := range args {
		for _, n := range names {
			if a == n && i+1 < len(args) {
				out = append(out, args[i+1])
			}
			if v, ok := strings.CutPrefix(a, n+"="); ok {
				out = append(out, v)
			}
		}
	}
	return out
}

// lookup walks a decoded TOML table by keys.
func lookup(m map[string]any, keys ...string) (any, bool) {
	var cur any = m
	for _, k := range keys {
		t, ok := cur.(map[string]any)
		if !ok {
			return nil, false
		}
		if cur, ok = t[k]; !ok {
			return nil, false
		}
	}
	return cur, true
}

func stringsOf(v any) ([]string, bool) {
	switch x := v.(type) {
	case string:
		return []string{x}, true
	case []any:
		out := make([]string, 0, len(x))
		for _, e := range x {
			s, ok := e.(string)
			if !ok {
				return nil, false
			}
			out = append(out, s)
		}
		return out, true
	}
	return nil, false
}

func decode(name string, data []byte) (map[string]any, error) {
	m := map[string]any{}
	if _, err := toml.Decode(string(data), &m); err != nil {
		return nil, fmt.Errorf("parse %s: %w", name, err)
	}
	return m, nil
}
