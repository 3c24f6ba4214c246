package redirect

import (
	"context"
	"errors"
	"fmt"
	"net/netip"
	"os"
	"path/filepath"
	"slices"
	"sync"
	"time"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/link"
	"go.uber.org/zap"

	"github.com/mesh-cni/mesh-cni/internal/keylock"
	"github.com/mesh-cni/mesh-cni/internal/netns"
)

// DefaultPinRoot is where the data path is pinned unless Config.PinRoot says otherwise.
const DefaultPinRoot = "/sys/fs/bpf/mesh-cni"

// Errors callers may test for with errors.Is.
var (
	// ErrClosed: the Datapath was closed.
	ErrClosed = errors.New("redirect data path is closed")
	// ErrNotEnrolled: the netns cookie has no settings entry.
	ErrNotEnrolled = errors.New("netns is not enrolled")
	// ErrLinkBroken: the pod's inbound capture link is missing, detached, attached
	// to another namespace or runs another program.
	ErrLinkBroken = errors.New("inbound capture link is not intact")
	// ErrNodeNamespace: the namespace is the node's own (or the agent's), which
	// would redirect the connects of every process on the node.
	ErrNodeNamespace = errors.New("refusing to enroll the node's own network namespace")
)

// Config says where the data path lives.
type Config struct {
	// PinRoot is the bpffs directory holding maps and links (DefaultPinRoot when
	// empty). When it is not on a bpffs, Open mounts one: at /sys/fs/bpf when
	// PinRoot is below it and nothing is mounted there (other eBPF agents expect
	// the shared mount), else at PinRoot itself.
	PinRoot string
	// CgroupRoot is the cgroup v2 directory the socket programs attach to; empty
	// means the root of the host's cgroup2 mount, found in /proc/self/mountinfo.
	CgroupRoot string
	// PacketSockets attaches the BPF LSM program that refuses packet sockets to
	// pods enrolled with DenyPacketSockets (the node's kernel must run the BPF
	// LSM); without it such pods are refused (ErrNoPacketHook).
	PacketSockets bool
	// UninstallGrace is how long Uninstall keeps the programs that answer for a
	// redirected connection (the hand-over, SO_ORIGINAL_DST) after those that
	// redirect are gone, while pods are enrolled; zero means one second.
	UninstallGrace time.Duration
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
	if c.UninstallGrace <= 0 {
		c.UninstallGrace = time.Second
	}
	return c
}

// layout names the pins under a PinRoot:
//
//	<root>/maps/<map>                     every map of the object
//	<root>/links/<hook>                   cgroup links at the cgroup v2 root
//	<root>/pods/<cookie>/lookup_<netns inode>   a pod's sk_lookup link
//	<root>/legacy/<map>                   maps of an earlier layout, while migrating
//	<root>/retired/<map>                  an earlier build's map of a retired feature, until it empties
type layout string

func (l layout) maps() string             { return filepath.Join(string(l), "maps") }
func (l layout) links() string            { return filepath.Join(string(l), "links") }
func (l layout) pods() string             { return filepath.Join(string(l), "pods") }
func (l layout) legacy() string           { return filepath.Join(string(l), "legacy") }
func (l layout) retired() string          { return filepath.Join(string(l), "retired") }
func (l layout) pod(cookie uint64) string { return filepath.Join(l.pods(), fmt.Sprint(cookie)) }

// cgroupHook is one socket program attached at the cgroup root.
type cgroupHook struct {
	name   string
	attach ebpf.AttachType
	prog   func(*programs) *ebpf.Program
}

