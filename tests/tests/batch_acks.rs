//! A batch's acks handed back together ([`consumer_core::transport::Acknowledger::ack_with`]), on
//! each broker: the deliveries of one RabbitMQ channel or one Kafka consumer are acked together,
//! each result lands on its own delivery (also beside an acknowledger of another kind), and
//! nothing held back is acked with them: no `multiple` ack covers an older delivery in
//! flight, and no committed offset passes a record held back.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use consumer_amqp::{AmqpConfig, AmqpConsumer, AmqpPublisher};
use consumer_core::transport::{Acknowledger, Incoming, Location, Settlement, TransportError};
use consumer_kafka::{KafkaConsumer, ProcessingOrder};
use consumer_tests::amqp::{self, config, init_tracing, wait_for, Rabbit, LONG};
use consumer_tests::kafka::{publish_all, KafkaEnv};
use futures::future::BoxFuture;
use futures::StreamExt;
use serde_json::json;

/// Publishes `n` messages with the ids `m-0`, `m-1`, … to the queue of `cfg`.
async fn publish(cfg: &AmqpConfig, n: usize) {
    let publisher = AmqpPublisher::connect(cfg.clone())
        .await
        .expect("a publisher");
    for i in 0..n {
        publisher
            .publish_json(&cfg.queue, &format!("m-{i}"), &json!({ "i": i }))
            .await
            .expect("published");
    }
    publisher.close().await;
}

/// The next `n` deliveries of a RabbitMQ or Kafka consumer, in delivery order.
async fn receive<S>(consumer: &mut S, n: usize) -> Vec<Incoming>
where
    S: futures::Stream<Item = Result<Incoming, TransportError>> + Unpin,
{
    let mut received = Vec::with_capacity(n);
    while received.len() < n {
        let item = tokio::time::timeout(LONG, consumer.next())
            .await
            .expect("a delivery in time")
            .expect("the stream does not end");
        received.push(item.expect("no loss of the connection"));
    }
    received
}

/// Drops the consumer, waits for its connection to close (which returns what it left
/// unacked to the queue), then expects `left` messages back in the queue and deletes the
/// test's queues.
async fn close_expecting(consumer: AmqpConsumer, cfg: &AmqpConfig, left: u32) {
    let health = consumer.health();
    drop(consumer);
    tokio::time::timeout(Duration::from_secs(10), health.closed())
        .await
        .expect("the consumer closes its connection");
    wait_for("the queue to hold what was left unacked", LONG, || async {
        Rabbit::ready(&cfg.queue).await == left
    })
    .await;
    assert_eq!(Rabbit::ready(&cfg.queue).await, left);
    Rabbit::delete_topology(cfg).await;
}

