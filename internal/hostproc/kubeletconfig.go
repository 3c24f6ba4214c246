package hostproc

import (
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path"
	"path/filepath"
	"slices"
	"strconv"
	"strings"

	"golang.org/x/sys/unix"
	"sigs.k8s.io/yaml"
)

// kubeletExeName is the executable whose command line is the kubelet's own:
// k3s, MicroK8s' kubelite and the like run the kubelet in-process with
// settings of theirs, which their command line does not show.
const kubeletExeName = "kubelet"

// kubeletSettings are the kubelet's settings the pod cgroup layout depends
// on, as it resolves them: its defaults, then its --config file, then the
// files of its --config-dir, then its command-line flags, each overriding the
// one before. A nil field was never set.
type kubeletSettings struct {
	driver, root *string
	perQoS       *bool
}

// PodCgroupLayout reads the layout from the kubelet process k: its command
// line and the configuration files it names, read through its own root and
// working directory (/proc/PID/root, /proc/PID/cwd), as it read them. It fails
// when the kubelet's settings cannot be read whole or give pods no cgroups
// of their own (cgroupsPerQOS false).
func (p Procfs) PodCgroupLayout(k Kubelet) (PodCgroupLayout, error) {
	if name := filepath.Base(strings.TrimSuffix(k.Exe, " (deleted)")); name != kubeletExeName {
		return PodCgroupLayout{}, fmt.Errorf("the kubelet runs inside %s (pid %d): its cgroup settings are not on its command line", name, k.PID)
	}
	args, err := p.Cmdline(k.PID)
	if err != nil {
		return PodCgroupLayout{}, fmt.Errorf("the kubelet's command line: %w", err)
	}
	flags, err := kubeletFlags(args)
	if err != nil {
		return PodCgroupLayout{}, err
	}
	var s kubeletSettings
	if file, ok := flags["config"]; ok && file != "" {
		b, err := p.ReadAsProcess(k.PID, file)
		if err != nil {
			return PodCgroupLayout{}, fmt.Errorf("the kubelet's --config: %w", err)
		}
		if err := s.merge(b); err != nil {
			return PodCgroupLayout{}, fmt.Errorf("the kubelet's --config %s: %w", file, err)
		}
	}
	if dir, ok := flags["config-dir"]; ok && dir != "" {
		if err := p.mergeDropIns(k.PID, dir, &s); err != nil {
			return PodCgroupLayout{}, fmt.Errorf("the kubelet's --config-dir %s: %w", dir, err)
		}
	}
	if v, ok := flags["cgroup-driver"]; ok {
		s.driver = &v
	}
	if v, ok := flags["cgroup-root"]; ok {
		s.root = &v
	}
	if v, ok := flags["cgroups-per-qos"]; ok {
		b, err := strconv.ParseBool(v)
		if err != nil {
			return PodCgroupLayout{}, fmt.Errorf("the kubelet's --cgroups-per-qos=%q: %w", v, err)
		}
		s.perQoS = &b
	}
	return s.layout()
}

// layout applies the kubelet's defaults: the cgroupfs driver, pods' cgroups
// on, cgroupRoot "/" when unset.
func (s kubeletSettings) layout() (PodCgroupLayout, error) {
	l := PodCgroupLayout{Driver: DriverCgroupfs, Root: "/"}
	if s.perQoS != nil && !*s.perQoS {
		return PodCgroupLayout{}, errors.New("the kubelet runs with cgroupsPerQOS false: pods have no cgroups of their own to be told apart by")
	}
	if s.driver != nil && *s.driver != "" {
		l.Driver = *s.driver
	}
	if s.root != nil && *s.root != "" {
		l.Root = *s.root
	}
	if err := l.Validate(); err != nil {
		return PodCgroupLayout{}, fmt.Errorf("the kubelet's settings: %w", err)
	}
	return l, nil
}

// merge takes the settings a KubeletConfiguration file (YAML or JSON) sets.
// Keys are matched exactly, as the kubelet does.
func (s *kubeletSettings) merge(b []byte) error {
	var doc map[string]any
	if err := yaml.Unmarshal(b, &doc); err != nil {
		return err
	}
	str := func(key string) (*string, error) {
		v, ok := doc[key]
		if !ok || v == nil {
			return nil, nil
		}
		sv, ok := v.(string)
		if !ok {
			return nil, fmt.Errorf("%s: want a string, got %T", key, v)
		}
		return &sv, nil
	}
	driver, err := str("cgroupDriver")
	if err != nil {
		return err
	}
	root, err := str("cgroupRoot")
	if err != nil {
		return err
	}
	if driver != nil {
		s.driver = driver
	}
	if root != nil {
		s.root = root
	}
	if v, ok := doc["cgroupsPerQOS"]; ok && v != nil {
		b, ok := v.(bool)
		if !ok {
			return fmt.Errorf("cgroupsPerQOS: want a boolean, got %T", v)
		}
		s.perQoS = &b
	}
	return nil
}

