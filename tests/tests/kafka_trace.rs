//! Kafka: a record published with a W3C `traceparent` fails once, goes through the retry
//! topic and then succeeds. Both delivery spans belong to the record's trace (the first
//! one's parent is the publisher's span, the retry's is the first attempt's span), and the
//! retry copy carries the first attempt's span as its `traceparent`: the checks of
//! [`Spans::assert_one_trace`], shared with the RabbitMQ test; and the outbox message the
//! committed attempt wrote carries that attempt's span.

use std::time::Duration;

use consumer_core::trace::TRACEPARENT;
use consumer_tests::kafka::{wait_for, worker_config, KafkaEnv, Running};
use consumer_tests::trace::{assert_outbox_in_trace, seen, traced, Spans, PUBLISHED};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_trace_goes_from_the_publisher_through_the_retry_topic() {
    let spans = Spans::install();
    let env = KafkaEnv::new("trace", 1).await;
    let running = Running::start_handler(&env, traced, env.config(), worker_config(1)).await;
    env.publisher()
        .publish(
            &env.topic,
            Some(b"traced".as_slice()),
            Some("traced-1"),
            b"{}",
            &[(TRACEPARENT, PUBLISHED)],
        )
        .await
        .expect("publish");
    wait_for("the second attempt", Duration::from_secs(120), || async {
        seen().len() >= 2
    })
    .await;
    let inbox = running.worker.inbox().clone();
    let stats = running.stop().await;
    assert_eq!(stats.completed, 1);
    spans.assert_one_trace("kafka");
    assert_outbox_in_trace(&inbox).await;
}
