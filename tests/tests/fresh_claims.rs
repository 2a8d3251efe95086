//! A batch's fresh keys are claimed with a plain insert, which fails if one of them has a
//! row (a republished message). The batch is then claimed again in a new transaction,
//! keeping that key apart: its members still commit together, on the fresh path, and the
//! republished message is acked as a duplicate.
//!
//! Against real PostgreSQL (a fresh schema), in batched mode.

// Test code may panic: a panic is how a test fails.
#![allow(clippy::unwrap_used)]

use std::sync::Arc;
use std::time::Duration;

use consumer_core::memory::{MemoryBroker, Message};
use consumer_core::retry::NoJitter;
use consumer_core::stats::StatsSnapshot;
use consumer_core::{handler, BatchConfig, Context, HandlerError, Inbox, Worker, WorkerConfig};
use consumer_tests::common::{self, PgEnv};
use serde::Deserialize;
use serde_json::json;
use sqlx::Postgres;

#[derive(Debug, Deserialize)]
struct Job {
    id: String,
}

/// Writes one ledger row per run.
#[handler(name = "ledger")]
async fn ledger(ctx: &mut Context<'_, Postgres>, job: Job) -> Result<(), HandlerError> {
    sqlx::query("INSERT INTO ledger (job_id, attempt) VALUES ($1, $2)")
        .bind(&job.id)
        .bind(i32::try_from(ctx.attempt()).unwrap())
        .execute(ctx.db())
        .await?;
    Ok(())
}

/// Publishes `ids` to a new queue (the message id is the job id), runs a batched worker on
/// them until the queue is drained, and returns its counters.
async fn run(inbox: Inbox<Postgres>, broker: &MemoryBroker, ids: &[String]) -> StatsSnapshot {
    let queue = common::unique("q");
    for id in ids {
        broker.publish(&queue, Message::json(id.as_str(), &json!({ "id": id })));
    }
    let config = WorkerConfig::default()
        .with_concurrency(1)
        .with_retention_interval(None)
        .with_jitter(Arc::new(NoJitter))
        .with_batch(Some(BatchConfig::new(16, Duration::from_millis(50))));
    let worker = Worker::with_config(inbox, ledger, config).unwrap();
    let run = worker.run(broker.consume(&queue), broker.drained(&queue));
    tokio::time::timeout(Duration::from_secs(30), run)
        .await
        .expect("drained")
        .unwrap();
    worker.snapshot()
}

#[tokio::test]
async fn a_republished_message_in_a_batch_leaves_the_others_claimed_together() {
    let env = PgEnv::new().await;
    let inbox = env.inbox().await;
    let broker = MemoryBroker::new();
    let republished = common::unique("republished");

    // First delivery: the key gets its row.
    let s = run(inbox.clone(), &broker, std::slice::from_ref(&republished)).await;
    assert_eq!(s.completed, 1, "{s:?}");

    // The same message again, published anew among eight new ones: a fresh delivery whose
    // key has a row.
    let mut ids: Vec<String> = (0..8).map(|i| common::unique(&format!("new{i}"))).collect();
    ids.insert(4, republished.clone());
    let s = run(inbox, &broker, &ids).await;
    assert_eq!((s.completed, s.duplicates), (8, 1), "{s:?}");
    // The eight new keys were claimed in their handlers' transaction, as one batch.
    assert_eq!((s.fresh_completed, s.batches), (8, 1), "{s:?}");

    let pool = env.pool(1).await;
    let rows: Vec<(String, i64)> =
        sqlx::query_as("SELECT job_id, count(*) FROM ledger GROUP BY job_id ORDER BY job_id")
            .fetch_all(&pool)
            .await
            .unwrap();
    assert_eq!(rows.len(), 9, "{rows:?}");
    assert!(rows.iter().all(|(_, n)| *n == 1), "{rows:?}");
}
