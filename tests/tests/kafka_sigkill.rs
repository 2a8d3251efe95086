//! The Kafka transport: a worker process (`src/bin/kafka_worker.rs`) is
//! killed with SIGKILL mid-stream, twice, and restarted each time; every job takes effect
//! exactly once and every offset ends up committed.

use std::process::{Child, Command, Stdio};
use std::time::Duration;

use consumer_tests::common;
use consumer_tests::kafka::{
    brokers, group_protocol, publish_all, wait_for, GroupProtocol, KafkaEnv,
};
use serde_json::json;

fn spawn_worker(env: &KafkaEnv) -> Child {
    let mut worker = Command::new(env!("CARGO_BIN_EXE_kafka_worker"));
    match group_protocol() {
        GroupProtocol::Classic => worker
            .env("KAFKA_CONSUMER_PROPERTY_SESSION_TIMEOUT_MS", "6000")
            .env("KAFKA_CONSUMER_PROPERTY_HEARTBEAT_INTERVAL_MS", "500"),
        GroupProtocol::Consumer => worker.env("KAFKA_CONSUMER_PROPERTY_GROUP_PROTOCOL", "consumer"),
    };
    worker
        .env("KAFKA_BROKERS", brokers())
        .env("KAFKA_GROUP_ID", &env.group)
        .env("KAFKA_TOPICS", &env.topic)
        .env("KAFKA_ORDER", "key")
        .env("KAFKA_COMMIT_INTERVAL_MS", "100")
        .env("KAFKA_CONSUMER_PROPERTY_FETCH_WAIT_MAX_MS", "100")
        .env("DATABASE_URL", common::database_url())
        .env("WORKER_SCHEMA", &env.pg.schema)
        .env("WORKER_CONCURRENCY", "8")
        .stdin(Stdio::null())
        .spawn()
        .expect("start kafka_worker")
}

/// SIGKILL: no shutdown path runs, nothing is committed on the way out.
fn kill_9(child: &mut Child) {
    child.kill().expect("SIGKILL");
    let status = child.wait().expect("reap");
    assert!(!status.success(), "{status:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigkill_mid_stream_and_restart_gives_every_job_exactly_once() {
    let env = KafkaEnv::new("sigkill", 3).await;
    let jobs = (0..600)
        .map(|i| {
            let id = format!("job-{i}");
            (
                format!("key-{}", i % 31),
                id.clone(),
                json!({ "id": id, "sleep_ms": 20 }),
            )
        })
        .collect();
    let ends = publish_all(&env.publisher(), &env.topic, 3, jobs).await;

    let mut worker = spawn_worker(&env);
    for (round, at_least) in [(1, 100), (2, 300)] {
        wait_for(
            &format!("{at_least} effects before kill {round}"),
            Duration::from_secs(90),
            || async { env.effect_count().await >= at_least },
        )
        .await;
        kill_9(&mut worker);
        worker = spawn_worker(&env);
    }
    wait_for(
        "all 600 effects and every offset committed",
        Duration::from_secs(120),
        || async { env.effect_count().await >= 600 && env.committed_up_to(&ends).await },
    )
    .await;
    kill_9(&mut worker);

    env.assert_each_job_once(600).await;
}
