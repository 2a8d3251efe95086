//! On SQLite (the embedded default), what the PostgreSQL tests in `tests/tests/` check of a
//! key's life in the inbox beyond one run: pending rows expire once no copy of their message
//! can still arrive (`pending_retention.rs`), a renamed handler takes over its former name's
//! keys (`handler_rename.rs`), and an edited key template is refused at startup
//! (`key_template_change.rs`).

// Test code may panic: a panic is how a test fails.
#![allow(clippy::unwrap_used)]

use std::sync::Arc;
use std::time::Duration;

use consumer_core::inbox::EntryStatus;
use consumer_core::memory::{MemoryBroker, Message};
use consumer_core::retry::NoJitter;
use consumer_core::stats::StatsSnapshot;
use consumer_core::{
    handler, BatchConfig, Context, Error, Handler, HandlerError, Inbox, Worker, WorkerConfig,
};
use consumer_scenarios::env::{run_until, unique, SqliteEnv};
use serde_json::json;
use sqlx::Sqlite;

async fn write(ctx: &mut Context<'_, Sqlite>, job: &serde_json::Value) -> Result<(), HandlerError> {
    sqlx::query("INSERT INTO ledger (job_id, attempt) VALUES (?1, 1)")
        .bind(job["id"].as_str().unwrap_or_default().to_owned())
        .execute(ctx.db())
        .await?;
    Ok(())
}

#[handler(name = "ledger_v1", key = "job-{id}")]
async fn ledger_v1(
    ctx: &mut Context<'_, Sqlite>,
    job: serde_json::Value,
) -> Result<(), HandlerError> {
    write(ctx, &job).await
}

#[handler(name = "ledger_v2", key = "job-{id}", aliases = ["ledger_v1"])]
async fn ledger_v2(
    ctx: &mut Context<'_, Sqlite>,
    job: serde_json::Value,
) -> Result<(), HandlerError> {
    write(ctx, &job).await
}

/// `ledger_v1` with its key template edited.
#[handler(name = "ledger_v1", key = "j-{id}")]
async fn ledger_v1_edited(
    ctx: &mut Context<'_, Sqlite>,
    job: serde_json::Value,
) -> Result<(), HandlerError> {
    write(ctx, &job).await
}

#[handler(name = "always_failing", backoff = "1h..1h")]
async fn always_failing(
    _ctx: &mut Context<'_, Sqlite>,
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

/// Runs `handler` on `ids` until the queue is drained: the worker's result and counters.
async fn run<H: Handler<Sqlite>>(
    inbox: &Inbox<Sqlite>,
    handler: H,
    ids: &[&str],
    config: WorkerConfig,
) -> (Result<(), Error>, StatsSnapshot) {
    let broker = MemoryBroker::new();
    let queue = unique("q");
    for id in ids {
        broker.publish(&queue, Message::json(*id, &json!({ "id": id })));
    }
    let worker = Worker::with_config(inbox.clone(), handler, config).unwrap();
    let run = worker.run(broker.consume(&queue), broker.drained(&queue));
    let done = tokio::time::timeout(Duration::from_secs(30), run)
        .await
        .expect("ended");
    (done, worker.snapshot())
}

#[tokio::test]
async fn sqlite_a_renamed_handler_with_an_alias_skips_keys_completed_under_its_old_name() {
    let env = SqliteEnv::new().await;
    let (done, s) = run(&env.inbox, ledger_v1, &["a", "b"], config()).await;
    done.unwrap();
    assert_eq!(s.completed, 2, "{s:?}");
    let (done, s) = run(&env.inbox, ledger_v2, &["a"], config()).await;
    done.unwrap();
    assert_eq!((s.completed, s.duplicates), (0, 1), "{s:?}");
    let batched = config().with_batch(BatchConfig::new(16, Duration::from_millis(50)));
    let (done, s) = run(&env.inbox, ledger_v2, &["b", "c"], batched).await;
    done.unwrap();
    assert_eq!((s.completed, s.duplicates), (1, 1), "{s:?}");
    let runs: i64 = sqlx::query_scalar("SELECT count(*) FROM ledger")
        .fetch_one(env.inbox.pool())
        .await
        .unwrap();
    assert_eq!(runs, 3, "each key ran once");
    let entry = env.inbox.entry("ledger_v2", "job-a").await.unwrap();
    assert_eq!(entry.map(|e| e.status), Some(EntryStatus::Completed));
}

#[tokio::test]
async fn sqlite_a_changed_key_template_is_refused_at_startup() {
    let env = SqliteEnv::new().await;
    run(&env.inbox, ledger_v1, &["a"], config())
        .await
        .0
        .unwrap();
    let (refused, s) = run(&env.inbox, ledger_v1_edited, &["a"], config()).await;
    let message = refused.expect_err("refused").to_string();
    for part in ["ledger_v1", "\"job-{id}\"", "\"j-{id}\""] {
        assert!(message.contains(part), "{part} in {message}");
    }
    assert_eq!(s.handler_runs, 0);
    let accept = config().with_allow_key_template_change(true);
    run(&env.inbox, ledger_v1_edited, &["a"], accept)
        .await
        .0
        .unwrap();
}

#[tokio::test]
async fn sqlite_pending_rows_expire_once_no_copy_can_arrive() {
    let env = SqliteEnv::new().await;
    let inbox = &env.inbox;
    let broker = MemoryBroker::new();
    let queue = unique("q");
    for id in ["stale", "copy_due_later"] {
        broker.publish(&queue, Message::json(id, &json!({ "id": id })));
    }
    let worker = Worker::with_config(inbox.clone(), always_failing, config()).unwrap();
    run_until(
        &worker,
        broker.consume(&queue),
        "both copies recorded",
        || async {
            for id in ["stale", "copy_due_later"] {
                match inbox.entry("always_failing", id).await.unwrap() {
                    Some(e) if e.retried_to >= 2 => {}
                    _ => return false,
                }
            }
            true
        },
    )
    .await;
    // Both idle for two hours (Unix milliseconds); one's copy was due two hours ago, the
    // other's is still due.
    let hours = |h: i64| h * 3_600_000;
    for (key, due_shift) in [("stale", hours(-3)), ("copy_due_later", 0)] {
        sqlx::query(
            "UPDATE consumer_inbox SET updated_at = updated_at - ?1, \
             retry_due_at = retry_due_at + ?2 WHERE key = ?3",
        )
        .bind(hours(2))
        .bind(due_shift)
        .bind(key)
        .execute(inbox.pool())
        .await
        .unwrap();
    }
    let purging = config()
        .with_retention_interval(Some(Duration::from_millis(50)))
        .with_pending_retention(Some(Duration::from_secs(3600)));
    let worker = Worker::with_config(inbox.clone(), always_failing, purging).unwrap();
    let empty = unique("empty");
    run_until(
        &worker,
        broker.consume(&empty),
        "the stale row purged",
        || async {
            inbox
                .entry("always_failing", "stale")
                .await
                .unwrap()
                .is_none()
        },
    )
    .await;
    assert_eq!(worker.snapshot().purged_pending, 1);
    let kept = inbox
        .entry("always_failing", "copy_due_later")
        .await
        .unwrap();
    assert_eq!(kept.map(|e| e.status), Some(EntryStatus::Pending));
}
