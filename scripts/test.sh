#!/usr/bin/env bash
# The test command (the README's, and what .ci/run calls).
#
#   scripts/test.sh [extra cargo test args...]
#
# Starts every server the tests need, installing it first if missing (PostgreSQL,
# RabbitMQ, a Kafka-protocol broker: see scripts/servers.sh), runs the embedded
# quickstart, then every test in the workspace against those real servers. The servers
# keep running afterwards so a second run starts fast; `scripts/servers.sh stop` stops them.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

# Capture first: `eval "$(...)"` would hide a failed start behind eval's own status.
env_lines=$(scripts/servers.sh env)
eval "$env_lines"

echo "== quickstart (embedded default: in-memory broker, SQLite inbox)"
cargo run --quiet -p quickstart

echo "== cargo test --workspace"
cargo test --workspace "$@"
