#!/usr/bin/env bash
# Installs the Debian packages of scripts/packages.txt that are missing.
#
#   scripts/install-packages.sh [GROUP...]    groups: build, test, ci (default: all)
#   scripts/install-packages.sh --list [GROUP...]   print the groups' packages, one a line
#
# Says what it installs (or that nothing is missing). As root it runs apt-get update and
# apt-get install for the missing packages, with no recommended extras, and keeps their
# services from starting (scripts/postgres.sh, scripts/rabbitmq.sh and scripts/redis.sh run
# their own servers). As any other user it fails at once, printing the apt-get line to run as root.
#
# Knobs (optional):
#   CONSUMER_SKIP_PACKAGES=1   check nothing, install nothing: for machines that are not
#                              Debian or Ubuntu, once their equivalents are installed
set -euo pipefail

LIST="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/packages.txt"

log() { printf 'install-packages.sh: %s\n' "$*" >&2; }
die() { log "error: $*"; exit 1; }

# The packages of the given groups (every group if none), in the list's order.
packages() {
    local -a groups=("$@")
    awk -v want="${groups[*]}" '
        BEGIN { n = split(want, g, " "); for (i = 1; i <= n; i++) keep[g[i]] = 1 }
        /^[[:space:]]*(#|$)/ { next }
        NF < 2 { printf "packages.txt:%d: no group\n", NR > "/dev/stderr"; exit 1 }
        n == 0 || ($2 in keep) { print $1 }
    ' "$LIST"
}

main() {
    local list_only=0 g
    if [[ "${1:-}" == --list ]]; then
        list_only=1
        shift
    fi
    case "${1:-}" in -h | --help) sed -n '2,/^set -euo/p' "$0" | sed -e '$d' -e 's/^# \{0,1\}//' >&2; exit 2 ;; esac
    for g in "$@"; do
        case "$g" in build | test | ci) ;; *) die "unknown group $g (use build, test or ci)" ;; esac
    done
    local out
    local -a wanted missing=()
    out=$(packages "$@")
    [[ -n "$out" ]] || die "no packages for groups: $*"
    mapfile -t wanted <<<"$out"
    if ((list_only)); then
        printf '%s\n' "${wanted[@]}"
        return 0
    fi
    if [[ "${CONSUMER_SKIP_PACKAGES:-0}" == 1 ]]; then
        log "CONSUMER_SKIP_PACKAGES=1: not checking ${wanted[*]}"
        return 0
    fi
    command -v dpkg-query >/dev/null ||
        die "not a Debian system (no dpkg-query): install the equivalents of ${wanted[*]}, then set CONSUMER_SKIP_PACKAGES=1"

    local p
    for p in "${wanted[@]}"; do
        dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
    done
    if ((${#missing[@]} == 0)); then
        log "all ${#wanted[@]} packages present (${*:-every group})"
        return 0
    fi
    local line="apt-get install -y --no-install-recommends ${missing[*]}"
    if [[ $EUID -ne 0 ]]; then
        log "missing Debian packages: ${missing[*]}"
        log "as root run: apt-get update && $line"
        exit 1
    fi
    log "installing missing Debian packages: ${missing[*]}"
    export DEBIAN_FRONTEND=noninteractive
    # Keep the packages' own services from starting (RabbitMQ's would take port 5672 under
    # another node name): a policy-rc.d exiting 101 means "do not start".
    local own_policy=0 rc=0
    if [[ ! -e /usr/sbin/policy-rc.d ]]; then
        printf '#!/bin/sh\nexit 101\n' >/usr/sbin/policy-rc.d
        chmod 755 /usr/sbin/policy-rc.d
        own_policy=1
    fi
    apt-get update -q || rc=$?
    if ((rc == 0)); then
        # shellcheck disable=SC2086 # the line is the one printed above, split on purpose
        apt-get ${line#apt-get } -q || rc=$?
    fi
    if ((own_policy)); then rm -f /usr/sbin/policy-rc.d; fi
    ((rc == 0)) || die "apt-get failed (exit $rc): $line"
    log "installed: ${missing[*]}"
}

main "$@"
