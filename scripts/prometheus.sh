#!/usr/bin/env bash
# Throwaway Prometheus server for tests (Debian's `prometheus` package, no Docker).
#
# Design: an executable with subcommands, like scripts/kafka.sh (never `source` it).
# Logs go to stderr; `start`/`env` print only `export ...` lines on stdout:
#
#   eval "$(scripts/prometheus.sh env)"   # start or reuse; export PROMETHEUS_URL, PROMETHEUS_TARGETS
#   scripts/prometheus.sh status          # exit 0 and print the URL if running
#   scripts/prometheus.sh restart | stop
#
# Exports:
#   PROMETHEUS_URL=http://127.0.0.1:PORT   the HTTP API (e.g. /api/v1/query)
#   PROMETHEUS_TARGETS=DIR                 a test writes DIR/NAME.json (Prometheus' file
#                                          service discovery format) naming its worker's
#                                          address and a label of its own; Prometheus picks
#                                          the file up at once and scrapes it every second
#
# State lives in ${CONSUMER_STATE_DIR:-/tmp/consumer-test}/prometheus:
#   prometheus.pid, port, env, prometheus.yml, data/, targets/, prometheus.log
#
# Knobs (all optional):
#   CONSUMER_STATE_DIR         state root (default /tmp/consumer-test)
#   CONSUMER_PROMETHEUS_PORT   first port to try (default 59090)
set -euo pipefail

source "$(dirname "${BASH_SOURCE[0]}")/service-lib.sh"

pid_server_files prometheus
CONFIG="$SERVICE_DIR/prometheus.yml"
TARGETS="$SERVICE_DIR/targets"
FIRST_PORT="${CONSUMER_PROMETHEUS_PORT:-59090}"
TIMEOUT=60
SERVER_PATTERN="prometheus.*$CONFIG"

server_ready() {
    python3 -c "import sys, urllib.request; urllib.request.urlopen(sys.argv[1], timeout=2)" \
        "http://127.0.0.1:$1/-/ready" >/dev/null 2>&1
}

write_config() {
    mkdir -p "$TARGETS" "$SERVICE_DIR/data"
    cat >"$CONFIG" <<EOF
# Written by scripts/prometheus.sh: every target a test names in $TARGETS/*.json,
# scraped every second.
global:
  scrape_interval: 1s
  scrape_timeout: 900ms
  evaluation_interval: 1s
scrape_configs:
  - job_name: tests
    file_sd_configs:
      - files: ['$TARGETS/*.json']
        refresh_interval: 1s
EOF
}

start_server() {
    local policy="$1" port pid
    command -v prometheus >/dev/null ||
        die "prometheus is not installed (scripts/install-packages.sh test)"
    if server_running; then
        log "reusing running Prometheus on port $(stored_port)"
        return 0
    fi
    if pid=$(server_pid); then
        log "Prometheus pid $pid does not answer; stopping it"
        stop_server
    fi
    port=$(choose_port "$policy")
    write_config
    printf '%s\n' "$port" >"$PORT_FILE"
    printf "export PROMETHEUS_URL='http://127.0.0.1:%s'\nexport PROMETHEUS_TARGETS='%s'\n" \
        "$port" "$TARGETS" >"$ENV_FILE"
    log "starting $(prometheus --version 2>&1 | head -n 1) on 127.0.0.1:$port (log: $LOG_FILE)"
    (
        exec setsid nohup prometheus \
            --config.file="$CONFIG" \
            --storage.tsdb.path="$SERVICE_DIR/data" \
            --storage.tsdb.retention.time=1d \
            --web.listen-address="127.0.0.1:$port" \
            </dev/null >>"$LOG_FILE" 2>&1 9>&-
    ) &
    printf '%s\n' "$!" >"$PID_FILE"
    wait_started prometheus server_ready server_pid "$port"
}

prometheus_url() {
    printf 'http://127.0.0.1:%s\n' "$(stored_port)"
}

mkdir -p "$SERVICE_DIR"
service_main prometheus start_server stop_server server_running prometheus_url "$@"
