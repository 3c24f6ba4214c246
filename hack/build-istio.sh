#!/usr/bin/env bash
# Builds Istio's control plane and CNI node agent from the Go module proxy (no
# other download) into a cache directory outside the repository, for test/k8s,
# which runs them as the peers mesh-cni replaces or works with: istiod
# (pilot-discovery) and its chart, istio-cni's node agent (install-cni, which
# also installs its plugin and serves ZDS), its plugin (istio-cni), and the
# sidecar's agent (pilot-agent), whose validation injected pods run. With them, hack/istio-inpod
# (its own module, pinned to the same Istio): istio-cni's in-pod rules applied
# by istio-cni's code, the baseline of test/capture and test/bench. A second run
# finds them there and builds nothing. Prints the directory holding the
# binaries as its last line.
#
#   hack/build-istio.sh
#   MESH_CNI_ISTIO_CACHE=/some/dir hack/build-istio.sh
#
# istio.io/istio has no replace directives, so `go install` of its main packages
# at a version builds the same sources as its release images (static, no cgo).
set -euo pipefail

ISTIO_VERSION="${ISTIO_VERSION:-v0.0.0-20260827124520-eed52ebb66ad}"
CACHE_ROOT="${MESH_CNI_ISTIO_CACHE:-/var/cache/mesh-cni/istio}"
INPOD="$(cd "$(dirname "${BASH_SOURCE[0]}")/istio-inpod" && pwd)"
if ! grep -q "istio.io/istio $ISTIO_VERSION\$" "$INPOD/go.mod"; then
	echo "$INPOD/go.mod does not require istio.io/istio $ISTIO_VERSION: pin both to one version" >&2
	exit 1
fi
# The helper's sources name the cache too: a change to them is a new build.
inpod_sum="$(cat "$INPOD/go.mod" "$INPOD/go.sum" "$INPOD"/*.go | sha256sum | cut -c1-12)"
OUT="$CACHE_ROOT/istio-$ISTIO_VERSION-inpod-$inpod_sum"
CMDS=(pilot/cmd/pilot-discovery pilot/cmd/pilot-agent cni/cmd/install-cni cni/cmd/istio-cni)
BINS=(pilot-discovery pilot-agent install-cni istio-cni istio-inpod)

# shellcheck source=hack/cache.sh
source "$(dirname "${BASH_SOURCE[0]}")/cache.sh"
cache_begin "${BINS[*]} (istio.io/istio $ISTIO_VERSION)"
cache_stage
pkgs=()
for c in "${CMDS[@]}"; do pkgs+=("istio.io/istio/$c@$ISTIO_VERSION"); done
GOBIN="$CACHE_STAGE" go install -trimpath -ldflags "-s -w" "${pkgs[@]}" >&2
(cd "$INPOD" && go build -trimpath -ldflags "-s -w" -o "$CACHE_STAGE/istio-inpod" .) >&2
# istiod's chart, whose sidecar injector templates and values test/k8s renders
# pods with.
cp -r "$(go env GOMODCACHE)/istio.io/istio@$ISTIO_VERSION/manifests/charts/istio-control/istio-discovery" "$CACHE_STAGE/"
chmod -R u+w "$CACHE_STAGE/istio-discovery"
cache_publish
