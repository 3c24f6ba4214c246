package redirect

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/link"
	"go.uber.org/zap"

	"github.com/mesh-cni/mesh-cni/pkg/netns"
)

// Target is a pod to enroll.
type Target struct {
	// NetnsPath is the pod's network namespace (/proc/PID/ns/net or a bind mount).
	NetnsPath string
	// Interfaces are the pod's interface names inside that netns (from the CNI
	// prevResult); each gets the inbound program. Loopback needs none.
	Interfaces []string
	Settings   Settings
}

// Link is a pod interface that carries the inbound program.
type Link struct {
	// Index is the interface index inside the pod netns when it was attached.
	Index int
	Name  string
}

// Enrollment is one enrolled pod, as the data path holds it.
type Enrollment struct {
	Cookie     uint64
	Interfaces []Link   // sorted by name
	Settings   Settings // normalized: sorted, deduplicated, masked
}

const ifNameMax = 15 // IFNAMSIZ - 1

// Enroll puts redirection in place for the pod: the inbound TCX program on each
// interface (attached from a thread inside the pod netns, pinned under
// PinRoot/pods/<cookie>/), then the CIDR entries, then — last — the settings entry
// every program keys on, so the pod is redirected all at once or not at all.
// Enrolling again with the same or new settings is safe: links that are intact are
// kept, links for interfaces no longer listed are removed.
func (d *Datapath) Enroll(ctx context.Context, t Target) (Enrollment, error) {
	if err := t.Settings.Validate(); err != nil {
		return Enrollment{}, err
	}
	s := t.Settings.normalized()
	names, err := checkIfNames(t.Interfaces)
	if err != nil {
		return Enrollment{}, err
	}
	if err := netns.Validate(t.NetnsPath); err != nil {
		return Enrollment{}, fmt.Errorf("enroll: %w", err)
	}
	nsFile, err := os.Open(t.NetnsPath)
	if err != nil {
		return Enrollment{}, fmt.Errorf("enroll: open netns: %w", err)
	}
	defer nsFile.Close()
	nsFd := int(nsFile.Fd())
	cookie, err := netns.CookieFd(nsFd)
	if err != nil {
		return Enrollment{}, fmt.Errorf("enroll %s: netns cookie: %w", t.NetnsPath, err)
	}
	log := d.log.With(zap.Uint64("cookie", cookie), zap.String("netns", t.NetnsPath))

	d.mu.RLock()
	defer d.mu.RUnlock()
	if d.closed {
		return Enrollment{}, ErrClosed
	}
	defer d.pods.lock(cookie)()
	if err := ctx.Err(); err != nil {
		return Enrollment{}, err
	}

	var old redirectPodSettings
	wasEnrolled := d.objs.Settings.Lookup(cookie, &old) == nil
	podDir := d.pins.pod(cookie)
	if err := os.MkdirAll(podDir, 0o700); err != nil {
		return Enrollment{}, fmt.Errorf("enroll: create %s: %w", podDir, err)
	}
	existing, err := readPodPins(podDir)
	if err != nil {
		return Enrollment{}, fmt.Errorf("enroll: %w", err)
	}
	ingressID, err := d.ingressID()
	if err != nil {
		return Enrollment{}, err
	}

	var (
		links   []Link
		created []string // pins made by this call, undone on failure
		keep    = map[string]bool{}
	)
	rollback := func() {
		for _, pin := range created {
			if err := detachPinned(pin); err != nil {
				log.Warn("roll back tcx link", zap.String("pin", pin), zap.Error(err))
			}
		}
		if !wasEnrolled {
			_ = os.Remove(podDir) // only succeeds when empty
		}
	}
	err = netns.DoFd(nsFd, func() error {
		for _, name := range names {
			if err := ctx.Err(); err != nil {
				return err
			}
			iface, err := net.InterfaceByName(name)
			if err != nil {
				return fmt.Errorf("interface %q: %w", name, err)
			}
			pin := filepath.Join(podDir, pinName(iface.Index, iface.Name))
			keep[pin] = true
			links = append(links, Link{Index: iface.Index, Name: iface.Name})
			if d.keepTCX(pin, iface.Index, ingressID) {
				continue
			}
			if err := detachPinned(pin); err != nil {
				return err
			}
			// The ifindex is resolved in this thread's netns: the pod's.
			l, err := link.AttachTCX(link.TCXOptions{
				Interface: iface.Index,
				Program:   d.objs.MeshIngress,
				Attach:    ebpf.AttachTCXIngress,
			})
			if err != nil {
				return fmt.Errorf("attach tcx ingress to %s: %w", iface.Name, err)
			}
			err = l.Pin(pin)
			l.Close() // once pinned, the pin holds the link
			if err != nil {
				return fmt.Errorf("pin tcx link of %s: %w", iface.Name, err)
			}
			created = append(created, pin)
		}
		return nil
	})
	if err != nil {
		rollback()
		return Enrollment{}, fmt.Errorf("enroll %s: %w", t.NetnsPath, err)
	}

	d.mapMu.Lock()
	defer d.mapMu.Unlock()
	// Reading a pod's CIDRs walks both tries whole; a first enrollment (every
	// ADD) has none: netns cookies are never reused within a boot, and Release
	// and Open remove the entries of cookies without settings.
	var oldExcluded, oldProbes []netip.Prefix
	if wasEnrolled {
		if oldExcluded, oldProbes, err = d.podCIDRs(cookie); err != nil {
			rollback()
			return Enrollment{}, fmt.Errorf("enroll: %w", err)
		}
	}
	addedExcluded, err := putCIDRs(d.objs.ExcludedDsts, cookie, s.ExcludedCIDRs, oldExcluded)
	if err == nil {
		var addedProbes []netip.Prefix
		addedProbes, err = putCIDRs(d.objs.ProbeSrcs, cookie, s.ProbeSources, oldProbes)
		if err == nil {
			err = d.objs.Settings.Put(cookie, s.toBPF())
			if err != nil {
				err = fmt.Errorf("write settings entry: %w", err)
			}
		}
		if err != nil {
			deleteCIDRs(d.objs.ProbeSrcs, cookie, addedProbes)
		}
	}
	if err != nil {
		deleteCIDRs(d.objs.ExcludedDsts, cookie, addedExcluded)
		rollback()
		return Enrollment{}, fmt.Errorf("enroll %s: %w", t.NetnsPath, err)
	}

	// The entry is in place: now drop what the new settings no longer include.
	deleteCIDRs(d.objs.ExcludedDsts, cookie, missing(oldExcluded, s.ExcludedCIDRs))
	deleteCIDRs(d.objs.ProbeSrcs, cookie, missing(oldProbes, s.ProbeSources))
	for _, p := range existing {
		if !keep[p.path] {
			if err := detachPinned(p.path); err != nil {
				log.Warn("remove link of an interface no longer listed", zap.String("interface", p.name), zap.Error(err))
			}
		}
	}
	slices.SortFunc(links, func(a, b Link) int { return strings.Compare(a.Name, b.Name) })
	log.Info("enrolled", zap.Strings("interfaces", names), zap.Bool("update", wasEnrolled))
	return Enrollment{Cookie: cookie, Interfaces: links, Settings: s}, nil
}

