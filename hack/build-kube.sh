#!/usr/bin/env bash
# Builds Kubernetes binaries from the Go module proxy (no other download) into a
# cache directory outside the repository. A second run finds them there and
# builds nothing. Prints the directory holding the binaries as its last line.
#
#   hack/build-kube.sh            # kube-apiserver and etcd, for test/k8s
#   hack/build-kube.sh node       # kubelet, kube-scheduler, kube-controller-manager,
#                                 # kube-proxy and kubectl: the rest of a one-node cluster, for test/node
#   MESH_CNI_KUBE_CACHE=/some/dir hack/build-kube.sh
#
# Why a throwaway module: k8s.io/kubernetes replaces its k8s.io/* staging modules
# with local paths, so `go install k8s.io/kubernetes/cmd/kube-apiserver@v` refuses
# it. A module that requires k8s.io/kubernetes and points each staging module at
# its published v0.x release builds the same sources. Replace directives of
# dependencies are ignored, so etcd's own main package builds the same way.
# A cold build of either set takes several minutes on two cores; the Go build
# cache makes the second set and a rebuild after a version change cheaper.
set -euo pipefail

KUBE_VERSION="${KUBE_VERSION:-v1.37.2}"
# The etcd release k8s.io/kubernetes $KUBE_VERSION requires.
ETCD_VERSION="${ETCD_VERSION:-v3.7.0}"
CACHE_ROOT="${MESH_CNI_KUBE_CACHE:-/var/cache/mesh-cni/kube}"

set_name="${1:-apiserver}"
case "$set_name" in
apiserver)
	OUT="$CACHE_ROOT/kube-$KUBE_VERSION-etcd-$ETCD_VERSION"
	KUBE_CMDS=(kube-apiserver)
	BINS=(kube-apiserver etcd)
	;;
node)
	OUT="$CACHE_ROOT/kube-node-$KUBE_VERSION"
	KUBE_CMDS=(kubelet kube-proxy kube-scheduler kube-controller-manager kubectl)
	BINS=("${KUBE_CMDS[@]}")
	;;
*)
	echo "usage: $0 [apiserver|node]" >&2
	exit 2
	;;
esac

# shellcheck source=hack/cache.sh
source "$(dirname "${BASH_SOURCE[0]}")/cache.sh"
cache_begin "${BINS[*]} ($KUBE_VERSION)" -mod=mod
cache_workdir kube

# Staging modules are published as v0.<minor>.<patch> for v1.<minor>.<patch>.
staging="v0.${KUBE_VERSION#v1.}"
kmod="$(go mod download -json "k8s.io/kubernetes@$KUBE_VERSION" | sed -n 's/^[[:space:]]*"GoMod": "\(.*\)",$/\1/p')"
if [[ -z "$kmod" || ! -f "$kmod" ]]; then
	echo "could not download k8s.io/kubernetes@$KUBE_VERSION from the module proxy" >&2
	exit 1
fi
{
	echo "replace ("
	# Lines like "k8s.io/api => ./staging/src/k8s.io/api".
	sed -n 's|^[[:space:]]*\(k8s\.io/[a-z0-9-]*\) => \./staging/src/.*$|\t\1 => \1 '"$staging"'|p' "$kmod"
	echo ")"
} >>go.mod

pkgs=()
for c in "${KUBE_CMDS[@]}"; do pkgs+=("k8s.io/kubernetes/cmd/$c@$KUBE_VERSION"); done
if [[ "$set_name" == apiserver ]]; then pkgs+=("go.etcd.io/etcd/server/v3@$ETCD_VERSION"); fi
go get "${pkgs[@]}" >&2

ver="k8s.io/component-base/version"
minor="${KUBE_VERSION#v1.}"
minor="${minor%%.*}"
ldflags="-s -w -X $ver.gitVersion=$KUBE_VERSION -X $ver.gitMajor=1 -X $ver.gitMinor=$minor -X $ver.gitTreeState=clean"
mkdir -p bin
for c in "${KUBE_CMDS[@]}"; do
	go build -trimpath -ldflags "$ldflags" -o "bin/$c" "k8s.io/kubernetes/cmd/$c" >&2
done
if [[ "$set_name" == apiserver ]]; then
	go build -trimpath -ldflags "-s -w" -o bin/etcd go.etcd.io/etcd/server/v3 >&2
fi
cache_publish_from bin
