#!/usr/bin/env bash
# Runs every Go fuzz target in the module for a fixed budget each, one target at
# a time (go test -fuzz takes one target in one package).
#
#   hack/fuzz.sh [budget] [package pattern]
#
# budget is what -fuzztime takes: a duration ("10s", "5m") or a count ("1000x");
# default 10s. The optional pattern (an extended regexp on the package path, e.g.
# 'pkg/(gate|podstore)') limits the run to matching packages.
#
# A crasher is written by go test to <package>/testdata/fuzz/<Target>/<hash>:
# commit it with the fix, and plain `go test` replays it as a regression test
# from then on. The script goes on with the other targets and fails at the end,
# listing the targets that failed.
set -uo pipefail
cd "$(dirname "$0")/.."

budget="${1:-10s}"
filter="${2:-.}"
GO="${GO:-go}"

# "<dir> <target>" for every func FuzzXxx(f *testing.F) in a _test.go file,
# skipping vendored and generated trees.
targets=$(grep -rEo --include='*_test.go' '^func Fuzz[A-Za-z0-9_]*\(' \
	--exclude-dir=.git --exclude-dir=bin --exclude-dir=vendor . |
	sed -E 's|^\./(.*)/[^/]+_test\.go:func (Fuzz[A-Za-z0-9_]*)\($|\1 \2|' |
	grep -E "^[^ ]*(${filter})[^ ]* " | sort -u)

if [ -z "$targets" ]; then
	echo "fuzz: no fuzz targets match '${filter}'" >&2
	exit 1
fi

count=$(wc -l <<<"$targets")
echo "fuzz: ${count} targets, ${budget} each"
failed=()
passed=0
out=$(mktemp)
trap 'rm -f "$out"' EXIT
# fuzz_once runs one target. The Go fuzzing coordinator can itself fail with
# "context deadline exceeded" when a worker answers late at the end of its
# budget on a loaded machine; that is not a finding (no input is written), so
# such a run is repeated (at most twice).
fuzz_once() {
	"$GO" test -run '^$' -fuzz "^$2\$" -fuzztime "$budget" "./$1" 2>&1 | tee "$out"
	return "${PIPESTATUS[0]}"
}
while read -r dir name; do
	echo "== ${dir} ${name}"
	ok=0
	for attempt in 1 2 3; do
		if fuzz_once "$dir" "$name"; then
			ok=1
			break
		fi
		if ! grep -q 'context deadline exceeded' "$out" || grep -q 'Failing input written' "$out"; then
			break # a real finding, or another failure: no retry
		fi
		echo "fuzz: ${name}: coordinator timeout without a finding (attempt ${attempt}), running it again"
	done
	if [ "$ok" = 1 ]; then
		passed=$((passed + 1))
	else
		failed+=("${dir} ${name}")
	fi
done <<<"$targets"

if [ "${#failed[@]}" -gt 0 ]; then
	echo "fuzz: failing targets (crashers, if any, are in <package>/testdata/fuzz/<target>/):"
	printf '  %s\n' "${failed[@]}"
fi
echo "fuzz: ${passed} passed, ${#failed[@]} failed"
[ "${#failed[@]}" -eq 0 ]