// keepTCX reports whether the link pinned at pin is attached to ifindex and runs
// this data path's ingress program (switching it over if it runs another).
func (d *Datapath) keepTCX(pin string, ifindex int, ingressID ebpf.ProgramID) bool {
	l, err := link.LoadPinnedLink(pin, nil)
	if err != nil {
		return false
	}
	defer l.Close()
	info, err := l.Info()
	if err != nil || info.TCX() == nil || int(info.TCX().Ifindex) != ifindex {
		return false
	}
	if info.Program != ingressID {
		return l.Update(d.objs.MeshIngress) == nil
	}
	return true
}

func (d *Datapath) ingressID() (ebpf.ProgramID, error) {
	info, err := d.objs.MeshIngress.Info()
	if err != nil {
		return 0, fmt.Errorf("ingress program info: %w", err)
	}
	id, ok := info.ID()
	if !ok {
		return 0, errors.New("ingress program has no ID")
	}
	return id, nil
}

// Release removes the pod's redirection: the settings entry first (every program
// stops acting on the netns at once), then its CIDR entries, links and pins. It needs
// only the cookie, so it works after the netns is gone, and it is idempotent.
func (d *Datapath) Release(ctx context.Context, cookie uint64) error {
	d.mu.RLock()
	defer d.mu.RUnlock()
	if d.closed {
		return ErrClosed
	}
	if err := ctx.Err(); err != nil {
		return err
	}
	defer d.pods.lock(cookie)()
	var errs []error
	func() {
		d.mapMu.Lock()
		defer d.mapMu.Unlock()
		if err := d.objs.Settings.Delete(cookie); err != nil && !errors.Is(err, ebpf.ErrKeyNotExist) {
			errs = append(errs, fmt.Errorf("delete settings entry: %w", err))
			return
		}
		excluded, probes, err := d.podCIDRs(cookie)
		errs = append(errs, err)
		deleteCIDRs(d.objs.ExcludedDsts, cookie, excluded)
		deleteCIDRs(d.objs.ProbeSrcs, cookie, probes)
	}()
	if err := errors.Join(errs...); err != nil {
		return fmt.Errorf("release %d: %w", cookie, err)
	}
	// Outside mapMu: detaching waits for an RCU grace period.
	errs = append(errs, d.removePodLinks(cookie))
	if err := errors.Join(errs...); err != nil {
		return fmt.Errorf("release %d: %w", cookie, err)
	}
	d.log.Info("released", zap.Uint64("cookie", cookie))
	return nil
}

