package cniinstall

import (
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"sort"

	"github.com/containernetworking/cni/libcni"
	"go.uber.org/zap"

	"github.com/mesh-cni/mesh-cni/internal/atomicfile"
	"github.com/mesh-cni/mesh-cni/internal/cniinstall/cniconf"
)

// candidate is one config file as a runtime would load it.
type candidate struct {
	name string
	kind cniconf.Kind
	data []byte
	mode os.FileMode // of the file the name resolves to
	uid  int
	gid  int
	link bool // the name is a symbolic link
	list *cniconf.List
	// filePlugins are the plugins libcni loads from <ConfDir>/<network name>/
	// after the inline ones.
	filePlugins []json.RawMessage
}

func (c *candidate) options() atomicfile.Options {
	return atomicfile.Options{Mode: c.mode, Chown: true, UID: c.uid, GID: c.gid}
}

func (in *Installer) scan() ([]string, error) {
	files, err := libcni.ConfFiles(in.cfg.ConfDir, cniconf.Extensions())
	if err != nil {
		return nil, fmt.Errorf("list CNI config directory: %w", err)
	}
	names := make([]string, 0, len(files))
	for _, f := range files {
		names = append(names, filepath.Base(f))
	}
	sort.Strings(names)
	return names, nil
}

// load reads and parses one config file the way a runtime would. A file that
// vanished returns an error wrapping os.ErrNotExist.
func (in *Installer) load(name string) (*candidate, error) {
	path := filepath.Join(in.cfg.ConfDir, name)
	lfi, err := os.Lstat(path)
	if err != nil {
		return nil, err
	}
	data, err := os.ReadFile(path)
	if err != nil {
		return nil, err
	}
	fi, err := os.Stat(path)
	if err != nil {
		return nil, err
	}
	c := &candidate{
		name: name,
		kind: cniconf.KindOf(name),
		data: data,
		mode: fi.Mode().Perm(),
		link: lfi.Mode()&os.ModeSymlink != 0,
	}
	c.uid, c.gid, _ = atomicfile.Owner(fi)
	if c.list, err = cniconf.Parse(c.kind, data); err != nil {
		return nil, err
	}
	if c.kind == cniconf.KindList && !c.list.LoadOnlyInlinedPlugins {
		confs, err := libcni.NetworkPluginConfsFromFiles(in.cfg.ConfDir, c.list.Name)
		if err != nil {
			return nil, err
		}
		for _, pc := range confs {
			c.filePlugins = append(c.filePlugins, pc.Bytes)
		}
	}
	if len(c.list.Plugins)+len(c.filePlugins) == 0 {
		return nil, errors.New("no plugin configs found")
	}
	return c, nil
}

// loadLogged is load that logs why a file is skipped, once per file and reason.
func (in *Installer) loadLogged(name string) *candidate {
	c, err := in.load(name)
	if err == nil {
		delete(in.skipped, name)
		return c
	}
	if errors.Is(err, os.ErrNotExist) {
		delete(in.skipped, name)
		return nil
	}
	if in.skipped[name] != err.Error() {
		in.skipped[name] = err.Error()
		in.log.Info("Skipping invalid CNI config file, as runtimes do", zap.String("file", name), zap.Error(err))
	}
	return nil
}

// findPrimary returns the primary config: PrimaryFile when configured (or the
// ".conflist" it was converted to), else the first valid non-owned file.
func (in *Installer) findPrimary(names []string) (*candidate, error) {
	if name := in.cfg.PrimaryFile; name != "" {
		c, err := in.load(name)
		if errors.Is(err, os.ErrNotExist) && cniconf.KindOf(name) == cniconf.KindConf {
			c, err = in.load(cniconf.ListName(name))
		}
		if errors.Is(err, os.ErrNotExist) {
			return nil, nil
		}
		if err != nil {
			return nil, fmt.Errorf("configured primary CNI config %s: %w", name, err)
		}
		return c, nil
	}
	for _, n := range names {
		if in.cfg.isOwned(n) {
			continue
		}
		if c := in.loadLogged(n); c != nil {
			return c, nil
		}
	}
	return nil, nil
}
