//! The Kafka transport across a broker restart: the broker started by `scripts/kafka.sh` is
//! stopped (SIGKILLed in one test, shut down in a controlled way in the other) and started
//! again (same port, same log) while a worker consumes and a producer publishes; records
//! keep flowing once it is back, none is lost or takes effect twice, and the offsets are
//! committed again.
//!
//! After a controlled shutdown of the only broker, librdkafka 2.12.1's idempotent producer
//! can keep a partition's leader unknown and time out every write to it for minutes (seen
//! in CI and in the chaos suite); the framework replaces a producer client whose write
//! timed out, so a write is late by at most one produce timeout.
//!
//! librdkafka can also keep a consumer's group coordinator connection down for good after
//! a controlled restart (its group request waits in an out-queue; seen in CI): the member's
//! session lapses, its partitions are revoked, and it never joins again. The transport
//! replaces a consumer whose coordinator stayed out of reach for `coordinator_timeout`;
//! the third test keeps the broker down that long.
//!
//! Its own test binary: it restarts the broker every Kafka test shares, and cargo runs
//! one test binary at a time; its tests take turns.

use std::path::Path;
use std::time::Duration;

use consumer_kafka::ProcessingOrder;
use consumer_tests::kafka::{publish_all, wait_for, worker_config, KafkaEnv, Running};
use serde_json::json;

fn jobs(range: std::ops::Range<usize>) -> Vec<(String, String, serde_json::Value)> {
    jobs_of(range, 10)
}

/// Jobs whose handler takes `sleep_ms` each.
fn jobs_of(
    range: std::ops::Range<usize>,
    sleep_ms: u64,
) -> Vec<(String, String, serde_json::Value)> {
    range
        .map(|i| {
            let id = format!("job-{i}");
            let body = json!({ "id": id, "sleep_ms": sleep_ms });
            (format!("key-{}", i % 13), id, body)
        })
        .collect()
}

/// `scripts/kafka.sh restart` (a controlled shutdown) or `restart kill` (a SIGKILL), then
/// a start on the same port and data.
async fn restart_broker(how: Restart) {
    kafka_script(match how {
        Restart::Crash => &["restart", "kill"],
        Restart::Controlled => &["restart"],
    })
    .await;
}

