package kubeenv

import (
	"testing"

	rbacv1 "k8s.io/api/rbac/v1"
)

// IstioCNIRoot is the root install-cni sees, as its DaemonSet's mounts make it: a
// tmpfs with the machine's system directories, its service account's files, its
// image's /opt/cni/bin, and the node's CNI bin dir, /proc and namespaces under
// /host. Arguments: root, service account dir, plugin source dir, node bin dir,
// the directory of install-cni, the node's procfs.
const IstioCNIRoot = `set -eu
root=$1 sa=$2 src=$3 bin=$4 istio=$5 proc=$6
mkdir -p "$root"
mount -t tmpfs tmpfs "$root"
for d in bin sbin lib lib64 usr etc dev proc sys tmp run; do
	[ -e "/$d" ] || continue
	if [ -L "/$d" ]; then ln -s "$(readlink "/$d")" "$root/$d"; continue; fi
	mkdir -p "$root/$d"
	mount --rbind "/$d" "$root/$d"
done
mkdir -p "$root/var/run/secrets/kubernetes.io/serviceaccount" "$root/opt/cni/bin" "$root/host/opt/cni/bin" \
	"$root/host/proc" "$root/host/run/netns" "$root/host/var/run/netns" "$root/istio"
mount --bind "$sa" "$root/var/run/secrets/kubernetes.io/serviceaccount"
mount --bind "$src" "$root/opt/cni/bin"
mount --bind "$bin" "$root/host/opt/cni/bin"
mount --rbind "$proc" "$root/host/proc"
mount --rbind /run/netns "$root/host/run/netns"
mount --rbind /run/netns "$root/host/var/run/netns"
mount --bind "$istio" "$root/istio"
exec chroot "$root" /istio/install-cni
`

// IstioCNIArgs are unshare's arguments that run install-cni as process 1 of a
// PID and mount namespace of its own, in the root IstioCNIRoot makes from the
// same arguments: it reads "the host" at /host/proc/1, which must be the node
// it runs on, not the machine: proc is a procfs of the node's PID namespace
// ("/proc" is install-cni's own, where it is process 1).
func IstioCNIArgs(root, sa, src, bin, istio, proc string) []string {
	return []string{"--mount", "--pid", "--fork", "--kill-child", "--mount-proc", "--propagation", "slave", "--",
		"sh", "-c", IstioCNIRoot, "istio-cni-root", root, sa, src, bin, istio, proc}
}

// IstioAmbientSelector is istio-cni's ambient enablement selector as its chart
// sets it (AMBIENT_ENABLEMENT_SELECTOR): a pod labelled ambient, or a pod not
// opted out in a namespace labelled ambient.
const IstioAmbientSelector = `[{"podSelector":{"matchLabels":{"istio.io/dataplane-mode":"ambient"}}},` +
	`{"podSelector":{"matchExpressions":[{"key":"istio.io/dataplane-mode","operator":"NotIn","values":["none"]}]},` +
	`"namespaceSelector":{"matchLabels":{"istio.io/dataplane-mode":"ambient"}}}]`

// GrantIstioCNI binds the rules istio-cni's chart gives its node agent, ambient
// on and repair off, to group: reading pods, nodes and namespaces, annotating a
// pod's status, reading its own DaemonSet.
func (s *APIServer) GrantIstioCNI(tb testing.TB, group string) {
	tb.Helper()
	s.grant(tb, "istio-cni", []rbacv1.PolicyRule{
		{APIGroups: []string{""}, Resources: []string{"pods", "nodes", "namespaces"}, Verbs: []string{"get", "list", "watch"}},
		{APIGroups: []string{""}, Resources: []string{"pods/status"}, Verbs: []string{"patch", "update"}},
		{APIGroups: []string{"apps"}, Resources: []string{"daemonsets"}, ResourceNames: []string{"istio-cni-node"}, Verbs: []string{"get"}},
	}, rbacv1.Subject{APIGroup: rbacv1.GroupName, Kind: rbacv1.GroupKind, Name: group})
}
