#!/usr/bin/env bash
# Installs the Debian packages listed in the given files (one name a line, #
# comments) that are not installed yet, with apt-get; with all of them present
# it changes nothing and asks no network. Make targets run it first, so the
# README's commands need nothing installed by hand but Go, make and git.
#
#   hack/deps.sh hack/packages.txt [hack/packages-kernels.txt ...]
set -euo pipefail

want=()
for f in "$@"; do
	while read -r line; do
		line="${line%%#*}"
		for p in $line; do want+=("$p"); done
	done <"$f"
done

missing=()
for p in "${want[@]}"; do
	status="$(dpkg-query -W -f='${Status}' "$p" 2>/dev/null || true)"
	[[ "$status" == "install ok installed" ]] || missing+=("$p")
done
[[ ${#missing[@]} -eq 0 ]] && exit 0

if [[ "$(id -u)" != 0 ]]; then
	echo "missing Debian packages (install them as root): ${missing[*]}" >&2
	exit 1
fi
echo "installing Debian packages: ${missing[*]}" >&2
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
