//! Keys the inbox database cannot hold: a message id or a key template over a string field
//! can yield a key with a NUL or other control character, or one longer than a btree index
//! entry. Such a message is dead-lettered `invalid_key` at once, with the reason, and never
//! stalls its queue (retried as if the database were down) or sinks the messages batched
//! with it.

use std::time::Duration;

use consumer_core::inbox::Backend;
use consumer_core::memory::{MemoryBroker, Message};
use consumer_core::retry::NoJitter;
use consumer_core::{
    handler, BatchConfig, Context, DeadLetterReason, Handler, HandlerError, Inbox, Worker,
    WorkerConfig,
};
use serde::Deserialize;
use serde_json::json;
use sqlx::{Postgres, Sqlite};

pub use crate::jobs::{pg_ledger, sqlite_ledger};

use crate::env::unique;

/// How long a queue of a few messages may take to drain. A stalled queue never drains.
const DRAIN_LIMIT: Duration = Duration::from_secs(20);

/// The invalid-key scenarios' job: its id is both the ledger row and, for the templated
/// handlers, the key.
#[derive(Debug, Deserialize)]
pub struct KeyedJob {
    id: String,
}

macro_rules! handlers {
    ($by_id:ident, $templated:ident, $db:ty, $insert:literal) => {
        /// Keyed by the message id.
        #[handler(name = "by_id", max_attempts = 3, backoff = "5ms..20ms")]
        pub async fn $by_id(ctx: &mut Context<'_, $db>, job: KeyedJob) -> Result<(), HandlerError> {
            sqlx::query($insert).bind(&job.id).execute(ctx.db()).await?;
            Ok(())
        }

        /// Keyed by a template over the job's string field.
        #[handler(
            name = "templated",
            key = "job-{id}",
            max_attempts = 3,
            backoff = "5ms..20ms"
        )]
        pub async fn $templated(
            ctx: &mut Context<'_, $db>,
            job: KeyedJob,
        ) -> Result<(), HandlerError> {
            sqlx::query($insert).bind(&job.id).execute(ctx.db()).await?;
            Ok(())
        }
    };
}

handlers!(
    by_id_pg,
    templated_pg,
    Postgres,
    "INSERT INTO ledger (job_id, attempt) VALUES ($1, 1)"
);
handlers!(
    by_id_sqlite,
    templated_sqlite,
    Sqlite,
    "INSERT INTO ledger (job_id, attempt) VALUES (?1, 1)"
);

/// A batch window wide enough that the messages published before the worker starts share
/// one batch.
pub const BATCHED_WIDE: Option<BatchConfig> = Some(BatchConfig::new(16, Duration::from_millis(50)));

fn config(batch: Option<BatchConfig>) -> WorkerConfig {
    WorkerConfig::default()
        .with_concurrency(2)
        .with_retention_interval(None)
        .with_jitter(std::sync::Arc::new(NoJitter))
        .with_batch(batch)
}

/// `len` characters no compression shortens: an index entry holds them as they are.
fn incompressible(len: usize) -> String {
    const ALPHABET: &[u8] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789";
    let mut x: u64 = 0x9E37_79B9_7F4A_7C15;
    (0..len)
        .map(|_| {
            // xorshift64
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            ALPHABET[(x % ALPHABET.len() as u64) as usize] as char
        })
        .collect()
}

/// Runs a worker until `queue` is drained; panics if it does not drain in `DRAIN_LIMIT`.
pub async fn drain<DB: Backend, H: Handler<DB>>(
    inbox: Inbox<DB>,
    handler: H,
    batch: Option<BatchConfig>,
    broker: &MemoryBroker,
    queue: &str,
) -> consumer_core::stats::StatsSnapshot {
    let worker = Worker::with_config(inbox, handler, config(batch)).unwrap();
    let run = worker.run(broker.consume(queue), broker.drained(queue));
    match tokio::time::timeout(DRAIN_LIMIT, run).await {
        Ok(done) => done.unwrap(),
        Err(_) => panic!(
            "the queue did not drain in {DRAIN_LIMIT:?}: {:?}, {:?}",
            broker.depth(queue),
            worker.snapshot()
        ),
    }
    worker.snapshot()
}

