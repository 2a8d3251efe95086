#!/usr/bin/env bash
# Throwaway RabbitMQ broker for tests, without systemd.
#
# Usage (logs go to stderr; start/env print only `export ...` lines):
#
#   eval "$(scripts/rabbitmq.sh env)"   # start or reuse, export AMQP_URL
#   scripts/rabbitmq.sh start           # same as env
#   scripts/rabbitmq.sh status          # exit 0 and print the URL if running
#   scripts/rabbitmq.sh restart         # same port, same data (chaos tests)
#   scripts/rabbitmq.sh stop            # clean shutdown
#   scripts/rabbitmq.sh ctl ARGS...     # rabbitmqctl against this node,
#                                       # e.g. `ctl list_queues name messages`
#
# Exports: AMQP_URL=amqp://consumer:consumer@127.0.0.1:PORT/%2f
#
# A cluster of N nodes on this machine, beside the single node (which it never touches):
#
#   eval "$(scripts/rabbitmq.sh cluster 3)"  # start or reuse, export AMQP_CLUSTER_URLS
#   scripts/rabbitmq.sh node stop|kill|start|restart|status I   # node I (1..N) alone;
#                                       # kill = SIGKILL, crash-like
#   scripts/rabbitmq.sh node ctl I ARGS...   # rabbitmqctl against node I
#   scripts/rabbitmq.sh cluster-stop    # clean shutdown of every node
#
# Exports: AMQP_CLUSTER_URLS=amqp://consumer:consumer@127.0.0.1:5772/%2f,...:5773/%2f,...
#
# Node I is consumer-cI@localhost (with a checksum of the state dir in the name when
# CONSUMER_STATE_DIR is not the default), AMQP port CONSUMER_RABBITMQ_CLUSTER_PORT + I - 1,
# Erlang distribution port AMQP port + 20000; the nodes share one Erlang cookie. The nodes
# start side by side (a node that was not the last one stopped waits for its peers at
# boot); nodes 2..N then join node 1 (join_cluster) unless they are members already, so a
# second `cluster N` reuses the running or stopped cluster. Quorum queues declared on it
# get a replica on every node (the initial group size defaults to the cluster's size).
# State: ${CONSUMER_STATE_DIR:-/tmp/consumer-test}/rabbitmq-cluster/nodeI (same layout as
# the single node's, below), home/.erlang.cookie shared, env (the export line).
#
# The user consumer/consumer (administrator, full permissions on vhost /) is
# created by the broker itself on first boot (default_user in rabbitmq.conf),
# which needs no rabbitmqctl call; guest is not created.
#
# Everything lives in ${CONSUMER_STATE_DIR:-/tmp/consumer-test}/rabbitmq:
#   home/.erlang.cookie   HOME of the server and of every CLI call made here,
#                         so rabbitmqctl always finds the same cookie (the
#                         usual failure when root runs rabbitmqctl)
#   mnesia/  log/  rabbitmq.conf  enabled_plugins  rabbitmq.pid
#   port, amqp_url, env, node     what the running broker uses, for other scripts
# Nothing under /etc/rabbitmq or /var/lib/rabbitmq is read or written.
#
# Knobs (all optional; RABBITMQ_* names are avoided because rabbitmq-env
# reads them):
#   CONSUMER_STATE_DIR            state root (default /tmp/consumer-test)
#   CONSUMER_RABBITMQ_PORT        first AMQP port to try (default 5672); the
#                                 Erlang distribution port is AMQP port + 20000
#   CONSUMER_RABBITMQ_MANAGEMENT  1 = enable the management plugin (HTTP on
#                                 AMQP port + 10000, i.e. 15672); off by default
#                                 because it slows boot down
#   CONSUMER_RABBITMQ_STOP_MODE   stop/restart: clean (default) or kill
#                                 (SIGKILL, crash-like; recovery on next start)
#   CONSUMER_RABBITMQ_CLUSTER_PORT  AMQP port of cluster node 1 (default 5772)
set -euo pipefail

