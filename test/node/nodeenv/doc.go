// Package nodeenv runs a real one-node Kubernetes cluster on this machine for
// the node tests: etcd, kube-apiserver, kube-scheduler and
// kube-controller-manager on the host, and a node made of its own network
// namespace and mount namespace holding containerd (CRI plugin, runc),
// kubelet and kube-proxy. Every binary is built from Go modules by the
// scripts in hack/ (cached outside the repository); runc comes from Debian.
//
// The node looks like a real machine to what runs on it: in its mount
// namespace /etc, /home, /opt, /var/lib and /var/log are overlays whose changes land
// in the test's directory, /run is its own tmpfs and /sys/fs/bpf its own
// bpffs, so /etc/cni/net.d, /opt/cni/bin, /var/run/mesh-cni and the pins of
// a DaemonSet installed with its default host paths are the node's, never the
// host's. The node reaches the API server over a veth pair; pods get
// addresses from the primary CNI the test writes into the node's conf dir.
//
// This machine has hybrid cgroups (v1 controllers at /sys/fs/cgroup/<name>,
// cgroup2 at /sys/fs/cgroup/unified, every controller but hugetlb bound to
// v1), so kubelet runs with the cgroupfs driver and failCgroupV1: false, its
// pods under a cgroup of the test's own in every hierarchy. Root here lacks
// CAP_SYS_RESOURCE: containerd restricts oom_score_adj to its own and kubelet
// leaves its own alone. docs/testing.md says why.
//
// Everything is removed in the test's cleanup, also on failure: pods,
// containers, shims and any process left in the node's cgroups or mount
// namespace, the namespaces, the cgroups, the directories.
package nodeenv
