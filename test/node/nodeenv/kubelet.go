package nodeenv

import (
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/mesh-cni/mesh-cni/test/harness"
)

// Kubelet's files on the node, where kubeadm puts them.
const (
	kubeletConfig     = "/var/lib/kubelet/config.yaml"
	kubeletKubeconfig = "/etc/kubernetes/kubelet.conf"
	proxyKubeconfig   = "/etc/kubernetes/proxy.conf"
	kubeletCA         = "/etc/kubernetes/pki/ca.crt"
	resolvConf        = "/etc/kubernetes/resolv.conf"
)

// kubeletConfigYAML is the node's KubeletConfiguration. Every setting that
// differs from kubelet's defaults says why.
func kubeletConfigYAML(m *Machine, taints []string) string {
	var register string
	if len(taints) > 0 {
		// Taints the node carries from its registration (--register-with-taints).
		register = "registerWithTaints:\n"
		for _, tt := range taints {
			key, rest, _ := strings.Cut(tt, "=")
			value, effect, _ := strings.Cut(rest, ":")
			register += fmt.Sprintf("  - {key: %q, value: %q, effect: %s}\n", key, value, effect)
		}
	}
	return fmt.Sprintf(`apiVersion: kubelet.config.k8s.io/v1beta1
kind: KubeletConfiguration
# This machine has hybrid cgroups (v1 controllers, cgroup2 at
# /sys/fs/cgroup/unified), which kubelet 1.37 refuses unless told otherwise.
failCgroupV1: false
# No systemd here (PID 1 is the VM's init).
cgroupDriver: cgroupfs
# The node's pods under a cgroup of the test's, in every hierarchy.
cgroupRoot: %s
# Root lacks CAP_SYS_RESOURCE: kubelet cannot lower its own oom_score_adj.
oomScoreAdj: 0
containerRuntimeEndpoint: unix://%s
address: %s
port: 10250
readOnlyPort: 0
authentication:
  anonymous: {enabled: false}
  webhook: {enabled: true}
  x509: {clientCAFile: %s}
authorization:
  mode: Webhook
# The disk and memory are the host's, shared with other tests: never evict
# the test's pods or collect its imported images (there is no registry to
# pull them back from).
evictionHard:
  memory.available: "1Mi"
  nodefs.available: "1%%"
  imagefs.available: "1%%"
imageGCHighThresholdPercent: 100
imageGCLowThresholdPercent: 99
serializeImagePulls: false
# Pods need no DNS here; an empty file keeps the host's resolver out of them.
resolvConf: %s
%s`, m.CgroupParent, ContainerdSocket, m.NodeIP, kubeletCA, resolvConf, register)
}

// startKubelet writes kubelet's files on the node and starts it; the node
// registers itself with the API server.
func startKubelet(tb testing.TB, m *Machine, bins Binaries, cp *ControlPlane, taints []string) *harness.Process {
	tb.Helper()
	files := map[string][]byte{
		kubeletConfig: []byte(kubeletConfigYAML(m, taints)),
		resolvConf:    nil,
	}
	ca, err := os.ReadFile(cp.API.CAFile())
	if err != nil {
		tb.Fatal(err)
	}
	files[kubeletCA] = ca
	for p, data := range files {
		writeNodeFile(tb, m, p, data, 0o644)
	}
	cp.API.WriteKubeconfig(tb, nodeUser(m.Name), m.Path(kubeletKubeconfig))
	// In a cgroup of its own, as systemd runs it: the agent lets the kubelet's
	// probes into pods by its cgroup.
	return m.StartInOwnCgroup(tb, "kubelet", bins.kube("kubelet"), kubeletArgs(m)...)
}

func kubeletArgs(m *Machine) []string {
	return []string{
		"--config", kubeletConfig,
		"--kubeconfig", kubeletKubeconfig,
		"--hostname-override", m.Name,
		"--node-ip", m.NodeIP.String(),
		"--v=1",
	}
}

// RestartKubeletInPlace stops the kubelet and starts it again in its cgroup
// made anew at the same path, as `systemctl restart kubelet` does: the same
// cgroup path, a new cgroup (another id). Pods keep running.
func (n *Node) RestartKubeletInPlace() {
	n.tb.Helper()
	n.Kubelet = n.restartKubelet()
}

// startKubeProxy runs kube-proxy (iptables mode) on the node: the agent
// reaches the API server the way any in-cluster client does, at the
// kubernetes Service's cluster IP.
func startKubeProxy(tb testing.TB, m *Machine, bins Binaries, cp *ControlPlane, podCIDR string) *harness.Process {
	tb.Helper()
	cp.API.WriteKubeconfig(tb, proxyUser, m.Path(proxyKubeconfig))
	return m.Start(tb, "kube-proxy", bins.kube("kube-proxy"),
		"--kubeconfig", proxyKubeconfig,
		"--hostname-override", m.Name,
		"--proxy-mode", "iptables",
		"--cluster-cidr", podCIDR,
		// The host's conntrack table is shared: leave its size alone.
		"--conntrack-max-per-core=0",
		"--metrics-bind-address", "127.0.0.1:10249",
		"--healthz-bind-address", "127.0.0.1:10256",
		"--v=1",
	)
}

// writeNodeFile writes data at the node's path p, making its directory.
func writeNodeFile(tb testing.TB, m *Machine, p string, data []byte, mode os.FileMode) {
	tb.Helper()
	path := m.Path(p)
	if err := os.MkdirAll(filepath.Dir(path), 0o755); err != nil {
		tb.Fatal(err)
	}
	if err := os.WriteFile(path, data, mode); err != nil {
		tb.Fatal(err)
	}
}