# Absolute, because the broker and later callers run from other directories.
STATE_DIR="$(realpath -m "${CONSUMER_STATE_DIR:-/tmp/consumer-test}")"

# Points the per-node variables at the node kept in directory $1, with its cookie in the
# HOME directory $2: the functions below then act on that node.
node_files() {
    RMQ_DIR="$1"
    HOME_DIR="$2"
    LOG_DIR="$RMQ_DIR/log"
    PID_FILE="$RMQ_DIR/rabbitmq.pid"
    PORT_FILE="$RMQ_DIR/port"
    URL_FILE="$RMQ_DIR/amqp_url"
    ENV_FILE="$RMQ_DIR/env"
    NODE_FILE="$RMQ_DIR/node"
}
node_files "$STATE_DIR/rabbitmq" "$STATE_DIR/rabbitmq/home"
FIRST_PORT="${CONSUMER_RABBITMQ_PORT:-5672}"
MANAGEMENT="${CONSUMER_RABBITMQ_MANAGEMENT:-0}"
STOP_MODE="${CONSUMER_RABBITMQ_STOP_MODE:-clean}"
CLUSTER_PORT="${CONSUMER_RABBITMQ_CLUSTER_PORT:-5772}"
CLUSTER_DIR="$STATE_DIR/rabbitmq-cluster"
RMQ_BIN=/usr/lib/rabbitmq/bin
AMQP_USER=consumer
AMQP_PASS=consumer
TIMEOUT=120

source "$(dirname "${BASH_SOURCE[0]}")/service-lib.sh"

install_rabbitmq() {
    [[ $EUID -eq 0 ]] || die "rabbitmq-server is not installed; as root run: apt-get install rabbitmq-server"
    log "installing rabbitmq-server from Debian packages (log: $RMQ_DIR/install.log)"
    export DEBIAN_FRONTEND=noninteractive
    # Keep the package's own service from starting (it would take port 5672
    # under another node name): policy-rc.d exit 101 = "do not start".
    local own_policy=0 rc=0
    if [[ ! -e /usr/sbin/policy-rc.d ]]; then
        printf '#!/bin/sh\nexit 101\n' >/usr/sbin/policy-rc.d
        chmod 755 /usr/sbin/policy-rc.d
        own_policy=1
    fi
    # Retry once after refreshing the package lists (fresh machines have none).
    if ! apt-get install -y -q --no-install-recommends rabbitmq-server >"$RMQ_DIR/install.log" 2>&1; then
        apt-get update -q >>"$RMQ_DIR/install.log" 2>&1 || true
        apt-get install -y -q --no-install-recommends rabbitmq-server >>"$RMQ_DIR/install.log" 2>&1 || rc=$?
    fi
    if ((own_policy)); then rm -f /usr/sbin/policy-rc.d; fi
    if ((rc != 0)); then
        tail -n 30 "$RMQ_DIR/install.log" >&2
        die "apt-get install rabbitmq-server failed"
    fi
}

# Unique per state dir, so two checkouts with different state dirs don't
# clash in epmd; stable, so the mnesia dir (named after the node) is reused.
node_name() {
    local sum
    if [[ "$STATE_DIR" == /tmp/consumer-test ]]; then
        printf 'consumer@localhost\n'
    else
        sum=$(printf '%s' "$STATE_DIR" | cksum | cut -d' ' -f1)
        printf 'consumer-%s@localhost\n' "$sum"
    fi
}

