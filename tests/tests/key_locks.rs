//! Which attempts hold their key's PostgreSQL advisory lock. A counted attempt (a retry, a
//! redelivery) runs under its key's lock, taken with its attempt count and released by the
//! statement that completes the key, so that two processes cannot count and run the same
//! key at once; a fresh attempt claims its key in its own transaction and takes no database
//! lock.
//!
//! Against real PostgreSQL (a fresh schema per test), one transaction per delivery and in
//! batched mode.

// Test code may panic: a panic is how a test fails.
#![allow(clippy::unwrap_used)]

use std::sync::{Arc, Mutex};
use std::time::Duration;

use consumer_core::memory::{MemoryBroker, Message};
use consumer_core::retry::NoJitter;
use consumer_core::{handler, BatchConfig, Context, HandlerError, Worker, WorkerConfig};
use consumer_tests::common::{self, PgEnv};
use serde::Deserialize;
use serde_json::json;
use sqlx::Postgres;

/// What each run saw: job id, attempt, whether it was fresh, and how many advisory locks
/// its connection held.
static SEEN: Mutex<Vec<(String, u32, bool, i64)>> = Mutex::new(Vec::new());

#[derive(Debug, Deserialize)]
struct Job {
    id: String,
}

/// Counts the advisory locks its own connection holds; a job whose id starts with `fails`
/// fails its first attempt.
#[handler(name = "probe", max_attempts = 3, backoff = "5ms..20ms")]
async fn probe(ctx: &mut Context<'_, Postgres>, job: Job) -> Result<(), HandlerError> {
    let held: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND pid = pg_backend_pid()",
    )
    .fetch_one(ctx.db())
    .await?;
    SEEN.lock()
        .unwrap()
        .push((job.id.clone(), ctx.attempt(), ctx.fresh(), held));
    if job.id.starts_with("fails") && ctx.attempt() == 1 {
        return Err(HandlerError::transient(format!("{} fails once", job.id)));
    }
    Ok(())
}

async fn only_counted_attempts_hold_their_key_lock(batch: Option<BatchConfig>) {
    let env = PgEnv::new().await;
    let inbox = env.inbox().await;
    let broker = MemoryBroker::new();
    let queue = common::unique("q");
    // Unique ids: the tests of this file share `SEEN`.
    let (ok, fails) = (common::unique("ok"), common::unique("fails"));
    for id in [&ok, &fails] {
        broker.publish(&queue, Message::json(id.as_str(), &json!({ "id": id })));
    }
    let config = WorkerConfig::default()
        .with_concurrency(1)
        .with_retention_interval(None)
        .with_jitter(Arc::new(NoJitter))
        .with_batch(batch);
    let worker = Worker::with_config(inbox, probe, config).unwrap();
    let run = worker.run(broker.consume(&queue), broker.drained(&queue));
    tokio::time::timeout(Duration::from_secs(30), run)
        .await
        .expect("drained")
        .unwrap();
    let s = worker.snapshot();
    assert_eq!((s.completed, s.retries), (2, 1), "{s:?}");
    let mut seen: Vec<_> = SEEN
        .lock()
        .unwrap()
        .iter()
        .filter(|(id, ..)| *id == ok || *id == fails)
        .map(|(id, attempt, fresh, held)| (id == &fails, *attempt, *fresh, *held))
        .collect();
    // Batched, the batch's first attempts run again one by one after its failed member.
    seen.sort();
    seen.dedup();
    assert_eq!(
        seen,
        [
            // (fails, attempt, fresh, advisory locks held)
            (false, 1, true, 0),
            (true, 1, true, 0),
            (true, 2, false, 1),
        ]
    );
}

#[tokio::test]
async fn only_counted_attempts_hold_their_key_lock_one_per_transaction() {
    only_counted_attempts_hold_their_key_lock(None).await;
}

#[tokio::test]
async fn only_counted_attempts_hold_their_key_lock_batched() {
    only_counted_attempts_hold_their_key_lock(Some(BatchConfig::new(8, Duration::from_millis(20))))
        .await;
}