/// The one dead letter of `queue`: it is `invalid_key`, no attempt was counted, and its error
/// contains `expect`.
pub fn assert_invalid_key(broker: &MemoryBroker, queue: &str, expect: &str) {
    let dead = broker.dead_letters(queue);
    assert_eq!(dead.len(), 1, "{dead:?}");
    let d = &dead[0].dead_letter;
    assert_eq!(d.reason, DeadLetterReason::InvalidKey, "{d:?}");
    assert_eq!(d.attempts, 0, "{d:?}");
    assert!(d.error.contains(expect), "{:?} lacks {expect:?}", d.error);
}

/// Counts a job's rows in `ledger` ([`crate::jobs::pg_ledger`], [`crate::jobs::sqlite_ledger`]).
pub type Ledger<DB> = fn(Inbox<DB>, String) -> futures::future::BoxFuture<'static, i64>;

/// A message id with a NUL is dead-lettered `invalid_key` at once, naming the character;
/// the messages beside it (in batched mode: in its batch) complete.
pub async fn key_with_nul<DB: Backend, H: Handler<DB>>(
    inbox: Inbox<DB>,
    handler: H,
    ledger: Ledger<DB>,
    batch: Option<BatchConfig>,
) {
    let broker = MemoryBroker::new();
    let queue = unique("q");
    broker.publish(&queue, Message::json("ok-1", &json!({"id": "ok-1"})));
    broker.publish(&queue, Message::json("bad\0id", &json!({"id": "bad"})));
    broker.publish(&queue, Message::json("ok-2", &json!({"id": "ok-2"})));
    let s = drain(inbox.clone(), handler, batch, &broker, &queue).await;
    assert_invalid_key(&broker, &queue, "U+0000");
    assert_eq!(
        (s.completed, s.dead_lettered, s.db_errors),
        (2, 1, 0),
        "{s:?}"
    );
    assert_eq!(ledger(inbox.clone(), "ok-1".into()).await, 1);
    assert_eq!(ledger(inbox.clone(), "ok-2".into()).await, 1);
    assert_eq!(ledger(inbox.clone(), "bad".into()).await, 0);
    // The in-memory broker's dead letters end with its process: the inbox kept this one
    // too, with the NUL (which PostgreSQL's text refuses) read back as U+FFFD.
    let kept = inbox
        .dead_letters()
        .await
        .expect("the inbox's dead letters");
    let ids: Vec<Option<&str>> = kept.iter().map(|l| l.message_id.as_deref()).collect();
    assert_eq!(ids, [Some("bad\u{fffd}id")], "{kept:#?}");
}

/// A templated key longer than a btree index entry holds is dead-lettered `invalid_key` at
/// once, naming its length; the messages beside it complete.
pub async fn overlong_key<DB: Backend, H: Handler<DB>>(
    inbox: Inbox<DB>,
    handler: H,
    ledger: Ledger<DB>,
    batch: Option<BatchConfig>,
) {
    let broker = MemoryBroker::new();
    let queue = unique("q");
    // Well past PostgreSQL's btree entry limit (2,704 bytes) once the template prefixes it.
    let long = incompressible(3000);
    broker.publish(&queue, Message::json("ok-1", &json!({"id": "ok-1"})));
    broker.publish(&queue, Message::json("long", &json!({"id": long})));
    broker.publish(&queue, Message::json("ok-2", &json!({"id": "ok-2"})));
    let s = drain(inbox.clone(), handler, batch, &broker, &queue).await;
    assert_invalid_key(&broker, &queue, "3004 bytes");
    assert_eq!(
        (s.completed, s.dead_lettered, s.db_errors),
        (2, 1, 0),
        "{s:?}"
    );
    assert_eq!(ledger(inbox.clone(), "ok-1".into()).await, 1);
    assert_eq!(ledger(inbox, "ok-2".into()).await, 1);
}