# Command prefix that runs a RabbitMQ tool with this broker's environment, as
# the rabbitmq user when root (its files stay owned by one user). The packaged
# wrappers in /usr/sbin are bypassed: they cd to /var/lib/rabbitmq, redirect
# output to /var/log/rabbitmq and reset HOME, which breaks the cookie.
# An array rather than a function so that setsid can run it.
set_rmq_prefix() {
    local port
    port=$(cat "$PORT_FILE")
    RMQ_PREFIX=()
    if [[ $EUID -eq 0 ]]; then
        RMQ_PREFIX=(runuser -u rabbitmq --)
    fi
    RMQ_PREFIX+=(
        env
        HOME="$HOME_DIR"
        RABBITMQ_NODENAME="$NODE"
        RABBITMQ_CONF_ENV_FILE="$RMQ_DIR/rabbitmq-env.conf"
        RABBITMQ_CONFIG_FILE="$RMQ_DIR/rabbitmq.conf"
        RABBITMQ_ADVANCED_CONFIG_FILE="$RMQ_DIR/advanced.config"
        RABBITMQ_ENABLED_PLUGINS_FILE="$RMQ_DIR/enabled_plugins"
        RABBITMQ_MNESIA_BASE="$RMQ_DIR/mnesia"
        RABBITMQ_LOG_BASE="$LOG_DIR"
        RABBITMQ_PID_FILE="$PID_FILE"
        RABBITMQ_NODE_IP_ADDRESS=127.0.0.1
        RABBITMQ_NODE_PORT="$port"
        RABBITMQ_DIST_PORT="$((port + 20000))"
        # Erlang distribution and epmd only on loopback too.
        RABBITMQ_SERVER_ADDITIONAL_ERL_ARGS="-kernel inet_dist_use_interface {127,0,0,1}"
        ERL_EPMD_ADDRESS=127.0.0.1
    )
}

# cd: the tools complain when the cwd (e.g. /root) is unreadable for them.
# 9>&- keeps the lock fd out of the long-lived broker.
as_rmq() {
    set_rmq_prefix
    (cd "$RMQ_DIR" && "${RMQ_PREFIX[@]}" "$@" 9>&-)
}

ctl() {
    as_rmq "$RMQ_BIN/rabbitmqctl" "$@"
}

# The AMQP port $1, its distribution port and (with the management UI) its HTTP port are free.
ports_free() {
    local p="$1"
    ! port_in_use "$p" && ! port_in_use "$((p + 20000))" &&
        { [[ "$MANAGEMENT" != 1 ]] || ! port_in_use "$((p + 10000))"; }
}

beam_pid() {
    local pid
    [[ -s "$PID_FILE" ]] || return 1
    pid=$(tr -dc '0-9' <"$PID_FILE")
    [[ -n "$pid" ]] || return 1
    kill -0 "$pid" 2>/dev/null || return 1
    # A stale pid file could name a recycled pid: insist on an Erlang VM.
    tr '\0' ' ' <"/proc/$pid/cmdline" | grep -q 'beam' || return 1
    printf '%s\n' "$pid"
}

# Ours and up: live VM from our pid file, and AMQP port accepting (the
# listener opens at the very end of boot, so this means "ready").
rmq_running() {
    local port
    beam_pid >/dev/null || return 1
    port=$(stored_port) || return 1
    port_in_use "$port"
}

write_config() {
    local port="$1" plugins="[]."
    mkdir -p "$HOME_DIR" "$LOG_DIR" "$RMQ_DIR/mnesia"
    # Same cookie for server and CLI; created once, Erlang insists on 0400.
    if [[ ! -s "$HOME_DIR/.erlang.cookie" ]]; then
        (umask 077 && head -c 32 /dev/urandom | od -An -tx1 | tr -d ' \n' >"$HOME_DIR/.erlang.cookie")
        chmod 400 "$HOME_DIR/.erlang.cookie"
    fi
    # Empty on purpose: stops /etc/rabbitmq/rabbitmq-env.conf from applying.
    printf '# Managed by scripts/rabbitmq.sh\n' >"$RMQ_DIR/rabbitmq-env.conf"
    cat >"$RMQ_DIR/rabbitmq.conf" <<EOF
# Managed by scripts/rabbitmq.sh; rewritten on every start.
# default_* only take effect on first boot (empty database).
default_vhost = /
default_user = $AMQP_USER
default_pass = $AMQP_PASS
default_user_tags.administrator = true
default_permissions.configure = .*
default_permissions.read = .*
default_permissions.write = .*
log.file.level = info
log.console = false
EOF
    if [[ "$MANAGEMENT" == 1 ]]; then
        plugins="[rabbitmq_management]."
        printf 'management.tcp.ip = 127.0.0.1\nmanagement.tcp.port = %s\n' "$((port + 10000))" >>"$RMQ_DIR/rabbitmq.conf"
    fi
    printf '%s\n' "$plugins" >"$RMQ_DIR/enabled_plugins"
    if [[ $EUID -eq 0 ]]; then
        chown -R rabbitmq:rabbitmq "$RMQ_DIR"
    fi
}

