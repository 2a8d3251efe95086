//! The Kafka transport with static membership (`KafkaConfig::instance_id`): a worker that
//! stops without settling and comes back under the same name takes its own partitions back
//! at once, with no rebalance of the group, long before its session would have expired;
//! every job takes effect exactly once.

use std::time::{Duration, Instant};

use consumer_kafka::{KafkaConfig, ProcessingOrder};
use consumer_tests::kafka::{publish_all, wait_for, worker_config, KafkaEnv, Running};
use serde_json::json;

/// Longer than the restart may take: without static membership the dead member's
/// partitions would wait this long (classic protocol; the consumer protocol's session is
/// the broker's, `scripts/kafka.sh`).
const SESSION_TIMEOUT_MS: &str = "45000";

/// How soon the restarted member must own its partitions again.
const TAKEN_BACK_WITHIN: Duration = Duration::from_secs(8);

/// The test's members' configuration: key order, a long session (classic protocol), and
/// static membership under the name `<group>-<name>`.
fn named(env: &KafkaEnv, name: &str) -> KafkaConfig {
    let mut config = env.config();
    config.order = ProcessingOrder::Key;
    if config
        .consumer_properties
        .get("session.timeout.ms")
        .is_some()
    {
        config
            .consumer_properties
            .set("session.timeout.ms", SESSION_TIMEOUT_MS);
    }
    config.instance_id = Some(format!("{}-{name}", env.group));
    config
}

/// Jobs `range`, each sleeping `sleep_ms` in the handler, on 17 keys.
fn jobs(range: std::ops::Range<usize>, sleep_ms: u64) -> Vec<(String, String, serde_json::Value)> {
    range
        .map(|i| {
            let id = format!("job-{i}");
            let body = json!({ "id": id, "sleep_ms": sleep_ms });
            (format!("key-{}", i % 17), id, body)
        })
        .collect()
}

/// Every partition the member owns, of the main topic and its retry topic (the consumer
/// protocol's assignor may give one member all of one topic).
fn owned(w: &Running) -> Vec<(String, i32)> {
    w.observer.assignment().into_iter().collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restarted_static_member_takes_its_partitions_back_at_once() {
    let env = KafkaEnv::new("static", 4).await;
    let ends_a = publish_all(&env.publisher(), &env.topic, 4, jobs(0..200, 20)).await;

    let a = Running::start(&env, named(&env, "a"), worker_config(4)).await;
    let b = Running::start(&env, named(&env, "b"), worker_config(4)).await;
    wait_for(
        "the eight partitions spread over both members, and 50 effects",
        Duration::from_secs(60),
        || async {
            let (pa, pb) = (owned(&a), owned(&b));
            !pa.is_empty()
                && !pb.is_empty()
                && pa.len() + pb.len() == 8
                && env.effect_count().await >= 50
        },
    )
    .await;
    let owned_by_a = owned(&a);
    let b_revocations = b.observer.revocations();

    // As a crash: nothing in flight settles, and on the classic protocol the member does
    // not leave the group. (On the consumer protocol the closing client tells the broker it
    // leaves for a while, which a SIGKILLed worker cannot: then the broker refuses its name
    // until its session ends; README, "Crash recovery on Kafka".)
    a.kill().await;
    let restarted = Instant::now();
    let a2 = Running::start(&env, named(&env, "a"), worker_config(4)).await;
    wait_for(
        "the restarted member to own its partitions again",
        TAKEN_BACK_WITHIN,
        || async { owned(&a2) == owned_by_a },
    )
    .await;
    let took = restarted.elapsed();
    assert_eq!(
        b.observer.revocations(),
        b_revocations,
        "the other member was not rebalanced"
    );

    let ends_b = publish_all(&env.publisher(), &env.topic, 4, jobs(200..400, 20)).await;
    let ends: Vec<i64> = ends_a.iter().zip(&ends_b).map(|(x, y)| *x.max(y)).collect();
    wait_for(
        "all 400 effects and every offset committed",
        Duration::from_secs(90),
        || async { env.effect_count().await >= 400 && env.committed_up_to(&ends).await },
    )
    .await;
    a2.stop().await;
    b.stop().await;

    env.assert_each_job_once(400).await;
    eprintln!("static membership: partitions {owned_by_a:?} taken back after {took:?}");
}

/// Two live workers started under one name: the classic protocol fences the member that
/// had it (`FENCED_INSTANCE_ID`), the consumer protocol refuses the newcomer
/// (`UNRELEASED_INSTANCE_ID`). The member told so forgets its partitions and asks again;
/// once its namesake is gone it owns every partition, and every job takes effect once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_member_fenced_by_a_namesake_takes_the_partitions_once_the_namesake_is_gone() {
    let env = KafkaEnv::new("fenced", 4).await;
    let ends_a = publish_all(&env.publisher(), &env.topic, 4, jobs(0..400, 50)).await;
    let first = Running::start(&env, named(&env, "twin"), worker_config(4)).await;
    wait_for(
        "the first member to own the eight partitions, and 20 effects",
        Duration::from_secs(60),
        || async { owned(&first).len() == 8 && env.effect_count().await >= 20 },
    )
    .await;
    let second = Running::start(&env, named(&env, "twin"), worker_config(4)).await;
    wait_for(
        "a member to be fenced or refused",
        Duration::from_secs(60),
        || async { first.observer.fences() + second.observer.fences() > 0 },
    )
    .await;
    let (fenced, namesake) = if first.observer.fences() > 0 {
        (first, second)
    } else {
        (second, first)
    };
    // Gone as a crashed worker goes: a static member does not leave the group.
    namesake.kill().await;
    wait_for(
        "the fenced member to own the eight partitions",
        Duration::from_secs(60),
        || async { owned(&fenced).len() == 8 },
    )
    .await;
    let ends_b = publish_all(&env.publisher(), &env.topic, 4, jobs(400..500, 0)).await;
    let ends: Vec<i64> = ends_a.iter().zip(&ends_b).map(|(x, y)| *x.max(y)).collect();
    wait_for(
        "all 500 effects and every offset committed",
        Duration::from_secs(120),
        || async { env.effect_count().await >= 500 && env.committed_up_to(&ends).await },
    )
    .await;
    let fences = fenced.observer.fences();
    assert!(
        fenced.observer.commits_without_ownership().is_empty(),
        "commits for partitions not owned: {:?}",
        fenced.observer.commits_without_ownership()
    );
    fenced.stop().await;
    env.assert_each_job_once(500).await;
    eprintln!("fenced {fences} time(s), then owned every partition again");
}
