package redirect

import (
	"bufio"
	"bytes"
	"fmt"
	"path/filepath"
	"slices"
	"strings"

	"go.uber.org/zap"
	"golang.org/x/sys/unix"

	"github.com/cilium/ebpf"
	"github.com/mesh-cni/mesh-cni/internal/netns"
)

// MaxProxyCgroups is how many proxy cgroups the node's settings hold
// (MAX_PROXY_CGROUPS of bpf/lib/common.h).
const MaxProxyCgroups = len(redirectNodeConfig{}.ProxyCgroups)

// SetProxyCgroups names the cgroups whose processes are the mesh proxy: their
// connects are never redirected, and their connections into pods never captured.
// Each path is a cgroup v2 directory below the cgroup2 hierarchy this data path
// attaches to, absolute or relative to its root (so "/mesh-proxies" means that
// cgroup of the hierarchy whether or not the caller knows where it is mounted);
// processes in its descendants count too. A pod cannot put its processes into
// another cgroup, so unlike a socket mark (which CAP_NET_RAW, a default
// capability, lets any pod set) this identity cannot be forged from a pod. The list
// replaces the previous one; empty clears it.
func (d *Datapath) SetProxyCgroups(paths []string) error {
	var cfg redirectNodeConfig
	names, n, err := d.cgroupList(paths, cfg.ProxyCgroups[:])
	if err != nil {
		return fmt.Errorf("proxy cgroups: %w", err)
	}
	cfg.NrProxyCgroups = n
	return d.putCgroupConfig(d.objs.Node, cfg, "proxy cgroups", names)
}

// KeepProxyCgroups is SetProxyCgroups for an agent's start: after the cgroups
// of paths it keeps those the pinned settings already name, the node proxy's
// that the agent before this one learned from its connection, up to
// MaxProxyCgroups. The proxy's own connections then stay exempt while no
// agent runs and until it connects to this one, whose SetProxyCgroups
// replaces the list. A kept id whose cgroup is gone exempts nothing: cgroup
// ids are not reused.
func (d *Datapath) KeepProxyCgroups(paths []string) error {
	var cfg redirectNodeConfig
	names, n, err := d.cgroupList(paths, cfg.ProxyCgroups[:])
	if err != nil {
		return fmt.Errorf("proxy cgroups: %w", err)
	}
	var pinned redirectNodeConfig
	if err := d.readCgroupConfig(d.objs.Node, &pinned); err != nil {
		return fmt.Errorf("read proxy cgroups: %w", err)
	}
	for _, c := range pinned.ProxyCgroups[:min(int(pinned.NrProxyCgroups), len(pinned.ProxyCgroups))] {
		if int(n) == len(cfg.ProxyCgroups) || c.Id == 0 || slices.Contains(cfg.ProxyCgroups[:n], c) {
			continue
		}
		cfg.ProxyCgroups[n] = c
		names = append(names, fmt.Sprintf("id %d (kept from before)", c.Id))
		n++
	}
	cfg.NrProxyCgroups = n
	return d.putCgroupConfig(d.objs.Node, cfg, "proxy cgroups", names)
}

// readCgroupConfig reads the one entry of config map m into cfg.
func (d *Datapath) readCgroupConfig(m *ebpf.Map, cfg any) error {
	d.mu.RLock()
	defer d.mu.RUnlock()
	if d.closed {
		return ErrClosed
	}
	return m.Lookup(uint32(0), cfg)
}

// SetProbeCgroups names the cgroups whose processes probe pods: the kubelet's.
// Their TCP connects in the network namespace with cookie netns (the kubelet's;
// 0: this process's) are recorded before the SYN leaves, and a pod's inbound capture lets those exact
// connections through to the application, so probes pass a proxy that would
// refuse them (mTLS, policy) while nothing else reaches a pod past its proxy:
// not traffic the node forwards or masquerades to a node address, not another
// host-network process, not a packet forged with a node address. Paths are as
// for SetProxyCgroups; a cgroup at the root of the hierarchy is refused (it
// would make every process of the node a prober). Empty clears it.
func (d *Datapath) SetProbeCgroups(netns uint64, paths []string) error {
	var cfg redirectProbeConfig
	names, n, err := d.cgroupList(paths, cfg.Cgroups[:])
	if err != nil {
		return fmt.Errorf("probe cgroups: %w", err)
	}
	for _, c := range cfg.Cgroups[:n] {
		if c.Level == 0 {
			return fmt.Errorf("probe cgroups: %s is the root of the cgroup hierarchy, which holds every process of the node", d.cgroup)
		}
	}
	cfg.NrCgroups = n
	if n > 0 {
		cfg.HostNetns = netns
		if netns == 0 {
			cfg.HostNetns = d.nodeCookies[0]
		}
	}
	return d.putCgroupConfig(d.objs.ProbeNode, cfg, "probe cgroups", names)
}

