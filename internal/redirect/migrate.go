package redirect

import (
	"encoding/binary"
	"errors"
	"fmt"
	"net/netip"
	"os"
	"path/filepath"
	"slices"
	"structs"

	"github.com/cilium/ebpf"
	"go.uber.org/zap"
)

// Upgrading a node whose pinned maps were made by an earlier layout of this data
// path, without a moment in which any enrolled pod is not redirected:
//
//  1. Open moves each pinned map whose layout this build does not have (or whose
//     spec changed) under legacy/ and creates this build's maps; maps whose layout
//     is unchanged (pods since the pinned release, sock_orig, orig_dsts) are
//     kept, so pods keep their entries and sockets redirected before the upgrade
//     their original destinations. A map's layout never changes now (new fields
//     go into new maps), so an earlier build, which sets aside only the maps it
//     does not know, keeps every entry it reads when the agent is rolled back.
//  2. migrate copies every pod's settings and CIDR lists into the new maps.
//  3. The pinned cgroup links switch to the new programs with link.Update: they
//     see every pod from their first run.
//  4. The earlier per-interface inbound links keep running their own program,
//     which still holds the legacy maps, until the agent enrolls each pod again
//     (Check reports them, the agent's reconcile at start repairs them): that
//     attaches the pod's sk_lookup link, then removes the old links.
//  5. finishMigration unpins legacy/: programs that still use those maps keep them
//     alive until their links go.

// podSettingsV2 is the pods value of the first socket-lookup layout (no DNS port).
// Its flags and set ids mean what they mean now, and the set maps are unchanged.
type podSettingsV2 struct {
	_               structs.HostLayout
	OutboundPort    uint16
	InboundPort     uint16
	Flags           uint32
	ProxyMark       uint32
	ProxyMarkMask   uint32
	ProxyUID        uint32
	ExcludedSet     uint32
	ProbeSet        uint32
	InboundPortSet  uint32
	OutboundPortSet uint32
}

// podSettingsWithNet is the pods value of the layout that held the pod's
// addresses and reply mark in the pods entry itself, after the settings: a
// pods value of this layout followed by podNetV1.
type podSettingsWithNet struct {
	_ structs.HostLayout
	redirectPodSettings
	podNetV1
}

// podNetV1 is what that layout held of a pod's namespace: pod_net_info before
// it held the kubelet's ports.
type podNetV1 struct {
	_             structs.HostLayout
	ReplyMark     uint32
	ReplyMarkMask uint32
	ScopeID       uint32
	Src4          uint32
	Src6          [4]uint32
	NrAddrs       uint32
	Addrs         [maxPodAddrs][4]uint32
}

// podNet is v as this build's pod_net value, with no kubelet ports (that layout
// never restricted the kubelet).
func (v podNetV1) podNet() *redirectPodNetInfo {
	return &redirectPodNetInfo{
		ReplyMark: v.ReplyMark, ReplyMarkMask: v.ReplyMarkMask, ScopeId: v.ScopeID,
		Src4: v.Src4, Src6: v.Src6, NrAddrs: v.NrAddrs, Addrs: v.Addrs,
	}
}

// Flags of earlier layouts that mean nothing now: the node's addresses as
// probe sources (the pinned release's SETTING_PROBE_NODE), and settings copied
// from an earlier layout without the pod's addresses.
const (
	earlierProbeNode = 1 << 9
	earlierCopied    = 1 << 13
)