// cgroupHooks in attach order: the programs that answer for redirected sockets go in
// before the connect programs start redirecting, and getsockopt before sockops: the
// new sockops moves an accepted socket's original destination out of the hand-over
// map, where an earlier release's getsockopt would look for it. Uninstall detaches
// in reverse.
var cgroupHooks = []cgroupHook{
	{"getsockopt", ebpf.AttachCGroupGetsockopt, func(p *programs) *ebpf.Program { return p.MeshGetsockopt }},
	{"getpeername4", ebpf.AttachCgroupInet4GetPeername, func(p *programs) *ebpf.Program { return p.MeshGetpeername4 }},
	{"getpeername6", ebpf.AttachCgroupInet6GetPeername, func(p *programs) *ebpf.Program { return p.MeshGetpeername6 }},
	{"recvmsg4", ebpf.AttachCGroupUDP4Recvmsg, func(p *programs) *ebpf.Program { return p.MeshRecvmsg4 }},
	{"recvmsg6", ebpf.AttachCGroupUDP6Recvmsg, func(p *programs) *ebpf.Program { return p.MeshRecvmsg6 }},
	{"sockops", ebpf.AttachCGroupSockOps, func(p *programs) *ebpf.Program { return p.MeshSockops }},
	{"sendmsg4", ebpf.AttachCGroupUDP4Sendmsg, func(p *programs) *ebpf.Program { return p.MeshSendmsg4 }},
	{"sendmsg6", ebpf.AttachCGroupUDP6Sendmsg, func(p *programs) *ebpf.Program { return p.MeshSendmsg6 }},
	{"sock_create", ebpf.AttachCGroupInetSockCreate, func(p *programs) *ebpf.Program { return p.MeshSockCreate }},
	{"connect4", ebpf.AttachCGroupInet4Connect, func(p *programs) *ebpf.Program { return p.MeshConnect4 }},
	{"connect6", ebpf.AttachCGroupInet6Connect, func(p *programs) *ebpf.Program { return p.MeshConnect6 }},
}

// programs are the ones loaded once; the small per-pod sk_lookup program, which
// tail-calls mesh_lookup_main, is loaded per pod from lookupTemplate.
type programs struct {
	MeshSockops      *ebpf.Program `ebpf:"mesh_sockops"`
	MeshGetsockopt   *ebpf.Program `ebpf:"mesh_getsockopt"`
	MeshGetpeername4 *ebpf.Program `ebpf:"mesh_getpeername4"`
	MeshGetpeername6 *ebpf.Program `ebpf:"mesh_getpeername6"`
	MeshConnect4     *ebpf.Program `ebpf:"mesh_connect4"`
	MeshConnect6     *ebpf.Program `ebpf:"mesh_connect6"`
	MeshSendmsg4     *ebpf.Program `ebpf:"mesh_sendmsg4"`
	MeshSendmsg6     *ebpf.Program `ebpf:"mesh_sendmsg6"`
	MeshRecvmsg4     *ebpf.Program `ebpf:"mesh_recvmsg4"`
	MeshRecvmsg6     *ebpf.Program `ebpf:"mesh_recvmsg6"`
	MeshLookupMain   *ebpf.Program `ebpf:"mesh_lookup_main"`
	MeshSockCreate   *ebpf.Program `ebpf:"mesh_sock_create"`
}

type objects struct {
	programs
	redirectMaps
}

func (o *objects) Close() error {
	return errors.Join(
		closeAll(o.MeshSockops, o.MeshGetsockopt, o.MeshGetpeername4, o.MeshGetpeername6,
			o.MeshConnect4, o.MeshConnect6, o.MeshSendmsg4, o.MeshSendmsg6, o.MeshRecvmsg4, o.MeshRecvmsg6,
			o.MeshLookupMain, o.MeshSockCreate),
		o.redirectMaps.Close(),
	)
}

func closeAll(progs ...*ebpf.Program) error {
	var errs []error
	for _, p := range progs {
		if p != nil {
			errs = append(errs, p.Close())
		}
	}
	return errors.Join(errs...)
}

// Datapath is a loaded (or adopted) redirection data path. Its methods are safe for
// concurrent use.
type Datapath struct {
	cfg    Config
	log    *zap.Logger
	pins   layout
	cgroup string
	// nodeCookies are the netns cookies of the node's and this process's own
	// namespaces, never enrolled.
	nodeCookies []uint64

	// mu guards the fields below: held for reading while the objects are in
	// use, for writing only to load and close them. Per-pod work runs in
	// parallel.
	mu      sync.RWMutex
	closed  bool
	objs    objects
	lookup  *lookupTemplate
	cgLinks map[string]link.Link
	// packetHook is the BPF LSM link of Config.PacketSockets (nil: none).
	packetHook link.Link

	// mapMu serializes the multi-step map updates (CIDR sets, then the pod
	// entry) so that readers see whole enrollments.
	mapMu    sync.Mutex
	excluded *sets[netip.Prefix]
	probes   *sets[netip.Prefix]
	ports    *sets[uint16]
	// pods serializes Enroll, Release and Check of one netns cookie (its pins).
	pods keylock.Map[uint64]
	// proc writes pods' net sysctls.
	proc procfs
}

