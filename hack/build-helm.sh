#!/usr/bin/env bash
# Builds the helm CLI from the Go module proxy (no other download) into a cache
# directory outside the repository, for the node tests in test/node, which
# install the chart in install/helm as an operator does. A second run finds it
# there and builds nothing. Prints the directory holding the binary as its last
# line.
#
#   hack/build-helm.sh
#   MESH_CNI_NODE_CACHE=/some/dir hack/build-helm.sh
#
# helm.sh/helm/v3 has no replace directives, so `go install` of its main
# package at a version builds the same sources as the release.
set -euo pipefail

HELM_VERSION="${HELM_VERSION:-v3.22.0}"
CACHE_ROOT="${MESH_CNI_NODE_CACHE:-/var/cache/mesh-cni/node}"
OUT="$CACHE_ROOT/helm-$HELM_VERSION"
BINS=(helm)

# shellcheck source=hack/cache.sh
source "$(dirname "${BASH_SOURCE[0]}")/cache.sh"
cache_begin "helm $HELM_VERSION"
cache_stage
GOBIN="$CACHE_STAGE" go install -trimpath \
	-ldflags "-s -w -X helm.sh/helm/v3/internal/version.version=$HELM_VERSION -X helm.sh/helm/v3/internal/version.gitTreeState=clean" \
	"helm.sh/helm/v3/cmd/helm@$HELM_VERSION" >&2
cache_publish
