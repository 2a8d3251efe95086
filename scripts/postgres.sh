#!/usr/bin/env bash
# Throwaway PostgreSQL cluster for tests and benchmarks.
#
# Design: an executable with subcommands (never `source` it: it uses
# `set -euo pipefail`, which would leak into the caller's shell).
# Logs go to stderr; `start`/`env` print only `export ...` lines on stdout:
#
#   eval "$(scripts/postgres.sh env)"    # start or reuse, export DATABASE_URL
#   scripts/postgres.sh start            # same as env
#   scripts/postgres.sh status           # exit 0 and print the URL if running
#   scripts/postgres.sh restart          # same port, same data (chaos tests)
#   scripts/postgres.sh stop
#   scripts/postgres.sh psql [args...]   # psql as the app user, for debugging
#
# Exports: DATABASE_URL=postgres://consumer:consumer@127.0.0.1:PORT/consumer
#
# State lives in ${CONSUMER_STATE_DIR:-/tmp/consumer-test}/pg:
#   data/          the cluster (initdb), owned by the postgres OS user when root
#   run/           unix socket, used only by this script for admin work
#   postgres.log   server log
#   port, database_url, env   what the running cluster uses, for other scripts
#
# Knobs (all optional):
#   CONSUMER_STATE_DIR       state root (default /tmp/consumer-test)
#   CONSUMER_PG_PORT         first port to try for a new cluster (default 15432, below the
#                            ephemeral range, as in scripts/kafka.sh)
#   CONSUMER_PG_STOP_MODE    pg_ctl stop mode for stop/restart: fast (default),
#                            smart, or immediate (crash-like, WAL recovery on start)
#   CONSUMER_PG_BIN          directory with initdb/pg_ctl/postgres (default: newest
#                            /usr/lib/postgresql/*/bin)
#
# Auth: socket connections trust (admin work by this script); TCP connections
# need a password (scram-sha-256), so DATABASE_URL is exercised as in production.
# fsync and synchronous_commit stay on: benchmarks must measure durable commits.
set -euo pipefail

# Absolute, because the server and later callers run from other directories.
STATE_DIR="$(realpath -m "${CONSUMER_STATE_DIR:-/tmp/consumer-test}")"
PG_DIR="$STATE_DIR/pg"
DATA_DIR="$PG_DIR/data"
SOCK_DIR="$PG_DIR/run"
LOG_FILE="$PG_DIR/postgres.log"
PORT_FILE="$PG_DIR/port"
URL_FILE="$PG_DIR/database_url"
ENV_FILE="$PG_DIR/env"
# Included from postgresql.conf; rewritten on every start so the port can move.
MANAGED_CONF="consumer.conf"
FIRST_PORT="${CONSUMER_PG_PORT:-15432}"
STOP_MODE="${CONSUMER_PG_STOP_MODE:-fast}"
DB_NAME=consumer
DB_USER=consumer
DB_PASS=consumer
TIMEOUT=60

source "$(dirname "${BASH_SOURCE[0]}")/service-lib.sh"

# Newest /usr/lib/postgresql/<ver>/bin; /usr/local/bin/pg_ctl may be a
# wrapper or symlink, so the versioned directory is preferred.
find_pg_bin() {
    local d best=""
    while IFS= read -r d; do
        if [[ -x "$d/postgres" && -x "$d/initdb" && -x "$d/pg_ctl" ]]; then
            best="$d"
        fi
    done < <(compgen -G '/usr/lib/postgresql/*/bin' | sort -V)
    [[ -n "$best" ]] || return 1
    printf '%s\n' "$best"
}

install_pg() {
    [[ $EUID -eq 0 ]] || die "PostgreSQL is not installed; as root run: apt-get install postgresql"
    log "installing postgresql from Debian packages (log: $PG_DIR/install.log)"
    mkdir -p "$PG_DIR"
    export DEBIAN_FRONTEND=noninteractive
    # Retry once after refreshing the package lists (fresh machines have none).
    if ! apt-get install -y -q --no-install-recommends postgresql >"$PG_DIR/install.log" 2>&1; then
        apt-get update -q >>"$PG_DIR/install.log" 2>&1 || true
        apt-get install -y -q --no-install-recommends postgresql >>"$PG_DIR/install.log" 2>&1 ||
            { tail -n 30 "$PG_DIR/install.log" >&2; die "apt-get install postgresql failed"; }
    fi
}