// Open loads the data path, or adopts the one pinned under cfg.PinRoot by an earlier
// agent: pinned maps are reused as they are (enrollments survive), pinned cgroup
// links are switched to the freshly loaded programs with link.Update and pods'
// sk_lookup links to freshly built programs, so an agent restart or upgrade never
// leaves a moment without redirection. Maps of an earlier, incompatible layout are
// migrated (see migrate.go). It first checks that the kernel has every feature the
// data path uses and names the first one missing. When it fails, it undoes what it
// did: a mount it made, pins it created.
//
// Several Datapaths with different PinRoots can run on one host at once: each
// attaches its own programs at the cgroup root (multi-attach) and acts only on the
// network namespaces enrolled in its own maps.
func Open(ctx context.Context, cfg Config) (_ *Datapath, err error) {
	cfg = cfg.withDefaults()
	if err := ctx.Err(); err != nil {
		return nil, err
	}
	if err := CheckKernel(); err != nil {
		return nil, err
	}
	var undo undoStack
	defer func() {
		if err != nil {
			undo.run(cfg.Logger)
		}
	}()
	if err := ensurePinRoot(cfg.PinRoot, cfg.Logger, &undo); err != nil {
		return nil, err
	}
	cgroup := cfg.CgroupRoot
	if cgroup == "" {
		if cgroup, err = findCgroup2(); err != nil {
			return nil, err
		}
	}
	nodeCookies, err := nodeNetnsCookies()
	if err != nil {
		return nil, err
	}
	d := &Datapath{
		cfg:         cfg,
		log:         cfg.Logger.With(zap.String("pinRoot", cfg.PinRoot)),
		pins:        layout(cfg.PinRoot),
		cgroup:      cgroup,
		nodeCookies: nodeCookies,
		cgLinks:     map[string]link.Link{},
	}
	legacy, err := d.load(&undo)
	if err != nil {
		return nil, err
	}
	undo.push(func() error { return d.closeAll() })
	if legacy != nil {
		// Pods of an earlier socket-lookup layout are copied as they are, before
		// the sets they name are counted.
		if err := d.migratePods(legacy); err != nil {
			return nil, fmt.Errorf("migrate pinned maps: %w", err)
		}
	}
	if err := d.loadSets(); err != nil {
		return nil, err
	}
	d.dropLegacyNodeSet()
	if legacy != nil {
		// Entries first, then the programs: the cgroup links switch to programs
		// that already know every pod.
		if err := d.migrate(legacy); err != nil {
			return nil, fmt.Errorf("migrate pinned maps: %w", err)
		}
	}
	d.dropStrayPodNet()
	// Every pod's program tail-calls the shared decision: put this build's in
	// place, which for an upgrade switches every enrolled pod at once. Only now:
	// it reads this build's maps, which an upgrade from an earlier layout has
	// just filled; before, it would find no pod and refuse their connections.
	if err := d.objs.LookupMain.Update(uint32(0), d.objs.MeshLookupMain, ebpf.UpdateAny); err != nil {
		return nil, fmt.Errorf("install the shared sk_lookup program: %w", err)
	}
	if err := d.attachCgroup(ctx, &undo); err != nil {
		return nil, err
	}
	if cfg.PacketSockets {
		spec, err := loadRedirect()
		if err != nil {
			return nil, fmt.Errorf("load BPF spec: %w", err)
		}
		if err := d.attachPacketHook(spec, &undo); err != nil {
			return nil, err
		}
	} else {
		d.dropPacketHook()
	}
	d.retireSpliceRest()
	if legacy != nil {
		d.finishMigration(legacy)
	}
	d.adoptPods(ctx)
	d.log.Info("redirect data path ready", zap.String("cgroup", cgroup))
	return d, nil
}

// undoStack collects what a failing Open must take back, run in reverse.
type undoStack []func() error

func (u *undoStack) push(f func() error) { *u = append(*u, f) }

func (u undoStack) run(log *zap.Logger) {
	for i := len(u) - 1; i >= 0; i-- {
		if err := u[i](); err != nil {
			log.Warn("undo after a failed start", zap.Error(err))
		}
	}
}

// nodeNetnsCookies returns the cookies of this process's netns and of the init
// process's (the node's, when the agent runs with the host's PID namespace).
func nodeNetnsCookies() ([]uint64, error) {
	own, err := netns.CurrentCookie()
	if err != nil {
		return nil, fmt.Errorf("own netns cookie: %w", err)
	}
	cookies := []uint64{own}
	if f, err := netns.Open("/proc/1/ns/net"); err == nil {
		init, err := netns.CookieFd(int(f.Fd()))
		f.Close()
		if err == nil && init != own {
			cookies = append(cookies, init)
		}
	}
	return cookies, nil
}

