package redirect

import (
	"errors"
	"fmt"
	"net/netip"
	"slices"
	"strings"

	"github.com/cilium/ebpf"
	"go.uber.org/zap"
)

// legacyNodeSet is the set id an earlier layout kept the node's own addresses
// under in probe_srcs (its probe sources by default). Open removes them.
const legacyNodeSet = 0xffffffff

// maxSets bounds the set ids of one map: far more distinct lists than a node has
// settings profiles.
const maxSets = 1 << 16

// sets stores each distinct list (of CIDRs, of ports) of the enrolled pods once in
// its map, under a set id the pods' settings name. Pods with the same list (every
// pod of a node, usually) share one copy, so a map's size bounds the number of
// distinct lists, not the number of pods, and one pod cannot crowd out another's
// entries. Callers hold Datapath.mapMu.
type sets[E comparable] struct {
	m     *ebpf.Map
	key   func(set uint32, e E) any // the map key of a member
	byKey map[string]*set[E]
	byID  map[uint32]*set[E]
}

type set[E comparable] struct {
	id      uint32
	members []E // normalized
	refs    int
}

func listKey[E comparable](es []E) string {
	parts := make([]string, len(es))
	for i, e := range es {
		parts[i] = fmt.Sprint(e)
	}
	return strings.Join(parts, ",")
}

// newSets reads back the sets stored in m: read lists its (set, member) entries;
// normalize puts a set's members in canonical order. References are counted by the
// caller.
func newSets[E comparable](m *ebpf.Map, key func(uint32, E) any, read func(func(uint32, E)) error, normalize func([]E) []E) (*sets[E], error) {
	s := &sets[E]{m: m, key: key, byKey: map[string]*set[E]{}, byID: map[uint32]*set[E]{}}
	err := read(func(id uint32, e E) {
		if id == 0 || id == legacyNodeSet {
			return
		}
		st := s.byID[id]
		if st == nil {
			st = &set[E]{id: id}
			s.byID[id] = st
		}
		st.members = append(st.members, e)
	})
	if err != nil {
		return nil, fmt.Errorf("read %s: %w", m, err)
	}
	for _, st := range s.byID {
		st.members = normalize(st.members)
		s.byKey[listKey(st.members)] = st
	}
	return s, nil
}

// members of set id (nil for 0 or an unknown id).
func (s *sets[E]) members(id uint32) []E {
	if st := s.byID[id]; st != nil {
		return slices.Clone(st.members)
	}
	return nil
}

// acquire returns the id of the set holding exactly es (normalized), storing it
// first if no pod uses it yet, and takes a reference. An empty list is id 0.
func (s *sets[E]) acquire(es []E) (uint32, error) {
	if len(es) == 0 {
		return 0, nil
	}
	k := listKey(es)
	if st := s.byKey[k]; st != nil {
		st.refs++
		return st.id, nil
	}
	id := uint32(1)
	for ; id < maxSets && s.byID[id] != nil; id++ {
	}
	if id == maxSets {
		return 0, fmt.Errorf("%s: %d distinct lists, no set id left", s.m, len(s.byID))
	}
	for i, e := range es {
		if err := s.m.Put(s.key(id, e), uint8(1)); err != nil {
			for _, f := range es[:i] {
				_ = s.m.Delete(s.key(id, f))
			}
			return 0, fmt.Errorf("add %v to %s: %w", e, s.m, err)
		}
	}
	st := &set[E]{id: id, members: slices.Clone(es), refs: 1}
	s.byID[id], s.byKey[k] = st, st
	return id, nil
}

// release drops a reference to set id; the last one removes the set from the map.
// Ids 0 and unknown ones are ignored.
func (s *sets[E]) release(id uint32) {
	st := s.byID[id]
	if st == nil {
		return
	}
	if st.refs--; st.refs > 0 {
		return
	}
	s.drop(st)
}

func (s *sets[E]) drop(st *set[E]) {
	for _, e := range st.members {
		_ = s.m.Delete(s.key(st.id, e))
	}
	delete(s.byID, st.id)
	delete(s.byKey, listKey(st.members))
}

// countRef records a pod's existing reference to id (when reading the maps back).
func (s *sets[E]) countRef(id uint32) {
	if st := s.byID[id]; st != nil {
		st.refs++
	}
}

// dropUnreferenced removes the sets no pod names (left by a Release that did not
// finish).
func (s *sets[E]) dropUnreferenced() {
	for _, st := range s.byID {
		if st.refs == 0 {
			s.drop(st)
		}
	}
}

