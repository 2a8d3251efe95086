//! A commit that fails for the database's own reason (a failover, a lost connection) is not
//! a failed attempt: the handler's outcome is unknown, its attempt is given back, and the
//! delivery is retried as after any database error. A message on its last attempt whose
//! handler succeeded must never be dead-lettered because the commit failed.
//!
//! The failover is real: a deferred constraint trigger terminates the session's own backend
//! at the first commit that inserts a ledger row (a sequence, which no rollback undoes,
//! makes it trip once). Against real PostgreSQL, per message and batched, on the fresh path
//! (a first delivery) and the counted one (a redelivery).
//!
//! A commit that refuses the handler's own writes (a deferred trigger's data exception) is
//! the handler's failed attempt, and only its job's.

// Test code may panic: a panic is how a test fails.
#![allow(clippy::unwrap_used)]

use std::time::Duration;

use consumer_core::inbox::EntryStatus;
use consumer_core::memory::{MemoryBroker, Message};
use consumer_core::retry::NoJitter;
use consumer_core::transport::Origin;
use consumer_core::{
    handler, BatchConfig, Context, DeadLetterReason, HandlerError, Inbox, Worker, WorkerConfig,
};
use consumer_tests::common::{self, run_until, PgEnv};
use futures::StreamExt;
use serde::Deserialize;
use serde_json::json;
use sqlx::Postgres;

#[derive(Debug, Deserialize)]
struct Job {
    id: String,
}

/// One attempt only: a failed commit counted as an attempt would dead-letter the job.
#[handler(name = "commit", max_attempts = 1, backoff = "5ms..20ms")]
async fn record_once(ctx: &mut Context<'_, Postgres>, job: Job) -> Result<(), HandlerError> {
    sqlx::query("INSERT INTO ledger (job_id, attempt) VALUES ($1, $2)")
        .bind(&job.id)
        .bind(i32::try_from(ctx.attempt()).unwrap_or(i32::MAX))
        .execute(ctx.db())
        .await?;
    Ok(())
}

/// A fresh schema whose first commit of a ledger row loses its connection.
async fn failing_over() -> PgEnv {
    let env = PgEnv::new().await;
    let s = &env.schema;
    let inbox = env.inbox().await;
    sqlx::raw_sql(&format!(
        "CREATE SEQUENCE \"{s}\".trips;
         CREATE FUNCTION \"{s}\".trip() RETURNS trigger LANGUAGE plpgsql AS $$
         BEGIN
           IF nextval('\"{s}\".trips') = 1 THEN
             PERFORM pg_terminate_backend(pg_backend_pid());
           END IF;
           RETURN NULL;
         END $$;
         CREATE CONSTRAINT TRIGGER trip AFTER INSERT ON \"{s}\".ledger
           DEFERRABLE INITIALLY DEFERRED FOR EACH ROW EXECUTE FUNCTION \"{s}\".trip();"
    ))
    .execute(inbox.pool())
    .await
    .expect("create the failover trigger");
    env
}

async fn a_failed_commit_is_not_a_failed_attempt(batch: Option<BatchConfig>, redelivered: bool) {
    let env = failing_over().await;
    let inbox = env.inbox().await;
    let ids = ["c1", "c2", "c3"];
    let (broker, queue, worker) = jobs_and_worker(&inbox, &ids, batch);
    // The first deliveries as redeliveries: the counted path. The retries (attempt 2 and up)
    // come as the broker sends them.
    let deliveries = broker.consume(&queue).map(move |item| {
        item.map(|mut incoming| {
            if redelivered && incoming.delivery.attempt == 1 {
                incoming.delivery.origin = Origin::Unknown;
                incoming.delivery.redelivered = true;
            }
            incoming
        })
    });
    run_until(
        &worker,
        deliveries,
        "every job completed or dead-lettered",
        || {
            let s = worker.snapshot();
            async move { s.completed + s.dead_lettered == 3 }
        },
    )
    .await;

    let s = worker.snapshot();
    assert_eq!((s.completed, s.dead_lettered), (3, 0), "{s:?}");
    assert!(s.db_errors >= 1, "the commit failed: {s:?}");
    assert!(broker.dead_letters(&queue).is_empty());
    for id in ids {
        let rows: i64 = sqlx::query_scalar("SELECT count(*) FROM ledger WHERE job_id = $1")
            .bind(id)
            .fetch_one(inbox.pool())
            .await
            .unwrap();
        assert_eq!(rows, 1, "{id}");
        let entry = inbox.entry("commit", id).await.unwrap().unwrap();
        assert_eq!(entry.status, EntryStatus::Completed, "{id}: {entry:?}");
        assert_eq!(
            entry.attempts, 1,
            "no attempt counted for the failed commit: {entry:?}"
        );
    }
}