// migratePods copies the pods of an earlier socket-lookup layout into this build's
// maps. Those of the first one, and those an earlier migration copied, come
// without their addresses, which only their namespace tells: they get no pod_net
// entry, so Check reports them and the agent's reconcile at start enrolls them
// again. Their per-pod programs tail-call the earlier shared program, which reads
// the earlier maps (still holding every entry), until Open puts this build's in
// place once the copy is done.
func (d *Datapath) migratePods(l *legacyMaps) error {
	pods := l.maps["pods"]
	if pods == nil {
		return nil
	}
	// read returns the next pod's entries; net is nil when its addresses are
	// not known.
	var read func(*uint64) (v redirectPodSettings, net *redirectPodNetInfo, ok bool)
	it := pods.Iterate()
	switch pods.ValueSize() {
	case uint32(binarySize[podSettingsV2]()):
		read = func(cookie *uint64) (redirectPodSettings, *redirectPodNetInfo, bool) {
			var v podSettingsV2
			ok := it.Next(cookie, &v)
			return redirectPodSettings{
				OutboundPort: v.OutboundPort, InboundPort: v.InboundPort,
				Flags:     redirectSettingFlags(v.Flags),
				ProxyMark: v.ProxyMark, ProxyMarkMask: v.ProxyMarkMask, ProxyUid: v.ProxyUID,
				ExcludedSet: v.ExcludedSet, ProbeSet: v.ProbeSet,
				InboundPortSet: v.InboundPortSet, OutboundPortSet: v.OutboundPortSet,
				DnsPort: DefaultSettings().DNSPort,
			}, nil, ok
		}
	case uint32(binarySize[redirectPodSettings]()):
		// This layout's own, set aside by a start that stopped before it
		// finished (Open keeps a pods map of this layout).
		read = func(cookie *uint64) (redirectPodSettings, *redirectPodNetInfo, bool) {
			var v redirectPodSettings
			ok := it.Next(cookie, &v)
			return v, nil, ok
		}
	case uint32(binarySize[podSettingsWithNet]()):
		read = func(cookie *uint64) (redirectPodSettings, *redirectPodNetInfo, bool) {
			var v podSettingsWithNet
			ok := it.Next(cookie, &v)
			if v.Flags&earlierCopied != 0 {
				return v.redirectPodSettings, nil, ok
			}
			return v.redirectPodSettings, v.podNet(), ok
		}
	default:
		return fmt.Errorf("legacy pods map has %d-byte values, a layout this build does not know", pods.ValueSize())
	}
	var (
		cookie uint64
		n      int
	)
	for {
		v, net, ok := read(&cookie)
		if !ok {
			break
		}
		if d.migratedBefore(cookie) {
			continue
		}
		v.Flags &^= earlierProbeNode | earlierCopied
		// pod_net first: the pods entry is what the programs key on.
		if net != nil {
			if err := d.objs.PodNet.Put(cookie, net); err != nil {
				return fmt.Errorf("migrate pod %d: %w", cookie, err)
			}
		}
		if err := d.objs.Pods.Put(cookie, v); err != nil {
			return fmt.Errorf("migrate pod %d: %w", cookie, err)
		}
		n++
	}
	return d.migrated(it, "an earlier socket-lookup layout", n)
}

// migratedBefore reports whether the pod is in this layout's map already: put
// there by an earlier start that was interrupted, or enrolled since.
func (d *Datapath) migratedBefore(cookie uint64) bool {
	var cur redirectPodSettings
	return d.objs.Pods.Lookup(cookie, &cur) == nil
}

// migrated ends a migration that read its pods through it: the iteration's
// error, or a log of how many pods came from layout.
func (d *Datapath) migrated(it *ebpf.MapIterator, layout string, n int) error {
	if err := it.Err(); err != nil {
		return fmt.Errorf("read the pods of %s: %w", layout, err)
	}
	d.log.Info("migrated pods from "+layout, zap.Int("pods", n))
	return nil
}

// legacyPodSettings is the settings value of the first layout (one port list
// applied in both directions, CIDR tries keyed by netns cookie).
type legacyPodSettings struct {
	_               structs.HostLayout
	OutboundPort    uint16
	InboundPort     uint16
	ProxyMark       uint32
	ProxyMarkMask   uint32
	ProxyUID        uint32
	Flags           uint32
	NrExcludedPorts uint32
	ExcludedPorts   [32]uint16
}

// legacyLpmKey is the first layout's trie key.
type legacyLpmKey struct {
	_         structs.HostLayout
	Prefixlen uint32
	Cookie    [2]uint32
	Addr      [4]uint32
}

const (
	legacyFlagProxyUID = 1 << 0
	legacyFlagFailOpen = 1 << 1
)

// legacyMaps are the pinned maps set aside by setAsideIncompatible.
type legacyMaps struct {
	dir  string
	maps map[string]*ebpf.Map
}

func (l *legacyMaps) Close() {
	for _, m := range l.maps {
		m.Close()
	}
}

// setAsideIncompatible moves pinned maps this build cannot adopt under legacy/ and
// opens them. It returns nil when there are none (and no earlier migration left
// any).
func (d *Datapath) setAsideIncompatible(spec *ebpf.CollectionSpec) (*legacyMaps, error) {
	entries, err := os.ReadDir(d.pins.maps())
	if err != nil {
		return nil, fmt.Errorf("list pinned maps: %w", err)
	}
	for _, e := range entries {
		pin := filepath.Join(d.pins.maps(), e.Name())
		if ms, ok := spec.Maps[e.Name()]; ok {
			m, err := ebpf.LoadPinnedMap(pin, nil)
			if err != nil {
				return nil, fmt.Errorf("open pinned map %s: %w", pin, err)
			}
			compatErr := ms.Compatible(m)
			m.Close()
			if compatErr == nil {
				continue
			}
		}
		if err := os.MkdirAll(d.pins.legacy(), 0o700); err != nil {
			return nil, fmt.Errorf("create %s: %w", d.pins.legacy(), err)
		}
		if err := os.Rename(pin, filepath.Join(d.pins.legacy(), e.Name())); err != nil {
			return nil, fmt.Errorf("set aside pinned map %s: %w", pin, err)
		}
		d.log.Info("pinned map of an earlier layout set aside for migration", zap.String("map", e.Name()))
	}
	legacy, err := os.ReadDir(d.pins.legacy())
	if errors.Is(err, os.ErrNotExist) {
		return nil, nil
	}
	if err != nil {
		return nil, fmt.Errorf("list %s: %w", d.pins.legacy(), err)
	}
	l := &legacyMaps{dir: d.pins.legacy(), maps: map[string]*ebpf.Map{}}
	for _, e := range legacy {
		m, err := ebpf.LoadPinnedMap(filepath.Join(l.dir, e.Name()), nil)
		if err != nil {
			l.Close()
			return nil, fmt.Errorf("open legacy map %s: %w", e.Name(), err)
		}
		l.maps[e.Name()] = m
	}
	return l, nil
}

