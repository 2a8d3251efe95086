#!/usr/bin/env bash
# Throwaway Redis server for tests (Debian's `redis-server` package, no Docker, no systemd).
#
# Design: an executable with subcommands, like scripts/prometheus.sh (never `source` it).
# Logs go to stderr; `start`/`env` print only `export ...` lines on stdout:
#
#   eval "$(scripts/redis.sh env)"   # start or reuse; export REDIS_URL
#   scripts/redis.sh status          # exit 0 and print the URL if running
#   scripts/redis.sh restart         # same port (its data is not kept: a cache)
#   scripts/redis.sh stop
#
# Exports: REDIS_URL=redis://127.0.0.1:PORT
#
# The server listens on 127.0.0.1 only (protected mode on, no password: loopback tests),
# keeps nothing on disk (no RDB snapshots, no AOF) and evicts nothing (maxmemory 0): the
# idempotency fast path is a cache in front of the database, and the tests check what it
# holds.
#
# State lives in ${CONSUMER_STATE_DIR:-/tmp/consumer-test}/redis:
#   redis.pid, port, env, redis.conf, redis.log
#
# Knobs (all optional):
#   CONSUMER_STATE_DIR    state root (default /tmp/consumer-test)
#   CONSUMER_REDIS_PORT   first port to try (default 56379)
set -euo pipefail

source "$(dirname "${BASH_SOURCE[0]}")/service-lib.sh"

pid_server_files redis
CONFIG="$SERVICE_DIR/redis.conf"
FIRST_PORT="${CONSUMER_REDIS_PORT:-56379}"
TIMEOUT=60
SERVER_PATTERN='redis-server'

server_ready() {
    [[ "$(redis-cli -h 127.0.0.1 -p "$1" ping 2>/dev/null)" == PONG ]]
}

write_config() {
    cat >"$CONFIG" <<EOF
# Written by scripts/redis.sh on every start.
bind 127.0.0.1
port $1
protected-mode yes
daemonize no
dir $SERVICE_DIR
logfile ""
save ""
appendonly no
maxmemory 0
EOF
}

start_server() {
    local policy="$1" port
    command -v redis-server >/dev/null ||
        die "redis-server is not installed (scripts/install-packages.sh test)"
    if server_running; then
        log "reusing running Redis on port $(stored_port)"
        return 0
    fi
    if server_pid >/dev/null; then
        log "Redis pid $(server_pid) does not answer; stopping it"
        stop_server
    fi
    port=$(choose_port "$policy")
    write_config "$port"
    printf '%s\n' "$port" >"$PORT_FILE"
    printf "export REDIS_URL='redis://127.0.0.1:%s'\n" "$port" >"$ENV_FILE"
    log "starting Redis $(redis-server --version | sed -E "s/.* v=([^ ]+).*/\1/") on 127.0.0.1:$port (log: $LOG_FILE)"
    (
        exec setsid nohup redis-server "$CONFIG" </dev/null >>"$LOG_FILE" 2>&1 9>&-
    ) &
    printf '%s\n' "$!" >"$PID_FILE"
    wait_started redis server_ready server_pid "$port"
}

redis_url() {
    printf 'redis://127.0.0.1:%s\n' "$(stored_port)"
}

mkdir -p "$SERVICE_DIR"
service_main redis start_server stop_server server_running redis_url "$@"
