package redirect

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"net/netip"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"

	"github.com/cilium/ebpf/link"
	"go.uber.org/zap"

	"github.com/mesh-cni/mesh-cni/internal/netns"
)

// Target is a pod to enroll.
type Target struct {
	// NetnsPath is the pod's network namespace (/proc/PID/ns/net or a bind mount).
	NetnsPath string
	// Netns, when set, is that namespace already opened (and checked) by the
	// caller for its whole request: Enroll uses it and does not open the path.
	// The caller keeps it and closes it.
	Netns    *os.File
	Settings Settings
}

// Enrollment is one enrolled pod, as the data path holds it.
type Enrollment struct {
	Cookie uint64
	// NetnsInode is the inode of the namespace its inbound capture is attached
	// to (0 when the link is missing).
	NetnsInode uint64
	Settings   Settings // normalized: sorted, deduplicated, masked
	// Addresses are the pod's own addresses, read from its namespace when it
	// was enrolled: connects to them are not redirected, and its proxy's
	// connects to them get the reply mark.
	Addresses []netip.Addr
}

// Enroll puts redirection in place for the pod: its sk_lookup program attached to
// its network namespace (pinned under PinRoot/pods/<cookie>/), then — last — the
// settings entry every program keys on, so the pod is redirected in both directions
// at once or not at all. It refuses the node's own namespace. Enrolling again with
// the same or new settings is safe: an intact link is kept, one from an earlier
// version is replaced.
//
// The namespace is opened once (or taken from Target.Netns, opened by the
// caller for its whole request), checked, and that descriptor is used for every
// later step, so the path cannot be swapped between the check and the use.
func (d *Datapath) Enroll(ctx context.Context, t Target) (Enrollment, error) {
	if err := t.Settings.Validate(); err != nil {
		return Enrollment{}, err
	}
	if t.Settings.DenyPacketSockets && !d.cfg.PacketSockets {
		return Enrollment{}, fmt.Errorf("enroll %s: %w", t.NetnsPath, ErrNoPacketHook)
	}
	s := t.Settings.normalized()
	nsFile := t.Netns
	if nsFile == nil {
		f, err := netns.Open(t.NetnsPath)
		if err != nil {
			return Enrollment{}, fmt.Errorf("enroll: %w", err)
		}
		defer f.Close()
		nsFile = f
	}
	nsFd := int(nsFile.Fd())
	ino, err := netns.InodeFd(nsFd)
	if err != nil {
		return Enrollment{}, fmt.Errorf("enroll %s: %w", t.NetnsPath, err)
	}
	// One visit to the pod's namespace: its cookie, whether a proxy already
	// listens there (which sockops would not have seen start), its addresses and
	// its reply route.
	var (
		cookie    uint64
		listening bool
		addrs     podAddrs
	)
	err = netns.DoFd(nsFd, func() error {
		var err error
		if cookie, err = netns.CurrentCookie(); err != nil {
			return fmt.Errorf("netns cookie: %w", err)
		}
		if d.isNodeCookie(cookie) {
			return ErrNodeNamespace
		}
		if listening, err = listenerOnPort(s.InboundPort); err != nil {
			return err
		}
		if addrs, err = readPodAddrs(); err != nil {
			return err
		}
		if s.ReplyMark != 0 {
			return setupReplyRoute(&d.proc, s)
		}
		return nil
	})
	if err != nil {
		return Enrollment{}, fmt.Errorf("enroll %s: %w", t.NetnsPath, err)
	}
	log := d.log.With(zap.Uint64("cookie", cookie), zap.String("netns", t.NetnsPath))

	unlock, err := d.lockPod(ctx, cookie)
	if err != nil {
		return Enrollment{}, err
	}
	defer unlock()

	var old redirectPodSettings
	wasEnrolled := d.objs.Pods.Lookup(cookie, &old) == nil
	podDir := d.pins.pod(cookie)
	if err := os.MkdirAll(podDir, 0o700); err != nil {
		return Enrollment{}, fmt.Errorf("enroll: create %s: %w", podDir, err)
	}
	existing, err := readPodPins(podDir)
	if err != nil {
		return Enrollment{}, fmt.Errorf("enroll: %w", err)
	}
	pin := filepath.Join(podDir, lookupPinName(ino))
	created, err := d.attachLookup(cookie, nsFd, ino, pin, existing)
	if err != nil {
		if !wasEnrolled {
			_ = os.Remove(podDir) // only succeeds when empty
		}
		return Enrollment{}, fmt.Errorf("enroll %s: %w", t.NetnsPath, err)
	}
	rollback := func() {
		if created {
			if err := detachPinned(pin); err != nil {
				log.Warn("roll back sk_lookup link", zap.Error(err))
			}
		}
		if !wasEnrolled {
			_ = os.Remove(podDir)
			if s.ReplyMark != 0 {
				if err := netns.DoFd(nsFd, func() error { return removeReplyRoute(&d.proc, s) }); err != nil {
					log.Warn("roll back the reply route", zap.Error(err))
				}
			}
		}
	}
	// sockops collects only listeners of enrolled namespaces: a proxy already
	// listening (a pod enrolled while running, or before this data path existed)
	// is collected here, before the entry, and once more after it, for one that
	// began listening in between.
	if listening {
		if err := d.collectExisting(nsFd, cookie, s.InboundPort); err != nil {
			log.Warn("collect existing inbound listeners", zap.Error(err))
		}
	}

	err = func() error {
		d.mapMu.Lock()
		defer d.mapMu.Unlock()
		var prev *redirectPodSettings
		if wasEnrolled {
			prev = &old
		}
		return d.putPod(cookie, s, &addrs, prev)
	}()
	if err != nil {
		rollback()
		return Enrollment{}, fmt.Errorf("enroll %s: %w", t.NetnsPath, err)
	}
	if listening {
		if err := d.collectExisting(nsFd, cookie, s.InboundPort); err != nil {
			log.Warn("collect existing inbound listeners", zap.Error(err))
		}
	}

	// The entry is in place: now drop links this enrollment does not use (an
	// earlier version's per-interface links, a link to a namespace inode that is
	// no longer the pod's).
	for _, p := range existing.all() {
		if p != pin {
			if err := detachPinned(p); err != nil {
				log.Warn("remove an earlier link", zap.String("pin", p), zap.Error(err))
			}
		}
	}
	log.Info("enrolled", zap.Bool("update", wasEnrolled), zap.Stringers("addresses", addrs.all))
	return Enrollment{Cookie: cookie, NetnsInode: ino, Settings: s, Addresses: addrs.all}, nil
}

