//! A delivery published longer ago than the handler's retention may find its key's row
//! purged, so the inbox cannot tell whether it ran: it is counted (`too_old`) and, by
//! default, run; a worker configured with `dead_letter_too_old` dead-letters it `too_old`
//! instead, without running it. A delivery within the retention is not touched. On SQLite
//! and the in-memory broker, whose messages carry their publish time.

// Test code may panic: a panic is how a test fails.
#![allow(clippy::unwrap_used)]

use std::time::{Duration, SystemTime};

use consumer_core::memory::{MemoryBroker, Message};
use consumer_core::{handler, Context, DeadLetterReason, HandlerError, Worker, WorkerConfig};
use consumer_scenarios::env::{unique, SqliteEnv, DEADLINE};
use serde_json::json;
use sqlx::Sqlite;

/// Does nothing; the retention is a day.
#[handler(name = "dated", retention = "1d")]
async fn dated(
    _ctx: &mut Context<'_, Sqlite>,
    _job: serde_json::Value,
) -> Result<(), HandlerError> {
    Ok(())
}

/// A message published `ago`.
fn published(id: &str, ago: Duration) -> Message {
    Message {
        published_at: Some(SystemTime::now() - ago),
        ..Message::json(id, &json!({ "id": id }))
    }
}

async fn run(
    dead_letter_too_old: bool,
) -> (MemoryBroker, String, consumer_core::stats::StatsSnapshot) {
    let env = SqliteEnv::new().await;
    let broker = MemoryBroker::new();
    let queue = unique("dated");
    broker.publish(&queue, published("old", Duration::from_secs(2 * 86_400)));
    broker.publish(&queue, published("recent", Duration::from_secs(3_600)));
    let config = WorkerConfig::default()
        .with_retention_interval(None)
        .with_dead_letter_too_old(dead_letter_too_old);
    let worker = Worker::with_config(env.inbox.clone(), dated, config).unwrap();
    tokio::time::timeout(
        DEADLINE,
        worker.run(broker.consume(&queue), broker.drained(&queue)),
    )
    .await
    .expect("drained in time")
    .unwrap();
    (broker, queue, worker.snapshot())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_delivery_older_than_the_retention_is_counted_and_dead_lettered_too_old_if_asked() {
    let (broker, queue, s) = run(true).await;
    assert_eq!(s.too_old, 1, "{s:?}");
    assert_eq!((s.completed, s.dead_lettered), (1, 1), "{s:?}");
    assert_eq!(s.handler_runs, 1, "the old one did not run: {s:?}");
    let dead = broker.dead_letters(&queue);
    assert_eq!(dead.len(), 1, "{dead:?}");
    let d = &dead[0].dead_letter;
    assert_eq!(d.reason, DeadLetterReason::TooOld);
    assert_eq!(dead[0].message.id.as_deref(), Some("old"));
    assert!(d.error.contains("retention"), "{}", d.error);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_delivery_older_than_the_retention_runs_counted_by_default() {
    let (broker, queue, s) = run(false).await;
    assert_eq!(s.too_old, 1, "{s:?}");
    assert_eq!((s.completed, s.dead_lettered), (2, 0), "{s:?}");
    assert!(broker.dead_letters(&queue).is_empty());
}
