package nodeenv

import (
	"context"
	"encoding/json"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"

	"github.com/mesh-cni/mesh-cni/internal/netns"
	"github.com/mesh-cni/mesh-cni/test/harness"
	"github.com/mesh-cni/mesh-cni/test/k8s/kubeenv"
)

// The node's primary network: the reference bridge plugin with host-local,
// and portmap, as a node's CNI installer would leave them. The range is the
// node's own (its network namespace holds the bridge and the routes).
const (
	PrimaryFile    = "10-bridge.conflist"
	PrimaryNetwork = "nodenet"
	BridgeName     = "cni0"
)

// PodCIDR is the primary network's pod range.
const PodCIDR = "10.244.0.0/24"

// primaryPlugins are the reference plugins the primary conflist uses, copied
// into the node's CNI bin dir.
func primaryPlugins() []string { return []string{"bridge", "host-local", "loopback", "portmap"} }

// startTimeout bounds the node's start (kubelet's registration and the
// network becoming ready) on a busy machine.
const startTimeout = 3 * time.Minute

// Node is a running one-node cluster: the control plane on the host and the
// node (containerd, kubelet, kube-proxy) on its Machine.
type Node struct {
	*Machine
	Bins       Binaries
	Control    *ControlPlane
	Containerd *Containerd
	Kubelet    *harness.Process
	KubeProxy  *harness.Process
	// Admin is a clientset in system:masters; AdminKubeconfig is the same
	// credential as a file for kubectl and helm.
	Admin           *kubernetes.Clientset
	AdminKubeconfig string
	// CNIBinDir and CNIConfDir are where the node's containerd looks for CNI
	// plugins and configs (Options).
	CNIBinDir, CNIConfDir string

	// tb owns the node's processes: one restarted from a subtest must live
	// as long as the node, not as the subtest.
	tb testing.TB
}

// Options configure Start.
type Options struct {
	// PrimaryCNIVersion is the cniVersion of the primary conflist; default
	// 1.0.0. With 1.1.0 the runtime also calls STATUS on every plugin.
	PrimaryCNIVersion string
	// CNIBinDir and CNIConfDir are the directories containerd is configured
	// with, a platform's layout (install/kubernetes Platforms); default
	// /opt/cni/bin and /etc/cni/net.d. Only /etc, /home, /opt and /var/lib
	// are the node's own.
	CNIBinDir, CNIConfDir string
	// RegisterWithTaints are taints (key=value:Effect) the kubelet registers
	// the node with, as a node pool's or --register-with-taints.
	RegisterWithTaints []string
}

// Start runs the control plane and the node, writes the primary CNI config
// into the node's conf dir and returns once the node is Ready. The reference
// plugins come from the harness's binaries (harness.Main builds them).
func Start(tb testing.TB, opts Options) *Node {
	tb.Helper()
	bins, err := FromEnv()
	if err != nil {
		tb.Fatal(err)
	}
	harness.Bins(tb).Require(tb, primaryPlugins()...)
	m := newMachine(tb)
	n := &Node{Machine: m, Bins: bins, tb: tb, CNIBinDir: opts.CNIBinDir, CNIConfDir: opts.CNIConfDir}
	if n.CNIBinDir == "" {
		n.CNIBinDir = "/opt/cni/bin"
	}
	if n.CNIConfDir == "" {
		n.CNIConfDir = "/etc/cni/net.d"
	}
	n.Control = startControlPlane(tb, bins, m)
	n.Admin = n.Control.API.Client(tb, kubeenv.AdminUser)
	n.AdminKubeconfig = n.Control.kubeconfig(tb, kubeenv.AdminUser)

	n.installPlugins(tb)
	version := opts.PrimaryCNIVersion
	if version == "" {
		version = "1.0.0"
	}
	n.WritePrimary(tb, version)

	n.Containerd = startContainerd(tb, m, bins, n.CNIBinDir, n.CNIConfDir)
	n.Kubelet = startKubelet(tb, m, bins, n.Control, opts.RegisterWithTaints)
	n.KubeProxy = startKubeProxy(tb, m, bins, n.Control, PodCIDR)
	// Runs before the processes' own cleanups (registered earlier): kubelet
	// first, so it recreates nothing, then every pod through the runtime,
	// which calls CNI DEL. What cannot be removed this way (containerd
	// stopped by the test) goes with the node's cgroups and namespaces.
	tb.Cleanup(func() {
		_ = n.KubeProxy.Kill()
		_ = n.Kubelet.Kill()
		select {
		case <-n.Containerd.Proc.Done():
		default:
			ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
			defer cancel()
			if err := n.Containerd.removePods(ctx); err != nil {
				tb.Logf("cleanup: %v", err)
			}
		}
	})

	ctx, cancel := context.WithTimeout(context.Background(), startTimeout)
	defer cancel()
	if err := n.WaitReady(ctx, true); err != nil {
		tb.Fatalf("node %s: %v", m.Name, err)
	}
	return n
}

