package runtimecni

import (
	"errors"
	"fmt"
	"io/fs"
	"path/filepath"
	"slices"

	"github.com/mesh-cni/mesh-cni/internal/hostproc"
)

// containerdDefaultConfig is where containerd reads its config without -c.
const containerdDefaultConfig = "/etc/containerd/config.toml"

// errNoCRI: the containerd runs without its CRI plugin (Docker's own, which
// ships a config with disabled_plugins = ["cri"]): it sets up no pod's
// network and loads no CNI.
var errNoCRI = errors.New("its CRI plugin is disabled")

// criPlugins are the names disabled_plugins turns the CRI off by: the short
// id, the 1.x plugin, and containerd 2's runtime plugin.
var criPlugins = []string{"cri", "io.containerd.grpc.v1.cri", "io.containerd.cri.v1.runtime"}

// containerd reads the CRI plugin's cni section: in config version 3 and
// later (containerd 2) io.containerd.cri.v1.runtime's bin_dirs (or bin_dir)
// and conf_dir, in version 2 io.containerd.grpc.v1.cri's bin_dir and
// conf_dir, in version 1 cri's. Files named by imports are merged over it in
// order, as containerd does; what no file sets is containerd's default.
func containerd(proc hostproc.Procfs, pid int) (Dirs, error) {
	d, args, err := readRuntime(proc, pid, Dirs{Runtime: "containerd", BinDirs: []string{"/opt/cni/bin"}, ConfDir: "/etc/cni/net.d"})
	if err != nil {
		return d, err
	}
	main, given := flagOr(args, containerdDefaultConfig, "-c", "--config")
	data, err := d.fs.read(main)
	if errors.Is(err, fs.ErrNotExist) && !given {
		d.Configs = []string{main + " (absent: defaults)"}
		return d, nil
	}
	if err != nil {
		return d, fmt.Errorf("containerd's config: %w", err)
	}
	files := []string{main}
	cfg, err := decode(main, data)
	if err != nil {
		return d, err
	}
	version := int64(1)
	if v, ok := cfg["version"].(int64); ok {
		version = v
	}
	tables := []map[string]any{cfg}
	if imports, ok := stringsOf(cfg["imports"]); ok {
		for _, pattern := range imports {
			if !filepath.IsAbs(pattern) {
				pattern = filepath.Join(filepath.Dir(main), pattern)
			}
			names, err := d.fs.glob(pattern)
			if err != nil {
				return d, fmt.Errorf("containerd's imports %q: %w", pattern, err)
			}
			for _, n := range names {
				b, err := d.fs.read(n)
				if err != nil {
					return d, fmt.Errorf("containerd's import %s: %w", n, err)
				}
				t, err := decode(n, b)
				if err != nil {
					return d, err
				}
				files = append(files, n)
				tables = append(tables, t)
			}
		}
	}
	d.Configs = files
	var section []string
	switch {
	case version >= 3:
		section = []string{"plugins", "io.containerd.cri.v1.runtime", "cni"}
	case version == 2:
		section = []string{"plugins", "io.containerd.grpc.v1.cri", "cni"}
	default:
		section = []string{"plugins", "cri", "cni"}
	}
	for _, t := range tables {
		if disabled, ok := stringsOf(t["disabled_plugins"]); ok && slices.ContainsFunc(disabled, func(p string) bool { return slices.Contains(criPlugins, p) }) {
			return d, errNoCRI
		}
		if v, ok := lookup(t, append(section, "bin_dirs")...); ok {
			if dirs, ok := stringsOf(v); ok && len(dirs) > 0 {
				d.BinDirs = dirs
			}
		}
		if v, ok := lookup(t, append(section, "bin_dir")...); ok {
			if s, ok := v.(string); ok && s != "" {
				d.BinDirs = []string{s}
			}
		}
		if v, ok := lookup(t, append(section, "conf_dir")...); ok {
			if s, ok := v.(string); ok && s != "" {
				d.ConfDir = s
			}
		}
	}
	return d, nil
}
