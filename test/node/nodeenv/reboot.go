package nodeenv

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"time"

	"github.com/containernetworking/plugins/pkg/netlinksafe"
	"github.com/vishvananda/netlink"

	"github.com/mesh-cni/mesh-cni/internal/netns"
	"github.com/mesh-cni/mesh-cni/test/fixtures"
	"github.com/mesh-cni/mesh-cni/test/harness"
)

// Reboot takes the node through a reboot as far as one machine allows: the
// kubelet, kube-proxy and containerd stop, and every other process of the
// node (shims, containers, the agent) is killed; what a reboot loses goes (a
// fresh /run, so the runtime's state, the netns mounts and the agent's
// socket; a fresh bpffs, so every pin and with it every attached program;
// the pods' cgroups, network namespaces and the primary network's bridge),
// while what is on disk stays (/etc, /opt, /var/lib: the CNI configs and
// plugins, containerd's and the kubelet's roots). Then containerd, the
// kubelet and kube-proxy start again in the order a node's init starts them,
// and the kubelet brings its pods back with new sandboxes. It returns when
// containerd serves again, the kubelet has started and the time the node went down.
func (n *Node) Reboot(ctx context.Context) time.Time {
	n.tb.Helper()
	down := time.Now()
	if err := n.Kubelet.Stop(ctx); err != nil {
		n.tb.Logf("reboot: kubelet: %v", err)
	}
	_ = n.KubeProxy.Kill()
	if err := n.Containerd.Stop(ctx); err != nil {
		n.tb.Logf("reboot: containerd: %v", err)
	}
	n.killLeftovers(n.tb, true)
	if err := n.wipeVolatile(ctx); err != nil {
		n.tb.Fatalf("reboot: %v", err)
	}
	n.Containerd.Start(n.tb)
	n.Kubelet = n.restartKubelet()
	n.KubeProxy = startKubeProxy(n.tb, n.Machine, n.Bins, n.Control, PodCIDR)
	return down
}

// wipeVolatile removes what does not survive a reboot, once the node's own
// processes are gone: the containers (each in its pod's cgroup, with mount
// and PID namespaces of their own) go with the pods' cgroups.
func (n *Node) wipeVolatile(ctx context.Context) error {
	mounts, err := cgroupMounts()
	if err != nil {
		return err
	}
	var errs []error
	for _, mp := range mounts {
		entries, err := os.ReadDir(filepath.Join(mp, n.CgroupParent))
		if err != nil {
			continue
		}
		for _, e := range entries {
			if e.IsDir() {
				errs = append(errs, removeCgroups([]string{mp}, filepath.Join(n.CgroupParent, e.Name())))
			}
		}
	}
	if err := errors.Join(errs...); err != nil {
		return fmt.Errorf("the pods' cgroups: %w", err)
	}
	// Lazily: the netns mounts under /run/netns and a container's view of
	// the bpffs may still be attached below.
	script := `set -e
umount -l /run
mount -t tmpfs -o mode=0755 tmpfs /run
umount -l /sys/fs/bpf
mount -t bpf bpf /sys/fs/bpf
`
	if out, err := n.Command(ctx, nil, "sh", "-ec", script).CombinedOutput(); err != nil {
		return fmt.Errorf("fresh /run and bpffs: %w: %s", err, out)
	}
	return netns.Do(n.NetNS, func() error {
		l, err := netlinksafe.LinkByName(BridgeName)
		if err != nil {
			return nil // no pod had started
		}
		return netlink.LinkDel(l)
	})
}

// restartKubelet stops the kubelet, if it runs, and starts it again in its
// cgroup made anew at the same path, as systemd does: a new cgroup id.
func (n *Node) restartKubelet() *harness.Process {
	n.tb.Helper()
	dir := n.Kubelet.Cgroup()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if err := n.Kubelet.Stop(ctx); err != nil {
		n.tb.Logf("kubelet stopped: %v", err)
	}
	var err error
	if !fixtures.Eventually(ctx, 10*time.Second, fixtures.WaitInterval, func() bool {
		err = os.Remove(dir)
		return err == nil || errors.Is(err, os.ErrNotExist)
	}) {
		n.tb.Fatalf("remove the kubelet's cgroup %s: %v", dir, err)
	}
	if err := os.Mkdir(dir, 0o755); err != nil {
		n.tb.Fatal(err)
	}
	return n.Machine.StartInCgroup(n.tb, "kubelet", dir, n.Bins.kube("kubelet"), kubeletArgs(n.Machine)...)
}
