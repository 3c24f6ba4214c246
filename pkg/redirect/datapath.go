package redirect

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"sync"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/link"
	"go.uber.org/zap"
)

// DefaultPinRoot is where the data path is pinned unless Config.PinRoot says otherwise.
const DefaultPinRoot = "/sys/fs/bpf/mesh-cni"

// Errors callers may test for with errors.Is.
var (
	// ErrClosed: the Datapath was closed.
	ErrClosed = errors.New("redirect data path is closed")
	// ErrNotEnrolled: the netns cookie has no settings entry.
	ErrNotEnrolled = errors.New("netns is not enrolled")
	// ErrLinkBroken: an interface's TCX link is missing, detached or runs a
	// program other than this data path's.
	ErrLinkBroken = errors.New("tcx link is not intact")
)

// Config says where the data path lives.
type Config struct {
	// PinRoot is the bpffs directory holding maps and links (DefaultPinRoot when
	// empty). When it is not on a bpffs, Open mounts one there.
	PinRoot string
	// CgroupRoot is the cgroup v2 directory the socket programs attach to; empty
	// means the root of the host's cgroup2 mount, found in /proc/self/mountinfo.
	CgroupRoot string
	// Logger receives what the data path does; nil means no logging.
	Logger *zap.Logger
}

func (c Config) withDefaults() Config {
	if c.PinRoot == "" {
		c.PinRoot = DefaultPinRoot
	}
	c.PinRoot = filepath.Clean(c.PinRoot)
	if c.Logger == nil {
		c.Logger = zap.NewNop()
	}
	return c
}

// layout names the pins under a PinRoot:
//
//	<root>/maps/<map>                 settings, excluded_dsts, probe_srcs, sock_orig, orig_dsts, counters
//	<root>/links/<hook>               cgroup links at the cgroup v2 root
//	<root>/pods/<cookie>/tcx_<ifindex>_<ifname>   a pod interface's TCX ingress link
type layout string

func (l layout) maps() string             { return filepath.Join(string(l), "maps") }
func (l layout) links() string            { return filepath.Join(string(l), "links") }
func (l layout) pods() string             { return filepath.Join(string(l), "pods") }
func (l layout) pod(cookie uint64) string { return filepath.Join(l.pods(), fmt.Sprint(cookie)) }

// cgroupHook is one socket program attached at the cgroup root.
type cgroupHook struct {
	name   string
	attach ebpf.AttachType
	prog   func(*redirectPrograms) *ebpf.Program
}

// cgroupHooks in attach order: the programs that answer for redirected sockets go in
// before the connect programs start redirecting; Uninstall detaches in reverse.
var cgroupHooks = []cgroupHook{
	{"sockops", ebpf.AttachCGroupSockOps, func(p *redirectPrograms) *ebpf.Program { return p.MeshSockops }},
	{"getsockopt", ebpf.AttachCGroupGetsockopt, func(p *redirectPrograms) *ebpf.Program { return p.MeshGetsockopt }},
	{"getpeername4", ebpf.AttachCgroupInet4GetPeername, func(p *redirectPrograms) *ebpf.Program { return p.MeshGetpeername4 }},
	{"getpeername6", ebpf.AttachCgroupInet6GetPeername, func(p *redirectPrograms) *ebpf.Program { return p.MeshGetpeername6 }},
	{"connect4", ebpf.AttachCGroupInet4Connect, func(p *redirectPrograms) *ebpf.Program { return p.MeshConnect4 }},
	{"connect6", ebpf.AttachCGroupInet6Connect, func(p *redirectPrograms) *ebpf.Program { return p.MeshConnect6 }},
}

// Datapath is a loaded (or adopted) redirection data path. Its methods are safe for
// concurrent use.
type Datapath struct {
	cfg    Config
	log    *zap.Logger
	pins   layout
	cgroup string

	// mu guards the fields below: held for reading while the objects are in
	// use, for writing only to load and close them. Per-pod work runs in
	// parallel: attaching TCX waits for an RCU grace period in the kernel, and
	// pods enrolled at once share one grace period instead of queueing for it.
	mu      sync.RWMutex
	closed  bool
	objs    redirectObjects
	cgLinks map[string]link.Link

	// mapMu serializes the multi-step map updates (CIDR tries, then the
	// settings entry) so that iterating readers see whole enrollments.
	mapMu sync.Mutex
	// pods serializes Enroll, Release and Check of one netns cookie (its pins).
	pods cookieLocks
}

