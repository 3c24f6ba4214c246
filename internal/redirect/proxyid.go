package redirect

import (
	"bufio"
	"errors"
	"fmt"
	"maps"
	"net/netip"
	"os"
	"path/filepath"
	"slices"
	"strings"

	"github.com/cilium/ebpf"
	"go.uber.org/zap"
	"golang.org/x/sys/unix"
)

// MaxProxyCgroups is how many proxy cgroups the node's settings hold
// (MAX_PROXY_CGROUPS of bpf/redirect.c).
const MaxProxyCgroups = len(redirectNodeConfig{}.ProxyCgroups)

// SetProxyCgroups names the cgroups whose processes are the mesh proxy: their
// connects are never redirected, and their connections into pods never captured.
// Each path is a cgroup v2 directory (absolute, below the cgroup2 mount this data
// path attaches to); processes in its descendants count too. A pod cannot put its
// processes into another cgroup, so unlike a socket mark (which CAP_NET_RAW, a
// default capability, lets any pod set) this identity cannot be forged from a pod.
// The list replaces the previous one; empty clears it.
func (d *Datapath) SetProxyCgroups(paths []string) error {
	cfg := redirectNodeConfig{}
	seen := map[string]bool{}
	for _, p := range paths {
		p = filepath.Clean(p)
		if seen[p] {
			continue
		}
		seen[p] = true
		if int(cfg.NrProxyCgroups) == MaxProxyCgroups {
			return fmt.Errorf("more than %d proxy cgroups", MaxProxyCgroups)
		}
		id, level, err := cgroupIDLevel(d.cgroup, p)
		if err != nil {
			return err
		}
		cfg.ProxyCgroups[cfg.NrProxyCgroups] = redirectProxyCgroup{Id: id, Level: level}
		cfg.NrProxyCgroups++
	}
	d.mu.RLock()
	defer d.mu.RUnlock()
	if d.closed {
		return ErrClosed
	}
	if err := d.objs.Node.Put(uint32(0), cfg); err != nil {
		return fmt.Errorf("write proxy cgroups: %w", err)
	}
	d.log.Info("proxy cgroups", zap.Strings("cgroups", slices.Sorted(maps.Keys(seen))))
	return nil
}

// cgroupIDLevel returns the cgroup id of dir (its inode on cgroupfs, what
// bpf_get_current_ancestor_cgroup_id returns) and its depth below root, the
// hierarchy's root directory (level 0).
func cgroupIDLevel(root, dir string) (id uint64, level uint32, _ error) {
	rel, err := filepath.Rel(root, dir)
	if err != nil || rel == ".." || strings.HasPrefix(rel, "../") {
		return 0, 0, fmt.Errorf("proxy cgroup %s is not below the cgroup v2 root %s", dir, root)
	}
	var st unix.Statfs_t
	if err := unix.Statfs(dir, &st); err != nil {
		return 0, 0, fmt.Errorf("proxy cgroup %s: %w", dir, err)
	}
	if st.Type != unix.CGROUP2_SUPER_MAGIC {
		return 0, 0, fmt.Errorf("proxy cgroup %s is not on cgroup v2", dir)
	}
	var s unix.Stat_t
	if err := unix.Stat(dir, &s); err != nil {
		return 0, 0, fmt.Errorf("proxy cgroup %s: %w", dir, err)
	}
	if rel != "." {
		level = uint32(len(strings.Split(rel, "/")))
	}
	return s.Ino, level, nil
}

// ProcessCgroup returns the cgroup v2 directory of process pid, below the cgroup2
// mount this data path attaches to.
func (d *Datapath) ProcessCgroup(pid int) (string, error) {
	f, err := os.Open(fmt.Sprintf("/proc/%d/cgroup", pid))
	if err != nil {
		return "", fmt.Errorf("cgroup of process %d: %w", pid, err)
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		// The v2 hierarchy's line is "0::<path>".
		if path, ok := strings.CutPrefix(sc.Text(), "0::"); ok {
			return filepath.Join(d.cgroup, path), nil
		}
	}
	if err := sc.Err(); err != nil {
		return "", fmt.Errorf("cgroup of process %d: %w", pid, err)
	}
	return "", fmt.Errorf("process %d has no cgroup v2 entry", pid)
}

// SetNodeAddresses replaces the node's own addresses: the probe sources of every
// pod enrolled with NodeProbeSources (kubelet probes come from them). They are kept
// once, in a set all those pods share, so a change is one map update per address,
// whatever the number of pods.
func (d *Datapath) SetNodeAddresses(addrs []netip.Prefix) error {
	want := normalizePrefixes(addrs)
	d.mu.RLock()
	defer d.mu.RUnlock()
	if d.closed {
		return ErrClosed
	}
	d.mapMu.Lock()
	defer d.mapMu.Unlock()
	var (
		have []netip.Prefix
		k    redirectLpmKey
		v    uint8
	)
	it := d.objs.ProbeSrcs.Iterate()
	for it.Next(&k, &v) {
		if id, p, ok := prefixFromLPM(k); ok && id == nodeSet {
			have = append(have, p)
		}
	}
	if err := it.Err(); err != nil {
		return fmt.Errorf("read node addresses: %w", err)
	}
	for _, p := range want {
		if !slices.Contains(have, p) {
			if err := d.objs.ProbeSrcs.Put(lpmKey(nodeSet, p), uint8(1)); err != nil {
				return fmt.Errorf("add node address %s: %w", p, err)
			}
		}
	}
	for _, p := range have {
		if !slices.Contains(want, p) {
			if err := d.objs.ProbeSrcs.Delete(lpmKey(nodeSet, p)); err != nil && !errors.Is(err, ebpf.ErrKeyNotExist) {
				return fmt.Errorf("remove node address %s: %w", p, err)
			}
		}
	}
	d.log.Info("node addresses (probe sources)", zap.Stringers("addresses", want))
	return nil
}
