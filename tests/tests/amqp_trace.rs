//! RabbitMQ: a message published with a W3C `traceparent` fails once and then succeeds. Both
//! delivery spans belong to the message's trace (the first one's parent is the publisher's
//! span, the retry's is the first attempt's span), and the retry copy carries the first
//! attempt's span as its `traceparent`. The spans are read from OpenTelemetry's in-memory
//! exporter behind `tracing-opentelemetry` (core's `opentelemetry` feature); the checks are
//! [`Spans::assert_one_trace`], shared with the Kafka test; and the outbox message the
//! committed attempt wrote carries that attempt's span.

use std::collections::BTreeMap;

use consumer_amqp::AmqpPublisher;
use consumer_core::trace::TRACEPARENT;
use consumer_core::Worker;
use consumer_tests::amqp::{self, config, wait_for, worker_config, Db, Rabbit, Running, LONG};
use consumer_tests::trace::{assert_outbox_in_trace, seen, traced, Spans, PUBLISHED};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_trace_goes_from_the_publisher_through_the_retry() {
    let spans = Spans::install();
    let db = Db::new().await;
    let queue = amqp::unique_name("trace");
    let cfg = config(&queue);
    let worker = Worker::with_config(db.inbox(4).await, traced, worker_config(1)).unwrap();
    let running = Running::start(worker, cfg.clone()).await;
    let publisher = AmqpPublisher::connect(cfg.clone()).await.unwrap();
    let headers = BTreeMap::from([(TRACEPARENT.to_owned(), PUBLISHED.to_owned())]);
    publisher
        .publish(&cfg.queue, "traced-1", b"{}", &headers)
        .await
        .unwrap();
    publisher.close().await;
    wait_for("the second attempt", LONG, || async { seen().len() >= 2 }).await;
    let inbox = running.worker.inbox().clone();
    let stats = running.stop().await;
    assert_eq!(stats.completed, 1);
    spans.assert_one_trace("rabbitmq");
    assert_outbox_in_trace(&inbox).await;
    Rabbit::delete_topology(&cfg).await;
}
