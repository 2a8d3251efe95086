#!/usr/bin/env bash
# The test command (the README's, and what .ci/run calls).
#
#   scripts/test.sh [extra cargo test args...]
#
# First installs the Debian packages the build and the servers need, if missing
# (scripts/packages.txt, groups build and test, through scripts/install-packages.sh: as
# root; as another user it stops at once and prints the apt-get line to run). Then starts
# every server the tests need (PostgreSQL, RabbitMQ, Apache Kafka, whose jars
# scripts/kafka.sh fetches once from Maven Central, Prometheus and Redis: see
# scripts/servers.sh) and playwright-core (npm, for the board's browser test in Debian's
# Chromium), runs the embedded quickstart, promtool's tests of the alert rules,
# every test in the workspace against those real servers (the Kafka tests twice, once per
# consumer group protocol), and the chaos suite. The servers
# keep running afterwards so a second run starts fast; `scripts/servers.sh stop` stops them.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

echo "== system packages (scripts/packages.txt: build, test)"
scripts/install-packages.sh build test

# Capture first: `eval "$(...)"` would hide a failed start behind eval's own status.
env_lines=$(scripts/servers.sh env)
eval "$env_lines"

echo "== quickstart (embedded default: in-memory broker, SQLite inbox)"
cargo run --quiet -p quickstart

# The alert rules (monitoring/alerts.yml) against their unit tests: each alert fires on
# series that should fire it and stays silent on healthy ones.
echo "== promtool: the alert rules and their tests (monitoring/)"
promtool check rules monitoring/alerts.yml
promtool test rules monitoring/alerts_test.yml
# The RabbitMQ failover and consumer_timeout tests run on a three-node cluster beside the
# single node (AMQP_CLUSTER_URLS).
echo "== the RabbitMQ cluster (scripts/rabbitmq.sh cluster 3)"
cluster_lines=$(scripts/rabbitmq.sh cluster 3)
eval "$cluster_lines"
# The board's browser test drives Chromium with Playwright (consumer-cli/tests/board).
echo "== npm ci: playwright-core for the board's browser test"
npm ci --prefix consumer-cli/tests/board --no-audit --no-fund --loglevel=error
echo "== cargo test --workspace"
cargo test --workspace "$@"
# The first run's Kafka members use the classic group protocol (librdkafka's default).
echo "== the Kafka tests again, with KIP-848's consumer group protocol"
# With --workspace, as above: the same features, so nothing is built again.
KAFKA_GROUP_PROTOCOL=consumer cargo test --workspace --test 'kafka_*' --test 'outbox_kafka*' "$@"

# The chaos suite (chaos/, CHAOS.md): real worker processes killed and restarted, fault
# points that abort them, broker restarts (a cluster's nodes killed), database faults
# (sessions terminated, an immediate PostgreSQL restart, every free connection slot held
# for a while); passes only with 0 lost, 0 duplicated,
# 0 unexpected effects and exactly the expected dead letters. The seed is random and
# printed; CHAOS_SEED=N reproduces a run's fault schedule.
# The dev profile, as the tests above: the workers share most of their build with the
# tests, and the CI profile's load (about 35 jobs a second) is far below what an unoptimised
# worker handles, so a release build would only add minutes (CHAOS.md: the release runs).
chaos=(cargo run --quiet -p chaos -- ${CHAOS_SEED:+--seed "$CHAOS_SEED"})
# The runs share no names (each has its own schema, queues, topics and groups), each
# restarts its broker (a restart by one run is one more fault for the others on that
# broker), and the runs mostly wait on retry delays: the two Kafka runs go in the
# background, side by side, their output is printed when they end, and every run's failure
# is reported before the script fails.
echo "== chaos suite: building the runner and the workers"
cargo build --quiet -p chaos -p invoices --bins
# The Kafka runs go against the three-node Kafka cluster (their broker restarts kill a
# node); the RabbitMQ cluster served the tests above and is stopped to give the runs the
# cores (the RabbitMQ runs start it again after them).
scripts/rabbitmq.sh cluster-stop || echo "== the RabbitMQ cluster did not stop; going on"
echo "== the Kafka cluster (scripts/kafka.sh cluster 3)"
kafka_cluster_lines=$(scripts/kafka.sh cluster 3)
eval "$kafka_cluster_lines"
kafka_runs=("Kafka cluster" "Kafka cluster, batched mode (64 per transaction)")
kafka_args=("" "--batch 64")
kafka_logs=()
kafka_pids=()
for i in "${!kafka_runs[@]}"; do
    log=$(mktemp "${TMPDIR:-/tmp}/chaos-kafka.XXXXXX")
    kafka_logs+=("$log")
    # shellcheck disable=SC2086 # the extra arguments are words
    (
        set -e
        echo "== chaos suite, cluster profile, ${kafka_runs[$i]}"
        "${chaos[@]}" --profile cluster --broker kafka ${kafka_args[$i]}
    ) >"$log" 2>&1 &
    kafka_pids+=($!)
done

failed=()
# The two Kafka runs go side by side; every other run goes alone: beside the Kafka cluster
# runs (three JVMs and eight workers on 2 cores) a RabbitMQ run's workers, restarted
# hundreds of times, made too little progress to drain in time, and a broker restart took
# longer than a starting worker waits for its broker.
for i in "${!kafka_runs[@]}"; do
    rc=0
    wait "${kafka_pids[$i]}" || rc=$?
    echo "== chaos suite, the ${kafka_runs[$i]} run's output:"
    cat "${kafka_logs[$i]}"
    rm -f "${kafka_logs[$i]}"
    ((rc == 0)) || failed+=("${kafka_runs[$i]} (exit $rc)")
done

# The RabbitMQ runs go against the three-node RabbitMQ cluster (their broker restarts kill
# the node leading the jobs queue); the Kafka cluster is stopped to give them the cores.
scripts/kafka.sh cluster-stop || echo "== the Kafka cluster did not stop; going on"
echo "== the RabbitMQ cluster (scripts/rabbitmq.sh cluster 3)"
cluster_lines=$(scripts/rabbitmq.sh cluster 3)
eval "$cluster_lines"
echo "== chaos suite, cluster profile, RabbitMQ cluster"
"${chaos[@]}" --profile cluster --broker amqp || failed+=("RabbitMQ cluster")
echo "== chaos suite, cluster profile, RabbitMQ cluster, batched mode (64 per transaction)"
"${chaos[@]}" --profile cluster --broker amqp --batch 64 || failed+=("RabbitMQ cluster batched")
scripts/rabbitmq.sh cluster-stop || echo "== the RabbitMQ cluster did not stop; going on"

# The suite can fail: with the test-only ack-before-commit switch the runner must report a
# violation (exit status 3), not pass and not crash. On the single brokers.
must_fail() {
    local broker=$1 name=$2 rc=0
    echo "== chaos suite, deliberately broken build (ack before commit) on $name: must fail"
    "${chaos[@]}" --profile ci --broker "$broker" --broken || rc=$?
    if [[ $rc -ne 3 ]]; then
        echo "chaos: the $name --broken run exited $rc, expected 3 (a detected violation)" >&2
        failed+=("$name broken (exit $rc, expected 3)")
    else
        echo "chaos: the $name --broken run failed as it must (exit 3)"
    fi
}
must_fail amqp RabbitMQ
must_fail kafka Kafka

if ((${#failed[@]})); then
    echo "chaos: failed: ${failed[*]}" >&2
    exit 1
fi
