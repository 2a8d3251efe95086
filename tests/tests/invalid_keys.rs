//! Keys the inbox database cannot hold: a message id or a key template over a string field
//! can yield a key with a NUL or other control character, or one longer than a btree index
//! entry. Such a message must be dead-lettered `invalid_key` at once, with the reason, and
//! must never stall its queue (retried as if the database were down) or sink the messages
//! batched with it. A rejection the key check does not foresee (a data exception, SQLSTATE
//! class 22, or a program limit, class 54, from an inbox statement) is permanent too.
//!
//! Against real PostgreSQL (a fresh schema per test) and SQLite, each with one transaction
//! per delivery and in batched mode.

// Test code may panic: a panic is how a test fails.
#![allow(clippy::unwrap_used)]

use std::time::Duration;

use consumer_core::memory::{MemoryBroker, Message};
use consumer_core::{
    handler, Backend, BatchConfig, Context, DeadLetterReason, Handler, HandlerError, Inbox,
    NoJitter, Worker, WorkerConfig,
};
use consumer_tests::common::{self, PgEnv, SqliteEnv};
use serde::Deserialize;
use serde_json::json;
use sqlx::{Postgres, Sqlite};

/// How long a queue of a few messages may take to drain. Today's stall never drains it.
const DRAIN_LIMIT: Duration = Duration::from_secs(20);

/// A test job: its id is both the ledger row and, for the templated handlers, the key.
#[derive(Debug, Deserialize)]
struct Job {
    id: String,
}

