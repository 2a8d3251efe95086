#!/usr/bin/env bash
# Throwaway Apache Kafka for tests: one KRaft broker, or a cluster of several, on loopback.
#
# Design: an executable with subcommands, like scripts/postgres.sh (never `source` it).
# Logs go to stderr; `start`/`env`/`cluster` print only `export ...` lines on stdout:
#
#   eval "$(scripts/kafka.sh env)"    # start or reuse one broker, export KAFKA_BROKERS
#   scripts/kafka.sh start            # same as env
#   scripts/kafka.sh status           # exit 0 and print the address if running
#   scripts/kafka.sh restart          # same port, same data (topics and offsets kept)
#   scripts/kafka.sh restart kill     # the same after a SIGKILL (a crash, no controlled shutdown)
#   scripts/kafka.sh kill             # SIGKILL, crash-like (the next start recovers its log)
#   scripts/kafka.sh stop
#
#   eval "$(scripts/kafka.sh cluster 3)"   # start or reuse a 3-node cluster, export
#                                          # KAFKA_CLUSTER_BROKERS (every node's address)
#   scripts/kafka.sh node stop|kill|start|restart I   # node I (1..N) of the cluster
#   scripts/kafka.sh node status I                    # exit 0 if node I answers
#   scripts/kafka.sh cluster-stop                     # every node of the cluster
#
# Exports: KAFKA_BROKERS=127.0.0.1:PORT (one broker), KAFKA_CLUSTER_BROKERS=HOST:PORT,...
#
# The broker is Apache Kafka $KAFKA_VERSION (below), fetched once with Maven from Maven
# Central (org.apache.kafka:kafka_2.13 and its runtime dependencies, checksums enforced)
# into the cache dir and run with the machine's Java 17 as `kafka.Kafka`; its storage is
# formatted with `kafka.tools.StorageTool`, as kafka-storage.sh does. Each node is a
# combined KRaft controller and broker.
#
# Settings that differ from Kafka's defaults, for tests (none changes what a consumer or a
# producer is promised):
#   group.initial.rebalance.delay.ms=0      a new group's first rebalance starts at once
#   group.min.session.timeout.ms=1000       lets tests ask for short session timeouts
#   group.consumer.*session/heartbeat*      the same for the KIP-848 consumer protocol
#                                           (10 s session, 1 s heartbeat; defaults 45 s, 5 s)
#   offsets/transaction topics: 8 partitions (default 50: slower to create on a cold broker)
#   log.segment.bytes=16 MiB                small segments (default 1 GiB)
#   a cluster: replication factor = N (at most 3), min.insync.replicas = 2 (one broker: 1)
#
# State lives in ${CONSUMER_STATE_DIR:-/tmp/consumer-test}/kafka (one broker) and
# .../kafka-cluster (the cluster); in it, per node, nodeI/{server.properties,data,kafka.pid,
# kafka.log}, and port (the first port), env, cluster-id.
# Ports: node I listens on PORT + 2(I-1) for clients and PORT + 2(I-1) + 1 for its
# controller.
#
# Knobs (all optional):
#   CONSUMER_STATE_DIR         state root (default /tmp/consumer-test)
#   CONSUMER_CACHE_DIR         install cache (default $HOME/.cache/consumer)
#   CONSUMER_KAFKA_PORT        first port to try for one broker (default 19092)
#   CONSUMER_KAFKA_CLUSTER_PORT  first port to try for the cluster (default 19192)
# The defaults lie below Linux's ephemeral range (32768-60999): a client that reconnects
# while a node restarts can otherwise be given the node's port as its own source port,
# connect to itself, and keep the node from binding it ("Address already in use").
#   CONSUMER_KAFKA_HEAP        the JVM's -Xmx per node (default 768m)
#   CONSUMER_KAFKA_DIR         this broker's state dir (default $CONSUMER_STATE_DIR/kafka)
set -euo pipefail