// cookieLocks is a mutex per netns cookie, dropped when unused.
type cookieLocks struct {
	mu    sync.Mutex
	locks map[uint64]*cookieLock
}

type cookieLock struct {
	mu   sync.Mutex
	refs int
}

func (c *cookieLocks) lock(cookie uint64) func() {
	c.mu.Lock()
	if c.locks == nil {
		c.locks = map[uint64]*cookieLock{}
	}
	l := c.locks[cookie]
	if l == nil {
		l = &cookieLock{}
		c.locks[cookie] = l
	}
	l.refs++
	c.mu.Unlock()
	l.mu.Lock()
	return func() {
		l.mu.Unlock()
		c.mu.Lock()
		if l.refs--; l.refs == 0 {
			delete(c.locks, cookie)
		}
		c.mu.Unlock()
	}
}

// Open loads the data path, or adopts the one pinned under cfg.PinRoot by an earlier
// agent: pinned maps are reused as they are (enrollments survive), pinned cgroup and
// TCX links are switched to the freshly loaded programs with link.Update, so an agent
// restart or upgrade never leaves a moment without redirection.
//
// Several Datapaths with different PinRoots can run on one host at once: each
// attaches its own programs at the cgroup root (multi-attach) and acts only on the
// network namespaces enrolled in its own maps.
func Open(ctx context.Context, cfg Config) (*Datapath, error) {
	cfg = cfg.withDefaults()
	if err := ctx.Err(); err != nil {
		return nil, err
	}
	mounted, err := ensureBPFFS(cfg.PinRoot)
	if err != nil {
		return nil, err
	}
	if mounted {
		cfg.Logger.Info("mounted bpffs", zap.String("path", cfg.PinRoot))
	}
	cgroup := cfg.CgroupRoot
	if cgroup == "" {
		if cgroup, err = findCgroup2(); err != nil {
			return nil, err
		}
	}
	d := &Datapath{
		cfg:     cfg,
		log:     cfg.Logger.With(zap.String("pinRoot", cfg.PinRoot)),
		pins:    layout(cfg.PinRoot),
		cgroup:  cgroup,
		cgLinks: map[string]link.Link{},
	}
	if err := d.load(); err != nil {
		return nil, err
	}
	if err := d.attachCgroup(ctx); err != nil {
		d.closeAll()
		return nil, err
	}
	d.adoptPods(ctx)
	d.log.Info("redirect data path ready", zap.String("cgroup", cgroup))
	return d, nil
}

func (d *Datapath) load() error {
	for _, dir := range []string{d.pins.maps(), d.pins.links(), d.pins.pods()} {
		if err := os.MkdirAll(dir, 0o700); err != nil {
			return fmt.Errorf("create pin dir: %w", err)
		}
	}
	spec, err := loadRedirect()
	if err != nil {
		return fmt.Errorf("load BPF spec: %w", err)
	}
	for _, m := range spec.Maps {
		m.Pinning = ebpf.PinByName
	}
	opts := &ebpf.CollectionOptions{Maps: ebpf.MapOptions{PinPath: d.pins.maps()}}
	if err := spec.LoadAndAssign(&d.objs, opts); err != nil {
		if errors.Is(err, ebpf.ErrMapIncompatible) {
			return fmt.Errorf("pinned maps under %s do not match this version (run uninstall first): %w", d.pins.maps(), err)
		}
		var verr *ebpf.VerifierError
		if errors.As(err, &verr) {
			return fmt.Errorf("load BPF programs: %+v", verr)
		}
		return fmt.Errorf("load BPF objects: %w", err)
	}
	if n := d.objs.Counters.MaxEntries(); n != counterMax {
		d.objs.Close()
		return fmt.Errorf("counters map has %d entries, this build expects %d", n, counterMax)
	}
	return nil
}