macro_rules! handlers {
    ($by_id:ident, $templated:ident, $db:ty, $insert:literal) => {
        /// Keyed by the message id.
        #[handler(name = "by_id", max_attempts = 3, backoff = "5ms..20ms")]
        async fn $by_id(ctx: &mut Context<'_, $db>, job: Job) -> Result<(), HandlerError> {
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
        async fn $templated(ctx: &mut Context<'_, $db>, job: Job) -> Result<(), HandlerError> {
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
const BATCHED: Option<BatchConfig> = Some(BatchConfig::new(16, Duration::from_millis(50)));

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

/// Runs a worker until `queue` is drained; panics if it does not drain in [`DRAIN_LIMIT`].
async fn drain<DB: Backend, H: Handler<DB>>(
    inbox: Inbox<DB>,
    handler: H,
    batch: Option<BatchConfig>,
    broker: &MemoryBroker,
    queue: &str,
) -> consumer_core::StatsSnapshot {
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
fn assert_invalid_key(broker: &MemoryBroker, queue: &str, expect: &str) {
    let dead = broker.dead_letters(queue);
    assert_eq!(dead.len(), 1, "{dead:?}");
    let d = &dead[0].dead_letter;
    assert_eq!(d.reason, DeadLetterReason::InvalidKey, "{d:?}");
    assert_eq!(d.attempts, 0, "{d:?}");
    assert!(d.error.contains(expect), "{:?} lacks {expect:?}", d.error);
}

type Ledger<DB> = fn(Inbox<DB>, &'static str) -> futures::future::BoxFuture<'static, i64>;

fn pg_ledger(inbox: Inbox<Postgres>, id: &'static str) -> futures::future::BoxFuture<'static, i64> {
    Box::pin(async move {
        sqlx::query_scalar("SELECT count(*) FROM ledger WHERE job_id = $1")
            .bind(id)
            .fetch_one(inbox.pool())
            .await
            .unwrap()
    })
}

fn sqlite_ledger(
    inbox: Inbox<Sqlite>,
    id: &'static str,
) -> futures::future::BoxFuture<'static, i64> {
    Box::pin(async move {
        sqlx::query_scalar("SELECT count(*) FROM ledger WHERE job_id = ?1")
            .bind(id)
            .fetch_one(inbox.pool())
            .await
            .unwrap()
    })
}

async fn key_with_nul<DB: Backend, H: Handler<DB>>(
    inbox: Inbox<DB>,
    handler: H,
    ledger: Ledger<DB>,
    batch: Option<BatchConfig>,
) {
    let broker = MemoryBroker::new();
    let queue = common::unique("q");
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
    assert_eq!(ledger(inbox.clone(), "ok-1").await, 1);
    assert_eq!(ledger(inbox.clone(), "ok-2").await, 1);
    assert_eq!(ledger(inbox, "bad").await, 0);
}

async fn overlong_key<DB: Backend, H: Handler<DB>>(
    inbox: Inbox<DB>,
    handler: H,
    ledger: Ledger<DB>,
    batch: Option<BatchConfig>,
) {
    let broker = MemoryBroker::new();
    let queue = common::unique("q");
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
    assert_eq!(ledger(inbox.clone(), "ok-1").await, 1);
    assert_eq!(ledger(inbox, "ok-2").await, 1);
}

/// Keys the check passes but the database refuses: a trigger on the inbox table raises a
/// data exception (SQLSTATE 22023) for keys starting `reject` and a program limit (54000)
/// for keys starting `limit`, standing in for any refusal the check does not foresee. Those
/// messages are dead-lettered naming the SQLSTATE; the messages around them (in batched
/// mode: in their batch) complete.
async fn data_exception_from_the_inbox(batch: Option<BatchConfig>) {
    let env = PgEnv::new().await;
    let inbox = env.inbox().await;
    let schema = &env.schema;
    sqlx::raw_sql(&format!(
        "CREATE FUNCTION \"{schema}\".reject_key() RETURNS trigger LANGUAGE plpgsql AS $$ \
         BEGIN IF NEW.key LIKE 'reject%' THEN \
         RAISE EXCEPTION 'key % is refused', NEW.key USING ERRCODE = '22023'; END IF; \
         IF NEW.key LIKE 'limit%' THEN \
         RAISE EXCEPTION 'key % is over a limit', NEW.key USING ERRCODE = '54000'; END IF; \
         RETURN NEW; END $$; \
         CREATE TRIGGER reject_key BEFORE INSERT ON {} \
         FOR EACH ROW EXECUTE FUNCTION \"{schema}\".reject_key();",
        inbox.table()
    ))
    .execute(inbox.pool())
    .await
    .unwrap();
    let broker = MemoryBroker::new();
    let queue = common::unique("q");
    broker.publish(&queue, Message::json("ok-1", &json!({"id": "ok-1"})));
    broker.publish(
        &queue,
        Message::json("reject-1", &json!({"id": "reject-1"})),
    );
    broker.publish(&queue, Message::json("limit-1", &json!({"id": "limit-1"})));
    broker.publish(&queue, Message::json("ok-2", &json!({"id": "ok-2"})));
    let s = drain(inbox.clone(), by_id_pg, batch, &broker, &queue).await;
    let mut dead: Vec<(String, DeadLetterReason, u32, bool)> = broker
        .dead_letters(&queue)
        .into_iter()
        .map(|d| {
            let id = d.message.id.unwrap_or_default();
            let code = if id.starts_with("reject") {
                "SQLSTATE 22023"
            } else {
                "SQLSTATE 54000"
            };
            let named = d.dead_letter.error.contains(code);
            (id, d.dead_letter.reason, d.dead_letter.attempts, named)
        })
        .collect();
    dead.sort_by(|a, b| a.0.cmp(&b.0));
    assert_eq!(
        dead,
        vec![
            ("limit-1".to_owned(), DeadLetterReason::InvalidKey, 0, true),
            ("reject-1".to_owned(), DeadLetterReason::InvalidKey, 0, true),
        ]
    );
    assert_eq!((s.completed, s.dead_lettered), (2, 2), "{s:?}");
    assert_eq!(pg_ledger(inbox.clone(), "ok-1").await, 1);
    assert_eq!(pg_ledger(inbox.clone(), "ok-2").await, 1);
    assert_eq!(pg_ledger(inbox.clone(), "reject-1").await, 0);
    assert_eq!(pg_ledger(inbox, "limit-1").await, 0);
}

macro_rules! scenarios {
    ($module:ident, $batch:expr) => {
        mod $module {
            use super::*;

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn a_key_with_nul_is_dead_lettered_invalid_key_postgres() {
                let env = PgEnv::new().await;
                key_with_nul(env.inbox().await, by_id_pg, pg_ledger, $batch).await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn a_key_with_nul_is_dead_lettered_invalid_key_sqlite() {
                let env = SqliteEnv::new().await;
                key_with_nul(env.inbox.clone(), by_id_sqlite, sqlite_ledger, $batch).await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn an_overlong_key_is_dead_lettered_invalid_key_postgres() {
                let env = PgEnv::new().await;
                overlong_key(env.inbox().await, templated_pg, pg_ledger, $batch).await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn an_overlong_key_is_dead_lettered_invalid_key_sqlite() {
                let env = SqliteEnv::new().await;
                overlong_key(env.inbox.clone(), templated_sqlite, sqlite_ledger, $batch).await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn a_data_exception_from_the_inbox_is_permanent() {
                data_exception_from_the_inbox($batch).await;
            }
        }
    };
}

scenarios!(per_message, None);
scenarios!(batched, BATCHED);
