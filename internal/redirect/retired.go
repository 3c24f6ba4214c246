package redirect

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"

	"github.com/cilium/ebpf"
	"go.uber.org/zap"
)

// Earlier builds could splice what a pod's applications wrote to their proxy
// into the proxy's socket (an sk_msg program on a sockhash, with a read
// accounting program pinned as a link); docs/design.md says why this one does
// not. On a node upgraded from such a build, retireSplice takes that away
// without breaking a connection:
//   - the switch (maps/splice_node) goes off first, so each spliced
//     connection's next write goes through TCP, behind what was spliced,
//     which the proxy's socket reads first;
//   - the read accounting's link is detached, and the pods' splice flag is
//     cleared;
//   - every splice pin goes but splice_targets, the proxies' sockets holding
//     spliced bytes they may not have read yet: freeing that map would drop
//     them. It moves to retired/ and goes once empty (its sockets leave it as
//     they close), checked at each start.

// The earlier build's splice pins, under the maps and links directories.
const (
	retiredSpliceSwitch  = "splice_node"
	retiredSpliceTargets = "splice_targets"
	retiredSpliceLink    = "splice_read"
	// retiredSpliceFlag is the pod setting that asked for the splice.
	retiredSpliceFlag = 1 << 15
)

func retiredSpliceMaps() []string {
	return []string{retiredSpliceSwitch, "splice_socks", "splice_flows", "splice_rx"}
}

// retireSplicePins takes an earlier build's splice pins away before this
// build loads (which would set any map it does not know aside and unpin it,
// splice_targets included): it is a no-op on a node that never spliced.
// Errors are logged: what is left spliced keeps working until its
// connections close.
func (d *Datapath) retireSplicePins() {
	sw := filepath.Join(d.pins.maps(), retiredSpliceSwitch)
	if !exists(sw) {
		return
	}
	var errs []error
	if m, err := ebpf.LoadPinnedMap(sw, nil); err == nil {
		// {enabled, pad, max_unread}: all zero is off.
		errs = append(errs, m.Put(uint32(0), make([]byte, m.ValueSize())), m.Close())
	} else {
		errs = append(errs, err)
	}
	if p := filepath.Join(d.pins.links(), retiredSpliceLink); exists(p) {
		errs = append(errs, detachPinned(p))
	}
	for _, name := range retiredSpliceMaps() {
		if err := os.Remove(filepath.Join(d.pins.maps(), name)); err != nil && !errors.Is(err, os.ErrNotExist) {
			errs = append(errs, err)
		}
	}
	if targets := filepath.Join(d.pins.maps(), retiredSpliceTargets); exists(targets) {
		if err := os.MkdirAll(d.pins.retired(), 0o700); err != nil {
			errs = append(errs, err)
		} else if err := os.Rename(targets, filepath.Join(d.pins.retired(), retiredSpliceTargets)); err != nil {
			errs = append(errs, err)
		}
	}
	if err := errors.Join(errs...); err != nil {
		d.log.Warn("retire an earlier build's splice", zap.Error(err))
		return
	}
	d.log.Info("retired an earlier build's splice: its connections go on through TCP")
}

// retireSpliceRest clears the pods' splice flag once this build's maps are
// loaded, and unpins the earlier build's proxy sockets (retired/) once none
// is left in their map.
func (d *Datapath) retireSpliceRest() {
	if err := d.clearPodFlag(retiredSpliceFlag); err != nil {
		d.log.Warn("clear the pods' splice flag", zap.Error(err))
	}
	p := filepath.Join(d.pins.retired(), retiredSpliceTargets)
	m, err := ebpf.LoadPinnedMap(p, &ebpf.LoadPinOptions{ReadOnly: true})
	if errors.Is(err, os.ErrNotExist) {
		return
	}
	if err != nil {
		d.log.Warn("an earlier build's spliced proxy sockets", zap.Error(err))
		return
	}
	defer m.Close()
	key := make([]byte, m.KeySize())
	if err := m.NextKey(nil, key); err == nil {
		d.log.Info("proxy sockets of an earlier build's splice may hold bytes they have not read: their map stays pinned until they close")
		return
	} else if !errors.Is(err, ebpf.ErrKeyNotExist) {
		d.log.Warn("an earlier build's spliced proxy sockets", zap.Error(err))
		return
	}
	if err := os.Remove(p); err != nil && !errors.Is(err, os.ErrNotExist) {
		d.log.Warn("unpin an earlier build's spliced proxy sockets", zap.Error(err))
		return
	}
	_ = os.Remove(d.pins.retired()) // empty now, unless a later retirement uses it
}

// clearPodFlag clears flag in every pod's settings (a flag no program of this
// build reads).
func (d *Datapath) clearPodFlag(flag redirectSettingFlags) error {
	d.mapMu.Lock()
	defer d.mapMu.Unlock()
	var (
		cookie uint64
		v      redirectPodSettings
		errs   []error
	)
	it := d.objs.Pods.Iterate()
	var set []uint64
	for it.Next(&cookie, &v) {
		if v.Flags&flag != 0 {
			set = append(set, cookie)
		}
	}
	if err := it.Err(); err != nil {
		return fmt.Errorf("read pods: %w", err)
	}
	for _, c := range set {
		if err := d.objs.Pods.Lookup(c, &v); err != nil {
			continue // released meanwhile
		}
		v.Flags &^= flag
		if err := d.objs.Pods.Update(c, v, ebpf.UpdateExist); err != nil && !errors.Is(err, ebpf.ErrKeyNotExist) {
			errs = append(errs, fmt.Errorf("pod %d: %w", c, err))
		}
	}
	return errors.Join(errs...)
}

func exists(p string) bool {
	_, err := os.Stat(p)
	return err == nil
}
