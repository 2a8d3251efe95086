//! What a scenario runs on: a backend's [`Harness`] (the SQLite one is here; the PostgreSQL
//! one lives with the tests that have a server), the worker configuration, and the helpers
//! that run a worker until its queue, or a queue made to look like a log, is drained.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use consumer_core::inbox::Backend;
use consumer_core::memory::{MemoryBroker, Message};
use consumer_core::retry::NoJitter;
use consumer_core::stats::StatsSnapshot;
use consumer_core::transport::{LogPosition, Origin};
use consumer_core::{BatchConfig, Error, Handler, Inbox, InboxConfig, Worker, WorkerConfig};
use futures::future::BoxFuture;
use futures::StreamExt;
use sqlx::Sqlite;

use crate::env::{unique, SqliteEnv, DEADLINE};
use crate::jobs::{bulk_sqlite, record_sqlite, sqlite_ledger};

/// Batches big enough to hold several of a scenario's messages at once.
pub const BATCHED: Option<BatchConfig> = Some(BatchConfig::new(16, Duration::from_millis(20)));

/// What a scenario needs from a backend.
pub struct Harness<DB: Backend, H> {
    /// The handler every worker of the scenario runs.
    pub handler: H,
    /// Batched mode, or one transaction per delivery.
    pub batch: Option<BatchConfig>,
    /// An inbox as a separate worker process would have it (PostgreSQL: its own pool;
    /// SQLite, one process only: the same inbox).
    pub new_inbox: Box<dyn Fn() -> BoxFuture<'static, Inbox<DB>> + Send + Sync>,
    /// An inbox on the same table with key locks of its own (as a second deployment whose
    /// locks this one does not see), its table spelled another way where the backend allows
    /// (PostgreSQL: unqualified, resolved through the search path), and a copy grace of its
    /// own.
    pub other_inbox: Box<dyn Fn(Duration) -> BoxFuture<'static, Inbox<DB>> + Send + Sync>,
    /// `SELECT count(*) FROM ledger WHERE job_id = ?`.
    pub ledger: fn(Inbox<DB>, String) -> BoxFuture<'static, i64>,
    /// `SELECT status FROM orders WHERE id = ?`, inserting the order first if `create`.
    pub order: fn(Inbox<DB>, i64, bool) -> BoxFuture<'static, String>,
    /// A database fault the model test makes while workers run, where the backend has one:
    /// PostgreSQL terminates one of the harness's server processes (a worker's connection
    /// lost mid-statement, mid-commit or idle in its pool). `None` on SQLite.
    pub db_fault: Option<DbFault>,
    /// Commits the model test makes fail, where the backend has a hook for it: given jobs
    /// (by id) and how each fails, the next commit that writes a job's ledger row fails
    /// that way, once; the retry of the same job commits. PostgreSQL: a deferred constraint
    /// trigger on the ledger. `None` on SQLite.
    pub commit_fault: Option<CommitFault>,
}

/// See [`Harness::db_fault`].
pub type DbFault = Arc<dyn Fn() -> BoxFuture<'static, ()> + Send + Sync>;

/// See [`Harness::commit_fault`].
pub type CommitFault = Arc<dyn CommitFaults>;

/// Failures of chosen jobs' commits (see [`Harness::commit_fault`]).
pub trait CommitFaults: Send + Sync {
    /// Arms a failure of the next commit that writes each listed job's effect, once.
    fn arm(&self, jobs: Vec<(String, CommitFailure)>) -> BoxFuture<'_, ()>;

    /// How many of `jobs` (armed before) have had their commit fail: what shows that the
    /// faults were made, not only armed.
    fn tripped(&self, jobs: Vec<String>) -> BoxFuture<'_, usize>;
}

/// How a commit armed by [`Harness::commit_fault`] fails. Neither refuses the handler's
/// writes: the runtime must take both as the database's failure, give the attempt back and
/// retry the delivery.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CommitFailure {
    /// The session's connection is lost at the commit (its server process terminated):
    /// whether the commit happened is unknown to the worker.
    LostConnection,
    /// The commit fails with a serialization failure (SQLSTATE 40001).
    SerializationFailure,
}

/// A fresh SQLite file with the per-delivery record handler.
pub async fn sqlite_harness(batch: Option<BatchConfig>) -> Harness<Sqlite, record_sqlite> {
    sqlite_harness_with(record_sqlite, batch).await
}

/// A fresh SQLite file with the record handler that has a batch function.
pub async fn sqlite_bulk_harness(batch: Option<BatchConfig>) -> Harness<Sqlite, bulk_sqlite> {
    sqlite_harness_with(bulk_sqlite, batch).await
}

