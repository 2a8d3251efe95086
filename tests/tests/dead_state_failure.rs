//! A dead letter goes out only once its key is dead in the inbox. When the database goes
//! away just as the key is being marked dead (its server process terminated), the delivery
//! is retried as after any database error, and its next delivery, its attempts used up,
//! dead-letters it with the key dead. A dead letter whose key stayed pending could not be
//! replayed as dead, and the key would hold its message for ever.
//!
//! The fault is real: a trigger terminates the session's own backend at the first update
//! that marks a key dead (a sequence, which no rollback undoes, makes it trip once).

// Test code may panic: a panic is how a test fails.
#![allow(clippy::unwrap_used)]

use consumer_core::inbox::EntryStatus;
use consumer_core::memory::{MemoryBroker, Message};
use consumer_core::retry::NoJitter;
use consumer_core::{handler, Context, DeadLetterReason, HandlerError, Worker, WorkerConfig};
use consumer_tests::common::{self, run_until, PgEnv};
use serde::Deserialize;
use serde_json::json;
use sqlx::Postgres;

#[derive(Debug, Deserialize)]
struct Job {
    id: String,
}

#[handler(name = "doomed", max_attempts = 2, backoff = "5ms..20ms")]
async fn always_fails(_ctx: &mut Context<'_, Postgres>, job: Job) -> Result<(), HandlerError> {
    Err(HandlerError::transient(format!(
        "job {} always fails",
        job.id
    )))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_key_is_dead_before_its_dead_letter_goes_out() {
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
           RETURN NEW;
         END $$;
         CREATE TRIGGER trip BEFORE UPDATE ON \"{s}\".consumer_inbox
           FOR EACH ROW WHEN (NEW.status = 'dead') EXECUTE FUNCTION \"{s}\".trip();"
    ))
    .execute(inbox.pool())
    .await
    .expect("create the trigger");

    let broker = MemoryBroker::new();
    let queue = common::unique("q");
    broker.publish(&queue, Message::json("d1", &json!({ "id": "d1" })));
    let config = WorkerConfig::default()
        .with_retention_interval(None)
        .with_jitter(std::sync::Arc::new(NoJitter));
    let worker = Worker::with_config(inbox.clone(), always_fails, config).unwrap();
    run_until(
        &worker,
        broker.consume(&queue),
        "the job dead-lettered",
        || {
            let s = worker.snapshot();
            async move { s.dead_lettered >= 1 }
        },
    )
    .await;

    let trips: i64 = sqlx::query_scalar(&format!("SELECT last_value FROM \"{s}\".trips"))
        .fetch_one(inbox.pool())
        .await
        .unwrap();
    assert!(trips >= 1, "the fault tripped");
    let entry = inbox.entry("doomed", "d1").await.unwrap().unwrap();
    assert_eq!(
        entry.status,
        EntryStatus::Dead,
        "the key is dead once its dead letter is out: {entry:?}"
    );
    let dead = broker.dead_letters(&queue);
    assert_eq!(dead.len(), 1, "one dead letter: {dead:?}");
    let reason = dead[0].dead_letter.reason;
    assert!(
        matches!(
            reason,
            DeadLetterReason::MaxAttemptsExceeded | DeadLetterReason::Quarantined
        ),
        "{reason:?}"
    );
}