/// An acknowledger of another kind, among a RabbitMQ batch: it records what it was asked
/// to do and refuses.
struct Foreign(Arc<Mutex<Vec<&'static str>>>);

impl Acknowledger for Foreign {
    fn settle(
        self: Box<Self>,
        settlement: Settlement,
    ) -> BoxFuture<'static, Result<(), TransportError>> {
        let what = match settlement {
            Settlement::Ack => "ack",
            _ => "other",
        };
        self.0.lock().expect("the log").push(what);
        Box::pin(std::future::ready(Err(TransportError::msg("refused"))))
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_is_acked_together_and_each_result_lands_on_its_delivery() {
    init_tracing();
    let mut cfg = config(&amqp::unique_name("acks_batch"));
    cfg.prefetch = 32;
    publish(&cfg, 20).await;
    let mut consumer = AmqpConsumer::connect(cfg.clone()).await.unwrap();
    let mut ackers = receive(&mut consumer, 20)
        .await
        .into_iter()
        .map(|incoming| incoming.acker);
    let first = ackers.next().unwrap();
    let mut others: Vec<Box<dyn Acknowledger>> = ackers.collect();
    // One of another kind in the middle: settled on its own, its result in its place.
    let foreign = Arc::new(Mutex::new(Vec::new()));
    others.insert(7, Box::new(Foreign(foreign.clone())));

    let results = tokio::time::timeout(LONG, first.ack_with(others))
        .await
        .expect("the batch is acked in time");
    assert_eq!(results.len(), 21);
    for (i, result) in results.iter().enumerate() {
        // `others[7]` is the batch's ninth.
        if i == 8 {
            assert!(result.is_err(), "the foreign acknowledger's own result");
        } else {
            assert!(result.is_ok(), "delivery {i}: {result:?}");
        }
    }
    assert_eq!(*foreign.lock().unwrap(), ["ack"]);
    close_expecting(consumer, &cfg, 0).await;
}

/// The oldest delivery stays in flight while the ones behind it are acked together: their
/// run must not be acked with a `multiple` ack (which would ack the oldest too); after the
/// wait for it they are acked alone, and closing the connection returns the oldest.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_ack_never_acks_an_older_delivery_in_flight() {
    init_tracing();
    let mut cfg = config(&amqp::unique_name("acks_older"));
    cfg.prefetch = 8;
    publish(&cfg, 5).await;
    let mut consumer = AmqpConsumer::connect(cfg.clone()).await.unwrap();
    let mut received = receive(&mut consumer, 5).await.into_iter();
    let oldest = received.next().unwrap();
    assert_eq!(oldest.delivery.message_id.as_deref(), Some("m-0"));
    let first = received.next().unwrap().acker;
    let others = received.map(|incoming| incoming.acker).collect();

    let results = tokio::time::timeout(LONG, first.ack_with(others))
        .await
        .expect("the batch is acked in time");
    assert_eq!(results.len(), 4);
    assert!(results.iter().all(Result::is_ok), "{results:?}");
    drop(oldest);
    close_expecting(consumer, &cfg, 1).await;
}

/// Thirty records over three partitions, all handed out at once (each its own key): the
/// oldest record of one partition is held back while the others, with an acknowledger of
/// another kind among them, are acked together. The other partitions are committed to
/// their ends, the held one's partition not past it; acking it commits the rest.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_kafka_batch_is_acked_together_and_commits_stop_at_a_record_held_back() {
    init_tracing();
    let env = KafkaEnv::new("ackwith", 3).await;
    let jobs = (0..30)
        .map(|i| (format!("k{i}"), format!("m{i}"), json!({ "id": i })))
        .collect();
    let ends = publish_all(&env.publisher(), &env.topic, 3, jobs).await;
    let mut config = env.config();
    config.order = ProcessingOrder::Key;
    let mut consumer = KafkaConsumer::new(config).unwrap();
    let mut received = receive(&mut consumer, 30).await;

    let held_partition = ends.iter().position(|end| *end > 0).unwrap();
    let is_held = |incoming: &Incoming| {
        matches!(
            incoming.delivery.source.location,
            Location::Record { partition, offset: 0, .. }
                if usize::try_from(partition).ok() == Some(held_partition)
        )
    };
    let held = received.remove(received.iter().position(is_held).unwrap());
    let mut ackers = received.into_iter().map(|incoming| incoming.acker);
    let first = ackers.next().unwrap();
    let mut others: Vec<Box<dyn Acknowledger>> = ackers.collect();
    let foreign = Arc::new(Mutex::new(Vec::new()));
    others.insert(3, Box::new(Foreign(foreign.clone())));

    let results = first.ack_with(others).await;
    assert_eq!(results.len(), 30);
    for (i, result) in results.iter().enumerate() {
        assert_eq!(result.is_err(), i == 4, "delivery {i}: {result:?}");
    }
    assert_eq!(*foreign.lock().unwrap(), ["ack"]);

    // Committed where every record below the end is settled: every partition but the
    // held one's.
    let expected: Vec<Option<i64>> = (0..ends.len())
        .map(|p| (p != held_partition && ends[p] > 0).then_some(ends[p]))
        .collect();
    wait_for("the other partitions to be committed", LONG, || async {
        let committed = env.committed().await;
        (0..ends.len())
            .filter(|&p| p != held_partition)
            .all(|p| committed[p] == expected[p])
    })
    .await;
    let committed = env.committed().await;
    assert!(
        committed[held_partition].is_none_or(|c| c == 0),
        "the held record's partition is not committed past it: {committed:?}"
    );

    held.acker.settle(Settlement::Ack).await.unwrap();
    wait_for("every partition to be committed", LONG, || async {
        env.committed_up_to(&ends).await
    })
    .await;
    drop(consumer);
}
