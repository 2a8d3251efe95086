//! The Kafka transport: a handler slower than `max.poll.interval.ms` does
//! not get the member kicked out of the group. The poll thread keeps polling (and holds
//! back full partitions) whatever the handlers do.

use std::time::Duration;

use consumer_kafka::OffsetEvent;
use consumer_tests::kafka::{publish_all, wait_for, worker_config, KafkaEnv, Running};
use serde_json::json;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn handler_slower_than_max_poll_interval_keeps_its_partitions() {
    let env = KafkaEnv::new("slowpoll", 1).await;
    let mut config = env.config();
    // librdkafka's floor: max.poll.interval.ms must be at least session.timeout.ms (6000).
    config
        .consumer_properties
        .set("max.poll.interval.ms", "6000");
    // The revoke wait runs inside the poll: it must stay under half the poll interval.
    config.revoke_timeout = std::time::Duration::from_secs(2);
    // Two records of 8s each, one after the other: 16s of handler time in one partition,
    // well past two poll intervals; then a fast one.
    let ends = publish_all(
        &env.publisher(),
        &env.topic,
        1,
        vec![
            (
                "k".into(),
                "slow-1".into(),
                json!({ "id": "slow-1", "sleep_ms": 8000 }),
            ),
            (
                "k".into(),
                "slow-2".into(),
                json!({ "id": "slow-2", "sleep_ms": 8000 }),
            ),
            ("k".into(), "fast".into(), json!({ "id": "fast" })),
        ],
    )
    .await;

    let running = Running::start(&env, config, worker_config(4)).await;
    wait_for(
        "three effects and the offsets committed",
        Duration::from_secs(90),
        || async { env.effect_count().await == 3 && env.committed_up_to(&ends).await },
    )
    .await;
    let events = running.observer.events();
    let stats = running.stop().await;

    assert_eq!(stats.handler_runs, 3, "no record ran twice: {stats:?}");
    let effects = env.effects().await;
    let jobs: Vec<&str> = effects.iter().map(|(j, _)| j.as_str()).collect();
    assert_eq!(jobs, ["slow-1", "slow-2", "fast"]);
    let assigned = events
        .iter()
        .filter(|e| matches!(e, OffsetEvent::Assigned { .. }))
        .count();
    let revoked: Vec<_> = events
        .iter()
        .filter(|e| matches!(e, OffsetEvent::Revoked { .. }))
        .collect();
    // The topic and its retry topic, assigned once and never taken away while handlers ran
    // (the log was read before the worker stopped).
    assert_eq!(assigned, 2, "{events:?}");
    assert!(
        revoked.is_empty(),
        "the member lost its partitions: {events:?}"
    );
}