# initdb refuses to run as root, so root runs the server as the postgres user.
# cd to our dir first: postgres tools complain when the cwd (e.g. /root) is
# unreadable for them.
# 9>&-: the lock fd must not leak into the server, or the lock outlives us.
as_pg() {
    if [[ $EUID -eq 0 ]]; then
        (cd "$PG_DIR" && runuser -u postgres -- "$@" 9>&-)
    else
        (cd "$PG_DIR" && "$@" 9>&-)
    fi
}

database_url() {
    printf 'postgres://%s:%s@127.0.0.1:%s/%s\n' "$DB_USER" "$DB_PASS" "$1" "$DB_NAME"
}

# Ours and up: pg_ctl status checks postmaster.pid and that the pid is alive;
# pg_isready checks that it actually accepts connections on the stored port.
pg_running() {
    local port
    [[ -f "$DATA_DIR/postmaster.pid" ]] || return 1
    port=$(stored_port) || return 1
    as_pg "$PG_BIN/pg_ctl" -D "$DATA_DIR" status >/dev/null 2>&1 || return 1
    "$PG_BIN/pg_isready" -q -h 127.0.0.1 -p "$port" -t 5
}

cluster_exists() {
    local major
    [[ -f "$DATA_DIR/PG_VERSION" && -f "$DATA_DIR/postgresql.conf" ]] || return 1
    # A cluster from another major version can't be started by these
    # binaries; it is throwaway, so it is recreated.
    major=$("$PG_BIN/postgres" --version | sed -E 's/.* ([0-9]+)(\.[0-9]+)*.*/\1/')
    if [[ "$(cat "$DATA_DIR/PG_VERSION")" != "$major" ]]; then
        log "cluster is from PostgreSQL $(cat "$DATA_DIR/PG_VERSION"), binaries are $major: recreating"
        return 1
    fi
}

init_cluster() {
    log "initdb in $DATA_DIR"
    rm -rf "$DATA_DIR"
    # Locale C: no dependency on generated locales, identical behaviour everywhere.
    as_pg "$PG_BIN/initdb" -D "$DATA_DIR" -U postgres --encoding=UTF8 --locale=C \
        --auth-local=trust --auth-host=scram-sha-256 --no-instructions >"$PG_DIR/initdb.log" 2>&1 ||
        { cat "$PG_DIR/initdb.log" >&2; die "initdb failed"; }
    printf "\n# Added by scripts/postgres.sh\ninclude_if_exists = '%s'\n" "$MANAGED_CONF" >>"$DATA_DIR/postgresql.conf"
}

write_managed_conf() {
    local port="$1"
    # Written as the postgres user so the file has the cluster's ownership.
    as_pg tee "$DATA_DIR/$MANAGED_CONF" >/dev/null <<EOF
# Managed by scripts/postgres.sh; rewritten on every start.
listen_addresses = '127.0.0.1'
port = $port
unix_socket_directories = '$SOCK_DIR'
max_connections = 200
# Durability on (they are the defaults; stated so nobody "tunes" them away):
fsync = on
synchronous_commit = on
full_page_writes = on
EOF
}

psql_admin() {
    as_pg "$PG_BIN/psql" -X -q -v ON_ERROR_STOP=1 -h "$SOCK_DIR" -p "$1" -U postgres -d postgres "${@:2}"
}

# Idempotent, so a start interrupted after initdb heals on the next call.
ensure_db() {
    local port="$1" exists
    psql_admin "$port" -c "DO \$\$ BEGIN
        IF NOT EXISTS (SELECT FROM pg_roles WHERE rolname = '$DB_USER') THEN
            CREATE ROLE $DB_USER LOGIN CREATEDB PASSWORD '$DB_PASS';
        END IF; END \$\$;"
    exists=$(psql_admin "$port" -tA -c "SELECT 1 FROM pg_database WHERE datname = '$DB_NAME'")
    if [[ "$exists" != 1 ]]; then
        psql_admin "$port" -c "CREATE DATABASE $DB_NAME OWNER $DB_USER"
    fi
}

