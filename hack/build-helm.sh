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

have() { [[ -f "$OUT/.complete" && -x "$OUT/helm" ]]; }

if have; then
	echo "$OUT"
	exit 0
fi

mkdir -p "$CACHE_ROOT"
# One build at a time per cache (shared with hack/build-containerd.sh).
exec 9>"$CACHE_ROOT/.build.lock"
flock 9
if have; then
	echo "$OUT"
	exit 0
fi

export GOFLAGS="-buildvcs=false"
export CGO_ENABLED=0
start=$(date +%s)
echo "building helm $HELM_VERSION into $OUT" >&2
# Move into place whole: a half-written cache is never taken for a built one.
tmp_out="$(mktemp -d "$CACHE_ROOT/.partial.XXXXXX")"
trap 'rm -rf "$tmp_out"' EXIT
GOBIN="$tmp_out" go install -trimpath \
	-ldflags "-s -w -X helm.sh/helm/v3/internal/version.version=$HELM_VERSION -X helm.sh/helm/v3/internal/version.gitTreeState=clean" \
	"helm.sh/helm/v3/cmd/helm@$HELM_VERSION" >&2
chmod 0755 "$tmp_out" "$tmp_out/helm"
echo "built $(date -u +%FT%TZ) in $(($(date +%s) - start))s: helm $HELM_VERSION" >"$tmp_out/.complete"
rm -rf "$OUT"
mv "$tmp_out" "$OUT"
trap - EXIT
cat "$OUT/.complete" >&2
echo "$OUT"
