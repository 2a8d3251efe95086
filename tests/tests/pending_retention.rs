//! Pending inbox rows expire, once no copy of their message can still arrive: the worker's
//! retention task deletes a handler's pending rows that nothing has updated for
//! `pending_retention` and whose newest retry copy was due longer ago than that plus the
//! copy grace. A row whose copy can still arrive stays.
//!
//! Against real PostgreSQL (a fresh schema). The rows are made by a handler that fails, so
//! each has its retry copy recorded; then their times are moved back, as the days would.

// Test code may panic: a panic is how a test fails.
#![allow(clippy::unwrap_used)]

use std::sync::Arc;
use std::time::Duration;

use consumer_core::inbox::EntryStatus;
use consumer_core::memory::{MemoryBroker, Message};
use consumer_core::retry::NoJitter;
use consumer_core::{handler, Context, HandlerError, Inbox, Worker, WorkerConfig};
use consumer_tests::common::{self, run_until, PgEnv};
use serde_json::json;
use sqlx::Postgres;

const HANDLER: &str = "always_failing";

/// Fails every attempt transiently: its keys stay pending, each with a retry copy due in
/// an hour.
#[handler(name = "always_failing", backoff = "1h..1h")]
async fn always_failing(
    _ctx: &mut Context<'_, Postgres>,
    _job: serde_json::Value,
) -> Result<(), HandlerError> {
    Err(HandlerError::transient("the provider is down"))
}

fn config() -> WorkerConfig {
    WorkerConfig::default()
        .with_concurrency(1)
        .with_retention_interval(None)
        .with_jitter(Arc::new(NoJitter))
}

/// Runs `ids` once each through the failing handler: each key ends pending, its copy due
/// in an hour.
async fn pending_keys(inbox: &Inbox<Postgres>, ids: &[&str]) {
    let broker = MemoryBroker::new();
    let queue = common::unique("q");
    for id in ids {
        broker.publish(&queue, Message::json(*id, &json!({ "id": id })));
    }
    let worker = Worker::with_config(inbox.clone(), always_failing, config()).unwrap();
    run_until(
        &worker,
        broker.consume(&queue),
        "every copy recorded",
        || async {
            for id in ids {
                match inbox.entry(HANDLER, id).await.unwrap() {
                    Some(e) if e.status == EntryStatus::Pending && e.retried_to >= 2 => {}
                    _ => return false,
                }
            }
            true
        },
    )
    .await;
}

/// Moves the key's last update back by `idle`, and its copy's due time to `due` (SQL, from
/// `now()`).
async fn age(inbox: &Inbox<Postgres>, key: &str, idle: &str, due: &str) {
    sqlx::query(&format!(
        "UPDATE {} SET updated_at = now() - interval '{idle}', retry_due_at = now() + interval '{due}' \
         WHERE handler = $1 AND key = $2",
        inbox.table()
    ))
    .bind(HANDLER)
    .bind(key)
    .execute(inbox.pool())
    .await
    .unwrap();
}

/// Runs a worker with its retention task (an hour's pending retention) on an empty queue
/// until `gone` has no row; returns its count of purged pending rows.
async fn purge_until_gone(inbox: &Inbox<Postgres>, gone: &str) -> u64 {
    let broker = MemoryBroker::new();
    let config = config()
        .with_retention_interval(Some(Duration::from_millis(50)))
        .with_pending_retention(Some(Duration::from_secs(3600)));
    let worker = Worker::with_config(inbox.clone(), always_failing, config).unwrap();
    let queue = common::unique("empty");
    run_until(
        &worker,
        broker.consume(&queue),
        "the stale row purged",
        || async { inbox.entry(HANDLER, gone).await.unwrap().is_none() },
    )
    .await;
    worker.snapshot().purged_pending
}

#[tokio::test]
async fn pending_rows_expire_once_no_copy_can_arrive() {
    let env = PgEnv::new().await;
    let inbox = env.inbox().await;
    pending_keys(&inbox, &["stale"]).await;
    // Idle for two hours, its copy due two hours ago: past an hour's retention plus the
    // five minutes' copy grace.
    age(&inbox, "stale", "2 hours", "-2 hours").await;

    let purged = purge_until_gone(&inbox, "stale").await;
    assert_eq!(purged, 1);
    assert_eq!(inbox.counts(HANDLER).await.unwrap().pending, 0);
}

#[tokio::test]
async fn a_pending_row_whose_copy_can_still_arrive_is_kept() {
    let env = PgEnv::new().await;
    let inbox = env.inbox().await;
    pending_keys(
        &inbox,
        &["stale", "copy_due_later", "copy_within_grace", "busy"],
    )
    .await;
    age(&inbox, "stale", "2 hours", "-2 hours").await;
    // Idle for two hours, but its copy is still due.
    age(&inbox, "copy_due_later", "2 hours", "30 minutes").await;
    // Its copy was due an hour and a minute ago: within the retention plus the grace.
    age(&inbox, "copy_within_grace", "2 hours", "-61 minutes").await;
    // Its copy was due long ago, but an attempt was counted a minute ago.
    age(&inbox, "busy", "1 minute", "-2 hours").await;

    let purged = purge_until_gone(&inbox, "stale").await;
    assert_eq!(purged, 1);
    for kept in ["copy_due_later", "copy_within_grace", "busy"] {
        let entry = inbox.entry(HANDLER, kept).await.unwrap();
        assert_eq!(
            entry.map(|e| e.status),
            Some(EntryStatus::Pending),
            "{kept}"
        );
    }
}