write_state() {
    local url
    url=$(database_url "$1")
    printf '%s\n' "$1" >"$PORT_FILE"
    printf '%s\n' "$url" >"$URL_FILE"
    printf "export DATABASE_URL='%s'\n" "$url" >"$ENV_FILE"
}

# $1 = "keep" to insist on the stored port (restart), "any" to move if taken.
start_pg() {
    local policy="$1" port
    if pg_running; then
        log "reusing running cluster on port $(stored_port)"
        return 0
    fi
    if ! cluster_exists; then
        init_cluster
        rm -f "$PORT_FILE"
    fi
    port=$(choose_port "$policy")
    # The socket path (dir + /.s.PGSQL.PORT) must fit in sun_path (107 bytes).
    ((${#SOCK_DIR} < 90)) || die "state dir path too long for a unix socket: $SOCK_DIR"
    as_pg mkdir -p "$SOCK_DIR"
    write_managed_conf "$port"
    write_state "$port"
    log "starting PostgreSQL $("$PG_BIN/postgres" --version | awk '{print $3}') on 127.0.0.1:$port (log: $LOG_FILE)"
    # -l: the server's stdio goes to the log, so `$(...)` callers never hang.
    if ! as_pg "$PG_BIN/pg_ctl" -D "$DATA_DIR" -l "$LOG_FILE" -w -t "$TIMEOUT" start >/dev/null; then
        tail -n 20 "$LOG_FILE" >&2 || true
        die "pg_ctl start failed"
    fi
    ensure_db "$port"
}

stop_pg() {
    if as_pg "$PG_BIN/pg_ctl" -D "$DATA_DIR" status >/dev/null 2>&1; then
        log "stopping (mode $STOP_MODE)"
        as_pg "$PG_BIN/pg_ctl" -D "$DATA_DIR" -m "$STOP_MODE" -w -t "$TIMEOUT" stop >/dev/null
    else
        log "not running"
    fi
}

# Proves the URL works over TCP with the password, not just over the socket.
check_url() {
    PGCONNECT_TIMEOUT=10 "$PG_BIN/psql" -X -q -tA -c 'SELECT 1' "$(cat "$URL_FILE")" >/dev/null ||
        die "cannot connect with $(cat "$URL_FILE")"
}

main() {
    local cmd="${1:-start}"
    [[ $# -gt 0 ]] && shift
    case "$cmd" in
        start | env | stop | restart | status | psql) ;;
        -h | --help | help) usage ;;
        *) log "unknown command: $cmd"; usage ;;
    esac

    mkdir -p "$STATE_DIR"
    if [[ -n "${CONSUMER_PG_BIN:-}" ]]; then
        [[ -x "$CONSUMER_PG_BIN/postgres" ]] || die "no postgres in CONSUMER_PG_BIN=$CONSUMER_PG_BIN"
        PG_BIN="$CONSUMER_PG_BIN"
    elif ! PG_BIN=$(find_pg_bin); then
        install_pg
        PG_BIN=$(find_pg_bin) || die "no PostgreSQL binaries after install"
    fi
    mkdir -p "$PG_DIR"
    if [[ $EUID -eq 0 ]]; then
        chown postgres:postgres "$PG_DIR"
        # The postgres user must be able to reach the state dir.
        runuser -u postgres -- test -x "$PG_DIR" || die "user postgres cannot access $PG_DIR (check parent dir permissions)"
    fi

    # Serialise concurrent callers (e.g. parallel test jobs all calling env).
    exec 9>"$STATE_DIR/.postgres.lock"
    flock -w 300 9 || die "timed out waiting for $STATE_DIR/.postgres.lock"

    case "$cmd" in
        start | env)
            start_pg any
            check_url
            cat "$ENV_FILE"
            ;;
        restart)
            stop_pg
            start_pg keep
            check_url
            cat "$ENV_FILE"
            ;;
        stop)
            stop_pg
            ;;
        status)
            if pg_running; then
                cat "$URL_FILE"
            else
                log "not running"
                exit 3
            fi
            ;;
        psql)
            pg_running || die "not running; run: scripts/postgres.sh start"
            exec 9>&-
            exec "$PG_BIN/psql" -X "$(cat "$URL_FILE")" "$@"
            ;;
    esac
}

main "$@"