write_state() {
    local url
    url=$(printf 'amqp://%s:%s@127.0.0.1:%s/%%2f' "$AMQP_USER" "$AMQP_PASS" "$1")
    printf '%s\n' "$1" >"$PORT_FILE"
    printf '%s\n' "$NODE" >"$NODE_FILE"
    printf '%s\n' "$url" >"$URL_FILE"
    printf "export AMQP_URL='%s'\n" "$url" >"$ENV_FILE"
}

# $1 = "keep" to insist on the stored port (restart), "any" to move if taken.
start_rmq() {
    local policy="$1" port server_pid deadline
    if rmq_running; then
        log "reusing running broker $NODE on port $(stored_port)"
        return 0
    fi
    if beam_pid >/dev/null; then
        # Alive but not listening: still booting from another call, or wedged.
        log "broker process exists but port is closed; waiting for it"
    else
        port=$(stored_port || true)
        if [[ -n "$port" ]] && ! ports_free "$port"; then
            [[ "$policy" == any ]] || die "port $port or $((port + 20000)) is taken by another process; cannot restart on the same port"
            log "port $port (or $((port + 20000))) is taken by another process; choosing a new one"
            port=""
        fi
        [[ -n "$port" ]] || port=$(find_free_port)
        write_state "$port"
        write_config "$port"
        rm -f "$PID_FILE"
        log "starting RabbitMQ node $NODE on 127.0.0.1:$port (log dir: $LOG_DIR)"
        # Foreground-mode rabbitmq-server in the background, in its own session
        # so a terminal's Ctrl-C or the caller's exit does not kill it; stdio to
        # a file so `$(...)` callers don't wait for it. (`-detached` is
        # deprecated since 3.8.)
        # The fd limit is raised after runuser, whose pam_limits resets the
        # soft limit to 1024 (the broker would cap itself at ~830 sockets).
        set_rmq_prefix
        # shellcheck disable=SC2016 # expanded by the inner sh, on purpose
        (cd "$RMQ_DIR" && exec setsid "${RMQ_PREFIX[@]}" sh -c \
            'ulimit -n 65536 2>/dev/null || ulimit -n "$(ulimit -Hn)"; exec "$0"' \
            "$RMQ_BIN/rabbitmq-server") \
            </dev/null >>"$LOG_DIR/startup.log" 2>&1 9>&- &
        server_pid=$!
    fi
    port=$(stored_port)
    deadline=$((SECONDS + TIMEOUT))
    until rmq_running; do
        if [[ -n "${server_pid:-}" ]] && ! kill -0 "$server_pid" 2>/dev/null; then
            tail -n 30 "$LOG_DIR/startup.log" >&2 || true
            die "rabbitmq-server exited during startup (see $LOG_DIR)"
        fi
        ((SECONDS < deadline)) || { tail -n 30 "$LOG_DIR/startup.log" >&2 || true; die "not ready after ${TIMEOUT}s"; }
        sleep 0.5
    done
    # Also proves rabbitmqctl works (cookie, node name) for ctl/stop later.
    ctl -q await_startup --timeout "$TIMEOUT" >&2 || die "rabbitmqctl await_startup failed"
}

