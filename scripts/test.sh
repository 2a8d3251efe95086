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

# The chaos suite (chaos/, CHAOS.md): real worker processes killed and restarted, fault
# points that abort them, broker restarts (RabbitMQ); passes only with 0 lost, 0 duplicated,
# 0 unexpected effects and exactly the expected dead letters. The seed is random and
# printed; CHAOS_SEED=N reproduces a run's fault schedule.
chaos=(cargo run --release --quiet -p chaos -- --profile ci ${CHAOS_SEED:+--seed "$CHAOS_SEED"})
echo "== chaos suite, CI profile, RabbitMQ"
"${chaos[@]}" --broker amqp

echo "== chaos suite, CI profile, RabbitMQ, batched mode (64 per transaction)"
"${chaos[@]}" --broker amqp --batch 64

echo "== chaos suite, CI profile, Kafka"
"${chaos[@]}" --broker kafka

echo "== chaos suite, CI profile, Kafka, batched mode (64 per transaction)"
"${chaos[@]}" --broker kafka --batch 64

# Acceptance 3: the suite can fail. With the test-only ack-before-commit switch the runner
# must report a violation (exit status 3), not pass and not crash.
echo "== chaos suite, deliberately broken build (ack before commit): must fail"
rc=0
"${chaos[@]}" --broker amqp --broken || rc=$?
if [[ $rc -ne 3 ]]; then
    echo "chaos: the --broken run exited $rc, expected 3 (a detected violation)" >&2
    exit 1
fi
echo "chaos: --broken run failed as it must (exit 3)"