KAFKA_VERSION=4.4.0
SCALA_VERSION=2.13
LOG4J_VERSION=2.25.5

STATE_DIR="$(realpath -m "${CONSUMER_STATE_DIR:-/tmp/consumer-test}")"
CACHE_DIR="$(realpath -m "${CONSUMER_CACHE_DIR:-${HOME:-/root}/.cache/consumer}")"
INSTALL_DIR="$CACHE_DIR/kafka-$KAFKA_VERSION"
HEAP="${CONSUMER_KAFKA_HEAP:-768m}"
TIMEOUT=120

source "$(dirname "${BASH_SOURCE[0]}")/service-lib.sh"

# Set by use_single / use_cluster: the deployment's dir, its first port and node count.
DIR=""
NODES=1

use_single() {
    DIR="$(realpath -m "${CONSUMER_KAFKA_DIR:-$STATE_DIR/kafka}")"
    FIRST_PORT="${CONSUMER_KAFKA_PORT:-19092}"
    NODES=1
    set_files
}

use_cluster() {
    DIR="$STATE_DIR/kafka-cluster"
    FIRST_PORT="${CONSUMER_KAFKA_CLUSTER_PORT:-19192}"
    NODES="$1"
    set_files
}

set_files() {
    PORT_FILE="$DIR/port"
    ENV_FILE="$DIR/env"
    mkdir -p "$DIR"
}

# Fetches Kafka's jars with Maven into a temporary dir and moves it into place, so an
# interrupted fetch is never used.
install_kafka() {
    command -v mvn >/dev/null || die "Maven is needed to fetch Apache Kafka (apt-get install maven)"
    command -v java >/dev/null || die "Java 17 is needed to run Apache Kafka (apt-get install openjdk-17-jre-headless)"
    mkdir -p "$CACHE_DIR"
    local tmp
    tmp=$(mktemp -d "$CACHE_DIR/.kafka-install.XXXXXX")
    log "fetching Apache Kafka $KAFKA_VERSION with Maven into $INSTALL_DIR"
    cat >"$tmp/pom.xml" <<EOF
<project xmlns="http://maven.apache.org/POM/4.0.0">
  <modelVersion>4.0.0</modelVersion>
  <groupId>local.consumer</groupId>
  <artifactId>kafka-broker</artifactId>
  <version>1</version>
  <packaging>pom</packaging>
  <dependencies>
    <dependency>
      <groupId>org.apache.kafka</groupId>
      <artifactId>kafka_$SCALA_VERSION</artifactId>
      <version>$KAFKA_VERSION</version>
    </dependency>
    <dependency>
      <groupId>org.apache.logging.log4j</groupId>
      <artifactId>log4j-slf4j-impl</artifactId>
      <version>$LOG4J_VERSION</version>
    </dependency>
  </dependencies>
</project>
EOF
    if ! mvn -B -q -C -f "$tmp/pom.xml" dependency:copy-dependencies \
        -DincludeScope=runtime -DoutputDirectory="$tmp/libs" >"$tmp/mvn.log" 2>&1; then
        tail -n 30 "$tmp/mvn.log" >&2
        rm -rf "$tmp"
        die "Maven could not fetch org.apache.kafka:kafka_$SCALA_VERSION:$KAFKA_VERSION"
    fi
    [[ -f "$tmp/libs/kafka_$SCALA_VERSION-$KAFKA_VERSION.jar" ]] ||
        { rm -rf "$tmp"; die "the fetch has no kafka_$SCALA_VERSION-$KAFKA_VERSION.jar"; }
    cat >"$tmp/log4j2.properties" <<'EOF'
status = warn
appender.out.type = Console
appender.out.name = out
appender.out.layout.type = PatternLayout
appender.out.layout.pattern = [%d] %p %m (%c)%n
rootLogger.level = INFO
rootLogger.appenderRef.out.ref = out
logger.request.name = kafka.request.logger
logger.request.level = WARN
EOF
    rm -f "$tmp/pom.xml" "$tmp/mvn.log"
    rm -rf "$INSTALL_DIR"
    mv "$tmp" "$INSTALL_DIR"
}

