#!/usr/bin/env bash
# Builds Istio's control plane and CNI node agent from the Go module proxy (no
# other download) into a cache directory outside the repository, for test/istio,
# which runs them as the peers mesh-cni replaces or works with: istiod
# (pilot-discovery), istio-cni's node agent (install-cni, which also installs its
# plugin and serves ZDS) and its plugin (istio-cni). A second run finds them there
# and builds nothing. Prints the directory holding the binaries as its last line.
#
#   hack/build-istio.sh
#   MESH_CNI_ISTIO_CACHE=/some/dir hack/build-istio.sh
#
# istio.io/istio has no replace directives, so `go install` of its main packages
# at a version builds the same sources as its release images (static, no cgo).
set -euo pipefail

ISTIO_VERSION="${ISTIO_VERSION:-v0.0.0-20260827124520-eed52ebb66ad}"
CACHE_ROOT="${MESH_CNI_ISTIO_CACHE:-/var/cache/mesh-cni/istio}"
OUT="$CACHE_ROOT/istio-$ISTIO_VERSION"
CMDS=(pilot/cmd/pilot-discovery cni/cmd/install-cni cni/cmd/istio-cni)
BINS=(pilot-discovery install-cni istio-cni)

have() {
	[[ -f "$OUT/.complete" ]] || return 1
	local b
	for b in "${BINS[@]}"; do [[ -x "$OUT/$b" ]] || return 1; done
}

if have; then
	echo "$OUT"
	exit 0
fi

mkdir -p "$CACHE_ROOT"
# One build at a time per cache.
exec 9>"$CACHE_ROOT/.build.lock"
flock 9
if have; then
	echo "$OUT"
	exit 0
fi

export GOFLAGS="-buildvcs=false"
export CGO_ENABLED=0
start=$(date +%s)
echo "building ${BINS[*]} (istio.io/istio $ISTIO_VERSION) into $OUT" >&2
# Move into place whole: a half-written cache is never taken for a built one.
tmp_out="$(mktemp -d "$CACHE_ROOT/.partial.XXXXXX")"
trap 'rm -rf "$tmp_out"' EXIT
pkgs=()
for c in "${CMDS[@]}"; do pkgs+=("istio.io/istio/$c@$ISTIO_VERSION"); done
GOBIN="$tmp_out" go install -trimpath -ldflags "-s -w" "${pkgs[@]}" >&2
chmod 0755 "$tmp_out"
echo "built $(date -u +%FT%TZ) in $(($(date +%s) - start))s: ${BINS[*]} (istio.io/istio $ISTIO_VERSION)" >"$tmp_out/.complete"
rm -rf "$OUT"
mv "$tmp_out" "$OUT"
trap - EXIT
cat "$OUT/.complete" >&2
echo "$OUT"
