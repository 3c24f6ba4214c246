# Sourced by hack/build-*.sh: the cache those scripts share. Each sets OUT (the
# directory its binaries go to), BINS (their names) and CACHE_ROOT, then:
#
#   cache_lookup        # prints OUT and exits when it is complete; otherwise
#                       # waits for the cache's build lock (and looks again)
#   stage="$(cache_stage)"                    # an empty directory beside OUT
#   ... build into "$stage" ...
#   cache_publish "$stage" "what was built"   # moves it into place, prints OUT
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

# cache_stage makes the staging directory; the caller removes it on failure
# (trap) since a subshell cannot set the caller's traps.
cache_stage() {
	mktemp -d "$CACHE_ROOT/.partial.XXXXXX"
}

cache_publish() {
	local stage="$1" what="$2" b
	for b in "${BINS[@]}"; do chmod 0755 "$stage/$b"; done
	chmod 0755 "$stage"
	echo "built $(date -u +%FT%TZ) in $(($(date +%s) - CACHE_START))s: $what" >"$stage/.complete"
	rm -rf "$OUT"
	mv "$stage" "$OUT"
	cat "$OUT/.complete" >&2
	echo "$OUT"
}
