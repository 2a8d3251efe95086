//! A handler that times out while one of its statements runs on the server (a long query, or
//! a wait for a lock someone else holds): the runtime drops the handler's future, but the
//! connection still has that statement in flight, and the rollback waits for it. The
//! handler's transaction carries a `statement_timeout` of the handler's timeout, so the
//! server ends the statement and the attempt is failed, retried and settled within a few
//! seconds, not when the statement would have finished or the lock been released.
//!
//! Against real PostgreSQL (a fresh schema per test), one transaction per delivery and in
//! batched mode.

// Test code may panic: a panic is how a test fails.
#![allow(clippy::unwrap_used)]

use std::sync::Arc;
use std::time::Duration;

use consumer_core::memory::{MemoryBroker, Message};
use consumer_core::retry::NoJitter;
use consumer_core::{handler, BatchConfig, Context, HandlerError, Worker, WorkerConfig};
use consumer_tests::common::{self, PgEnv};
use serde::Deserialize;
use serde_json::json;
use sqlx::{Connection, PgConnection, Postgres};

/// Far inside the 30 s the first attempt's statement would run for.
const SETTLE_LIMIT: Duration = Duration::from_secs(10);

#[derive(Debug, Deserialize)]
struct Job {
    id: String,
}

/// The advisory lock the test holds while the job `blocked` waits for it.
const HELD: i64 = 7_340_021_977;

/// On its first attempt the job `slow` sleeps 30 s in the database, and the job `blocked`
/// waits for the lock [`HELD`]; every other run succeeds.
#[handler(
    name = "sleepy",
    max_attempts = 3,
    backoff = "5ms..20ms",
    timeout = "1s"
)]
async fn sleepy(ctx: &mut Context<'_, Postgres>, job: Job) -> Result<(), HandlerError> {
    if job.id == "slow" && ctx.attempt() == 1 {
        sqlx::query("SELECT pg_sleep(30)").execute(ctx.db()).await?;
    }
    if job.id == "blocked" && ctx.attempt() == 1 {
        sqlx::query("SELECT pg_advisory_xact_lock($1)")
            .bind(HELD)
            .execute(ctx.db())
            .await?;
    }
    sqlx::query("INSERT INTO ledger (job_id, attempt) VALUES ($1, $2)")
        .bind(&job.id)
        .bind(i32::try_from(ctx.attempt()).unwrap_or(i32::MAX))
        .execute(ctx.db())
        .await?;
    Ok(())
}

/// Runs the job `slow_id` and a quick one; the first attempt of `slow_id` outlasts the
/// handler's timeout on the server.
async fn a_statement_past_the_handler_timeout_is_cancelled(
    batch: Option<BatchConfig>,
    slow_id: &str,
) {
    let env = PgEnv::new().await;
    let inbox = env.inbox().await;
    let broker = MemoryBroker::new();
    let queue = common::unique("q");
    // Two messages, so that batched mode batches them (a batch of one runs alone).
    broker.publish(&queue, Message::json(slow_id, &json!({"id": slow_id})));
    broker.publish(&queue, Message::json("quick", &json!({"id": "quick"})));
    let config = WorkerConfig::default()
        .with_concurrency(1)
        .with_retention_interval(None)
        .with_jitter(Arc::new(NoJitter))
        .with_batch(batch);
    let worker = Worker::with_config(inbox.clone(), sleepy, config).unwrap();
    let run = worker.run(broker.consume(&queue), broker.drained(&queue));
    match tokio::time::timeout(SETTLE_LIMIT, run).await {
        Ok(done) => done.unwrap(),
        Err(_) => panic!(
            "not settled within {SETTLE_LIMIT:?}: {:?}, {:?}",
            broker.depth(&queue),
            worker.snapshot()
        ),
    }
    let s = worker.snapshot();
    assert_eq!(
        (s.completed, s.retries, s.dead_lettered),
        (2, 1, 0),
        "{s:?}"
    );
    for (id, attempt) in [(slow_id, 2), ("quick", 1)] {
        let attempts: Vec<i32> = sqlx::query_scalar("SELECT attempt FROM ledger WHERE job_id = $1")
            .bind(id)
            .fetch_all(inbox.pool())
            .await
            .unwrap();
        assert_eq!(attempts, vec![attempt], "{id}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_handler_timeout_cancels_its_statement_per_message() {
    a_statement_past_the_handler_timeout_is_cancelled(None, "slow").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_handler_timeout_cancels_its_statement_batched() {
    a_statement_past_the_handler_timeout_is_cancelled(
        Some(BatchConfig::new(16, Duration::from_millis(20))),
        "slow",
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_handler_timeout_ends_its_wait_for_a_lock() {
    // Held for the whole run, on a connection of its own.
    let mut holder = PgConnection::connect(&common::database_url())
        .await
        .unwrap();
    sqlx::query("SELECT pg_advisory_lock($1)")
        .bind(HELD)
        .execute(&mut holder)
        .await
        .unwrap();
    a_statement_past_the_handler_timeout_is_cancelled(None, "blocked").await;
    holder.close().await.unwrap();
}
