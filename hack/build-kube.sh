#!/usr/bin/env bash
# Builds kube-apiserver and etcd from the Go module proxy (no other download) into a
# cache directory outside the repository, for the tests in test/k8s. A second run
# finds them there and builds nothing. Prints the directory holding both binaries
# as its last line.
#
#   hack/build-kube.sh            # build if missing, print the directory
#   MESH_CNI_KUBE_CACHE=/some/dir hack/build-kube.sh
#
# Why a throwaway module: k8s.io/kubernetes replaces its k8s.io/* staging modules
# with local paths, so `go install k8s.io/kubernetes/cmd/kube-apiserver@v` refuses
# it. A module that requires k8s.io/kubernetes and points each staging module at
# its published v0.x release builds the same sources. Replace directives of
# dependencies are ignored, so etcd's own main package builds the same way.
# A cold build takes several minutes on two cores; the Go build cache makes a
# rebuild after a version change cheaper.
set -euo pipefail

KUBE_VERSION="${KUBE_VERSION:-v1.37.2}"
# The etcd release k8s.io/kubernetes $KUBE_VERSION requires.
ETCD_VERSION="${ETCD_VERSION:-v3.7.0}"
CACHE_ROOT="${MESH_CNI_KUBE_CACHE:-/var/cache/mesh-cni/kube}"
OUT="$CACHE_ROOT/kube-$KUBE_VERSION-etcd-$ETCD_VERSION"

have() { [[ -x "$OUT/kube-apiserver" && -x "$OUT/etcd" && -f "$OUT/.complete" ]]; }

if have; then
	echo "$OUT"
	exit 0
fi

mkdir -p "$CACHE_ROOT"
# One build at a time per cache: parallel test binaries (or engineers) wait for
# the first builder instead of all building at once.
exec 9>"$CACHE_ROOT/.build.lock"
flock 9
if have; then
	echo "$OUT"
	exit 0
fi

export GOFLAGS="-mod=mod -buildvcs=false"
export CGO_ENABLED=0
work="$(mktemp -d "${TMPDIR:-/tmp}/mesh-cni-kube-build.XXXXXX")"
trap 'rm -rf "$work"' EXIT
cd "$work"

start=$(date +%s)
echo "building kube-apiserver $KUBE_VERSION and etcd $ETCD_VERSION into $OUT" >&2
go mod init mesh-cni.local/kube-build >/dev/null 2>&1

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

go get "k8s.io/kubernetes/cmd/kube-apiserver@$KUBE_VERSION" "go.etcd.io/etcd/server/v3@$ETCD_VERSION" >&2

ver="k8s.io/component-base/version"
minor="${KUBE_VERSION#v1.}"
minor="${minor%%.*}"
ldflags="-s -w -X $ver.gitVersion=$KUBE_VERSION -X $ver.gitMajor=1 -X $ver.gitMinor=$minor -X $ver.gitTreeState=clean"
mkdir -p bin
go build -trimpath -ldflags "$ldflags" -o bin/kube-apiserver k8s.io/kubernetes/cmd/kube-apiserver >&2
go build -trimpath -ldflags "-s -w" -o bin/etcd go.etcd.io/etcd/server/v3 >&2

# Move into place whole: a half-written cache is never taken for a built one.
tmp_out="$(mktemp -d "$CACHE_ROOT/.partial.XXXXXX")"
mv bin/kube-apiserver bin/etcd "$tmp_out/"
chmod 0755 "$tmp_out" "$tmp_out/kube-apiserver" "$tmp_out/etcd"
echo "built $(date -u +%FT%TZ) in $(($(date +%s) - start))s: kube-apiserver $KUBE_VERSION, etcd $ETCD_VERSION" >"$tmp_out/.complete"
rm -rf "$OUT"
mv "$tmp_out" "$OUT"
cat "$OUT/.complete" >&2
echo "$OUT"