// attachLookup makes pin the pod's intact sk_lookup link: kept when it is, updated
// in place when it runs another program, attached otherwise. created reports a new
// attachment (for rollback).
func (d *Datapath) attachLookup(cookie uint64, nsFd int, ino uint64, pin string, existing podPins) (created bool, _ error) {
	if existing.lookup != nil && existing.lookup.path == pin {
		if d.checkLookup(cookie, pin, ino) == nil {
			return false, nil
		}
		if err := d.refreshLookup(cookie, pin); err == nil && d.checkLookup(cookie, pin, ino) == nil {
			return false, nil
		}
		if err := detachPinned(pin); err != nil {
			return false, err
		}
	}
	prog, err := d.lookup.load(cookie)
	if err != nil {
		return false, err
	}
	defer prog.Close()
	l, err := link.AttachNetNs(nsFd, prog)
	if err != nil {
		return false, fmt.Errorf("attach sk_lookup to netns: %w", err)
	}
	err = l.Pin(pin)
	l.Close() // once pinned, the pin holds the link
	if err != nil {
		return false, fmt.Errorf("pin sk_lookup link: %w", err)
	}
	return true, nil
}

// Release removes the pod's redirection: the settings entry first (every program
// stops acting on the netns at once), then its CIDR set references, links, pins
// and collected listeners. It needs only the cookie, so it works after the netns is
// gone, and it is idempotent. A pod that leaves the mesh while its namespace lives
// on is released with ReleaseNetns, which also takes its reply route out.
func (d *Datapath) Release(ctx context.Context, cookie uint64) error {
	return d.release(ctx, cookie, -1)
}

