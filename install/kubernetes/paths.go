// Package kubernetes holds the manifests that run mesh-agent on every node of a
// cluster (`kubectl apply -k install/kubernetes`), and the one table of host
// paths the agent is configured with there. The package's tests hold the
// manifests to that table: every mount, every path-valued flag, nothing more.
package kubernetes

import (
	"embed"
	"io/fs"
)

//go:embed *.yaml uninstall/*.yaml components/*/kustomization.yaml
var manifests embed.FS

// Manifests returns the manifest files: kustomization.yaml and the files it
// lists, uninstall/ (the uninstall Job's kustomization and Job) and the
// components/ an overlay may add.
func Manifests() fs.FS { return manifests }

// Fixed names and values of the DaemonSet that other parts of the manifests (and
// their tests) refer to.
const (
	Namespace      = "mesh-system"
	ServiceAccount = "mesh-agent"
	DaemonSet      = "mesh-agent"
	Container      = "agent"
	// Image is the agent image's name in daemonset.yaml, without tag or
	// digest: kustomization.yaml pins ReleaseDigest with `images`.
	Image = "ghcr.io/mesh-cni/mesh-agent"
	// UninstallNode is the placeholder for the node's name in the uninstall
	// Job (uninstall/job.yaml).
	UninstallNode = "NODE_NAME"
	// AgentBinary is where the image keeps mesh-agent.
	AgentBinary = "/usr/local/bin/mesh-agent"
	// MetricsAddr serves /healthz, /readyz and metrics. Loopback: the kubelet
	// probes a host-network pod from the host's network namespace.
	MetricsAddr = "127.0.0.1:15099"
)

// Propagation of a mount between the host and the container, as Kubernetes
// names it ("" is None).
const (
	PropagationNone            = ""
	PropagationHostToContainer = "HostToContainer"
	PropagationBidirectional   = "Bidirectional"
)

// Mount is a host directory the agent container mounts.
type Mount struct {
	// Volume is the name of the hostPath volume in the DaemonSet.
	Volume string
	// HostPath is the directory on the node.
	HostPath string
	// Path is where the container sees it. Equal to HostPath wherever the agent
	// hands the path to something on the host (the plugin dials the gate
	// socket at the same path, CNI passes /var/run/netns paths).
	Path        string
	ReadOnly    bool
	Propagation string
}

// PathFlag is a path-valued flag of `mesh-agent run` and the value the
// DaemonSet gives it.
type PathFlag struct {
	// Flag is the flag's name without dashes.
	Flag  string
	Value string
	// InImage marks a path that comes with the image (the plugin binary the
	// agent copies onto the node): no mount may hide it. Every other value
	// must lie in exactly one Mount.
	InImage bool
}

// AgentMounts returns the host directories the agent container mounts.
func AgentMounts() []Mount {
	return []Mount{
		// A platform's CNI directories (Platforms), at the agent's default
		// --cni-bin-dir and --cni-conf-dir, which no flag names: the agent
		// installs where the node's runtime loads CNI from, through these
		// when they are those directories, through the host's root
		// otherwise.
		{Volume: "cni-bin", HostPath: "/opt/cni/bin", Path: "/opt/cni/bin"},
		{Volume: "cni-conf", HostPath: "/etc/cni/net.d", Path: "/etc/cni/net.d"},
		// Pins must outlive the pod: they live in the host's bpffs, which the
		// DaemonSet's init container mounts where the node has none.
		{Volume: "bpffs", HostPath: "/sys/fs/bpf", Path: "/sys/fs/bpf", Propagation: PropagationHostToContainer},
		// Not at /sys/fs/cgroup: that is the container's own cgroup namespace.
		{Volume: "cgroup", HostPath: "/sys/fs/cgroup", Path: "/host/sys/fs/cgroup", ReadOnly: true},
		// Pod network namespaces: no flag names them, CNI passes their paths.
		{Volume: "netns", HostPath: "/var/run/netns", Path: "/var/run/netns", ReadOnly: true, Propagation: PropagationHostToContainer},
		{Volume: "mesh-run", HostPath: "/var/run/mesh-cni", Path: "/var/run/mesh-cni"},
		{Volume: "ztunnel-run", HostPath: "/var/run/ztunnel", Path: "/var/run/ztunnel"},
	}
}

// AgentPathFlags returns the path-valued flags the DaemonSet passes to
// `mesh-agent run`.
func AgentPathFlags() []PathFlag {
	return []PathFlag{
		{Flag: "socket", Value: "/var/run/mesh-cni/gate.sock"},
		{Flag: "state-dir", Value: "/var/run/mesh-cni/pods"},
		{Flag: "bpffs-root", Value: "/sys/fs/bpf/mesh-cni"},
		{Flag: "cgroup-root", Value: "/host/sys/fs/cgroup"},
		{Flag: "plugin-binary", Value: "/usr/local/bin/mesh-cni", InImage: true},
		{Flag: "zds-socket", Value: "/var/run/ztunnel/ztunnel.sock"},
	}
}