/// A queue holding one job for each of `ids`, and a worker of `record_once` on `inbox`.
fn jobs_and_worker(
    inbox: &Inbox<Postgres>,
    ids: &[&str],
    batch: Option<BatchConfig>,
) -> (MemoryBroker, String, Worker<Postgres, record_once>) {
    let broker = MemoryBroker::new();
    let queue = common::unique("q");
    for id in ids {
        broker.publish(&queue, Message::json(*id, &json!({ "id": id })));
    }
    let config = WorkerConfig::default()
        .with_concurrency(4)
        .with_retention_interval(None)
        .with_jitter(std::sync::Arc::new(NoJitter))
        .with_batch(batch);
    let worker = Worker::with_config(inbox.clone(), record_once, config).unwrap();
    (broker, queue, worker)
}

const BATCHED: Option<BatchConfig> = Some(BatchConfig::new(8, Duration::from_millis(50)));

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_commit_is_not_a_failed_attempt_fresh() {
    a_failed_commit_is_not_a_failed_attempt(None, false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_commit_is_not_a_failed_attempt_counted() {
    a_failed_commit_is_not_a_failed_attempt(None, true).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_commit_is_not_a_failed_attempt_fresh_batched() {
    a_failed_commit_is_not_a_failed_attempt(BATCHED, false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_commit_is_not_a_failed_attempt_counted_batched() {
    a_failed_commit_is_not_a_failed_attempt(BATCHED, true).await;
}

/// A fresh schema whose commit of a ledger row for a job named `bad-…` fails with a data
/// exception (SQLSTATE 22023) raised by a deferred trigger: the database refuses the
/// handler's own writes at the commit.
async fn refusing_bad_rows() -> PgEnv {
    let env = PgEnv::new().await;
    let s = &env.schema;
    let inbox = env.inbox().await;
    sqlx::raw_sql(&format!(
        "CREATE FUNCTION \"{s}\".refuse() RETURNS trigger LANGUAGE plpgsql AS $$
         BEGIN
           IF NEW.job_id LIKE 'bad-%' THEN
             RAISE EXCEPTION 'ledger row % refused', NEW.job_id USING ERRCODE = '22023';
           END IF;
           RETURN NULL;
         END $$;
         CREATE CONSTRAINT TRIGGER refuse AFTER INSERT ON \"{s}\".ledger
           DEFERRABLE INITIALLY DEFERRED FOR EACH ROW EXECUTE FUNCTION \"{s}\".refuse();"
    ))
    .execute(inbox.pool())
    .await
    .expect("create the refusing trigger");
    env
}

/// A data exception (class 22) raised at the commit by the handler's own writes is the
/// handler's failed attempt, counted, and dead-lettered as any failure after its attempts;
/// not the inbox refusing the key (`invalid_key`, no attempt). In a batch, only its job
/// fails: the others commit when the batch runs again one by one.
async fn a_data_error_at_commit_is_the_handlers_failed_attempt(batch: Option<BatchConfig>) {
    let env = refusing_bad_rows().await;
    let inbox = env.inbox().await;
    let ids = ["ok-1", "bad-1", "ok-2"];
    let (broker, queue, worker) = jobs_and_worker(&inbox, &ids, batch);
    run_until(
        &worker,
        broker.consume(&queue),
        "every job completed or dead-lettered",
        || {
            let s = worker.snapshot();
            async move { s.completed + s.dead_lettered == 3 }
        },
    )
    .await;

    let s = worker.snapshot();
    assert_eq!((s.completed, s.dead_lettered), (2, 1), "{s:?}");
    let dead = broker.dead_letters(&queue);
    assert_eq!(dead.len(), 1, "{dead:?}");
    let d = &dead[0].dead_letter;
    assert_eq!(d.reason, DeadLetterReason::MaxAttemptsExceeded, "{d:?}");
    assert_eq!((d.key.as_deref(), d.attempts), (Some("bad-1"), 1), "{d:?}");
    assert!(
        d.error.contains("refused the handler's writes") && d.error.contains("bad-1 refused"),
        "{}",
        d.error
    );
    let entry = inbox.entry("commit", "bad-1").await.unwrap().unwrap();
    assert_eq!(
        (entry.status, entry.attempts),
        (EntryStatus::Dead, 1),
        "{entry:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_data_error_at_commit_is_the_handlers_failed_attempt_per_message() {
    a_data_error_at_commit_is_the_handlers_failed_attempt(None).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_data_error_at_commit_is_the_handlers_failed_attempt_batched() {
    a_data_error_at_commit_is_the_handlers_failed_attempt(BATCHED).await;
}
