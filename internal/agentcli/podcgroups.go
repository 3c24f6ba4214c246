package agentcli

import (
	"fmt"
	"sync"

	"go.uber.org/zap"

	"github.com/mesh-cni/mesh-cni/internal/agent"
	"github.com/mesh-cni/mesh-cni/internal/hostproc"
)

// podCgroupsFromKubelet is --pod-cgroup-driver's default: the layout is read
// from the kubelet.
const podCgroupsFromKubelet = "kubelet"

// sandboxFinder finds running pods' namespaces for --adopt-running, by the
// node's pod cgroup layout: --pod-cgroup-driver and --pod-cgroup-root, or the
// kubelet's, read on every pass (a kubelet restarted with other settings is
// followed). Where the layout cannot be learned no pod is adopted: each is
// reported failed with the reason, which is logged when it changes.
func (o options) sandboxFinder(log *zap.Logger) (agent.SandboxFinder, error) {
	procfs, netnsDir := hostproc.Procfs{Root: "/proc"}, o.netnsDir
	layout, err := o.podCgroupLayout()
	if err != nil {
		return nil, err
	}
	var mu sync.Mutex
	last := ""
	return func(uids []string) (hostproc.SandboxScan, error) {
		l, err := layout()
		mu.Lock()
		defer mu.Unlock()
		if err != nil {
			err = fmt.Errorf("%w (set --pod-cgroup-driver and --pod-cgroup-root): %w", hostproc.ErrNoPodCgroupLayout, err)
			if last != err.Error() {
				log.Warn("running pods are not adopted: the node's pod cgroup layout cannot be learned", zap.Error(err))
				last = err.Error()
			}
			scan := hostproc.SandboxScan{Problems: map[string]error{}}
			for _, u := range uids {
				scan.Problems[u] = err
			}
			return scan, nil
		}
		if last != l.String() {
			log.Info("running pods are adopted by their cgroups at the node's layout", zap.String("layout", l.String()))
			last = l.String()
		}
		return procfs.Sandboxes(l, netnsDir, uids)
	}, nil
}

// podCgroupLayout returns how the node's pod cgroup layout is learned:
// --pod-cgroup-driver and --pod-cgroup-root, or the kubelet's, read on each
// call (a kubelet restarted with other settings is followed).
func (o options) podCgroupLayout() (func() (hostproc.PodCgroupLayout, error), error) {
	if o.podCgroupDriver != podCgroupsFromKubelet {
		fixed := hostproc.PodCgroupLayout{Driver: o.podCgroupDriver, Root: o.podCgroupRoot}
		if err := fixed.Validate(); err != nil {
			return nil, fmt.Errorf("--pod-cgroup-driver, --pod-cgroup-root: %w", err)
		}
		return func() (hostproc.PodCgroupLayout, error) { return fixed, nil }, nil
	}
	if o.podCgroupRoot != "/" {
		return nil, fmt.Errorf("--pod-cgroup-root %q needs --pod-cgroup-driver=systemd or cgroupfs: with %s the kubelet's is read", o.podCgroupRoot, podCgroupsFromKubelet)
	}
	procfs := hostproc.Procfs{Root: "/proc"}
	finder := hostproc.KubeletFinder{Proc: procfs, Names: agent.KubeletProcessNames(), Exes: o.kubeletExes, ExeNames: agent.KubeletExeNames()}
	return func() (hostproc.PodCgroupLayout, error) {
		k, _, err := finder.Find()
		if err != nil {
			return hostproc.PodCgroupLayout{}, err
		}
		return procfs.PodCgroupLayout(k)
	}, nil
}