// load creates or adopts the maps and loads the programs. Pinned maps whose layout
// no longer matches this build are moved under legacy/ first; the returned legacy
// maps (nil when there were none) are for migrate.
func (d *Datapath) load(undo *undoStack) (*legacyMaps, error) {
	for _, dir := range []string{d.pins.maps(), d.pins.links(), d.pins.pods()} {
		created, err := mkdirNew(dir)
		if err != nil {
			return nil, fmt.Errorf("create pin dir: %w", err)
		}
		if created {
			undo.push(func() error { return removeIfExists(dir) })
		}
	}
	spec, err := loadRedirect()
	if err != nil {
		return nil, fmt.Errorf("load BPF spec: %w", err)
	}
	d.retireSplicePins()
	legacy, err := d.setAsideIncompatible(spec)
	if err != nil {
		return nil, err
	}
	// Pins that did not exist before are this call's to remove if it fails.
	for name := range spec.Maps {
		pin := filepath.Join(d.pins.maps(), name)
		if _, err := os.Stat(pin); errors.Is(err, os.ErrNotExist) {
			undo.push(func() error { return removeIfExists(pin) })
		}
	}
	for _, m := range spec.Maps {
		m.Pinning = ebpf.PinByName
	}
	opts := &ebpf.CollectionOptions{Maps: ebpf.MapOptions{PinPath: d.pins.maps()}}
	if err := spec.LoadAndAssign(&d.objs, opts); err != nil {
		if legacy != nil {
			legacy.Close()
		}
		var verr *ebpf.VerifierError
		if errors.As(err, &verr) {
			return nil, fmt.Errorf("load BPF programs: %+v", verr)
		}
		return nil, fmt.Errorf("load BPF objects: %w", err)
	}
	if n := d.objs.Counters.MaxEntries(); n != counterMax {
		d.objs.Close()
		return nil, fmt.Errorf("counters map has %d entries, this build expects %d", n, counterMax)
	}
	lt, err := newLookupTemplate(spec.Programs["mesh_lookup"], &d.objs.redirectMaps)
	if err != nil {
		d.objs.Close()
		return nil, err
	}
	d.lookup = lt
	return legacy, nil
}

// mkdirNew creates dir (and its parents) with mode 0700 and reports whether dir
// itself was created by this call.
func mkdirNew(dir string) (bool, error) {
	if _, err := os.Stat(dir); err == nil {
		return false, nil
	}
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return false, err
	}
	return true, nil
}

