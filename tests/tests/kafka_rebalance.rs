//! The Kafka transport: two workers in a group, a third joins and one
//! leaves mid-stream. Every job takes effect exactly once, and no member commits for a
//! partition it no longer owns: each member's log of assignments, revocations and commits
//! is replayed, and settlements that arrived after their partition was revoked were dropped
//! (the handlers are slower than the revoke timeout, so some always do).

use std::time::Duration;

use consumer_kafka::{ProcessingOrder, RetryMode};
use consumer_tests::kafka::{
    group_protocol, publish_all, wait_for, worker_config, GroupProtocol, KafkaEnv, Running,
};
use serde_json::json;

fn jobs(range: std::ops::Range<usize>) -> Vec<(String, String, serde_json::Value)> {
    range
        .map(|i| {
            let id = format!("job-{i}");
            (
                format!("key-{}", i % 29),
                id.clone(),
                json!({ "id": id, "sleep_ms": 150 }),
            )
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn members_join_and_leave_without_losing_duplicating_or_committing_foreign_partitions() {
    // librdkafka's default (range,roundrobin): every rebalance revokes every partition
    // (classic protocol; the consumer protocol is incremental).
    // An original member leaves.
    let dropped = join_and_leave(None, 0).await;
    assert!(
        dropped > 0,
        "no settlement arrived after a revoke; the scenario did not exercise it"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cooperative_rebalancing_gives_the_same_guarantees() {
    // Incremental: only the partitions that move are revoked, in two rounds. The first
    // member (the classic group's leader, which computes the assignment) leaves.
    join_and_leave(Some("cooperative-sticky"), 0).await;
}

/// Runs the scenario and checks it; returns how many settlements were dropped because
/// their partition had been revoked.
async fn join_and_leave(strategy: Option<&str>, leaving: usize) -> usize {
    let env = KafkaEnv::new("rebalance", 3).await;
    let publisher = env.publisher();
    let mut config = env.config();
    config.order = ProcessingOrder::Key;
    // Under KIP-848's consumer protocol the broker assigns, always incrementally: the
    // strategy is the classic protocol's alone.
    if let (Some(s), GroupProtocol::Classic) = (strategy, group_protocol()) {
        config
            .consumer_properties
            .set("partition.assignment.strategy", s);
    }
    // Shorter than the handlers: a revoke gives up on in-flight records, whose settlements
    // then arrive for partitions this member no longer owns.
    config.revoke_timeout = Duration::from_millis(50);

    let ends_a = publish_all(&publisher, &env.topic, 3, jobs(0..300)).await;
    let w1 = Running::start(&env, config.clone(), worker_config(8)).await;
    let w2 = Running::start(&env, config.clone(), worker_config(8)).await;
    wait_for(
        "60 effects with two members",
        Duration::from_secs(60),
        || async { env.effect_count().await >= 60 },
    )
    .await;

    let w3 = Running::start(&env, config.clone(), worker_config(8)).await;
    let ends_b = publish_all(&publisher, &env.topic, 3, jobs(300..600)).await;
    let ends: Vec<i64> = ends_a.iter().zip(&ends_b).map(|(a, b)| *a.max(b)).collect();
    // Let the join finish (with cooperative-sticky that takes a second round) before a
    // member leaves, so that the leave is a rebalance of its own.
    let joined = [&w1, &w2, &w3];
    wait_for(
        "all six partitions spread over the three members",
        Duration::from_secs(60),
        || async {
            let owned: Vec<_> = joined.iter().map(|w| w.observer.assignment()).collect();
            let total: usize = owned.iter().map(|o| o.len()).sum();
            let distinct: std::collections::BTreeSet<_> = owned.iter().flatten().collect();
            owned.iter().all(|o| !o.is_empty()) && total == 6 && distinct.len() == 6
        },
    )
    .await;
    wait_for(
        "350 effects with three members",
        Duration::from_secs(90),
        || async { env.effect_count().await >= 350 },
    )
    .await;

    let observers = [
        w1.observer.clone(),
        w2.observer.clone(),
        w3.observer.clone(),
    ];
    let mut members = vec![Some(w1), Some(w2), Some(w3)];
    let mut completed = 0;
    if let Some(w) = members[leaving].take() {
        completed += w.stop().await.completed;
    }
    wait_for(
        "all 600 effects and every offset committed",
        Duration::from_secs(90),
        || async { env.effect_count().await >= 600 && env.committed_up_to(&ends).await },
    )
    .await;
    for w in members.into_iter().flatten() {
        completed += w.stop().await.completed;
    }

    env.assert_each_job_once(600).await;
    assert_eq!(completed, 600);

    let mut revocations = 0;
    let mut dropped = 0;
    for (i, o) in observers.iter().enumerate() {
        let foreign = o.commits_without_ownership();
        assert!(
            foreign.is_empty(),
            "member {} committed for partitions it did not own: {foreign:?}",
            i + 1
        );
        revocations += o.revocations();
        dropped += o.settlements_dropped();
    }
    assert!(
        revocations >= 2,
        "the join and the leave rebalanced the group"
    );
    dropped
}

/// The stream takes records from a partition several at a time and hands them out one by
/// one as the worker asks. A revoke must not wait for the ones it took and has not handed
/// out: with one slow handler at a time, those would take far longer than the revoke's
/// timeout to run, and the revoke would give up with records still in flight. They go back
/// to the partition as soon as the worker next asks, and the revoke ends with nothing in
/// flight.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_revoke_waits_only_for_records_handed_out() {
    let revoked = revoke_with_records_taken(Duration::from_secs(5), None).await;
    assert_eq!(
        revoked.first(),
        Some(&0),
        "the revoke ended with records in flight: {revoked:?}"
    );
}

/// A revoke that gives up (its timeout far shorter than the handler in flight) forgets the
/// partition while the stream still holds records it took from it: those are dropped when
/// the worker next asks, and the member goes on working and stops cleanly.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn records_taken_from_a_partition_revoked_meanwhile_are_dropped() {
    let revoked =
        revoke_with_records_taken(Duration::from_millis(50), Some(Duration::from_secs(30))).await;
    assert!(
        revoked.first().is_some_and(|&n| n > 0),
        "the revoke did not give up on a record in flight: {revoked:?}"
    );
}

/// 120 records on one partition, read by one member with one handler at a time (so the
/// stream holds records it took and has not handed out), then a second member joins: the
/// first member's revoke waits at most `revoke_timeout`. Each record's handler takes 300 ms;
/// with `stuck`, the third record's first run takes that long instead and the others 10 ms,
/// and the second member joins while it runs. Checks that every record took effect once and
/// that both members stop; returns the in-flight counts of the first member's revocations
/// of the main partition.
async fn revoke_with_records_taken(
    revoke_timeout: Duration,
    stuck: Option<Duration>,
) -> Vec<usize> {
    const JOBS: usize = 120;
    const STUCK: usize = 2;
    let env = KafkaEnv::new("revoketaken", 1).await;
    let mut config = env.config();
    config.order = ProcessingOrder::Key;
    config.revoke_timeout = revoke_timeout;
    let millis = |d: Duration| u64::try_from(d.as_millis()).unwrap_or(u64::MAX);
    let records = (0..JOBS).map(|i| {
        let id = format!("job-{i}");
        let job = match stuck {
            None => json!({ "id": id, "sleep_ms": 300 }),
            Some(d) if i == STUCK => {
                json!({ "id": id, "sleep_ms": 10, "fresh_sleep_ms": millis(d) })
            }
            Some(_) => json!({ "id": id, "sleep_ms": 10 }),
        };
        (format!("key-{i}"), id, job)
    });
    let ends = publish_all(&env.publisher(), &env.topic, 1, records.collect()).await;
    let first = Running::start(&env, config.clone(), worker_config(1)).await;
    // One at a time in offset order: once the records before it took effect, the stuck one
    // runs (or is next).
    let before = if stuck.is_some() { STUCK } else { 1 };
    wait_for("the first effects", Duration::from_secs(60), || async {
        env.effect_count().await >= before as i64
    })
    .await;
    if stuck.is_some() {
        // Runs count as they start: the stuck record is in its handler, not merely next.
        wait_for(
            "the stuck record's run",
            Duration::from_secs(60),
            || async { first.stats().handler_runs > STUCK as u64 },
        )
        .await;
    }
    // Only the revocations from here on are the join's (a group may settle its first
    // assignment in more than one round), and only the main partition's: the first member
    // also owns the retry topic's partition.
    let earlier = first.observer.events().len();
    let main_revocations = |observer: &consumer_kafka::KafkaObserver| -> Vec<usize> {
        observer
            .events()
            .into_iter()
            .skip(earlier)
            .filter_map(|e| match e {
                consumer_kafka::OffsetEvent::Revoked {
                    topic, unsettled, ..
                } if topic == env.topic => Some(unsettled),
                _ => None,
            })
            .collect()
    };
    // A second member joins, consuming the main topic only (blocking retries: no retry
    // topic). A balanced group then has to move the main partition to it, whichever
    // protocol assigns: KIP-848's broker-side assignor, sticky, balanced a second member
    // of both topics by moving the retry topic's partition instead about half the time.
    let mut joining = config.clone();
    joining.retry = RetryMode::Blocking;
    let second = Running::start(&env, joining, worker_config(1)).await;
    wait_for(
        "the first member's revoke of the main partition",
        Duration::from_secs(60),
        || async { !main_revocations(&first.observer).is_empty() },
    )
    .await;
    // The rebalance ends (the partition has an owner again) before the revocations are
    // read.
    let main = (env.topic.clone(), 0);
    wait_for(
        "the partition assigned again",
        Duration::from_secs(60),
        || async {
            first.observer.assignment().contains(&main)
                || second.observer.assignment().contains(&main)
        },
    )
    .await;
    let revoked = main_revocations(&first.observer);
    // Both members run on to the end, so the first one's worker asks for records again once
    // its record in flight is done, whatever the revoke left in its stream.
    wait_for(
        "every effect and every offset committed",
        Duration::from_secs(120),
        || async { env.effect_count().await >= JOBS as i64 && env.committed_up_to(&ends).await },
    )
    .await;
    let stopping = Duration::from_secs(60);
    let stats = tokio::time::timeout(stopping, first.stop())
        .await
        .expect("the first member stopped");
    tokio::time::timeout(stopping, second.stop())
        .await
        .expect("the second member stopped");
    let effects = env.effects().await;
    let distinct: std::collections::HashSet<_> = effects.iter().map(|(id, _)| id).collect();
    assert_eq!(distinct.len(), JOBS, "every job took effect ({stats:?})");
    assert_eq!(effects.len(), JOBS, "none twice");
    revoked
}
