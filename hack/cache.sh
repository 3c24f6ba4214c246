# Sourced by hack/build-*.sh: the cache those scripts share, and the steps
# of their builds. Each sets OUT (the directory its binaries go to), BINS
# (their names) and CACHE_ROOT, then:
#
#   cache_begin "what" [GOFLAGS]  # prints OUT and exits when it is complete;
#                                 # otherwise waits for the cache's build lock
#                                 # (and looks again), then sets up the build
#   cache_stage                   # CACHE_STAGE: an empty directory beside OUT
#   ... build into "$CACHE_STAGE" ...
#   cache_publish                 # moves it into place, prints OUT
#
# or, for a build in a throwaway module of its own:
#
#   cache_workdir NAME            # a temporary module, the current directory
#   ... build BINS into bin/ ...
#   cache_publish_from bin
#
# A complete cache holds every name in BINS, executable, and a .complete stamp
# written last, so a half-written directory is never taken for a built one.

cache_complete() {
	[[ -f "$OUT/.complete" ]] || return 1
	local b
	for b in "${BINS[@]}"; do [[ -x "$OUT/$b" ]] || return 1; done
}

cache_lookup() {
	if cache_complete; then
		echo "$OUT"
		exit 0
	fi
	mkdir -p "$CACHE_ROOT"
	# One build at a time per cache: parallel test binaries (or engineers) wait
	# for the first builder instead of all building at once.
	exec 9>"$CACHE_ROOT/.build.lock"
	flock 9
	if cache_complete; then
		echo "$OUT"
		exit 0
	fi
	CACHE_START=$(date +%s)
}

# cache_begin looks the build up (see cache_lookup) and, when it is to be
# done, sets the environment every build here uses: static binaries, no VCS
# stamp (the module proxy's sources have none), and extra GOFLAGS ($2).
cache_begin() {
	cache_lookup
	CACHE_WHAT="$1"
	export GOFLAGS="${2:+$2 }-buildvcs=false"
	export CGO_ENABLED=0
	echo "building $CACHE_WHAT into $OUT" >&2
}

# cache_workdir makes a throwaway module mesh-cni.local/$1-build in a
# temporary directory, removed on exit, and changes into it.
cache_workdir() {
	CACHE_WORK="$(mktemp -d "${TMPDIR:-/tmp}/mesh-cni-$1-build.XXXXXX")"
	trap 'rm -rf "$CACHE_WORK"' EXIT
	cd "$CACHE_WORK"
	go mod init "mesh-cni.local/$1-build" >/dev/null 2>&1
}

# cache_stage makes the staging directory CACHE_STAGE, removed on exit unless
# it was published (with the work directory, if any).
cache_stage() {
	CACHE_STAGE="$(mktemp -d "$CACHE_ROOT/.partial.XXXXXX")"
	trap 'rm -rf "${CACHE_WORK:-}" "$CACHE_STAGE"' EXIT
}

cache_publish() {
	local b
	for b in "${BINS[@]}"; do chmod 0755 "$CACHE_STAGE/$b"; done
	chmod 0755 "$CACHE_STAGE"
	echo "built $(date -u +%FT%TZ) in $(($(date +%s) - CACHE_START))s: $CACHE_WHAT" >"$CACHE_STAGE/.complete"
	rm -rf "$OUT"
	mv "$CACHE_STAGE" "$OUT"
	cat "$OUT/.complete" >&2
	echo "$OUT"
}

# cache_publish_from publishes BINS, built into directory $1.
cache_publish_from() {
	cache_stage
	local b
	for b in "${BINS[@]}"; do mv "$1/$b" "$CACHE_STAGE/"; done
	cache_publish
}
