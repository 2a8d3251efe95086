//! Renaming a handler: with its former name as an alias, a key completed under the old name
//! is a duplicate under the new one, on the fresh path (one delivery, or a batch claimed
//! with one statement) as on the counted path; nothing runs again.
//!
//! Against real PostgreSQL (a fresh schema).

// Test code may panic: a panic is how a test fails.
#![allow(clippy::unwrap_used)]

use std::sync::Arc;
use std::time::Duration;

use consumer_core::inbox::EntryStatus;
use consumer_core::memory::{MemoryBroker, Message};
use consumer_core::retry::NoJitter;
use consumer_core::stats::StatsSnapshot;
use consumer_core::{
    handler, BatchConfig, Context, Handler, HandlerError, Inbox, Worker, WorkerConfig,
};
use consumer_tests::common::{self, PgEnv};
use serde::Deserialize;
use serde_json::json;
use sqlx::Postgres;

#[derive(Debug, Deserialize)]
struct Job {
    id: String,
}

async fn write(ctx: &mut Context<'_, Postgres>, job: &Job) -> Result<(), HandlerError> {
    sqlx::query("INSERT INTO ledger (job_id, attempt) VALUES ($1, $2)")
        .bind(&job.id)
        .bind(i32::try_from(ctx.attempt()).unwrap())
        .execute(ctx.db())
        .await?;
    Ok(())
}

/// The handler before its rename.
#[handler(name = "ledger_v1")]
async fn ledger_v1(ctx: &mut Context<'_, Postgres>, job: Job) -> Result<(), HandlerError> {
    write(ctx, &job).await
}

/// The same handler, renamed.
#[handler(name = "ledger_v2", aliases = ["ledger_v1"])]
async fn ledger_v2(ctx: &mut Context<'_, Postgres>, job: Job) -> Result<(), HandlerError> {
    write(ctx, &job).await
}

/// Publishes `ids` (the message id is the job id) to a new queue and runs `handler` on them
/// until the queue is drained; its counters.
async fn run<H: Handler<Postgres>>(
    inbox: &Inbox<Postgres>,
    handler: H,
    ids: &[&str],
    batch: bool,
) -> StatsSnapshot {
    let broker = MemoryBroker::new();
    let queue = common::unique("q");
    for id in ids {
        broker.publish(&queue, Message::json(*id, &json!({ "id": id })));
    }
    let mut config = WorkerConfig::default()
        .with_concurrency(1)
        .with_retention_interval(None)
        .with_jitter(Arc::new(NoJitter));
    if batch {
        config = config.with_batch(BatchConfig::new(16, Duration::from_millis(50)));
    }
    let worker = Worker::with_config(inbox.clone(), handler, config).unwrap();
    let run = worker.run(broker.consume(&queue), broker.drained(&queue));
    tokio::time::timeout(Duration::from_secs(30), run)
        .await
        .expect("drained")
        .unwrap();
    worker.snapshot()
}

async fn ledger_runs(env: &PgEnv, id: &str) -> i64 {
    let pool = env.pool(1).await;
    sqlx::query_scalar("SELECT count(*) FROM ledger WHERE job_id = $1")
        .bind(id)
        .fetch_one(&pool)
        .await
        .unwrap()
}

#[tokio::test]
async fn a_renamed_handler_with_an_alias_skips_keys_completed_under_its_old_name() {
    let env = PgEnv::new().await;
    let inbox = env.inbox().await;
    let s = run(&inbox, ledger_v1, &["a", "b"], false).await;
    assert_eq!(s.completed, 2, "{s:?}");

    // The same messages again, under the new name: one alone, one in a batch with a new key.
    let s = run(&inbox, ledger_v2, &["a"], false).await;
    assert_eq!((s.completed, s.duplicates), (0, 1), "{s:?}");
    let s = run(&inbox, ledger_v2, &["b", "c"], true).await;
    assert_eq!((s.completed, s.duplicates), (1, 1), "{s:?}");

    for id in ["a", "b", "c"] {
        assert_eq!(ledger_runs(&env, id).await, 1, "{id} ran once");
        let entry = inbox.entry("ledger_v2", id).await.unwrap();
        assert_eq!(
            entry.map(|e| e.status),
            Some(EntryStatus::Completed),
            "{id}"
        );
    }
    // The rows moved to the new name.
    assert_eq!(inbox.entry("ledger_v1", "a").await.unwrap(), None);
}