/// A fresh SQLite file with `handler`. One process only: every "new process" shares its
/// inbox; the other inbox is a second one on the same pool, with key locks of its own.
pub async fn sqlite_harness_with<H>(handler: H, batch: Option<BatchConfig>) -> Harness<Sqlite, H> {
    let env = Arc::new(SqliteEnv::new().await);
    Harness {
        handler,
        batch,
        new_inbox: Box::new({
            let env = env.clone();
            move || {
                let env = env.clone();
                Box::pin(async move { env.inbox.clone() })
            }
        }),
        other_inbox: Box::new(move |grace| {
            let env = env.clone();
            Box::pin(async move {
                let config = InboxConfig::default().with_copy_grace(grace);
                Inbox::new(env.inbox.pool().clone(), config).await.unwrap()
            })
        }),
        ledger: sqlite_ledger,
        order: |inbox, id, create| {
            Box::pin(async move {
                if create {
                    sqlx::query("INSERT INTO orders (id) VALUES (?1)")
                        .bind(id)
                        .execute(inbox.pool())
                        .await
                        .expect("insert order");
                }
                sqlx::query_scalar("SELECT status FROM orders WHERE id = ?1")
                    .bind(id)
                    .fetch_one(inbox.pool())
                    .await
                    .expect("order status")
            })
        },
        db_fault: None,
        commit_fault: None,
    }
}

impl<DB: Backend, H> Harness<DB, H> {
    /// The worker configuration of every scenario: four deliveries at a time, no retention
    /// task, no jitter, and the harness's batch mode.
    pub fn config(&self) -> WorkerConfig {
        WorkerConfig::default()
            .with_concurrency(4)
            .with_retention_interval(None)
            .with_jitter(Arc::new(NoJitter))
            .with_batch(self.batch)
    }
}

pub(crate) fn msg(id: &str, body: serde_json::Value) -> Message {
    Message::json(id, &body)
}

/// Runs one worker on `queue` until the queue is drained (or the worker crashes).
pub(crate) async fn run_until_drained<DB: Backend, H: Handler<DB>>(
    worker: &Worker<DB, H>,
    broker: &MemoryBroker,
    queue: &str,
) -> Result<(), Error> {
    tokio::time::timeout(
        DEADLINE,
        worker.run(broker.consume(queue), broker.drained(queue)),
    )
    .await
    .expect("worker did not drain the queue in time")
}

/// A log for [`run_log_until_drained`]: its name, and the offset of each message id.
pub(crate) struct Log {
    pub(crate) name: Arc<str>,
    offsets: HashMap<String, i64>,
}

impl Log {
    pub(crate) fn new(ids: &[&str]) -> Log {
        Log {
            name: Arc::from(unique("group/topic/0")),
            offsets: ids
                .iter()
                .zip(0..)
                .map(|(id, o)| (id.to_string(), o))
                .collect(),
        }
    }
}

/// [`run_until_drained`], with the queue's deliveries made to look as a Kafka partition's
/// records do: a position (epoch 1, the offset `log` gives the message id), never flagged
/// redelivered (a log is read again after a crash, not redelivered), and no transport
/// freshness. Only the log mark can make them fresh.
pub(crate) async fn run_log_until_drained<DB: Backend, H: Handler<DB>>(
    worker: &Worker<DB, H>,
    broker: &MemoryBroker,
    queue: &str,
    log: &Log,
) -> Result<(), Error> {
    let name = log.name.clone();
    let offsets = log.offsets.clone();
    let records = broker.consume(queue).map(move |item| {
        item.map(|mut incoming| {
            let d = &mut incoming.delivery;
            d.redelivered = false;
            d.origin = d
                .message_id
                .as_deref()
                .and_then(|id| offsets.get(id))
                .map_or(Origin::Unknown, |&offset| {
                    Origin::Log(LogPosition {
                        log: name.clone(),
                        epoch: 1,
                        offset,
                    })
                });
            incoming
        })
    });
    tokio::time::timeout(DEADLINE, worker.run(records, broker.drained(queue)))
        .await
        .expect("worker did not drain the log in time")
}

pub(crate) fn sum(a: StatsSnapshot, b: StatsSnapshot) -> StatsSnapshot {
    StatsSnapshot {
        received: a.received + b.received,
        handler_runs: a.handler_runs + b.handler_runs,
        completed: a.completed + b.completed,
        duplicates: a.duplicates + b.duplicates,
        retries: a.retries + b.retries,
        dead_lettered: a.dead_lettered + b.dead_lettered,
        quarantined: a.quarantined + b.quarantined,
        ..StatsSnapshot::default()
    }
}