// migrate copies the first layout's pods into this build's maps. A pod already in
// the new map (a migration that was interrupted) is left as it is.
func (d *Datapath) migrate(l *legacyMaps) error {
	settings := l.maps["settings"]
	if settings == nil {
		return nil
	}
	if settings.ValueSize() != uint32(binarySize[legacyPodSettings]()) {
		return fmt.Errorf("legacy settings map has %d-byte values, not the first layout's", settings.ValueSize())
	}
	excluded, err := legacyCIDRs(l.maps["excluded_dsts"])
	if err != nil {
		return err
	}
	probes, err := legacyCIDRs(l.maps["probe_srcs"])
	if err != nil {
		return err
	}
	d.mapMu.Lock()
	defer d.mapMu.Unlock()
	var (
		cookie uint64
		v      legacyPodSettings
		n      int
	)
	it := settings.Iterate()
	for it.Next(&cookie, &v) {
		if d.migratedBefore(cookie) {
			continue
		}
		ports := portsFromBPF(v.ExcludedPorts[:], v.NrExcludedPorts)
		s := Settings{
			OutboundPort: v.OutboundPort,
			InboundPort:  v.InboundPort,
			ProxyMark:    v.ProxyMark, ProxyMarkMask: v.ProxyMarkMask,
			// The first layout excluded its ports in both directions; the
			// agent's next enrollment of the pod applies its current settings.
			InboundExcludedPorts:  ports,
			OutboundExcludedPorts: slices.Clone(ports),
			ExcludedCIDRs:         excluded[cookie],
			ProbeSources:          probes[cookie],
			FailOpen:              v.Flags&legacyFlagFailOpen != 0,
		}
		if v.Flags&legacyFlagProxyUID != 0 {
			uid := v.ProxyUID
			s.ProxyUID = &uid
		}
		s = s.normalized()
		if err := s.Validate(); err != nil {
			d.log.Warn("legacy pod settings not migrated", zap.Uint64("cookie", cookie), zap.Error(err))
			continue
		}
		if err := d.putPod(cookie, s, nil, nil); err != nil {
			return fmt.Errorf("migrate pod %d: %w", cookie, err)
		}
		n++
	}
	return d.migrated(it, "an earlier layout", n)
}

func legacyCIDRs(m *ebpf.Map) (map[uint64][]netip.Prefix, error) {
	out := map[uint64][]netip.Prefix{}
	if m == nil {
		return out, nil
	}
	if m.KeySize() != uint32(binarySize[legacyLpmKey]()) {
		return nil, fmt.Errorf("legacy trie %s has %d-byte keys, not the first layout's", m, m.KeySize())
	}
	var (
		k   legacyLpmKey
		val uint8
	)
	it := m.Iterate()
	for it.Next(&k, &val) {
		bits := int(k.Prefixlen) - 64
		if bits < 0 || bits > 128 {
			continue
		}
		cookie := uint64(k.Cookie[0]) | uint64(k.Cookie[1])<<32
		a := netip.AddrFrom16(wordsAddr(k.Addr))
		p := netip.PrefixFrom(a, bits)
		if a.Is4In6() && bits >= lpmV4Offset {
			p = netip.PrefixFrom(a.Unmap(), bits-lpmV4Offset)
		}
		out[cookie] = append(out[cookie], p)
	}
	if err := it.Err(); err != nil {
		return nil, fmt.Errorf("read legacy trie %s: %w", m, err)
	}
	return out, nil
}

// finishMigration unpins the legacy maps and closes this process's handles.
func (d *Datapath) finishMigration(l *legacyMaps) {
	defer l.Close()
	for name := range l.maps {
		if err := removeIfExists(filepath.Join(l.dir, name)); err != nil {
			d.log.Warn("remove legacy map pin", zap.Error(err))
		}
	}
	if err := removeIfExists(l.dir); err != nil {
		d.log.Warn("remove legacy dir", zap.Error(err))
	}
}

// binarySize is the encoded size of a fixed-size map key or value type.
func binarySize[T any]() int {
	var v T
	return binary.Size(v)
}
