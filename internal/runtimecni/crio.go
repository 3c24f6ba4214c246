package runtimecni

import (
	"errors"
	"fmt"
	"io/fs"
	"path/filepath"

	"github.com/mesh-cni/mesh-cni/internal/hostproc"
)

// CRI-O's defaults: its config, its drop-in directory and its CNI dirs.
const (
	crioDefaultConfig    = "/etc/crio/crio.conf"
	crioDefaultConfigDir = "/etc/crio/crio.conf.d"
)

// crio reads [crio.network] network_dir and plugin_dirs from crio.conf and
// then its drop-in directory in lexical order, later files winning, and the
// --cni-config-dir and --cni-plugin-dir flags over both, as CRI-O does.
func crio(proc hostproc.Procfs, pid int) (Dirs, error) {
	d, args, err := readRuntime(proc, pid, Dirs{Runtime: "crio", BinDirs: []string{"/opt/cni/bin/"}, ConfDir: "/etc/cni/net.d/"})
	if err != nil {
		return d, err
	}
	main, _ := flagOr(args, crioDefaultConfig, "--config", "-c")
	dir, _ := flagOr(args, crioDefaultConfigDir, "--config-dir", "-d")
	files := []string{main}
	dropIns, err := d.fs.glob(filepath.Join(dir, "*.conf"))
	if err != nil {
		return d, fmt.Errorf("crio's config dir: %w", err)
	}
	files = append(files, dropIns...)
	for _, f := range files {
		data, err := d.fs.read(f)
		if errors.Is(err, fs.ErrNotExist) && f == main {
			continue
		}
		if err != nil {
			return d, fmt.Errorf("crio's config: %w", err)
		}
		t, err := decode(f, data)
		if err != nil {
			return d, err
		}
		d.Configs = append(d.Configs, f)
		if v, ok := lookup(t, "crio", "network", "network_dir"); ok {
			if s, ok := v.(string); ok && s != "" {
				d.ConfDir = s
			}
		}
		for _, key := range []string{"plugin_dir", "plugin_dirs"} {
			if v, ok := lookup(t, "crio", "network", key); ok {
				if dirs, ok := stringsOf(v); ok && len(dirs) > 0 {
					d.BinDirs = dirs
				}
			}
		}
	}
	if v, ok := flagValue(args, "--cni-config-dir"); ok {
		d.ConfDir = v
	}
	if v := flagValues(args, "--cni-plugin-dir"); len(v) > 0 {
		d.BinDirs = v
	}
	return d, nil
}
