//! The transports' own metrics, read through a recorder installed for this test process:
//! RabbitMQ's unacked deliveries, connection state and reconnections; Kafka's lag and
//! fetched records per partition. Each test's series are told apart by its unique queue or group label.

use std::sync::OnceLock;

use consumer_amqp::{AmqpConsumer, AmqpPublisher};
use consumer_core::transport::Settlement;
use consumer_kafka::{KafkaConfig, KafkaConsumer};
use consumer_tests::amqp::{self, close_connections_matching, config, init_tracing, Rabbit, LONG};
use consumer_tests::common::wait_for;
use consumer_tests::kafka::{publish_all, KafkaEnv};
use futures::StreamExt;
use metrics_exporter_prometheus::{PrometheusBuilder, PrometheusHandle};
use serde_json::json;

/// The process's recorder, the Prometheus exporter's (installed once; the tests of this
/// file share it).
fn recorder() -> &'static PrometheusHandle {
    static HANDLE: OnceLock<PrometheusHandle> = OnceLock::new();
    HANDLE.get_or_init(|| {
        PrometheusBuilder::new()
            .install_recorder()
            .expect("the only recorder of this process")
    })
}

/// The sum of the values of metric `name` whose label `label` is `value`, in the exporter's
/// text.
fn value(name: &str, label: &str, value: &str) -> Option<f64> {
    let wanted = format!("{label}=\"{value}\"");
    let mut sum = None;
    for line in recorder().render().lines() {
        let Some((series, v)) = line.rsplit_once(' ') else {
            continue;
        };
        let Some(labels) = series.strip_prefix(name).and_then(|l| l.strip_prefix('{')) else {
            continue;
        };
        if labels.split(',').any(|l| l.trim_end_matches('}') == wanted) {
            *sum.get_or_insert(0.0) += v.parse::<f64>().expect("a number");
        }
    }
    sum
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rabbitmq_reports_unacked_deliveries_and_reconnections() {
    init_tracing();
    recorder();
    let queue = amqp::unique_name("tmetrics");
    let cfg = config(&queue);
    let mut consumer = AmqpConsumer::connect(cfg.clone()).await.unwrap();
    let publisher = AmqpPublisher::connect(cfg.clone()).await.unwrap();
    for i in 0..3 {
        publisher
            .publish_json(&cfg.queue, &format!("m{i}"), &json!({ "i": i }))
            .await
            .unwrap();
    }
    publisher.close().await;
    let unacked = || value("consumer_amqp_unacked", "queue", &queue);
    assert_eq!(value("consumer_amqp_connected", "queue", &queue), Some(1.0));
    let mut held = Vec::new();
    while held.len() < 3 {
        let incoming = tokio::time::timeout(LONG, consumer.next())
            .await
            .expect("a delivery in time")
            .expect("the stream goes on")
            .expect("a delivery");
        held.push(incoming);
    }
    assert_eq!(unacked(), Some(3.0), "three deliveries held");
    held.pop()
        .unwrap()
        .acker
        .settle(Settlement::Ack)
        .await
        .unwrap();
    assert_eq!(unacked(), Some(2.0), "one acked");

    // A connection closed by the broker: the consumer reconnects, and counts it.
    assert_eq!(close_connections_matching(&queue).await, 1);
    wait_for("a reconnection counted", LONG, || async {
        value("consumer_amqp_reconnects_total", "queue", &queue) == Some(1.0)
    })
    .await;
    assert_eq!(value("consumer_amqp_connected", "queue", &queue), Some(1.0));
    // The new connection's book starts empty: the two held deliveries went back to the queue
    // and come again.
    drop(held);
    let mut again = 0;
    while again < 2 {
        match tokio::time::timeout(LONG, consumer.next()).await {
            Ok(Some(Ok(incoming))) => {
                incoming.acker.settle(Settlement::Ack).await.unwrap();
                again += 1;
            }
            Ok(Some(Err(_))) => {}
            other => panic!("no redelivery: {:?}", other.map(|o| o.map(|r| r.is_ok()))),
        }
    }
    assert_eq!(unacked(), Some(0.0));
    drop(consumer);
    Rabbit::delete_topology(&cfg).await;
}

/// The next record of `consumer`.
async fn next(consumer: &mut KafkaConsumer) -> consumer_core::transport::Incoming {
    tokio::time::timeout(LONG, consumer.next())
        .await
        .expect("a record in time")
        .expect("the stream goes on")
        .expect("a record")
}

/// Takes the next record of `consumer` and acks it.
async fn ack_next(consumer: &mut KafkaConsumer) {
    next(consumer)
        .await
        .acker
        .settle(Settlement::Ack)
        .await
        .expect("acked");
}

/// A fresh topic of `partitions` partitions holding `records` records, and the
/// configuration of a consumer of it whose statistics (which the lag and the fetched-record
/// counts come from) arrive every 100 ms.
async fn backlog(prefix: &str, partitions: i32, records: usize) -> (KafkaEnv, KafkaConfig) {
    recorder();
    let env = KafkaEnv::new(prefix, partitions).await;
    let jobs = (0..records)
        .map(|i| {
            (
                format!("k{i}"),
                format!("m{i}"),
                json!({ "id": format!("m{i}") }),
            )
        })
        .collect();
    publish_all(&env.publisher(), &env.topic, partitions, jobs).await;
    let mut config = env.config();
    config
        .consumer_properties
        .set("statistics.interval.ms", "100");
    (env, config)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kafka_reports_each_partitions_lag() {
    let (env, config) = backlog("tmetrics", 1, 20).await;
    let mut consumer = KafkaConsumer::new(config).unwrap();
    let lag = || value("consumer_kafka_lag", "group", &env.group);
    // The first record held (a partition's records are handed out in order, one at a
    // time): nothing settled, nothing committed, the whole partition is behind.
    let first = next(&mut consumer).await;
    wait_for("a lag of 20", LONG, || async { lag() == Some(20.0) }).await;
    first.acker.settle(Settlement::Ack).await.unwrap();
    for _ in 1..20 {
        ack_next(&mut consumer).await;
    }
    wait_for("no lag once committed", LONG, || async {
        lag() == Some(0.0)
    })
    .await;
    drop(consumer);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kafka_fetches_each_record_once_however_small_its_buffers() {
    const RECORDS: usize = 300;
    let (env, mut config) = backlog("tfetched", 2, RECORDS).await;
    // Far less than the topic: the partitions fill up and wait for the records taken one
    // at a time here, again and again.
    config.max_buffered_per_partition = 10;
    let mut consumer = KafkaConsumer::new(config).unwrap();
    for _ in 0..RECORDS {
        ack_next(&mut consumer).await;
    }
    let fetched = || value("consumer_kafka_fetched_records_total", "group", &env.group);
    wait_for("every record counted as fetched", LONG, || async {
        fetched().is_some_and(|n| n >= RECORDS as f64)
    })
    .await;
    assert_eq!(
        fetched(),
        Some(RECORDS as f64),
        "records fetched of the two partitions"
    );
    drop(consumer);
}
