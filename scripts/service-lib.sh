# Shared by the service scripts (postgres.sh, rabbitmq.sh, kafka.sh, prometheus.sh, redis.sh): their
# logging, usage text, ports, pid handling and the wait for a started server. Sourced, never
# run. A script sets FIRST_PORT (the first port to try) and PORT_FILE (where its port is
# kept), before sourcing or with pid_server_files; wait_started also reads TIMEOUT and
# LOG_FILE; service_main also reads STATE_DIR and ENV_FILE.

# Messages go to stderr, prefixed with the script's name: stdout is for `export` lines.
log() { printf '%s: %s\n' "$(basename "$0")" "$*" >&2; }
die() { log "error: $*"; exit 1; }

# The script's header comment, as its help.
usage() {
    sed -n '2,/^set -euo/p' "$0" | sed -e '$d' -e 's/^# \{0,1\}//' >&2
    exit 2
}

# Something already accepts connections on 127.0.0.1:$1 (bash /dev/tcp, no deps).
port_in_use() {
    (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null
}

# Port $1 is free; a script that needs more than one port redefines it after sourcing.
ports_free() {
    ! port_in_use "$1"
}

# The first port from FIRST_PORT on that ports_free accepts.
find_free_port() {
    local p="$FIRST_PORT"
    until ports_free "$p"; do
        p=$((p + 1))
        ((p < FIRST_PORT + 200)) || die "no free port in $FIRST_PORT..$p"
    done
    printf '%s\n' "$p"
}

# The port kept in PORT_FILE, if any.
stored_port() {
    [[ -s "$PORT_FILE" ]] && cat "$PORT_FILE"
}

# Waits up to $2 seconds for pid $1 to exit, then sends it SIGKILL.
wait_or_kill() {
    local pid="$1" deadline=$((SECONDS + $2))
    while kill -0 "$pid" 2>/dev/null; do
        if ((SECONDS >= deadline)); then
            log "pid $pid still alive after ${2}s; sending SIGKILL"
            kill -KILL "$pid" 2>/dev/null || true
            break
        fi
        sleep 0.1
    done
}

# The port to start on, by policy $1: the stored one when free; when another process holds
# it, a new free one with `any`, an error with `keep` (a restart must keep its port).
choose_port() {
    local port
    port=$(stored_port || true)
    if [[ -n "$port" ]] && port_in_use "$port"; then
        [[ "$1" == any ]] || die "port $port is taken by another process; cannot restart on the same port"
        log "port $port is taken by another process; choosing a new one"
        port=""
    fi
    [[ -n "$port" ]] || port=$(find_free_port)
    printf '%s\n' "$port"
}

# Waits up to TIMEOUT seconds for the server $1 just started: `$2 PORT` says it is ready,
# `$3` fails once its process is gone (then, or at the deadline, the log's tail is shown
# and the script stops).
wait_started() {
    local name="$1" ready="$2" alive="$3" port="$4" deadline=$((SECONDS + TIMEOUT))
    until "$ready" "$port"; do
        if ! "$alive" >/dev/null; then
            tail -n 20 "$LOG_FILE" >&2 || true
            die "$name exited during start"
        fi
        ((SECONDS < deadline)) || { tail -n 20 "$LOG_FILE" >&2 || true; die "$name not ready after ${TIMEOUT}s"; }
        sleep 0.2
    done
}

# The pid in PID_FILE, if that process is alive and its command line matches the regex $1
# (not a recycled pid).
pid_from_file() {
    local pid
    [[ -s "$PID_FILE" ]] || return 1
    pid=$(cat "$PID_FILE")
    [[ -r "/proc/$pid/cmdline" ]] || return 1
    tr '\0' ' ' <"/proc/$pid/cmdline" | grep -q "$1" || return 1
    printf '%s\n' "$pid"
}

# The files of a server that the script starts in the background and keeps the pid of
# (prometheus.sh, redis.sh), by its name $1: sets STATE_DIR (CONSUMER_STATE_DIR, default
# /tmp/consumer-test), SERVICE_DIR (STATE_DIR/$1) and in it PID_FILE ($1.pid), PORT_FILE
# (port), ENV_FILE (env) and LOG_FILE ($1.log). Such a script then sets SERVER_PATTERN and
# defines `server_ready PORT`, for server_pid, server_running and stop_server below.
pid_server_files() {
    STATE_DIR="$(realpath -m "${CONSUMER_STATE_DIR:-/tmp/consumer-test}")"
    SERVICE_DIR="$STATE_DIR/$1"
    PID_FILE="$SERVICE_DIR/$1.pid"
    PORT_FILE="$SERVICE_DIR/port"
    ENV_FILE="$SERVICE_DIR/env"
    LOG_FILE="$SERVICE_DIR/$1.log"
}

# The pid in PID_FILE is alive and is our server: its command line matches SERVER_PATTERN
# (not a recycled pid).
server_pid() {
    pid_from_file "$SERVER_PATTERN"
}

# Our server is alive and answers on its stored port.
server_running() {
    local port
    server_pid >/dev/null || return 1
    port=$(stored_port) || return 1
    server_ready "$port"
}

stop_server() {
    stop_by_pid_file server_pid
}

# Stops the server whose pid the function $1 prints (TERM, then KILL after 15 s) and removes
# PID_FILE: for a server this script started in the background and keeps the pid of.
stop_by_pid_file() {
    local pid
    if ! pid=$("$1"); then
        log "not running"
        rm -f "$PID_FILE"
        return 0
    fi
    log "stopping pid $pid"
    kill -TERM "$pid" 2>/dev/null || true
    wait_or_kill "$pid" 15
    rm -f "$PID_FILE"
}

# The subcommands of a service script, start|env|stop|restart|status, serialised on the
# lock STATE_DIR/.$1.lock: `service_main NAME START STOP RUNNING URL CMD`, where START takes
# the port policy (any, keep), RUNNING says the server answers, URL prints its address, and
# ENV_FILE holds the export lines that start, env and restart print.
service_main() {
    local name="$1" start="$2" stop="$3" running="$4" url="$5" cmd="${6:-start}"
    case "$cmd" in
        start | env | stop | restart | status) ;;
        -h | --help | help) usage ;;
        *) log "unknown command: $cmd"; usage ;;
    esac
    exec 9>"$STATE_DIR/.$name.lock"
    flock -w 300 9 || die "timed out waiting for $STATE_DIR/.$name.lock"
    case "$cmd" in
        start | env)
            "$start" any
            cat "$ENV_FILE"
            ;;
        restart)
            "$stop"
            "$start" keep
            cat "$ENV_FILE"
            ;;
        stop) "$stop" ;;
        status)
            if "$running"; then
                "$url"
            else
                log "not running"
                exit 3
            fi
            ;;
    esac
}
