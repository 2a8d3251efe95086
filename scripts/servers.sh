#!/usr/bin/env bash
# Start/stop every server the tests need (used by .ci/run and the README).
#
#   scripts/servers.sh start [SERVICE...]   start or reuse; print export lines
#   scripts/servers.sh env   [SERVICE...]   same as start
#   scripts/servers.sh stop  [SERVICE...]   stop (reverse order)
#   scripts/servers.sh status [SERVICE...]  exit non-zero if any is down
#
# In a script, capture first, so a failed start fails the script (the exit
# status of `eval "$(...)"` is eval's, not the command's):
#
#   env_lines=$(scripts/servers.sh env)
#   eval "$env_lines"
#
# Interactively `eval "$(scripts/servers.sh env)"` is fine.
#
# Exports: DATABASE_URL (scripts/postgres.sh), AMQP_URL (scripts/rabbitmq.sh),
# KAFKA_BROKERS (scripts/kafka.sh), PROMETHEUS_URL and PROMETHEUS_TARGETS
# (scripts/prometheus.sh), REDIS_URL (scripts/redis.sh).
# State, logs and ports live under ${CONSUMER_STATE_DIR:-/tmp/consumer-test};
# see each service script's header for its options.
set -euo pipefail

SCRIPTS_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"

# Start order. Each name is scripts/NAME.sh with the same interface:
# start|env|stop|restart|status, logs on stderr, `export VAR='...'` on stdout.
SERVICES=(
    postgres
    rabbitmq
    kafka
    prometheus
    redis
)

main() {
    local cmd="${1:-}" rc=0 i s
    [[ $# -gt 0 ]] && shift
    local -a names=("$@")
    [[ ${#names[@]} -gt 0 ]] || names=("${SERVICES[@]}")
    for s in "${names[@]}"; do
        [[ -x "$SCRIPTS_DIR/$s.sh" ]] || { echo "servers.sh: unknown service: $s" >&2; exit 2; }
    done

    case "$cmd" in
        start | env)
            # Collect everything first so nothing is printed if a start fails.
            local out=""
            for s in "${names[@]}"; do
                out+="$("$SCRIPTS_DIR/$s.sh" start)"$'\n'
            done
            printf '%s' "$out"
            ;;
        stop)
            for ((i = ${#names[@]} - 1; i >= 0; i--)); do
                "$SCRIPTS_DIR/${names[i]}.sh" stop || rc=1
            done
            exit "$rc"
            ;;
        status)
            for s in "${names[@]}"; do
                printf '%s: ' "$s"
                "$SCRIPTS_DIR/$s.sh" status 2>&1 || rc=1
            done
            exit "$rc"
            ;;
        *)
            sed -n '2,/^set -euo/p' "$0" | sed -e '$d' -e 's/^# \{0,1\}//' >&2
            exit 2
            ;;
    esac
}

main "$@"