func (d *Datapath) removePodLinks(cookie uint64) error {
	return removeLinkDir(d.pins.pod(cookie))
}

// Check reports whether the pod's redirection is intact: the settings entry exists,
// and every pinned TCX link is still attached to its interface and runs this data
// path's program; interfaces, when not nil, must all have a link. The error says
// everything that is missing.
func (d *Datapath) Check(ctx context.Context, cookie uint64, interfaces []string) error {
	d.mu.RLock()
	defer d.mu.RUnlock()
	if d.closed {
		return ErrClosed
	}
	defer d.pods.lock(cookie)()
	if err := ctx.Err(); err != nil {
		return err
	}
	var s redirectPodSettings
	if err := d.objs.Settings.Lookup(cookie, &s); err != nil {
		if errors.Is(err, ebpf.ErrKeyNotExist) {
			return fmt.Errorf("netns cookie %d: %w", cookie, ErrNotEnrolled)
		}
		return fmt.Errorf("check %d: %w", cookie, err)
	}
	ingressID, err := d.ingressID()
	if err != nil {
		return err
	}
	pins, err := readPodPins(d.pins.pod(cookie))
	if err != nil {
		return fmt.Errorf("check %d: %w", cookie, err)
	}
	var errs []error
	have := map[string]bool{}
	for _, p := range pins {
		have[p.name] = true
		if err := checkTCX(p, ingressID); err != nil {
			errs = append(errs, err)
		}
	}
	for _, name := range interfaces {
		if !have[name] {
			errs = append(errs, fmt.Errorf("interface %s has no tcx link: %w", name, ErrLinkBroken))
		}
	}
	errs = append(errs, d.checkCgroupLinks())
	if err := errors.Join(errs...); err != nil {
		return fmt.Errorf("netns cookie %d: %w", cookie, err)
	}
	return nil
}