stop_rmq() {
    local pid deadline
    if ! pid=$(beam_pid); then
        log "not running"
        rm -f "$PID_FILE"
        return 0
    fi
    if [[ "$STOP_MODE" == kill ]]; then
        log "killing broker (SIGKILL, pid $pid)"
        kill -KILL "$pid"
    else
        log "stopping broker $NODE (pid $pid)"
        # `stop <pidfile>` returns once the VM has exited; SIGTERM (a clean
        # shutdown too since 3.8) is the fallback if the CLI can't connect.
        if ! ctl -q stop "$PID_FILE" >/dev/null; then
            log "rabbitmqctl stop failed; sending SIGTERM"
            kill -TERM "$pid" 2>/dev/null || true
        fi
    fi
    deadline=$((SECONDS + TIMEOUT))
    while kill -0 "$pid" 2>/dev/null; do
        if ((SECONDS >= deadline)); then
            log "still alive after ${TIMEOUT}s; SIGKILL"
            kill -KILL "$pid" 2>/dev/null || true
        fi
        sleep 0.2
    done
    rm -f "$PID_FILE"
}

# ---- the cluster ----------------------------------------------------------------------

# Points every per-node variable (RMQ_DIR, PID_FILE, NODE, ...) at cluster node $1; the
# functions above then act on that node. HOME_DIR (the cookie) is shared by the nodes.
use_node() {
    local i="$1" sum=""
    node_files "$CLUSTER_DIR/node$i" "$CLUSTER_DIR/home"
    if [[ "$STATE_DIR" != /tmp/consumer-test ]]; then
        sum="-$(printf '%s' "$STATE_DIR" | cksum | cut -d' ' -f1)"
    fi
    NODE="consumer-c$i$sum@localhost"
    mkdir -p "$RMQ_DIR"
    # A node keeps its port: the first start takes CLUSTER_PORT + I - 1.
    [[ -s "$PORT_FILE" ]] || printf '%s\n' "$((CLUSTER_PORT + i - 1))" >"$PORT_FILE"
}

# The number of nodes of the cluster, as its last `cluster N` recorded it.
cluster_size() {
    [[ -s "$CLUSTER_DIR/size" ]] || die "no cluster here; run: scripts/rabbitmq.sh cluster 3"
    cat "$CLUSTER_DIR/size"
}

# Node $1 (2..N) is a member of node 1's cluster, or becomes one (its own data is reset).
join_node() {
    local i="$1" first
    use_node 1
    first="$NODE"
    use_node "$i"
    if ctl -q cluster_status --formatter json | grep -q "\"$first\""; then
        return 0
    fi
    log "node $i ($NODE) joins $first"
    # The CLI's chatter (the app restarting) goes to the node's log dir.
    {
        ctl -q stop_app && ctl -q reset && ctl -q join_cluster "$first" && ctl -q start_app
    } >>"$LOG_DIR/join.log" 2>&1 || { tail -n 20 "$LOG_DIR/join.log" >&2; die "node $i could not join $first"; }
}

start_cluster() {
    local n="$1" i pids=() failed=0 urls=() started=$SECONDS
    [[ "$n" =~ ^[1-9][0-9]?$ ]] || die "cluster size must be a number from 1 to 99, not ${n:-nothing}"
    if [[ -s "$CLUSTER_DIR/size" && "$(cat "$CLUSTER_DIR/size")" != "$n" ]]; then
        die "a cluster of $(cat "$CLUSTER_DIR/size") nodes is kept in $CLUSTER_DIR; stop it (cluster-stop) and remove that directory first"
    fi
    mkdir -p "$CLUSTER_DIR/home"
    printf '%s\n' "$n" >"$CLUSTER_DIR/size"
    if [[ ! -s "$CLUSTER_DIR/home/.erlang.cookie" ]]; then
        (umask 077 && head -c 32 /dev/urandom | od -An -tx1 | tr -d ' \n' >"$CLUSTER_DIR/home/.erlang.cookie")
        chmod 400 "$CLUSTER_DIR/home/.erlang.cookie"
    fi
    if [[ $EUID -eq 0 ]]; then
        chown -R rabbitmq:rabbitmq "$CLUSTER_DIR"
    fi
    # Side by side: a node that was not the last one stopped waits for its peers at boot.
    for ((i = 1; i <= n; i++)); do
        (use_node "$i" && start_rmq keep) &
        pids+=($!)
    done
    for i in "${!pids[@]}"; do
        wait "${pids[$i]}" || { log "node $((i + 1)) did not start"; failed=1; }
    done
    ((failed == 0)) || die "the cluster did not start (logs: $CLUSTER_DIR/node*/log)"
    for ((i = 2; i <= n; i++)); do
        join_node "$i"
    done
    for ((i = 1; i <= n; i++)); do
        use_node "$i"
        urls+=("$(cat "$URL_FILE")")
    done
    (IFS=,; printf "export AMQP_CLUSTER_URLS='%s'\n" "${urls[*]}") >"$CLUSTER_DIR/env"
    log "cluster of $n nodes ready in $((SECONDS - started)) s"
}

