// Package runtimecni reads where the node's container runtime loads CNI plugins
// and network configs from: its process (found in the host's procfs by what a
// pod cannot fake), its command line and its config files, read through the
// process's own root so that the paths mean what they mean to the runtime.
// Decide says where the agent installs its plugin and chain entry: a chain
// entry anywhere else (a manifest rendered for the default layout on GKE's
// /home/kubernetes/bin or k3s' directories) would have every pod start
// without the mesh.
package runtimecni

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"sort"
	"strconv"
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

// ErrNoRuntime is returned when no containerd or CRI-O process runs as the
// host's own.
var ErrNoRuntime = errors.New("no container runtime process (containerd, crio) of the host's own found")

// runtimeNames are the process names (comm) that make a process a candidate.
var runtimeNames = []string{"containerd", "crio"}

// FindAll reads the CNI dirs of every containerd and CRI-O process that runs
// as the host's own: its root directory and network namespace PID 1's, no
// cgroup of it a pod's (hostproc.HostProcesses, as the kubelet is found). A
// process in a pod can be named containerd and read a config of its own
// making; it is refused, never read. A node runs one runtime, but a machine
// may run several; Serves and Decide say which matters. A containerd whose
// CRI plugin is disabled (Docker's own) loads no CNI and is left out.
func FindAll(proc hostproc.Procfs) (found []Dirs, refused []hostproc.Refusal, _ error) {
	hosts, refused, err := proc.HostProcesses(runtimeNames)
	if err != nil {
		return nil, nil, err
	}
	var errs []error
	for _, h := range hosts {
		var d Dirs
		switch h.Comm {
		case "containerd":
			d, err = containerd(proc, h.PID)
		case "crio":
			d, err = crio(proc, h.PID)
		}
		if errors.Is(err, errNoCRI) {
			continue
		}
		if err != nil {
			errs = append(errs, fmt.Errorf("%s (pid %d): %w", h.Comm, h.PID, err))
			continue
		}
		found = append(found, d)
	}
	if len(found) == 0 && len(errs) == 0 {
		return nil, refused, ErrNoRuntime
	}
	return found, refused, errors.Join(errs...)
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

// root is the runtime's root directory, as the agent reaches it.
func (r runtimeFS) root() string {
	return filepath.Join(r.proc.Root, strconv.Itoa(r.pid), "root")
}

// path is where the agent reaches the runtime's absolute path p: its symbolic
// links followed inside the runtime's root (resolve), or, where p does not
// resolve, p as it reads below that root (a stat then says what is missing).
func (r runtimeFS) path(p string) string {
	if in, err := r.resolve(p); err == nil {
		p = in
	}
	return filepath.Join(r.root(), p)
}

// maxLinks is how many symbolic links resolve follows, as the kernel does.
const maxLinks = 40

// resolve follows the symbolic links of the runtime's absolute path p as the
// runtime would, within its root, and returns the path without them. Through
// /proc/PID/root the kernel would start a link's absolute target again at the
// agent's own root (its container image), never the runtime's. A path, not a
// descriptor (openat2 RESOLVE_IN_ROOT, as the runtime's files are read): the
// installer keeps writing and watching its directories by path.
func (r runtimeFS) resolve(p string) (string, error) {
	root := r.root()
	rest := strings.Split(filepath.Clean(p), "/")
	cur, links := "/", 0
	for len(rest) > 0 {
		c := rest[0]
		rest = rest[1:]
		switch c {
		case "", ".":
			continue
		case "..":
			cur = filepath.Dir(cur)
			continue
		}
		next := filepath.Join(cur, c)
		fi, err := os.Lstat(filepath.Join(root, next))
		if err != nil {
			return "", err
		}
		if fi.Mode()&os.ModeSymlink == 0 {
			cur = next
			continue
		}
		if links++; links > maxLinks {
			return "", fmt.Errorf("%s: more than %d symbolic links", p, maxLinks)
		}
		target, err := os.Readlink(filepath.Join(root, next))
		if err != nil {
			return "", err
		}
		if filepath.IsAbs(target) {
			cur = "/"
		}
		rest = append(strings.Split(target, "/"), rest...)
	}
	return cur, nil
}

// read reads the runtime's file p as the runtime opens it.
func (r runtimeFS) read(p string) ([]byte, error) { return r.proc.ReadAsProcess(r.pid, p) }

// glob expands pattern in the runtime's filesystem, sorted, as runtime names.
func (r runtimeFS) glob(pattern string) ([]string, error) {
	root := r.root()
	dir, base := filepath.Split(pattern)
	if in, err := r.resolve(dir); err == nil {
		dir = in
	}
	matches, err := filepath.Glob(filepath.Join(root, dir, base))
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
	if vs := flagValues(args, names...); len(vs) > 0 {
		return vs[0], true
	}
	return "", false
}

// flagOr is the first value of names on the command line, else def; given
// says which.
func flagOr(args []string, def string, names ...string) (v string, given bool) {
	if v, given = flagValue(args, names...); !given {
		v = def
	}
	return v, given
}

// readRuntime starts reading the runtime process pid, whose defaults d holds:
// its command line, and its files through its root (d.fs).
func readRuntime(proc hostproc.Procfs, pid int, d Dirs) (Dirs, []string, error) {
	d.PID, d.fs = pid, runtimeFS{proc, pid}
	args, err := proc.Cmdline(pid)
	if err != nil {
		return d, nil, fmt.Errorf("%s's command line: %w", d.Runtime, err)
	}
	return d, args, nil
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
