#!/usr/bin/env bash
# Builds (or finds in /var/cache/mesh-cni) every real peer the test suite runs,
# from the Go module proxy: kube-apiserver and etcd, a node's containerd,
# kubelet and the rest of its Kubernetes, helm, istiod and istio-cni. Prints
# the shell exports that hand their directories to the tests, so no test
# starts its clock while a peer compiles:
#
#   eval "$(hack/peers.sh)"
#
# Cold, on two cores, this takes about half an hour (istio.io/istio is the
# largest); warm, a second.
set -euo pipefail
hack="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"

build() {
	local var="$1"
	shift
	local dir
	dir="$(bash "$hack/$1" "${@:2}" | tail -n1)"
	[[ -d "$dir" ]] || {
		echo "hack/$1 printed $dir, not a directory" >&2
		exit 1
	}
	printf 'export %s=%q\n' "$var" "$dir"
}

build MESH_CNI_KUBE_BIN_DIR build-kube.sh
build MESH_CNI_KUBE_NODE_BIN_DIR build-kube.sh node
build MESH_CNI_CONTAINERD_BIN_DIR build-containerd.sh
build MESH_CNI_HELM_BIN_DIR build-helm.sh
build MESH_CNI_ISTIO_BIN_DIR build-istio.sh