# `node stop|kill|start|restart|status|ctl I [ARGS...]`.
node_cmd() {
    local action="${1:-}" i="${2:-}" n
    n=$(cluster_size)
    [[ "$i" =~ ^[0-9]+$ ]] && ((i >= 1 && i <= n)) || die "node: the node must be 1..$n, not ${i:-nothing}"
    shift 2
    use_node "$i"
    case "$action" in
        stop) stop_rmq ;;
        kill) STOP_MODE=kill stop_rmq ;;
        start) start_rmq keep ;;
        restart) stop_rmq && start_rmq keep ;;
        status)
            if rmq_running; then cat "$URL_FILE"; else log "node $i not running"; exit 3; fi
            ;;
        ctl)
            exec 9>&-
            ctl "$@"
            ;;
        *) log "node: unknown action ${action:-(none)}"; usage ;;
    esac
}

stop_cluster() {
    local n i
    [[ -s "$CLUSTER_DIR/size" ]] || { log "no cluster here"; return 0; }
    n=$(cat "$CLUSTER_DIR/size")
    for ((i = n; i >= 1; i--)); do
        use_node "$i"
        stop_rmq
    done
}

main() {
    local cmd="${1:-start}"
    [[ $# -gt 0 ]] && shift
    case "$cmd" in
        start | env | stop | restart | status | ctl | cluster | node | cluster-stop) ;;
        -h | --help | help) usage ;;
        *) log "unknown command: $cmd"; usage ;;
    esac
    case "$STOP_MODE" in clean | kill) ;; *) die "CONSUMER_RABBITMQ_STOP_MODE must be clean or kill" ;; esac

    mkdir -p "$RMQ_DIR"
    [[ -x "$RMQ_BIN/rabbitmq-server" ]] || install_rabbitmq
    [[ -x "$RMQ_BIN/rabbitmq-server" ]] || die "no $RMQ_BIN/rabbitmq-server after install"
    NODE=$(node_name)
    if [[ $EUID -eq 0 ]]; then
        # The rabbitmq user must be able to reach the state dir.
        runuser -u rabbitmq -- test -x "$STATE_DIR" || die "user rabbitmq cannot access $STATE_DIR (check parent dir permissions)"
    fi

    # Serialise concurrent callers (e.g. parallel test jobs all calling env); the cluster
    # has its own lock, so the single node's callers never wait for it.
    local lock="$STATE_DIR/.rabbitmq.lock"
    case "$cmd" in cluster | node | cluster-stop) lock="$STATE_DIR/.rabbitmq-cluster.lock" ;; esac
    exec 9>"$lock"
    flock -w 300 9 || die "timed out waiting for $lock"

    case "$cmd" in
        cluster)
            start_cluster "${1:-3}"
            cat "$CLUSTER_DIR/env"
            ;;
        node) node_cmd "$@" ;;
        cluster-stop) stop_cluster ;;
        start | env)
            start_rmq any
            cat "$ENV_FILE"
            ;;
        restart)
            stop_rmq
            start_rmq keep
            cat "$ENV_FILE"
            ;;
        stop)
            stop_rmq
            ;;
        status)
            if rmq_running; then
                cat "$URL_FILE"
            else
                log "not running"
                exit 3
            fi
            ;;
        ctl)
            [[ -s "$PORT_FILE" ]] || die "never started; run: scripts/rabbitmq.sh start"
            exec 9>&-
            ctl "$@"
            ;;
    esac
}

main "$@"