// putCgroupConfig writes cfg, the one entry of config map m, naming cgroups
// (what they are for and their names, for the log).
func (d *Datapath) putCgroupConfig(m *ebpf.Map, cfg any, what string, names []string) error {
	d.mu.RLock()
	defer d.mu.RUnlock()
	if d.closed {
		return ErrClosed
	}
	if err := m.Put(uint32(0), cfg); err != nil {
		return fmt.Errorf("write %s: %w", what, err)
	}
	d.log.Info(what, zap.Strings("cgroups", names))
	return nil
}

// cgroupList resolves paths (deduplicated) into out and returns their cleaned
// names and how many there are.
func (d *Datapath) cgroupList(paths []string, out []redirectProxyCgroup) ([]string, uint32, error) {
	var names []string
	n := uint32(0)
	for _, p := range paths {
		p = d.cgroupPath(p)
		if slices.Contains(names, p) {
			continue
		}
		if int(n) == len(out) {
			return nil, 0, fmt.Errorf("more than %d cgroups", len(out))
		}
		id, level, err := cgroupIDLevel(d.cgroup, p)
		if err != nil {
			return nil, 0, err
		}
		out[n] = redirectProxyCgroup{Id: id, Level: level}
		names = append(names, p)
		n++
	}
	slices.Sort(names)
	return names, n, nil
}

// cgroupPath is p below this data path's cgroup v2 root: kept when it already is,
// joined to the root otherwise.
func (d *Datapath) cgroupPath(p string) string {
	p = filepath.Clean(p)
	if rel, err := filepath.Rel(d.cgroup, p); err == nil && rel != ".." && !strings.HasPrefix(rel, "../") {
		return p
	}
	return filepath.Join(d.cgroup, p)
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

// CgroupID returns the id this data path holds for a cgroup path, taken as
// SetProbeCgroups and SetProxyCgroups take it: the directory's inode, which a
// cgroup removed and made again at the same path does not keep.
func (d *Datapath) CgroupID(path string) (uint64, error) {
	id, _, err := cgroupIDLevel(d.cgroup, d.cgroupPath(path))
	return id, err
}

// ProcessCgroup returns the cgroup v2 directory of process pid, below the cgroup2
// mount this data path attaches to.
func (d *Datapath) ProcessCgroup(pid int) (string, error) {
	b, err := readHostCgroupFile(fmt.Sprintf("/proc/%d/cgroup", pid))
	if err != nil {
		return "", fmt.Errorf("cgroup of process %d: %w", pid, err)
	}
	sc := bufio.NewScanner(bytes.NewReader(b))
	for sc.Scan() {
		// The v2 hierarchy's line is "0::<path>".
		if path, ok := strings.CutPrefix(sc.Text(), "0::"); ok {
			return filepath.Join(d.cgroup, path), nil
		}
	}
	return "", fmt.Errorf("process %d has no cgroup v2 entry", pid)
}

// readHostCgroupFile reads a /proc/<pid>/cgroup file as the init process's cgroup
// namespace renders it. The kernel writes those paths relative to the reader's
// cgroup namespace: an agent container on a cgroup v2 node has one of its own,
// where another process's cgroup reads as "/../../<path>", which names nothing
// below the host's hierarchy the agent attaches to. The read is done on a thread
// that joins the init process's cgroup namespace and is thrown away after.
func readHostCgroupFile(path string) ([]byte, error) {
	return netns.ReadInCgroupNamespace("/proc/1/ns/cgroup", path)
}

// dropLegacyNodeSet removes the node's addresses an earlier layout kept as every
// pod's probe sources: kubelet probes are now recognised by their socket.
func (d *Datapath) dropLegacyNodeSet() {
	d.mapMu.Lock()
	defer d.mapMu.Unlock()
	var (
		keys []redirectLpmKey
		k    redirectLpmKey
		v    uint8
	)
	it := d.objs.ProbeSrcs.Iterate()
	for it.Next(&k, &v) {
		if k.Set == legacyNodeSet {
			keys = append(keys, k)
		}
	}
	for _, k := range keys {
		_ = d.objs.ProbeSrcs.Delete(&k)
	}
	if len(keys) > 0 {
		d.log.Info("removed the node addresses an earlier version exempted from inbound capture", zap.Int("addresses", len(keys)))
	}
}
