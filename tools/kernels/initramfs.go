package kernels

import (
	"bufio"
	"bytes"
	"debug/elf"
	"encoding/json"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strings"
)

// bootModules are what the guest needs before it can reach the host's tree:
// the virtio PCI transport, 9p over virtio, and overlayfs for a writable root
// over the read-only share. Each kernel builds some of them in; the rest, with
// their dependencies, go into the initramfs.
var bootModules = []string{"virtio_pci", "9pnet_virtio", "9p", "overlay"}

// moduleIndex is a kernel's modules.dep and modules.builtin, by module name.
type moduleIndex struct {
	dir     string
	deps    map[string][]string // module -> its dependencies (module names)
	path    map[string]string   // module -> file, relative to dir
	builtin map[string]bool
}

// modName is the module name of a path in modules.dep: kernel/fs/9p/9p.ko.xz ->
// 9p; dashes and underscores are the same to the kernel.
func modName(path string) string {
	base := filepath.Base(path)
	base, _, _ = strings.Cut(base, ".ko")
	return strings.ReplaceAll(base, "-", "_")
}

func readModuleIndex(dir string) (*moduleIndex, error) {
	ix := &moduleIndex{dir: dir, deps: map[string][]string{}, path: map[string]string{}, builtin: map[string]bool{}}
	dep, err := os.ReadFile(filepath.Join(dir, "modules.dep"))
	if err != nil {
		return nil, err
	}
	sc := bufio.NewScanner(bytes.NewReader(dep))
	for sc.Scan() {
		mod, deps, ok := strings.Cut(sc.Text(), ":")
		if !ok {
			continue
		}
		name := modName(mod)
		ix.path[name] = mod
		for _, d := range strings.Fields(deps) {
			ix.deps[name] = append(ix.deps[name], modName(d))
		}
	}
	// modules.builtin is optional: a kernel may build nothing in.
	if b, err := os.ReadFile(filepath.Join(dir, "modules.builtin")); err == nil {
		for _, line := range strings.Fields(string(b)) {
			ix.builtin[modName(line)] = true
		}
	}
	return ix, nil
}

// loadOrder is mods and everything they depend on, each after its
// dependencies, without what the kernel has built in.
func (ix *moduleIndex) loadOrder(mods []string) ([]string, error) {
	var order []string
	seen := map[string]bool{}
	var visit func(m string, from []string) error
	visit = func(m string, from []string) error {
		if seen[m] || ix.builtin[m] {
			return nil
		}
		if _, ok := ix.path[m]; !ok {
			return fmt.Errorf("module %s (needed by %s) is neither in modules.dep nor built in", m, strings.Join(append(from, "the guest"), " <- "))
		}
		seen[m] = true
		for _, d := range ix.deps[m] {
			if err := visit(d, append(from, m)); err != nil {
				return err
			}
		}
		order = append(order, m)
		return nil
	}
	for _, m := range mods {
		if err := visit(m, nil); err != nil {
			return nil, err
		}
	}
	return order, nil
}

// writeInitramfs writes the guest's initramfs: init (a static build of this
// program), the plan, and the boot modules in load order, the plan naming them.
func writeInitramfs(path, initBinary string, u *Unpacked, p plan) error {
	ix, err := readModuleIndex(u.Modules)
	if err != nil {
		return err
	}
	order, err := ix.loadOrder(bootModules)
	if err != nil {
		return err
	}
	if err := checkStatic(initBinary); err != nil {
		return err
	}
	f, err := os.Create(path)
	if err != nil {
		return err
	}
	defer f.Close()
	w := newCPIO(f)
	w.dir("dev", 0o755)
	// The kernel opens /dev/console for init's stdin, stdout and stderr before
	// any devtmpfs exists.
	w.node("dev/console", unixCharDev|0o600, 5, 1)
	w.dir("modules", 0o755)
	for i, m := range order {
		data, err := os.ReadFile(filepath.Join(u.Modules, ix.path[m]))
		if err != nil {
			return err
		}
		name := fmt.Sprintf("modules/%02d-%s", i, filepath.Base(ix.path[m]))
		w.file(name, 0o644, data)
		p.Modules = append(p.Modules, "/"+name)
	}
	init, err := os.ReadFile(initBinary)
	if err != nil {
		return err
	}
	w.file("init", 0o755, init)
	planJSON, err := json.MarshalIndent(p, "", "  ")
	if err != nil {
		return err
	}
	w.file(planFile[1:], 0o644, planJSON)
	if err := w.close(); err != nil {
		return fmt.Errorf("write %s: %w", path, err)
	}
	return f.Close()
}

// checkStatic refuses an init that needs a dynamic loader: the initramfs has
// none.
func checkStatic(path string) error {
	f, err := elf.Open(path)
	if err != nil {
		return fmt.Errorf("guest init %s: %w", path, err)
	}
	defer f.Close()
	for _, p := range f.Progs {
		if p.Type == elf.PT_INTERP {
			return fmt.Errorf("guest init %s is dynamically linked: build it with CGO_ENABLED=0", path)
		}
	}
	return nil
}

const (
	unixDir     = 0o040000
	unixFile    = 0o100000
	unixCharDev = 0o020000
)

// cpioWriter writes the "newc" cpio format, the one the kernel unpacks as an
// initramfs. The first error sticks and is returned by close.
type cpioWriter struct {
	w   *bufio.Writer
	ino int
	err error
}

func newCPIO(w io.Writer) *cpioWriter { return &cpioWriter{w: bufio.NewWriter(w)} }

func (c *cpioWriter) dir(name string, perm uint32) { c.entry(name, unixDir|perm, 0, 0, nil) }

func (c *cpioWriter) file(name string, perm uint32, data []byte) {
	c.entry(name, unixFile|perm, 0, 0, data)
}

func (c *cpioWriter) node(name string, mode uint32, major, minor int) {
	c.entry(name, mode, major, minor, nil)
}

func (c *cpioWriter) entry(name string, mode uint32, rmajor, rminor int, data []byte) {
	if c.err != nil {
		return
	}
	c.ino++
	nlink := 1
	if mode&unixDir != 0 {
		nlink = 2
	}
	// magic, ino, mode, uid, gid, nlink, mtime, filesize, devmajor, devminor,
	// rdevmajor, rdevminor, namesize (with its NUL), check.
	hdr := fmt.Sprintf("070701%08X%08X%08X%08X%08X%08X%08X%08X%08X%08X%08X%08X%08X",
		c.ino, mode, 0, 0, nlink, 0, len(data), 0, 0, rmajor, rminor, len(name)+1, 0)
	c.write([]byte(hdr))
	c.write(append([]byte(name), 0))
	c.pad(len(hdr) + len(name) + 1)
	c.write(data)
	c.pad(len(data))
}

func (c *cpioWriter) write(b []byte) {
	if c.err == nil {
		_, c.err = c.w.Write(b)
	}
}

// pad aligns to four bytes after n bytes: both the header with its name and
// the data are padded.
func (c *cpioWriter) pad(n int) {
	if r := n % 4; r != 0 {
		c.write(make([]byte, 4-r))
	}
}

func (c *cpioWriter) close() error {
	c.entry("TRAILER!!!", 0, 0, 0, nil)
	if c.err != nil {
		return c.err
	}
	return c.w.Flush()
}