func cidrSets(trie *ebpf.Map) (*sets[netip.Prefix], error) {
	read := func(add func(uint32, netip.Prefix)) error {
		var (
			k redirectLpmKey
			v uint8
		)
		it := trie.Iterate()
		for it.Next(&k, &v) {
			if id, p, ok := prefixFromLPM(k); ok {
				add(id, p)
			}
		}
		return it.Err()
	}
	key := func(id uint32, p netip.Prefix) any { return lpmKey(id, p) }
	return newSets(trie, key, read, normalizePrefixes)
}

func portSets(m *ebpf.Map) (*sets[uint16], error) {
	read := func(add func(uint32, uint16)) error {
		var (
			k redirectPortKey
			v uint8
		)
		it := m.Iterate()
		for it.Next(&k, &v) {
			add(k.Set, k.Port)
		}
		return it.Err()
	}
	key := func(id uint32, p uint16) any { return redirectPortKey{Set: id, Port: p} }
	return newSets(m, key, read, normalizePorts)
}

// podSets are the sets one pod's settings name.
type podSets struct{ excluded, probes, inPorts, outPorts uint32 }

func setsOf(v redirectPodSettings) podSets {
	return podSets{v.ExcludedSet, v.ProbeSet, v.InboundPortSet, v.OutboundPortSet}
}

// loadSets reads the set maps back and counts the pods' references.
func (d *Datapath) loadSets() error {
	d.mapMu.Lock()
	defer d.mapMu.Unlock()
	var err error
	if d.excluded, err = cidrSets(d.objs.ExcludedDsts); err != nil {
		return err
	}
	if d.probes, err = cidrSets(d.objs.ProbeSrcs); err != nil {
		return err
	}
	if d.ports, err = portSets(d.objs.ExcludedPorts); err != nil {
		return err
	}
	err = eachEntry(d.objs.Pods, func(_ uint64, v redirectPodSettings) {
		ps := setsOf(v)
		d.excluded.countRef(ps.excluded)
		d.probes.countRef(ps.probes)
		d.ports.countRef(ps.inPorts)
		d.ports.countRef(ps.outPorts)
	})
	if err != nil {
		return fmt.Errorf("read pods: %w", err)
	}
	err = eachEntry(d.objs.PodCapture, func(_ uint64, c redirectPodCaptureInfo) {
		cs := captureSetsOf(c)
		d.excluded.countRef(cs.included)
		d.ports.countRef(cs.outPorts)
		d.ports.countRef(cs.inPorts)
	})
	if err != nil {
		return fmt.Errorf("read pod_capture: %w", err)
	}
	d.excluded.dropUnreferenced()
	d.probes.dropUnreferenced()
	d.ports.dropUnreferenced()
	return nil
}

func (d *Datapath) releaseSets(ps podSets) {
	d.excluded.release(ps.excluded)
	d.probes.release(ps.probes)
	d.ports.release(ps.inPorts)
	d.ports.release(ps.outPorts)
}

// settingsOf reads a pod's settings back, lists included; n is its pod_net
// entry (nil: none). Callers hold mapMu.
func (d *Datapath) settingsOf(v redirectPodSettings, n *redirectPodNetInfo, c *redirectPodCaptureInfo) Settings {
	ps := setsOf(v)
	s := settingsFromBPF(v, n, d.excluded.members(ps.excluded), d.probes.members(ps.probes),
		d.ports.members(ps.inPorts), d.ports.members(ps.outPorts))
	if c != nil {
		s.Capture = d.captureFromBPF(*c)
	}
	return s
}

// podNet reads the pod's pod_net entry; nil when it has none (enrolled by a
// build without the map, or copied from an earlier layout).
func (d *Datapath) podNet(cookie uint64) (*redirectPodNetInfo, error) {
	return podEntry[redirectPodNetInfo](d.objs.PodNet, cookie, "pod_net")
}

// podEntry reads a pod's entry of a per-pod map; nil when it has none.
func podEntry[V any](m *ebpf.Map, cookie uint64, name string) (*V, error) {
	var v V
	if err := m.Lookup(cookie, &v); errors.Is(err, ebpf.ErrKeyNotExist) {
		return nil, nil
	} else if err != nil {
		return nil, fmt.Errorf("read %s entry: %w", name, err)
	}
	return &v, nil
}