// attachCgroup adopts or creates the cgroup links, one per hook.
func (d *Datapath) attachCgroup(ctx context.Context) error {
	for _, h := range cgroupHooks {
		if err := ctx.Err(); err != nil {
			return err
		}
		prog := h.prog(&d.objs.redirectPrograms)
		pin := filepath.Join(d.pins.links(), h.name)
		l, err := link.LoadPinnedLink(pin, nil)
		switch {
		case err == nil:
			if err := checkLinkType(l, link.CgroupType); err != nil {
				l.Close()
				return fmt.Errorf("pinned link %s: %w", pin, err)
			}
			if err := l.Update(prog); err != nil {
				l.Close()
				return fmt.Errorf("update pinned link %s: %w", pin, err)
			}
			d.log.Debug("adopted cgroup link", zap.String("hook", h.name))
		case errors.Is(err, os.ErrNotExist):
			l, err = link.AttachCgroup(link.CgroupOptions{Path: d.cgroup, Attach: h.attach, Program: prog})
			if err != nil {
				return fmt.Errorf("attach %s to cgroup %s: %w", h.name, d.cgroup, err)
			}
			if err := l.Pin(pin); err != nil {
				l.Close()
				return fmt.Errorf("pin %s link: %w", h.name, err)
			}
			d.log.Debug("attached cgroup link", zap.String("hook", h.name))
		default:
			return fmt.Errorf("load pinned link %s: %w", pin, err)
		}
		d.cgLinks[h.name] = l
	}
	return nil
}

func checkLinkType(l link.Link, want link.Type) error {
	info, err := l.Info()
	if err != nil {
		return fmt.Errorf("link info: %w", err)
	}
	if info.Type != want {
		return fmt.Errorf("link type %v, want %v", info.Type, want)
	}
	return nil
}

// adoptPods switches every pinned pod TCX link to the new ingress program and drops
// the pins of pods whose settings entry is missing (an Enroll or Release that did not
// finish: the entry is written last and removed first).
func (d *Datapath) adoptPods(ctx context.Context) {
	entries, err := os.ReadDir(d.pins.pods())
	if err != nil {
		d.log.Warn("list pinned pods", zap.Error(err))
		return
	}
	for _, e := range entries {
		cookie, ok := parseCookie(e.Name())
		if !ok {
			continue
		}
		var s redirectPodSettings
		if err := d.objs.Settings.Lookup(cookie, &s); err != nil {
			d.log.Info("removing pins of a pod that is not enrolled", zap.Uint64("cookie", cookie))
			if err := d.removePodLinks(cookie); err != nil {
				d.log.Warn("remove pod pins", zap.Uint64("cookie", cookie), zap.Error(err))
			}
			continue
		}
		pins, err := readPodPins(d.pins.pod(cookie))
		if err != nil {
			d.log.Warn("list pod pins", zap.Uint64("cookie", cookie), zap.Error(err))
			continue
		}
		for _, p := range pins {
			if ctx.Err() != nil {
				return
			}
			if err := d.updateTCX(p.path); err != nil {
				d.log.Warn("pod link not updated", zap.Uint64("cookie", cookie),
					zap.String("interface", p.name), zap.Error(err))
			}
		}
	}
	d.removeOrphanCIDRs()
}

func (d *Datapath) updateTCX(pin string) error {
	l, err := link.LoadPinnedLink(pin, nil)
	if err != nil {
		return fmt.Errorf("load pinned link %s: %w", pin, err)
	}
	defer l.Close()
	if err := l.Update(d.objs.MeshIngress); err != nil {
		return fmt.Errorf("update link %s: %w", pin, err)
	}
	return nil
}

// Close releases this process's handles. Pins stay: the data path keeps redirecting
// with no agent running, and the next Open adopts it.
func (d *Datapath) Close() error {
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.closed {
		return nil
	}
	d.closed = true
	return d.closeAll()
}

func (d *Datapath) closeAll() error {
	var errs []error
	for name, l := range d.cgLinks {
		if err := l.Close(); err != nil {
			errs = append(errs, fmt.Errorf("close %s link: %w", name, err))
		}
	}
	d.cgLinks = nil
	if err := d.objs.Close(); err != nil {
		errs = append(errs, fmt.Errorf("close BPF objects: %w", err))
	}
	return errors.Join(errs...)
}

