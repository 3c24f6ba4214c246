#!/usr/bin/env bash
# Builds containerd (with its CRI plugin), its runc shim, ctr and crictl from the
# Go module proxy (no other download) into a cache directory outside the
# repository, for the node tests in test/node. runc itself comes from Debian
# (apt-get install runc). A second run finds the binaries there and builds
# nothing. Prints the directory holding the binaries as its last line.
#
#   hack/build-containerd.sh
#   MESH_CNI_NODE_CACHE=/some/dir hack/build-containerd.sh
#
# All four are plain main packages of modules without replace directives, so a
# throwaway module that requires them builds the same sources as upstream's
# release. CGO is off: upstream builds the shim that way too; containerd itself
# loses only the btrfs snapshotter, which the tests do not use (overlayfs).
set -euo pipefail

CONTAINERD_VERSION="${CONTAINERD_VERSION:-v2.4.2}"
CRICTL_VERSION="${CRICTL_VERSION:-v1.37.0}"
CACHE_ROOT="${MESH_CNI_NODE_CACHE:-/var/cache/mesh-cni/node}"
OUT="$CACHE_ROOT/containerd-$CONTAINERD_VERSION-crictl-$CRICTL_VERSION"
BINS=(containerd containerd-shim-runc-v2 ctr crictl)

# shellcheck source=hack/cache.sh
source "$(dirname "${BASH_SOURCE[0]}")/cache.sh"
cache_begin "containerd $CONTAINERD_VERSION, crictl $CRICTL_VERSION" -mod=mod
cache_workdir containerd
go get "github.com/containerd/containerd/v2@$CONTAINERD_VERSION" "sigs.k8s.io/cri-tools@$CRICTL_VERSION" >&2

cpkg=github.com/containerd/containerd/v2
cldflags="-s -w -X $cpkg/version.Version=$CONTAINERD_VERSION -X $cpkg/version.Package=$cpkg"
mkdir -p bin
go build -trimpath -tags urfave_cli_no_docs -ldflags "$cldflags" -o bin/ \
	"$cpkg/cmd/containerd" "$cpkg/cmd/containerd-shim-runc-v2" "$cpkg/cmd/ctr" >&2
go build -trimpath -ldflags "-s -w -X sigs.k8s.io/cri-tools/pkg/version.Version=$CRICTL_VERSION" \
	-o bin/crictl sigs.k8s.io/cri-tools/cmd/crictl >&2
cache_publish_from bin