// attachCgroup adopts or creates the cgroup links, one per hook.
func (d *Datapath) attachCgroup(ctx context.Context, undo *undoStack) error {
	for _, h := range cgroupHooks {
		if err := ctx.Err(); err != nil {
			return err
		}
		prog := h.prog(&d.objs.programs)
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
			undo.push(func() error { return detachPinned(pin) })
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

// adoptPods switches every pinned sk_lookup link to this build's program and drops
// the pins of pods without a settings entry (an Enroll or Release that did not
// finish: the entry is written last and removed first). A pod that has only an
// earlier version's per-interface links keeps them until it is enrolled again
// (Check reports it, so the agent's reconcile does that at start).
func (d *Datapath) adoptPods(ctx context.Context) {
	entries, err := os.ReadDir(d.pins.pods())
	if err != nil {
		d.log.Warn("list pinned pods", zap.Error(err))
		return
	}
	for _, e := range entries {
		if ctx.Err() != nil {
			return
		}
		cookie, ok := parseCookie(e.Name())
		if !ok {
			continue
		}
		var s redirectPodSettings
		if err := d.objs.Pods.Lookup(cookie, &s); err != nil {
			d.log.Info("removing pins of a pod that is not enrolled", zap.Uint64("cookie", cookie))
			if err := removeLinkDir(d.pins.pod(cookie)); err != nil {
				d.log.Warn("remove pod pins", zap.Uint64("cookie", cookie), zap.Error(err))
			}
			continue
		}
		pp, err := readPodPins(d.pins.pod(cookie))
		if err != nil {
			d.log.Warn("list pod pins", zap.Uint64("cookie", cookie), zap.Error(err))
			continue
		}
		if pp.lookup == nil {
			continue
		}
		if err := d.refreshLookup(cookie, pp.lookup.path); err != nil {
			d.log.Warn("pod link not updated", zap.Uint64("cookie", cookie), zap.Error(err))
		}
	}
}

// lockPod takes what a change to one pod holds: the data path open (its read
// lock; Close waits) and the pod's own lock, in that order, then checks ctx,
// which may have ended while it waited. unlock releases both.
func (d *Datapath) lockPod(ctx context.Context, cookie uint64) (unlock func(), err error) {
	d.mu.RLock()
	if d.closed {
		d.mu.RUnlock()
		return nil, ErrClosed
	}
	podUnlock := d.pods.Lock(cookie)
	unlock = func() {
		podUnlock()
		d.mu.RUnlock()
	}
	if err := ctx.Err(); err != nil {
		unlock()
		return nil, err
	}
	return unlock, nil
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
	if d.packetHook != nil {
		errs = append(errs, d.packetHook.Close())
		d.packetHook = nil
	}
	if err := d.objs.Close(); err != nil {
		errs = append(errs, fmt.Errorf("close BPF objects: %w", err))
	}
	d.proc.close()
	return errors.Join(errs...)
}

// redirects says whether the hook sends connections or datagrams to the proxy
// (it rewrites their destination); the others answer for what it sent.
func (h cgroupHook) redirects() bool {
	switch h.attach {
	case ebpf.AttachCGroupInet4Connect, ebpf.AttachCGroupInet6Connect, ebpf.AttachCGroupUDP4Sendmsg, ebpf.AttachCGroupUDP6Sendmsg:
		return true
	}
	return false
}

// Uninstall removes everything Open and Enroll put in place under cfg.PinRoot:
// it detaches the pods' links and the cgroup links (the redirecting programs
// first, and the ones that answer for what they redirected a grace period later,
// so no connection is redirected without them), removes the
// pins and, when PinRoot is a bpffs mount of its own, unmounts it and removes the
// directory. A PinRoot inside a shared bpffs (such as /sys/fs/bpf) is removed, the
// mount left alone. Nothing there is fine. Any open Datapath on this PinRoot stops
// redirecting.
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
	// The hooks that redirect go first. A connection one of them sent to the
	// proxy's port just before is handed over by sockops when its side is
	// established and answered for by getsockopt when the proxy accepts it,
	// which under load comes later: those stay for cfg.UninstallGrace, so the
	// proxy does not find the connection addressed to itself.
	redirected := false
	for i := len(cgroupHooks) - 1; i >= 0; i-- {
		if h := cgroupHooks[i]; h.redirects() {
			path := filepath.Join(pins.links(), h.name)
			if _, err := os.Stat(path); err == nil {
				redirected = true
			}
			errs = append(errs, detachPinned(path))
		}
	}
	// Hooks this build does not know (pinned by an older or newer build) may
	// redirect too: they go with the redirecting ones, before the grace.
	// Whatever of theirs answered for them goes with them: nothing they
	// redirected is then left unanswered by a hook of this build's.
	others, err := os.ReadDir(pins.links())
	if err != nil && !errors.Is(err, os.ErrNotExist) {
		errs = append(errs, fmt.Errorf("list links: %w", err))
	}
	for _, e := range others {
		if slices.ContainsFunc(cgroupHooks, func(h cgroupHook) bool { return h.name == e.Name() }) {
			continue
		}
		redirected = true
		errs = append(errs, detachPinned(filepath.Join(pins.links(), e.Name())))
	}
	if redirected && len(podDirs) > 0 {
		// A caller that stops waiting still gets everything removed: nothing
		// redirects any more, and what answers for it goes now.
		select {
		case <-time.After(cfg.UninstallGrace):
		case <-ctx.Done():
		}
	}
	for i := len(cgroupHooks) - 1; i >= 0; i-- {
		if h := cgroupHooks[i]; !h.redirects() {
			errs = append(errs, detachPinned(filepath.Join(pins.links(), h.name)))
		}
	}
	for _, dir := range []string{pins.pods(), pins.links()} {
		errs = append(errs, removeIfExists(dir))
	}
	for _, dir := range []string{pins.maps(), pins.legacy(), pins.retired()} {
		mapPins, err := os.ReadDir(dir)
		if err != nil && !errors.Is(err, os.ErrNotExist) {
			errs = append(errs, fmt.Errorf("list %s: %w", dir, err))
		}
		for _, e := range mapPins {
			errs = append(errs, removeIfExists(filepath.Join(dir, e.Name())))
		}
		errs = append(errs, removeIfExists(dir))
	}
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
	// A link whose interface or namespace is gone is already detached; unpinning
	// is what remains, so a failed Detach is not an error when Unpin succeeds.
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

// isNodeCookie reports whether cookie is the node's or this process's netns.
func (d *Datapath) isNodeCookie(cookie uint64) bool { return slices.Contains(d.nodeCookies, cookie) }