// mergeDropIns merges the kubelet's drop-in files: every file named *.conf
// below dir, in lexical order of path, as the kubelet walks it.
func (p Procfs) mergeDropIns(pid int, dir string, s *kubeletSettings) error {
	root, rel, err := p.processPath(pid, dir)
	if err != nil {
		return err
	}
	var files []string
	// The walk goes through the kubelet's root, which is the host's (the
	// kubelet passed CheckRoot): a link in it leads where the kubelet's would.
	err = filepath.WalkDir(filepath.Join(root, rel), func(path string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if !d.IsDir() && filepath.Ext(d.Name()) == ".conf" {
			r, err := filepath.Rel(root, path)
			if err != nil {
				return err
			}
			files = append(files, "/"+r)
		}
		return nil
	})
	if err != nil {
		return err
	}
	slices.Sort(files)
	for _, f := range files {
		b, err := readInRoot(root, f)
		if err != nil {
			return err
		}
		if err := s.merge(b); err != nil {
			return fmt.Errorf("%s: %w", f, err)
		}
	}
	return nil
}

// processPath is the process's root directory (/proc/PID/root) and name
// made absolute in it, against its working directory when relative.
func (p Procfs) processPath(pid int, name string) (root, abs string, _ error) {
	root = p.path(pid, "root")
	if path.IsAbs(name) {
		return root, path.Clean(name), nil
	}
	cwd, err := os.Readlink(p.path(pid, "cwd"))
	if err != nil {
		return "", "", fmt.Errorf("working directory of process %d: %w", pid, err)
	}
	return root, path.Join(cwd, name), nil
}

// ReadAsProcess reads the file name as process pid opens it: relative to its
// working directory, links followed inside its root directory (at most 1 MiB:
// a config file).
func (p Procfs) ReadAsProcess(pid int, name string) ([]byte, error) {
	root, abs, err := p.processPath(pid, name)
	if err != nil {
		return nil, err
	}
	return readInRoot(root, abs)
}

// readInRoot reads name resolved inside root, links included (a link to
// /etc/... leads to root's /etc, not the agent's).
func readInRoot(root, name string) ([]byte, error) {
	dir, err := os.Open(root)
	if err != nil {
		return nil, err
	}
	defer dir.Close()
	fd, err := unix.Openat2(int(dir.Fd()), strings.TrimPrefix(name, "/"), &unix.OpenHow{
		Flags:   unix.O_RDONLY | unix.O_CLOEXEC,
		Resolve: unix.RESOLVE_IN_ROOT | unix.RESOLVE_NO_MAGICLINKS,
	})
	if err != nil {
		return nil, &fs.PathError{Op: "open", Path: filepath.Join(root, name), Err: err}
	}
	f := os.NewFile(uintptr(fd), filepath.Join(root, name))
	defer f.Close()
	return readAllLimited(f)
}

// maxConfigSize bounds a kubelet configuration file the agent reads.
const maxConfigSize = 1 << 20

func readAllLimited(f *os.File) ([]byte, error) {
	b, err := io.ReadAll(io.LimitReader(f, maxConfigSize+1))
	if err != nil {
		return nil, err
	}
	if len(b) > maxConfigSize {
		return nil, fmt.Errorf("%s: larger than %d bytes", f.Name(), maxConfigSize)
	}
	return b, nil
}

// kubeletFlags reads the flags the layout depends on from the kubelet's
// arguments, as its flag parser does: "--name=value" or "--name value" ("_"
// and "-" alike in names; booleans only "--name" or "--name=value"), the last
// one winning, nothing after "--".
func kubeletFlags(args []string) (map[string]string, error) {
	valued := []string{"config", "config-dir", "cgroup-driver", "cgroup-root"}
	out := map[string]string{}
	for i := 1; i < len(args); i++ {
		a := args[i]
		if a == "--" {
			break
		}
		name, ok := strings.CutPrefix(a, "--")
		if !ok {
			continue
		}
		name, value, hasValue := strings.Cut(name, "=")
		name = strings.ReplaceAll(name, "_", "-")
		switch {
		case slices.Contains(valued, name):
			if !hasValue {
				if i+1 >= len(args) {
					return nil, fmt.Errorf("the kubelet's --%s has no value", name)
				}
				i++
				value = args[i]
			}
			out[name] = value
		case name == "cgroups-per-qos":
			if !hasValue {
				value = "true"
			}
			out[name] = value
		}
	}
	return out, nil
}
