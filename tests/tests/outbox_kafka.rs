//! The outbox on PostgreSQL, relayed to Kafka (an idempotent producer, delivery reports): a
//! rolled-back transaction publishes nothing and a committed one publishes once; two relays
//! on one table publish every row, each key's in order (the key is the record key, so one
//! key's records share a partition); a relay killed between the delivery report and its mark
//! publishes the record again, and the consuming worker runs it once.

use std::sync::Arc;

use consumer_core::fault::{CrashOnce, FaultAction, FaultPoint};
use consumer_core::outbox::{OutboxMessage, Publisher, Relay, RelayConfig};
use consumer_core::Error;
use consumer_tests::common::wait_until;
use consumer_tests::kafka::{header, read_topic, worker_config, KafkaEnv, Running};
use consumer_tests::outbox::{
    self, count_event, events_run, relay_all, write, Received, READ_LIMIT,
};
use rdkafka::Message as _;
use serde_json::json;

/// Reads `n` records of the env's topic back.
async fn read(env: &KafkaEnv, n: usize) -> Vec<Received> {
    read_topic(&env.topic, env.partitions, n, READ_LIMIT)
        .await
        .iter()
        .map(|m| Received {
            message_id: header(m, "message_id"),
            body: m.payload().unwrap_or_default().to_vec(),
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rolled_back_transaction_publishes_nothing_and_a_committed_one_publishes_once() {
    let env = KafkaEnv::new("outbox-events", 1).await;
    let inbox = env.pg.inbox().await;
    // The rolled-back message was written first: had it been published, it would be the
    // first record read.
    outbox::rollback_and_commit(inbox, env.publisher(), &env.topic, |n| read(&env, n)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_relays_on_one_table_publish_every_row_in_key_order() {
    let env = KafkaEnv::new("outbox-order", 3).await;
    let publishers: [Arc<dyn Publisher>; 2] =
        [Arc::new(env.publisher()), Arc::new(env.publisher())];
    let inboxes = [env.pg.inbox().await, env.pg.inbox().await];
    outbox::two_relays_keep_key_order(inboxes, publishers, &env.topic, 300, 5, |n| read(&env, n))
        .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_relay_killed_between_report_and_mark_publishes_twice_and_the_consumer_runs_once() {
    let env = KafkaEnv::new("outbox-crash", 1).await;
    let inbox = env.pg.inbox().await;
    let message = OutboxMessage::json(&env.topic, &json!({"n": 1}))
        .expect("json")
        .key("order-1");
    let id = write(&inbox, message, true).await;

    let faults = Arc::new(CrashOnce::new(
        FaultAction::StopWorker,
        [(FaultPoint::OutboxAfterPublish, id)],
    ));
    let crashing = Relay::new(inbox.outbox(), env.publisher())
        .with_config(RelayConfig::default().with_faults(faults.clone()))
        .expect("relay");
    assert!(matches!(crashing.run_once().await, Err(Error::Crashed(_))));
    assert_eq!(faults.fired(), 1);
    assert_eq!(inbox.outbox().stats().await.expect("stats").pending, 1);

    let relay = Relay::new(inbox.outbox(), env.publisher());
    relay_all(&inbox, &relay).await;
    let copies = read(&env, 2).await;
    assert_eq!(copies.len(), 2, "published twice");
    assert_eq!(copies[0].message_id, copies[1].message_id);

    let running = Running::start_handler(&env, count_event, env.config(), worker_config(2)).await;
    wait_until("the consumer settled both copies", || async {
        let s = running.stats();
        s.completed + s.duplicates == 2
    })
    .await;
    let stats = running.stop().await;
    assert_eq!((stats.completed, stats.duplicates), (1, 1));
    assert_eq!(events_run(&inbox).await, 1, "consumed once");
}