# Runs a Kafka main class with the installed jars.
kafka_java() {
    java -Xms128m -Xmx256m -cp "$INSTALL_DIR/libs/*" \
        -Dlog4j2.configurationFile="$INSTALL_DIR/log4j2.properties" "$@"
}

node_dir() { printf '%s/node%s\n' "$DIR" "$1"; }
client_port() { printf '%s\n' $(($(stored_port) + 2 * ($1 - 1))); }
controller_port() { printf '%s\n' $(($(stored_port) + 2 * ($1 - 1) + 1)); }

# Every port of the deployment is free (find_free_port asks this of each candidate).
ports_free() {
    local p
    for ((p = $1; p < $1 + 2 * NODES; p++)); do
        port_in_use "$p" && return 1
    done
    return 0
}

# Writes node $1's server.properties.
write_config() {
    local i="$1" dir voters="" n rf isr
    dir=$(node_dir "$i")
    for ((n = 1; n <= NODES; n++)); do
        voters+="${voters:+,}$n@127.0.0.1:$(controller_port "$n")"
    done
    rf=$((NODES < 3 ? NODES : 3))
    isr=$((rf < 2 ? 1 : 2))
    mkdir -p "$dir"
    cat >"$dir/server.properties" <<EOF
process.roles=broker,controller
node.id=$i
controller.quorum.voters=$voters
listeners=PLAINTEXT://127.0.0.1:$(client_port "$i"),CONTROLLER://127.0.0.1:$(controller_port "$i")
advertised.listeners=PLAINTEXT://127.0.0.1:$(client_port "$i")
controller.listener.names=CONTROLLER
listener.security.protocol.map=PLAINTEXT:PLAINTEXT,CONTROLLER:PLAINTEXT
inter.broker.listener.name=PLAINTEXT
log.dirs=$dir/data
num.partitions=1
default.replication.factor=$rf
min.insync.replicas=$isr
offsets.topic.replication.factor=$rf
offsets.topic.num.partitions=8
transaction.state.log.replication.factor=$rf
transaction.state.log.min.isr=$isr
transaction.state.log.num.partitions=8
share.coordinator.state.topic.replication.factor=$rf
share.coordinator.state.topic.min.isr=$isr
group.initial.rebalance.delay.ms=0
group.min.session.timeout.ms=1000
group.consumer.min.session.timeout.ms=3000
group.consumer.session.timeout.ms=10000
group.consumer.min.heartbeat.interval.ms=500
group.consumer.heartbeat.interval.ms=1000
log.segment.bytes=16777216
EOF
}

# Formats every node's storage with one cluster id (once: a formatted node keeps its data).
format_nodes() {
    local i dir id
    if [[ ! -s "$DIR/cluster-id" ]]; then
        id=$(kafka_java kafka.tools.StorageTool random-uuid 2>/dev/null | tail -n 1)
        [[ "$id" =~ ^[A-Za-z0-9_-]{22}$ ]] || die "StorageTool random-uuid printed '$id'"
        printf '%s\n' "$id" >"$DIR/cluster-id"
    fi
    id=$(cat "$DIR/cluster-id")
    for ((i = 1; i <= NODES; i++)); do
        dir=$(node_dir "$i")
        [[ -f "$dir/data/meta.properties" ]] && continue
        kafka_java kafka.tools.StorageTool format --ignore-formatted -t "$id" \
            -c "$dir/server.properties" >"$dir/format.log" 2>&1 ||
            { cat "$dir/format.log" >&2; die "formatting node $i's storage failed"; }
    done
}

# The pid of node $1 if it is alive and is our broker (not a recycled pid).
node_pid() {
    PID_FILE="$(node_dir "$1")/kafka.pid" pid_from_file "kafka.Kafka $(node_dir "$1")/server.properties"
}

