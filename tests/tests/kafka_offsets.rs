//! The Kafka transport: out-of-order completion. With key concurrency, a
//! slow record is followed by fast ones (other keys) in the same partition; the fast ones
//! finish first, but the group's committed offset never passes the slow record. The
//! consumer is then killed with the slow record unsettled, and a new one loses nothing.

use std::collections::HashMap;
use std::time::Duration;

use consumer_kafka::{OffsetEvent, ProcessingOrder};
use consumer_tests::kafka::{publish_all, wait_for, worker_config, KafkaEnv, Running};
use serde_json::json;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn committed_offset_waits_for_the_slow_record_and_a_crash_loses_nothing() {
    let env = KafkaEnv::new("slow", 1).await;
    let publisher = env.publisher();
    let publish = |key: String, id: String, body: serde_json::Value| {
        let publisher = publisher.clone();
        let topic = env.topic.clone();
        async move {
            publisher
                .publish(
                    &topic,
                    Some(key.as_bytes()),
                    Some(&id),
                    body.to_string().as_bytes(),
                    &[],
                )
                .await
                .expect("publish")
                .offset
        }
    };
    for i in 0..3 {
        let id = format!("before-{i}");
        publish(id.clone(), id.clone(), json!({ "id": id })).await;
    }
    // Slow on its first hand-out only: long enough that only the crash ends it.
    let slow_offset = publish(
        "slow".into(),
        "slow".into(),
        json!({ "id": "slow", "fresh_sleep_ms": 600_000 }),
    )
    .await;
    let mut end = slow_offset + 1;
    for i in 0..20 {
        let id = format!("after-{i}");
        end = publish(id.clone(), id.clone(), json!({ "id": id })).await + 1;
    }

    let mut config = env.config();
    config.order = ProcessingOrder::Key;
    let first = Running::start(&env, config.clone(), worker_config(8)).await;
    wait_for(
        "the 23 fast records to take effect",
        Duration::from_secs(60),
        || async { env.effect_count().await == 23 },
    )
    .await;
    wait_for(
        "the records before the slow one to be committed",
        Duration::from_secs(30),
        || async { env.committed().await == vec![Some(slow_offset)] },
    )
    .await;
    // Twenty commit intervals later it still has not moved past the slow record.
    for _ in 0..20 {
        tokio::time::sleep(Duration::from_millis(100)).await;
        assert_eq!(env.committed().await, vec![Some(slow_offset)]);
    }
    let commits: Vec<i64> = first
        .observer
        .events()
        .into_iter()
        .filter_map(|e| match e {
            OffsetEvent::Committed { topic, offset, .. } if topic == env.topic => Some(offset),
            _ => None,
        })
        .collect();
    assert!(!commits.is_empty());
    assert!(
        commits.iter().all(|&o| o <= slow_offset),
        "a commit passed the slow record at {slow_offset}: {commits:?}"
    );

    // Crash now: the slow record is in flight, twenty records behind it are settled.
    let crashed = first.kill().await;
    assert_eq!(crashed.completed, 23, "{crashed:?}");
    assert_eq!(
        crashed.fresh_completed, 23,
        "past the log mark: {crashed:?}"
    );
    assert_eq!(env.committed().await, vec![Some(slow_offset)]);

    let second = Running::start(&env, config, worker_config(8)).await;
    wait_for(
        "the slow record to take effect and everything to be committed",
        Duration::from_secs(60),
        || async { env.effect_count().await == 24 && env.committed_up_to(&[end]).await },
    )
    .await;
    let redelivered = second.stop().await;
    // The twenty settled records behind the slow one came back and were recognised.
    assert_eq!(
        (redelivered.completed, redelivered.duplicates),
        (1, 20),
        "{redelivered:?}"
    );
    // Below the log mark the first consumer raised: the slow record may have run (it did),
    // so its attempt was counted before it ran again.
    assert_eq!(redelivered.fresh_completed, 0, "{redelivered:?}");

    let effects = env.effects().await;
    let mut per_job: HashMap<&str, Vec<i32>> = HashMap::new();
    for (job, attempt) in &effects {
        per_job.entry(job.as_str()).or_default().push(*attempt);
    }
    assert_eq!(effects.len(), 24);
    assert!(per_job.values().all(|a| a.len() == 1), "{per_job:?}");
    // The crashed attempt was fresh, so it was not counted (the fresh path's price, see
    // the README): the counted run after it is attempt 1.
    assert_eq!(per_job["slow"], vec![1]);
    let inbox = env.pg.inbox().await;
    let entry = inbox.entry("kafka_record", "slow").await.unwrap();
    assert_eq!(entry.map(|e| e.attempts), Some(1));
}

/// A crash replays what the partitions did since their last commit. A worker that crashes
/// soon after each start (a crash loop) must still move its partitions forward: right after
/// an assignment its progress is committed at once, not at the next `commit_interval`
/// (here a minute).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn progress_right_after_an_assignment_is_committed_at_once() {
    let env = KafkaEnv::new("young", 1).await;
    let jobs = (0..100)
        .map(|i| {
            let id = format!("job-{i}");
            (format!("key-{i}"), id.clone(), json!({ "id": id }))
        })
        .collect();
    let ends = publish_all(&env.publisher(), &env.topic, 1, jobs).await;
    let mut config = env.config();
    config.commit_interval = Duration::from_secs(60);
    let worker = Running::start(&env, config, worker_config(4)).await;
    wait_for(
        "every record committed, long before the interval",
        Duration::from_secs(10),
        || async { env.committed_up_to(&ends).await },
    )
    .await;
    worker.stop().await;
    assert_eq!(env.effect_count().await, 100);
}