// putPod writes a pod's entries with its sets and addresses (nil: unknown, no
// pod_net entry), replacing earlier ones (old, when not nil) and releasing the
// sets that one named. The pods entry, which every program keys on, goes last.
// Callers hold mapMu.
func (d *Datapath) putPod(cookie uint64, s Settings, addrs *podAddrs, old *redirectPodSettings) error {
	var (
		ps   podSets
		errs acquisitions
	)
	id, err := d.excluded.acquire(s.ExcludedCIDRs)
	errs.take(&ps.excluded, id, err)
	id, err = d.probes.acquire(s.ProbeSources)
	errs.take(&ps.probes, id, err)
	id, err = d.ports.acquire(s.InboundExcludedPorts)
	errs.take(&ps.inPorts, id, err)
	id, err = d.ports.acquire(s.OutboundExcludedPorts)
	errs.take(&ps.outPorts, id, err)
	if err := errors.Join(errs...); err != nil {
		d.releaseSets(ps)
		return err
	}
	undoCapture, doneCapture, err := d.putCapture(cookie, s.Capture)
	if err != nil {
		d.releaseSets(ps)
		return err
	}
	if addrs != nil {
		err = d.objs.PodNet.Put(cookie, addrs.toBPF(s))
	} else {
		err = d.objs.PodNet.Delete(cookie)
		if errors.Is(err, ebpf.ErrKeyNotExist) {
			err = nil
		}
	}
	if err != nil {
		undoCapture()
		d.releaseSets(ps)
		return fmt.Errorf("write pod_net entry: %w", err)
	}
	if err := d.objs.Pods.Put(cookie, s.toBPF(ps)); err != nil {
		undoCapture()
		d.releaseSets(ps)
		if old == nil {
			_ = d.objs.PodNet.Delete(cookie)
		}
		return fmt.Errorf("write pod entry: %w", err)
	}
	doneCapture()
	if old != nil {
		d.releaseSets(setsOf(*old))
	}
	return nil
}

// deletePod removes a pod's entry and releases its sets. Callers hold mapMu.
func (d *Datapath) deletePod(cookie uint64) error {
	var v redirectPodSettings
	if err := d.objs.Pods.Lookup(cookie, &v); errors.Is(err, ebpf.ErrKeyNotExist) {
		return nil
	} else if err != nil {
		return fmt.Errorf("read pod entry: %w", err)
	}
	if err := d.objs.Pods.Delete(cookie); err != nil {
		return fmt.Errorf("delete pod entry: %w", err)
	}
	d.releaseSets(setsOf(v))
	if err := d.objs.PodNet.Delete(cookie); err != nil && !errors.Is(err, ebpf.ErrKeyNotExist) {
		return fmt.Errorf("delete pod_net entry: %w", err)
	}
	return d.deleteCapture(cookie)
}

// dropStrayPodNet removes pod_net and pod_capture entries of pods without a
// pods entry (an agent stopped between the deletions).
func (d *Datapath) dropStrayPodNet() {
	for _, cookie := range strayEntries[redirectPodNetInfo](d, d.objs.PodNet) {
		if err := d.objs.PodNet.Delete(cookie); err != nil && !errors.Is(err, ebpf.ErrKeyNotExist) {
			d.log.Warn("remove a stray pod_net entry", zap.Uint64("cookie", cookie), zap.Error(err))
		}
	}
	// pod_capture's sets were counted by loadSets: released with the entry.
	stray := strayEntries[redirectPodCaptureInfo](d, d.objs.PodCapture)
	d.mapMu.Lock()
	defer d.mapMu.Unlock()
	for _, cookie := range stray {
		if err := d.deleteCapture(cookie); err != nil {
			d.log.Warn("remove a stray pod_capture entry", zap.Uint64("cookie", cookie), zap.Error(err))
		}
	}
}

// strayEntries lists the cookies of a per-pod map (values V) that have no
// pods entry.
func strayEntries[V any](d *Datapath, m *ebpf.Map) []uint64 {
	var stray []uint64
	err := eachEntry(m, func(cookie uint64, _ V) {
		var p redirectPodSettings
		if errors.Is(d.objs.Pods.Lookup(cookie, &p), ebpf.ErrKeyNotExist) {
			stray = append(stray, cookie)
		}
	})
	if err != nil {
		d.log.Warn("read a per-pod map", zap.Error(err))
	}
	return stray
}

// eachEntry calls fn with every entry of a per-pod map (values V).
func eachEntry[V any](m *ebpf.Map, fn func(cookie uint64, v V)) error {
	var (
		cookie uint64
		v      V
	)
	it := m.Iterate()
	for it.Next(&cookie, &v) {
		fn(cookie, v)
	}
	return it.Err()
}

// acquisitions collects what acquiring a pod's sets failed with.
type acquisitions []error

// take stores a set id acquired (0 when it failed or the list is empty).
func (a *acquisitions) take(dst *uint32, id uint32, err error) {
	*dst = id
	*a = append(*a, err)
}
