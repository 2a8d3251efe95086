//! The in-memory broker's own tests.

use super::*;
use std::time::Duration;

fn msg(id: &str) -> Message {
    Message::json(id, &serde_json::json!({"id": id}))
}

#[tokio::test]
async fn unacked_deliveries_of_a_dropped_consumer_come_back_redelivered() {
    let broker = MemoryBroker::new();
    broker.publish("q", msg("a"));
    broker.publish("q", msg("b"));
    let mut c1 = broker.consume("q");
    let a = c1.next().await.unwrap().unwrap();
    assert!(!a.delivery.redelivered);
    drop(a);
    drop(c1);
    let mut c2 = broker.consume("q");
    let again = c2.next().await.unwrap().unwrap();
    assert_eq!(again.delivery.message_id.as_deref(), Some("a"));
    assert!(again.delivery.redelivered);
    again.acker.settle(Settlement::Ack).await.unwrap();
    let b = c2.next().await.unwrap().unwrap();
    assert_eq!(b.delivery.message_id.as_deref(), Some("b"));
    b.acker.settle(Settlement::Ack).await.unwrap();
    assert!(broker.depth("q").is_drained());
}

#[tokio::test(start_paused = true)]
async fn retry_comes_back_after_its_delay_without_blocking_others() {
    let broker = MemoryBroker::new();
    broker.publish("q", msg("slow"));
    let mut c = broker.consume("q");
    let first = c.next().await.unwrap().unwrap();
    first
        .acker
        .settle(Settlement::Retry {
            delay: Duration::from_secs(5),
            attempt: 2,
        })
        .await
        .unwrap();
    broker.publish("q", msg("fast"));
    let fast = c.next().await.unwrap().unwrap();
    assert_eq!(fast.delivery.message_id.as_deref(), Some("fast"));
    assert_eq!(broker.depth("q").delayed, 1);
    let start = tokio::time::Instant::now();
    let retried = c.next().await.unwrap().unwrap();
    assert!(start.elapsed() >= Duration::from_secs(4));
    assert_eq!(retried.delivery.attempt, 2);
    assert_eq!(
        retried.delivery.headers.get(crate::header_names::ATTEMPT),
        Some("2")
    );
}

#[tokio::test]
async fn stale_tags_cannot_be_settled() {
    let broker = MemoryBroker::new();
    broker.publish("q", msg("a"));
    let mut c1 = broker.consume("q");
    let a = c1.next().await.unwrap().unwrap();
    drop(c1);
    assert!(a.acker.settle(Settlement::Ack).await.is_err());
    assert_eq!(broker.depth("q").ready, 1);
}

#[tokio::test]
async fn a_lost_connection_requeues_its_unsettled_deliveries_and_consumes_again() {
    let broker = MemoryBroker::new();
    broker.publish("q", msg("a"));
    broker.publish("q", msg("b"));
    let mut c = broker.consume("q");
    let a = c.next().await.unwrap().unwrap();
    c.connection().lose();
    assert_eq!(broker.depth("q").ready, 2, "back in the queue");
    assert!(
        c.next().await.unwrap().is_err(),
        "the stream reports the loss"
    );
    let again = c.next().await.unwrap().unwrap();
    assert_eq!(again.delivery.message_id.as_deref(), Some("a"));
    assert!(again.delivery.redelivered);
    assert!(
        a.acker.settle(Settlement::Ack).await.is_err(),
        "a delivery of the lost connection cannot be settled"
    );
    again.acker.settle(Settlement::Ack).await.unwrap();
    let b = c.next().await.unwrap().unwrap();
    assert_eq!(b.delivery.message_id.as_deref(), Some("b"));
    b.acker.settle(Settlement::Ack).await.unwrap();
    assert!(broker.depth("q").is_drained());
}