func (n *Node) installPlugins(tb testing.TB) {
	tb.Helper()
	bins := harness.Bins(tb)
	for _, p := range primaryPlugins() {
		data, err := os.ReadFile(bins.Path(p))
		if err != nil {
			tb.Fatal(err)
		}
		writeNodeFile(tb, n.Machine, filepath.Join(n.CNIBinDir, p), data, 0o755)
	}
}

// WritePrimary writes the primary conflist into the node's conf dir with the
// given cniVersion, as the primary CNI's installer would.
func (n *Node) WritePrimary(tb testing.TB, cniVersion string) {
	tb.Helper()
	conf := map[string]any{
		"cniVersion": cniVersion,
		"name":       PrimaryNetwork,
		"plugins": []any{
			map[string]any{
				"type": "bridge", "bridge": BridgeName, "isGateway": true, "ipMasq": true,
				"ipam": map[string]any{
					"type":   "host-local",
					"ranges": []any{[]any{map[string]any{"subnet": PodCIDR}}},
					"routes": []any{map[string]any{"dst": "0.0.0.0/0"}},
				},
			},
			map[string]any{"type": "portmap", "capabilities": map[string]any{"portMappings": true}},
		},
	}
	data, err := json.MarshalIndent(conf, "", "  ")
	if err != nil {
		tb.Fatal(err)
	}
	writeNodeFile(tb, n.Machine, filepath.Join(n.CNIConfDir, PrimaryFile), append(data, '\n'), 0o644)
}

// ReadyCondition is the node's Ready condition as the API server has it.
func (n *Node) ReadyCondition(ctx context.Context) (corev1.NodeCondition, error) {
	node, err := n.Admin.CoreV1().Nodes().Get(ctx, n.Name, metav1.GetOptions{})
	if err != nil {
		return corev1.NodeCondition{}, err
	}
	for _, c := range node.Status.Conditions {
		if c.Type == corev1.NodeReady {
			return c, nil
		}
	}
	return corev1.NodeCondition{}, fmt.Errorf("node %s has no Ready condition yet", n.Name)
}

// WaitReady waits until the node's Ready condition is (or, with ready false,
// is not) True.
func (n *Node) WaitReady(ctx context.Context, ready bool) error {
	want := corev1.ConditionTrue
	return harness.PollUntil(ctx, n.Kubelet, 200*time.Millisecond, func(ctx context.Context) error {
		c, err := n.ReadyCondition(ctx)
		if err != nil {
			return err
		}
		if (c.Status == want) != ready {
			return fmt.Errorf("node condition Ready=%s: %s", c.Status, c.Message)
		}
		return nil
	})
}

// RestartContainerd stops containerd with SIGTERM and starts it again, as a
// runtime upgrade or `systemctl restart containerd` does; pods keep running.
func (n *Node) RestartContainerd() {
	n.tb.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if err := n.Containerd.Stop(ctx); err != nil {
		n.tb.Logf("containerd stopped: %v", err)
	}
	n.Containerd.Start(n.tb)
}

// Dial connects to addr from inside the node's network namespace (its
// loopback, the agent's health port).
func (n *Node) Dial(ctx context.Context, network, addr string) (net.Conn, error) {
	var conn net.Conn
	err := netns.Do(n.NetNS, func() error {
		var d net.Dialer
		c, err := d.DialContext(ctx, network, addr)
		conn = c
		return err
	})
	return conn, err
}
