//! The Kafka transport: 1,000 jobs over 3 partitions, 10 % of them published
//! twice (same message id, same payload), give exactly 1,000 effects; and every offset ends
//! up committed. Against the real broker (`scripts/kafka.sh`) and PostgreSQL.

use std::time::Duration;

use consumer_kafka::{CommitMode, ProcessingOrder};
use consumer_tests::kafka::{publish_all, wait_for, worker_config, KafkaEnv, Running};
use serde_json::json;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn thousand_jobs_with_republished_duplicates_take_effect_exactly_once() {
    let env = KafkaEnv::new("eo", 3).await;
    let mut jobs = Vec::new();
    for i in 0..1000 {
        let id = format!("job-{i}");
        jobs.push((format!("key-{}", i % 37), id.clone(), json!({ "id": id })));
        // Every tenth job is republished later (a producer retry, a replayed batch).
        if i % 10 == 0 {
            let dup = jobs.last().cloned().expect("just pushed");
            jobs.push(dup);
        }
    }
    assert_eq!(jobs.len(), 1100);
    let ends = publish_all(&env.publisher(), &env.topic, env.partitions, jobs).await;

    let mut config = env.config();
    config.order = ProcessingOrder::Key;
    // The auto-committer path (offsets stored after settlement) is exercised here.
    config.commit = CommitMode::AutoStore;
    let running = Running::start(&env, config, worker_config(8)).await;
    wait_for(
        "1,000 effects and every offset committed",
        Duration::from_secs(120),
        || async { env.effect_count().await >= 1000 && env.committed_up_to(&ends).await },
    )
    .await;
    let stats = running.stop().await;

    env.assert_each_job_once(1000).await;
    assert_eq!(stats.received, 1100, "{stats:?}");
    assert_eq!(
        (stats.completed, stats.duplicates),
        (1000, 100),
        "{stats:?}"
    );
    // One worker, one run: every record is past the log marks it raised, so every
    // completion took the fresh path.
    assert_eq!(stats.fresh_completed, 1000, "{stats:?}");
    assert_eq!(
        ends.iter().sum::<i64>(),
        1100,
        "offsets are contiguous here"
    );
    assert_eq!(
        env.committed().await,
        ends.iter().map(|&e| Some(e)).collect::<Vec<_>>()
    );
}
