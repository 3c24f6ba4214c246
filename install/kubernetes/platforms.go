package kubernetes

// Platform is where a distribution's container runtime looks for CNI plugins
// and configs on its nodes: the host directories behind the DaemonSet's
// cni-bin and cni-conf volumes. Inside the container they stay /opt/cni/bin
// and /etc/cni/net.d (AgentMounts), so only the host side changes. The agent
// reads the runtime's directories from its process and installs there
// whatever the platform, through these mounts when they are the runtime's:
// a platform saves it going through the host's root, and is where it
// installs when it cannot read the runtime.
type Platform struct {
	Name       string
	CNIBinDir  string
	CNIConfDir string
	// Component is the kustomize component that selects the platform
	// (platforms/<Name>), empty where the defaults are the platform's.
	Component string
}

// Platforms returns the platforms the install has presets for: the chart's
// platform value and the kustomize components under platforms/. The first is
// the default every other kubeadm-shaped node has.
func Platforms() []Platform {
	return []Platform{
		{Name: "default", CNIBinDir: "/opt/cni/bin", CNIConfDir: "/etc/cni/net.d"},
		{Name: "eks", CNIBinDir: "/opt/cni/bin", CNIConfDir: "/etc/cni/net.d"},
		{Name: "kind", CNIBinDir: "/opt/cni/bin", CNIConfDir: "/etc/cni/net.d"},
		// GKE's kubelet runs plugins from /home/kubernetes/bin; /opt is
		// read-only there.
		{Name: "gke", CNIBinDir: "/home/kubernetes/bin", CNIConfDir: "/etc/cni/net.d", Component: "platforms/gke"},
		// k3s runs its embedded containerd with directories of its own.
		{Name: "k3s", CNIBinDir: "/var/lib/rancher/k3s/data/cni", CNIConfDir: "/var/lib/rancher/k3s/agent/etc/cni/net.d", Component: "platforms/k3s"},
		{Name: "microk8s", CNIBinDir: "/var/snap/microk8s/current/opt/cni/bin", CNIConfDir: "/var/snap/microk8s/current/args/cni-network", Component: "platforms/microk8s"},
		// OpenShift: Multus is the runtime's network and runs its plugins
		// from /var/lib/cni/bin; the chain entry goes into Multus' own config.
		// The agent's pods also need a SecurityContextConstraints.
		{Name: "openshift", CNIBinDir: "/var/lib/cni/bin", CNIConfDir: "/etc/kubernetes/cni/net.d", Component: "platforms/openshift"},
	}
}