# Node $1's client port accepts connections and the node has logged its start.
node_ready() {
    port_in_use "$(client_port "$1")" &&
        grep -q 'Kafka Server started' "$(node_dir "$1")/kafka.log" 2>/dev/null
}

start_node() {
    local i="$1" dir
    dir=$(node_dir "$i")
    if node_pid "$i" >/dev/null; then
        return 0
    fi
    # The readiness check reads this log: a new start begins a new one.
    [[ -f "$dir/kafka.log" ]] && mv "$dir/kafka.log" "$dir/kafka.log.1"
    # setsid + nohup: the broker outlives this script and its session; stdio goes to the
    # log so `$(...)` callers never hang; 9>&-: the lock fd must not leak into the broker.
    (
        cd "$dir"
        exec setsid nohup java -Xms256m -Xmx"$HEAP" -XX:+UseG1GC -XX:MaxGCPauseMillis=20 \
            -Djava.awt.headless=true -cp "$INSTALL_DIR/libs/*" \
            -Dlog4j2.configurationFile="$INSTALL_DIR/log4j2.properties" \
            kafka.Kafka "$dir/server.properties" \
            </dev/null >>"$dir/kafka.log" 2>&1 9>&-
    ) &
    printf '%s\n' "$!" >"$dir/kafka.pid"
}

# The process started for node $1 is alive (it may not have become java yet).
node_alive() {
    local pid
    pid=$(cat "$(node_dir "$1")/kafka.pid" 2>/dev/null) && kill -0 "$pid" 2>/dev/null
}

wait_node() {
    local i="$1" deadline=$((SECONDS + TIMEOUT))
    until node_ready "$i"; do
        if ! node_alive "$i"; then
            tail -n 30 "$(node_dir "$i")/kafka.log" >&2 || true
            die "Kafka node $i exited during start"
        fi
        ((SECONDS < deadline)) ||
            { tail -n 30 "$(node_dir "$i")/kafka.log" >&2 || true; die "Kafka node $i not ready after ${TIMEOUT}s"; }
        sleep 0.2
    done
}

# Stops node $1: TERM (a controlled shutdown) or, with $2 = kill, SIGKILL.
stop_node() {
    local i="$1" how="${2:-term}" pid
    if ! pid=$(node_pid "$i"); then
        rm -f "$(node_dir "$i")/kafka.pid"
        return 0
    fi
    if [[ "$how" == kill ]]; then
        log "killing node $i (pid $pid)"
        kill -KILL "$pid" 2>/dev/null || true
        wait_or_kill "$pid" 5
    else
        log "stopping node $i (pid $pid)"
        kill -TERM "$pid" 2>/dev/null || true
        wait_or_kill "$pid" 30
    fi
    rm -f "$(node_dir "$i")/kafka.pid"
}

running() {
    local i
    [[ -s "$PORT_FILE" ]] || return 1
    for ((i = 1; i <= NODES; i++)); do
        node_pid "$i" >/dev/null && port_in_use "$(client_port "$i")" || return 1
    done
}

write_env() {
    local i addrs=""
    for ((i = 1; i <= NODES; i++)); do
        addrs+="${addrs:+,}127.0.0.1:$(client_port "$i")"
    done
    printf "export %s='%s'\n" "$1" "$addrs" >"$ENV_FILE"
}

# Starts (or reuses) every node; $1 = "keep" to insist on the stored port, "any" to move.
start_all() {
    local policy="$1" var="$2" i port
    [[ -f "$INSTALL_DIR/libs/kafka_$SCALA_VERSION-$KAFKA_VERSION.jar" ]] || install_kafka
    if running; then
        log "reusing the running Kafka ($NODES node(s)) from port $(stored_port)"
        return 0
    fi
    for ((i = 1; i <= NODES; i++)); do stop_node "$i"; done
    port=$(choose_port "$policy")
    if [[ "$(stored_port || true)" != "$port" ]]; then
        # New ports: the old storage names the old controller addresses.
        rm -rf "$DIR"/node[0-9]* "$DIR/cluster-id"
        printf '%s\n' "$port" >"$PORT_FILE"
    fi
    for ((i = 1; i <= NODES; i++)); do write_config "$i"; done
    format_nodes
    log "starting Apache Kafka $KAFKA_VERSION, $NODES node(s), on 127.0.0.1:$port.. (logs: $DIR/node*/kafka.log)"
    for ((i = 1; i <= NODES; i++)); do start_node "$i"; done
    for ((i = 1; i <= NODES; i++)); do wait_node "$i"; done
    write_env "$var"
}