func checkTCX(p podPin, ingressID ebpf.ProgramID) error {
	l, err := link.LoadPinnedLink(p.path, nil)
	if err != nil {
		return fmt.Errorf("interface %s: load pinned link: %w: %w", p.name, err, ErrLinkBroken)
	}
	defer l.Close()
	info, err := l.Info()
	if err != nil {
		return fmt.Errorf("interface %s: link info: %w: %w", p.name, err, ErrLinkBroken)
	}
	tcx := info.TCX()
	switch {
	case tcx == nil:
		return fmt.Errorf("interface %s: pinned link is not tcx: %w", p.name, ErrLinkBroken)
	case tcx.Ifindex == 0:
		return fmt.Errorf("interface %s: link detached (interface gone): %w", p.name, ErrLinkBroken)
	case int(tcx.Ifindex) != p.index:
		return fmt.Errorf("interface %s: link on ifindex %d, pinned for %d: %w", p.name, tcx.Ifindex, p.index, ErrLinkBroken)
	case info.Program != ingressID:
		return fmt.Errorf("interface %s: link runs program %d, not %d: %w", p.name, info.Program, ingressID, ErrLinkBroken)
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
	excluded, err := allCIDRs(d.objs.ExcludedDsts)
	if err != nil {
		return nil, fmt.Errorf("list: %w", err)
	}
	probes, err := allCIDRs(d.objs.ProbeSrcs)
	if err != nil {
		return nil, fmt.Errorf("list: %w", err)
	}
	var (
		out    []Enrollment
		cookie uint64
		value  redirectPodSettings
	)
	it := d.objs.Settings.Iterate()
	for it.Next(&cookie, &value) {
		e := Enrollment{
			Cookie:   cookie,
			Settings: settingsFromBPF(value, excluded[cookie], probes[cookie]),
		}
		pins, err := readPodPins(d.pins.pod(cookie))
		if err != nil {
			return nil, fmt.Errorf("list: %w", err)
		}
		for _, p := range pins {
			e.Interfaces = append(e.Interfaces, Link{Index: p.index, Name: p.name})
		}
		out = append(out, e)
	}
	if err := it.Err(); err != nil {
		return nil, fmt.Errorf("list settings: %w", err)
	}
	slices.SortFunc(out, func(a, b Enrollment) int {
		switch {
		case a.Cookie < b.Cookie:
			return -1
		case a.Cookie > b.Cookie:
			return 1
		}
		return 0
	})
	return out, nil
}

// podPin is one pinned TCX link of a pod.
type podPin struct {
	path  string
	index int
	name  string
}

func pinName(ifindex int, name string) string { return fmt.Sprintf("tcx_%d_%s", ifindex, name) }

// readPodPins lists a pod's pins, sorted by interface name. A missing directory is an
// empty list; files not named by pinName are skipped.
func readPodPins(dir string) ([]podPin, error) {
	entries, err := os.ReadDir(dir)
	if errors.Is(err, os.ErrNotExist) {
		return nil, nil
	}
	if err != nil {
		return nil, fmt.Errorf("list pins in %s: %w", dir, err)
	}
	var pins []podPin
	for _, e := range entries {
		parts := strings.SplitN(e.Name(), "_", 3)
		if len(parts) != 3 || parts[0] != "tcx" {
			continue
		}
		idx, err := strconv.Atoi(parts[1])
		if err != nil || idx <= 0 {
			continue
		}
		pins = append(pins, podPin{path: filepath.Join(dir, e.Name()), index: idx, name: parts[2]})
	}
	slices.SortFunc(pins, func(a, b podPin) int { return strings.Compare(a.name, b.name) })
	return pins, nil
}

func parseCookie(s string) (uint64, bool) {
	c, err := strconv.ParseUint(s, 10, 64)
	return c, err == nil && c != 0
}

// checkIfNames validates interface names (they become file names under the pin root)
// and drops duplicates, keeping order.
func checkIfNames(names []string) ([]string, error) {
	var out []string
	for _, n := range names {
		if n == "" || len(n) > ifNameMax || n == "." || n == ".." ||
			strings.ContainsAny(n, "/\x00") || strings.ContainsFunc(n, isSpace) {
			return nil, fmt.Errorf("invalid interface name %q", n)
		}
		if !slices.Contains(out, n) {
			out = append(out, n)
		}
	}
	return out, nil
}

func isSpace(r rune) bool {
	return r == ' ' || r == '\t' || r == '\n' || r == '\r' || r == '\v' || r == '\f'
}

// podCIDRs reads one pod's entries from both tries.
func (d *Datapath) podCIDRs(cookie uint64) (excluded, probes []netip.Prefix, err error) {
	all, err := allCIDRs(d.objs.ExcludedDsts)
	if err != nil {
		return nil, nil, err
	}
	allProbes, err := allCIDRs(d.objs.ProbeSrcs)
	if err != nil {
		return nil, nil, err
	}
	return all[cookie], allProbes[cookie], nil
}

// allCIDRs reads a trie, grouped by cookie. Keys are collected before anything is
// deleted: iterating a map while deleting from it can skip entries.
func allCIDRs(m *ebpf.Map) (map[uint64][]netip.Prefix, error) {
	out := map[uint64][]netip.Prefix{}
	var (
		key redirectLpmKey
		val uint8
	)
	it := m.Iterate()
	for it.Next(&key, &val) {
		if cookie, p, ok := prefixFromLPM(key); ok {
			out[cookie] = append(out[cookie], p)
		}
	}
	if err := it.Err(); err != nil {
		return nil, fmt.Errorf("read %s: %w", m, err)
	}
	return out, nil
}

// putCIDRs writes want for cookie and returns the prefixes that were not there before.
func putCIDRs(m *ebpf.Map, cookie uint64, want, have []netip.Prefix) ([]netip.Prefix, error) {
	var added []netip.Prefix
	for _, p := range want {
		if slices.Contains(have, p) {
			continue
		}
		if err := m.Put(lpmKey(cookie, p), uint8(1)); err != nil {
			deleteCIDRs(m, cookie, added)
			return nil, fmt.Errorf("add %s to %s: %w", p, m, err)
		}
		added = append(added, p)
	}
	return added, nil
}

// deleteCIDRs removes entries; already missing ones are fine. Only the settings
// entry decides whether a pod is redirected, so a leftover prefix is harmless and
// removed by the next Open.
func deleteCIDRs(m *ebpf.Map, cookie uint64, ps []netip.Prefix) {
	for _, p := range ps {
		_ = m.Delete(lpmKey(cookie, p))
	}
}

// missing returns the prefixes of old not in cur.
func missing(old, cur []netip.Prefix) []netip.Prefix {
	var out []netip.Prefix
	for _, p := range old {
		if !slices.Contains(cur, p) {
			out = append(out, p)
		}
	}
	return out
}

// removeOrphanCIDRs drops trie entries of cookies that have no settings entry.
func (d *Datapath) removeOrphanCIDRs() {
	for _, m := range []*ebpf.Map{d.objs.ExcludedDsts, d.objs.ProbeSrcs} {
		all, err := allCIDRs(m)
		if err != nil {
			d.log.Warn("read CIDR trie", zap.Error(err))
			continue
		}
		for cookie, ps := range all {
			var s redirectPodSettings
			if d.objs.Settings.Lookup(cookie, &s) != nil {
				deleteCIDRs(m, cookie, ps)
			}
		}
	}
}