// ReleaseNetns releases the pod whose namespace is at netnsPath, as Release does,
// and removes what Enroll put inside that namespace (the reply route).
func (d *Datapath) ReleaseNetns(ctx context.Context, netnsPath string) error {
	ns, err := netns.OpenHandle(netnsPath)
	if err != nil {
		return fmt.Errorf("release: %w", err)
	}
	defer ns.Close()
	if d.isNodeCookie(ns.Cookie) {
		return fmt.Errorf("release %s: %w", netnsPath, ErrNodeNamespace)
	}
	return d.release(ctx, ns.Cookie, int(ns.File.Fd()))
}

func (d *Datapath) release(ctx context.Context, cookie uint64, nsFd int) error {
	unlock, err := d.lockPod(ctx, cookie)
	if err != nil {
		return err
	}
	defer unlock()
	var v redirectPodSettings
	enrolled := d.objs.Pods.Lookup(cookie, &v) == nil
	// The reply mark its reply route is for (none known without a pod_net
	// entry: a pod enrolled by a build without one has no reply route).
	podNet, err := d.podNet(cookie)
	if err != nil {
		return fmt.Errorf("release %d: %w", cookie, err)
	}
	err = func() error {
		d.mapMu.Lock()
		defer d.mapMu.Unlock()
		return d.deletePod(cookie)
	}()
	if err != nil {
		return fmt.Errorf("release %d: %w", cookie, err)
	}
	errs := []error{removeLinkDir(d.pins.pod(cookie))}
	if enrolled {
		d.dropListeners(cookie, v.InboundPort)
		if nsFd >= 0 && v.Flags&redirectSettingFlagsSETTING_REPLY_MARK != 0 && podNet != nil {
			s := Settings{ReplyMark: podNet.ReplyMark, ReplyMarkMask: podNet.ReplyMarkMask}
			errs = append(errs, netns.DoFd(nsFd, func() error { return removeReplyRoute(&d.proc, s) }))
		}
	}
	if err := errors.Join(errs...); err != nil {
		return fmt.Errorf("release %d: %w", cookie, err)
	}
	d.log.Info("released", zap.Uint64("cookie", cookie))
	return nil
}

// Check reports whether the pod's redirection is intact: the settings entry exists,
// the pod's sk_lookup link is attached to its namespace and runs its program, and
// the cgroup programs are attached. The error says everything that is missing.
// Inbound capture is per namespace: the one link covers every interface of the pod.
func (d *Datapath) Check(ctx context.Context, cookie uint64) error {
	_, unlock, err := d.lockEnrolled(ctx, cookie)
	if err != nil {
		return err
	}
	defer unlock()
	pp, err := readPodPins(d.pins.pod(cookie))
	if err != nil {
		return fmt.Errorf("check %d: %w", cookie, err)
	}
	var errs []error
	switch n, err := d.podNet(cookie); {
	case err != nil:
		errs = append(errs, err)
	case n == nil:
		// Enrolled by a build without pod_net (the release, before an
		// upgrade or during a rollback) or copied from an earlier layout.
		errs = append(errs, fmt.Errorf("enrolled without the pod's addresses (no pod_net entry): %w", ErrLinkBroken))
	}
	switch {
	case pp.lookup != nil:
		if err := d.checkLookup(cookie, pp.lookup.path, pp.lookup.ino); err != nil {
			errs = append(errs, fmt.Errorf("inbound capture: %w", err))
		}
	case len(pp.legacy) > 0:
		errs = append(errs, fmt.Errorf("inbound capture still by an earlier version's per-interface links: %w", ErrLinkBroken))
	default:
		errs = append(errs, fmt.Errorf("no inbound capture link: %w", ErrLinkBroken))
	}
	errs = append(errs, d.checkCgroupLinks())
	if err := errors.Join(errs...); err != nil {
		return fmt.Errorf("netns cookie %d: %w", cookie, err)
	}
	return nil
}