/// Runs `scripts/kafka.sh` with `args` (on the broker every Kafka test shares).
async fn kafka_script(args: &'static [&'static str]) {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../scripts/kafka.sh");
    let out =
        tokio::task::spawn_blocking(move || std::process::Command::new(script).args(args).output())
            .await
            .expect("the restart's task")
            .expect("run scripts/kafka.sh restart");
    assert!(
        out.status.success(),
        "scripts/kafka.sh {args:?} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// The broker killed by a test: started again when the test is done with it, or fails
/// (the Kafka tests after this binary need it).
struct BrokerDown;

impl Drop for BrokerDown {
    fn drop(&mut self) {
        let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../scripts/kafka.sh");
        match std::process::Command::new(script).arg("restart").output() {
            Ok(out) if out.status.success() => {}
            Ok(out) => eprintln!(
                "scripts/kafka.sh restart failed: {}",
                String::from_utf8_lossy(&out.stderr)
            ),
            Err(e) => eprintln!("running scripts/kafka.sh restart: {e}"),
        }
    }
}

/// How the broker goes down.
#[derive(Debug, Clone, Copy)]
enum Restart {
    Crash,
    Controlled,
}

/// The tests of this binary restart the one broker: one at a time.
static ONE_RESTART_AT_A_TIME: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn records_keep_flowing_across_a_broker_crash_without_loss_or_duplicates() {
    across_a_restart(Restart::Crash).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn records_keep_flowing_across_a_controlled_broker_restart_without_loss_or_duplicates() {
    across_a_restart(Restart::Controlled).await;
}

async fn across_a_restart(how: Restart) {
    let _turn = ONE_RESTART_AT_A_TIME.lock().await;
    let env = KafkaEnv::new(&format!("brokerrestart{how:?}").to_lowercase(), 3).await;
    let mut config = env.config();
    config.order = ProcessingOrder::Key;
    // One producer throughout, as a service's: it must carry on after the restart.
    let publisher = env.publisher();
    let ends_a = publish_all(&publisher, &env.topic, 3, jobs(0..300)).await;
    let running = Running::start(&env, config, worker_config(4)).await;
    wait_for(
        "50 effects before the restart",
        Duration::from_secs(60),
        || async { env.effect_count().await >= 50 },
    )
    .await;
    let committed_before = env.committed().await;

    // Published one at a time while the broker stops and starts: records in flight at the
    // restart are retried by the producer, which reconnects as the consumer does.
    let publishing = tokio::spawn({
        let (publisher, topic) = (publisher.clone(), env.topic.clone());
        async move {
            // A write that fails while the broker is down is written again, as a service
            // would (the same message id: the inbox drops a second copy). Each job gets
            // long enough for the restart and one produce timeout (30 s), not for a
            // producer that stays stuck.
            let mut ends = vec![0; 3];
            for (key, id, body) in jobs(300..600) {
                let body = body.to_string();
                let deadline = std::time::Instant::now() + Duration::from_secs(90);
                let written = loop {
                    let result = publisher
                        .publish(
                            &topic,
                            Some(key.as_bytes()),
                            Some(&id),
                            body.as_bytes(),
                            &[],
                        )
                        .await;
                    match result {
                        Ok(w) => break w,
                        Err(e) if std::time::Instant::now() < deadline => {
                            eprintln!("publish {id} failed, writing it again: {e}");
                        }
                        Err(e) => panic!("publish {id}: {e}"),
                    }
                };
                let p = usize::try_from(written.partition).expect("partition");
                ends[p] = ends[p].max(written.offset + 1);
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
            ends
        }
    });
    restart_broker(how).await;
    let before = env.effect_count().await;
    let ends_b = publishing.await.expect("the publishing task");
    let ends: Vec<i64> = ends_a.iter().zip(&ends_b).map(|(a, b)| *a.max(b)).collect();
    wait_for(
        "all 600 effects and every offset committed after the restart",
        Duration::from_secs(120),
        || async { env.effect_count().await >= 600 && env.committed_up_to(&ends).await },
    )
    .await;
    running.stop().await;

    env.assert_each_job_once(600).await;
    assert!(
        before < 600,
        "the restart came after the last effect ({before}): it interrupted nothing"
    );
    let committed_after = env.committed().await;
    assert!(
        committed_after
            .iter()
            .zip(&committed_before)
            .any(|(after, before)| after > before),
        "no commit after the restart: {committed_before:?} -> {committed_after:?}"
    );
}

/// The broker is killed and stays down until the consumer's coordinator has been out of reach for its
/// `coordinator_timeout` and the consumer was replaced; the new consumer joins once the
/// broker is back and takes every record, old and new, once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_consumer_whose_coordinator_stays_out_of_reach_is_replaced_without_loss_or_duplicates() {
    let _turn = ONE_RESTART_AT_A_TIME.lock().await;
    let env = KafkaEnv::new("coordinatorlost", 3).await;
    let mut config = env.config();
    config.order = ProcessingOrder::Key;
    config.coordinator_timeout = Duration::from_secs(3);
    config
        .consumer_properties
        .set("statistics.interval.ms", "500");
    let publisher = env.publisher();
    // 100 ms each, 4 at a time: the broker goes down with most of them still to do.
    let ends_a = publish_all(&publisher, &env.topic, 3, jobs_of(0..300, 100)).await;
    let running = Running::start(&env, config, worker_config(4)).await;
    wait_for(
        "50 effects before the broker stops",
        Duration::from_secs(60),
        || async { env.effect_count().await >= 50 },
    )
    .await;

    kafka_script(&["kill"]).await;
    let down = BrokerDown;
    let before = env.effect_count().await;
    wait_for(
        "the consumer replaced while the broker is down",
        Duration::from_secs(60),
        || async { running.observer.coordinator_losses() >= 1 },
    )
    .await;
    drop(down);

    // A new producer: this test is about the consumer (the first two, about a producer
    // that carries on across a restart).
    let ends_b = publish_all(&env.publisher(), &env.topic, 3, jobs(300..400)).await;
    let ends: Vec<i64> = ends_a.iter().zip(&ends_b).map(|(a, b)| *a.max(b)).collect();
    wait_for(
        "all 400 effects and every offset committed after the broker is back",
        Duration::from_secs(120),
        || async { env.effect_count().await >= 400 && env.committed_up_to(&ends).await },
    )
    .await;
    running.stop().await;

    env.assert_each_job_once(400).await;
    assert!(
        before < 300,
        "every old record took effect before the broker was killed ({before}): it interrupted nothing"
    );
}