// Uninstall removes everything Open and Enroll put in place under cfg.PinRoot:
// it detaches the pods' TCX links and the cgroup links (connect programs first, so
// no connection is redirected without the programs that answer for it), removes
// the pins and, when PinRoot is a bpffs mount of its own (Open mounts one when
// PinRoot is not on a bpffs), unmounts it and removes the directory. A PinRoot
// inside a shared bpffs (such as /sys/fs/bpf) is removed, the mount left alone.
// Nothing there is fine. Any open Datapath on this PinRoot stops redirecting.
func Uninstall(ctx context.Context, cfg Config) error {
	cfg = cfg.withDefaults()
	log := cfg.Logger.With(zap.String("pinRoot", cfg.PinRoot))
	if _, err := os.Stat(cfg.PinRoot); errors.Is(err, os.ErrNotExist) {
		return nil
	}
	onBPFFS, err := isBPFFS(cfg.PinRoot)
	if err != nil {
		return err
	}
	if !onBPFFS {
		// Nothing can be pinned here; only an empty directory Open made may remain.
		if err := os.Remove(cfg.PinRoot); err != nil && !errors.Is(err, os.ErrNotExist) {
			return fmt.Errorf("remove %s: %w", cfg.PinRoot, err)
		}
		return nil
	}
	pins := layout(cfg.PinRoot)
	var errs []error

	podDirs, err := os.ReadDir(pins.pods())
	if err != nil && !errors.Is(err, os.ErrNotExist) {
		errs = append(errs, fmt.Errorf("list pods: %w", err))
	}
	for _, e := range podDirs {
		if err := ctx.Err(); err != nil {
			return err
		}
		errs = append(errs, removeLinkDir(filepath.Join(pins.pods(), e.Name())))
	}
	for i := len(cgroupHooks) - 1; i >= 0; i-- {
		errs = append(errs, detachPinned(filepath.Join(pins.links(), cgroupHooks[i].name)))
	}
	for _, dir := range []string{pins.pods(), pins.links()} {
		errs = append(errs, removeIfExists(dir))
	}
	mapPins, err := os.ReadDir(pins.maps())
	if err != nil && !errors.Is(err, os.ErrNotExist) {
		errs = append(errs, fmt.Errorf("list maps: %w", err))
	}
	for _, e := range mapPins {
		errs = append(errs, removeIfExists(filepath.Join(pins.maps(), e.Name())))
	}
	errs = append(errs, removeIfExists(pins.maps()))
	if err := errors.Join(errs...); err != nil {
		return fmt.Errorf("uninstall %s: %w", cfg.PinRoot, err)
	}

	mnt, err := isMountPoint(cfg.PinRoot)
	if err != nil {
		return err
	}
	if mnt {
		if err := unmount(cfg.PinRoot); err != nil {
			return err
		}
		log.Info("unmounted bpffs", zap.String("path", cfg.PinRoot))
	}
	if err := removeIfExists(cfg.PinRoot); err != nil {
		return fmt.Errorf("uninstall: %w", err)
	}
	log.Info("redirect data path uninstalled")
	return nil
}

// detachPinned detaches the link pinned at path and removes the pin. A missing pin
// is fine.
func detachPinned(path string) error {
	l, err := link.LoadPinnedLink(path, nil)
	if errors.Is(err, os.ErrNotExist) {
		return nil
	}
	if err != nil {
		// Not a link (or unreadable): the pin still has to go.
		return errors.Join(fmt.Errorf("load pinned link %s: %w", path, err), removeIfExists(path))
	}
	defer l.Close()
	// A TCX link whose interface is gone is already detached; unpinning is what
	// remains, so a failed Detach is not an error when Unpin succeeds.
	detachErr := l.Detach()
	if err := l.Unpin(); err != nil {
		return errors.Join(fmt.Errorf("unpin %s: %w", path, err), detachErr)
	}
	return nil
}

func removeLinkDir(dir string) error {
	entries, err := os.ReadDir(dir)
	if errors.Is(err, os.ErrNotExist) {
		return nil
	}
	if err != nil {
		return fmt.Errorf("list %s: %w", dir, err)
	}
	var errs []error
	for _, e := range entries {
		errs = append(errs, detachPinned(filepath.Join(dir, e.Name())))
	}
	errs = append(errs, removeIfExists(dir))
	return errors.Join(errs...)
}

func removeIfExists(path string) error {
	if err := os.Remove(path); err != nil && !errors.Is(err, os.ErrNotExist) {
		return fmt.Errorf("remove %s: %w", path, err)
	}
	return nil
}