// checkCgroupLinks verifies the socket programs are still attached to the cgroup
// (something other than this Datapath, such as Uninstall, may have detached them).
func (d *Datapath) checkCgroupLinks() error {
	var errs []error
	for _, h := range cgroupHooks {
		l := d.cgLinks[h.name]
		if l == nil {
			errs = append(errs, fmt.Errorf("cgroup link %s missing", h.name))
			continue
		}
		info, err := l.Info()
		if err != nil {
			errs = append(errs, fmt.Errorf("cgroup link %s: %w", h.name, err))
			continue
		}
		if cg := info.Cgroup(); cg == nil || cg.CgroupId == 0 {
			errs = append(errs, fmt.Errorf("cgroup link %s is detached", h.name))
		}
	}
	return errors.Join(errs...)
}

// List returns every enrolled pod, read back from the pinned maps and pins, so an
// agent that restarted sees what its predecessor enrolled. Sorted by cookie.
func (d *Datapath) List(ctx context.Context) ([]Enrollment, error) {
	d.mu.RLock()
	defer d.mu.RUnlock()
	if d.closed {
		return nil, ErrClosed
	}
	d.mapMu.Lock()
	defer d.mapMu.Unlock()
	if err := ctx.Err(); err != nil {
		return nil, err
	}
	var (
		out    []Enrollment
		cookie uint64
		value  redirectPodSettings
	)
	it := d.objs.Pods.Iterate()
	for it.Next(&cookie, &value) {
		n, err := d.podNet(cookie)
		if err != nil {
			return nil, fmt.Errorf("list: %w", err)
		}
		c, err := d.podCapture(cookie)
		if err != nil {
			return nil, fmt.Errorf("list: %w", err)
		}
		e := Enrollment{Cookie: cookie, Settings: d.settingsOf(value, n, c)}
		if n != nil {
			e.Addresses = podAddrsFromBPF(*n)
		}
		pp, err := readPodPins(d.pins.pod(cookie))
		if err != nil {
			return nil, fmt.Errorf("list: %w", err)
		}
		if pp.lookup != nil {
			e.NetnsInode = pp.lookup.ino
		}
		out = append(out, e)
	}
	if err := it.Err(); err != nil {
		return nil, fmt.Errorf("list pods: %w", err)
	}
	slices.SortFunc(out, func(a, b Enrollment) int { return cmp.Compare(a.Cookie, b.Cookie) })
	return out, nil
}

// podPins are the pins in one pod's directory.
type podPins struct {
	lookup *lookupPin
	// legacy are per-interface links of an earlier version (tcx_<ifindex>_<name>)
	// and anything else found there.
	legacy []string
}

type lookupPin struct {
	path string
	ino  uint64
}

func (p podPins) all() []string {
	out := slices.Clone(p.legacy)
	if p.lookup != nil {
		out = append(out, p.lookup.path)
	}
	return out
}

// readPodPins lists a pod's pins. A missing directory is an empty list. With more
// than one lookup link (a namespace inode that changed), the others count as legacy.
func readPodPins(dir string) (podPins, error) {
	var pp podPins
	entries, err := os.ReadDir(dir)
	if errors.Is(err, os.ErrNotExist) {
		return pp, nil
	}
	if err != nil {
		return pp, fmt.Errorf("list pins in %s: %w", dir, err)
	}
	for _, e := range entries {
		path := filepath.Join(dir, e.Name())
		if v, ok := strings.CutPrefix(e.Name(), "lookup_"); ok {
			if ino, err := strconv.ParseUint(v, 10, 64); err == nil && ino != 0 && pp.lookup == nil {
				pp.lookup = &lookupPin{path: path, ino: ino}
				continue
			}
		}
		pp.legacy = append(pp.legacy, path)
	}
	return pp, nil
}

func parseCookie(s string) (uint64, bool) {
	c, err := strconv.ParseUint(s, 10, 64)
	return c, err == nil && c != 0
}