lock() {
    exec 9>"$STATE_DIR/.$1.lock"
    flock -w 300 9 || die "timed out waiting for $STATE_DIR/.$1.lock"
}

main() {
    local cmd="${1:-start}"
    [[ $# -gt 0 ]] && shift
    mkdir -p "$STATE_DIR"
    case "$cmd" in
        start | env | stop | restart | kill | status)
            lock kafka
            use_single
            case "$cmd" in
                start | env) start_all any KAFKA_BROKERS; cat "$ENV_FILE" ;;
                restart)
                    stop_node 1 "${1:-term}"
                    start_all keep KAFKA_BROKERS
                    cat "$ENV_FILE"
                    ;;
                kill) stop_node 1 kill ;;
                stop) stop_node 1 ;;
                status)
                    if running; then
                        printf '127.0.0.1:%s\n' "$(stored_port)"
                    else
                        log "not running"
                        exit 3
                    fi
                    ;;
            esac
            ;;
        cluster)
            local n="${1:-3}"
            [[ "$n" =~ ^[1-9]$ ]] || die "cluster N: N is a node count, 1..9 (got '$n')"
            lock kafka-cluster
            use_cluster "$n"
            if [[ -s "$DIR/size" && "$(cat "$DIR/size")" != "$n" ]]; then
                log "the cluster has $(cat "$DIR/size") nodes; stopping it to start $n"
                local old i
                old=$(cat "$DIR/size")
                for ((i = 1; i <= old; i++)); do stop_node "$i"; done
                rm -rf "$DIR"/node[0-9]* "$DIR/cluster-id"
            fi
            printf '%s\n' "$n" >"$DIR/size"
            start_all any KAFKA_CLUSTER_BROKERS
            cat "$ENV_FILE"
            ;;
        node)
            local what="${1:-}" i="${2:-}"
            lock kafka-cluster
            [[ -s "$STATE_DIR/kafka-cluster/size" ]] || die "no cluster: run scripts/kafka.sh cluster N first"
            use_cluster "$(cat "$STATE_DIR/kafka-cluster/size")"
            [[ "$i" =~ ^[1-9]$ ]] && ((i <= NODES)) || die "node $what I: I is a node of the cluster, 1..$NODES (got '$i')"
            case "$what" in
                stop) stop_node "$i" ;;
                kill) stop_node "$i" kill ;;
                start) start_node "$i"; wait_node "$i" ;;
                restart) stop_node "$i"; start_node "$i"; wait_node "$i" ;;
                status) node_pid "$i" >/dev/null && port_in_use "$(client_port "$i")" || exit 3 ;;
                *) log "unknown node command: $what"; usage ;;
            esac
            ;;
        cluster-stop)
            lock kafka-cluster
            [[ -s "$STATE_DIR/kafka-cluster/size" ]] || { log "no cluster"; exit 0; }
            use_cluster "$(cat "$STATE_DIR/kafka-cluster/size")"
            # All at once: a node stopped alone waits for a controller quorum to leave.
            local i pid
            for ((i = 1; i <= NODES; i++)); do
                pid=$(node_pid "$i") && kill -TERM "$pid" 2>/dev/null || true
            done
            for ((i = 1; i <= NODES; i++)); do stop_node "$i"; done
            ;;
        -h | --help | help) usage ;;
        *) log "unknown command: $cmd"; usage ;;
    esac
}

main "$@"
