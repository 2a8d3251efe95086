//! The inbox: durable memory of which (handler, key) pairs were processed.
//!
//! One row per (handler, key) holds the payload hash, status (`pending`, `completed`,
//! `dead`), attempts, the newest retry copy's attempt number, scope and due time
//! (`retried_to`, `retry_scope`, `retry_due_at`: an older delivery of a pending key through
//! the same consumers is superseded while the copy can still arrive, see
//! [`Claim::Superseded`]), first seen, completed at, expires at and the last error.
//! Completed and dead rows expire after the handler's retention; [`Inbox::release`] deletes a
//! dead key's row for a replay.
//!
//! A fresh delivery (see [`Delivery::fresh`](crate::Delivery::fresh)) takes one step, under
//! the in-process key lock: [`Backend::claim_fresh`] inserts the key as completed in the
//! handler's transaction, unless it has a row (a concurrent insert of the same key waits on
//! the primary key for this transaction); the commit makes the handler's writes and the
//! completion durable together. If the key has a row, the delivery takes the counted path.
//!
//! The counted path (every other delivery) takes two steps, both under a per-key lock (an
//! in-process mutex, plus a PostgreSQL session advisory lock so workers in other processes
//! wait too):
//!
//! 1. [`Backend::begin_attempt`] counts the attempt in its own small transaction and commits it
//!    *before* the handler runs, so an attempt that kills the process is still counted.
//! 2. The handler's transaction ends with [`Backend::complete`], which marks the key completed
//!    in the same commit as the handler's writes — only if the row is still pending at this
//!    attempt's count, so that no second run's effects commit even where the locks do not
//!    hold (another inbox instance, a pooler that breaks session locks). The same statement releases the database
//!    lock: from there the updated row's lock, held to the commit, keeps another worker's
//!    attempt count on the key waiting, and that count then sees the key completed.

mod locks;
mod postgres;
mod sqlite;

use std::sync::Arc;
use std::time::Duration;

use futures::future::BoxFuture;
use sqlx::pool::PoolConnection;
use sqlx::Pool;

pub(crate) use locks::KeyLocks;

use crate::ident::Identifier;
use crate::Error;

/// Where the inbox lives, and how long a retry copy may be late.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct InboxConfig {
    /// PostgreSQL schema (created if missing). Not supported on SQLite.
    pub schema: Option<String>,
    /// Table name; default `consumer_inbox`.
    pub table: String,
    /// How long past its due time a retry copy may still arrive (default 5 minutes). Until
    /// then an older delivery of the key that comes through the same consumers is superseded
    /// by the copy (acked without running, counted as `superseded`); after it, the copy is
    /// taken as lost (a retry topic past its retention, a retry queue deleted) and such a
    /// delivery runs. Too short costs an attempt (the replay and the copy both run, one after
    /// the other, under the key's lock); too long delays a message whose copy was lost.
    pub copy_grace: Duration,
}

impl Default for InboxConfig {
    fn default() -> Self {
        InboxConfig {
            schema: None,
            table: "consumer_inbox".to_owned(),
            copy_grace: Duration::from_secs(300),
        }
    }
}

impl InboxConfig {
    /// The default table in `schema`.
    pub fn in_schema(schema: impl Into<String>) -> Self {
        InboxConfig {
            schema: Some(schema.into()),
            ..InboxConfig::default()
        }
    }

    /// The table `table` (in the connection's default schema on PostgreSQL).
    pub fn table(table: impl Into<String>) -> Self {
        InboxConfig {
            table: table.into(),
            ..InboxConfig::default()
        }
    }

    /// The same place with another schema.
    pub fn with_schema(mut self, schema: impl Into<String>) -> Self {
        self.schema = Some(schema.into());
        self
    }

    /// The same with another [`InboxConfig::copy_grace`].
    pub fn with_copy_grace(mut self, grace: Duration) -> Self {
        self.copy_grace = grace;
        self
    }
}

/// Validated, quoted names of the inbox objects.
#[derive(Debug, Clone)]
#[doc(hidden)]
pub struct TableNames {
    pub(crate) schema: Option<Identifier>,
    /// `"table"`, without its schema.
    bare_table: String,
    /// `"schema"."table"` or `"table"`.
    pub(crate) inbox: String,
    /// `"schema"."table_migrations"`.
    pub(crate) migrations: String,
    /// `"schema"."table_log_marks"` (see [`crate::LogPosition`]).
    pub(crate) log_marks: String,
    /// `"table_expires_at"` (indexes live in the table's schema).
    pub(crate) expires_index: String,
    /// `"table_dead_expires_at"`.
    pub(crate) dead_expires_index: String,
    /// Distinguishes this inbox in lock ids: the table as the database resolved it (see
    /// [`Backend::lock_namespace`]), so two spellings of one table take the same locks.
    pub(crate) lock_namespace: String,
    /// [`InboxConfig::copy_grace`].
    pub(crate) copy_grace: Duration,
    /// The backend's statements on this table, rendered once (see [`Backend::statements`]).
    pub(crate) sql: Statements,
}

/// The inbox statements with the table name filled in, built once per inbox rather than
/// formatted per statement. A backend leaves empty what it does not use.
#[derive(Debug, Clone, Default)]
#[doc(hidden)]
pub struct Statements {
    pub(crate) begin_attempt: String,
    pub(crate) begin_attempts: String,
    pub(crate) select_entries: String,
    pub(crate) fetch_entry: String,
    pub(crate) complete: String,
    pub(crate) complete_and_unlock: String,
    pub(crate) complete_many: String,
    pub(crate) complete_many_and_unlock: String,
    pub(crate) record_failure: String,
    pub(crate) record_retry: String,
    pub(crate) uncount_attempt: String,
    pub(crate) release_dead: String,
    pub(crate) counts: String,
    pub(crate) purge_expired: String,
    pub(crate) claim_fresh: String,
    pub(crate) claim_fresh_many: String,
    pub(crate) count_fresh_failure: String,
    /// Creates the (handler, log) mark row if missing, with no mark.
    pub(crate) mark_insert: String,
    /// Reads the mark (PostgreSQL: and locks the row to the end of the transaction).
    pub(crate) mark_select: String,
    /// Raises the mark to at least the bound value.
    pub(crate) mark_update: String,
}

impl TableNames {
    fn new(config: &InboxConfig) -> Result<Self, Error> {
        let schema = config
            .schema
            .as_deref()
            .map(|s| Identifier::parse("inbox.schema", s))
            .transpose()?;
        let table = Identifier::parse("inbox.table", &config.table)?;
        let qualify = |name: &str| match &schema {
            Some(s) => format!("{}.\"{name}\"", s.quoted()),
            None => format!("\"{name}\""),
        };
        Ok(TableNames {
            bare_table: format!("\"{table}\""),
            inbox: qualify(table.as_str()),
            migrations: qualify(&format!("{table}_migrations")),
            log_marks: qualify(&format!("{table}_log_marks")),
            expires_index: format!("\"{table}_expires_at\""),
            dead_expires_index: format!("\"{table}_dead_expires_at\""),
            lock_namespace: qualify(table.as_str()),
            copy_grace: config.copy_grace,
            schema,
            sql: Statements::default(),
        })
    }

    /// The table's quoted name without its schema.
    pub(crate) fn unqualified_table(&self) -> &str {
        &self.bare_table
    }

    pub(crate) fn render(&self, template: &str) -> String {
        template
            .replace("{inbox}", &self.inbox)
            .replace("{log_marks}", &self.log_marks)
            .replace("{expires_index}", &self.expires_index)
            .replace("{dead_expires_index}", &self.dead_expires_index)
            .replace("{copy_grace_ms}", &self.copy_grace_ms().to_string())
    }

    /// [`InboxConfig::copy_grace`] in milliseconds, as the statements compare it.
    pub(crate) fn copy_grace_ms(&self) -> i64 {
        i64::try_from(self.copy_grace.as_millis()).unwrap_or(i64::MAX)
    }
}

/// One delivery to count an attempt for: its key, payload hash, own attempt number and the
/// scope its retry copies go to (see [`Backend::begin_attempt`]).
#[derive(Debug, Clone)]
#[doc(hidden)]
pub struct AttemptItem<'a> {
    pub(crate) key: &'a str,
    pub(crate) hash: &'a str,
    pub(crate) attempt: u32,
    /// [`Acknowledger::copy_scope`](crate::Acknowledger::copy_scope) of the delivery.
    pub(crate) scope: Option<&'a str>,
}

/// The state of one key in the inbox.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EntryStatus {
    /// Seen, not completed (in flight, failed, or crashed).
    Pending,
    /// Completed: later deliveries are duplicates.
    Completed,
    /// Dead-lettered.
    Dead,
}

impl EntryStatus {
    fn parse(s: &str) -> Self {
        match s {
            "completed" => EntryStatus::Completed,
            "dead" => EntryStatus::Dead,
            _ => EntryStatus::Pending,
        }
    }
}

/// One inbox row, for operators and tests.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct InboxEntry {
    /// Status.
    pub status: EntryStatus,
    /// Attempts counted (crashed ones included).
    pub attempts: u32,
    /// SHA-256 of the canonical payload first seen with this key.
    pub payload_hash: String,
    /// The last failure, if any.
    pub last_error: Option<String>,
    /// The highest attempt number of a retry copy of the message that its broker confirmed
    /// (0: none). While the key is pending, a delivery with a lower number is superseded by
    /// that copy (acked without running), if it comes through the same consumers
    /// ([`InboxEntry::retry_scope`]) before the copy is overdue.
    pub retried_to: u32,
    /// Where that copy went: the consumers that will read it
    /// ([`Acknowledger::copy_scope`](crate::Acknowledger::copy_scope)).
    pub retry_scope: Option<String>,
    /// Milliseconds until that copy is due, by the database's clock (negative once it is
    /// overdue); `None` without a recorded copy.
    pub copy_due_in_ms: Option<i64>,
}

impl InboxEntry {
    /// Whether the newest retry copy supersedes a delivery carrying `attempt` that comes
    /// through `scope`: the copy is numbered above it, goes to the same consumers, and is
    /// not overdue by more than `grace`. The statements that count attempts apply the same
    /// rule in SQL (see `BEGIN_ATTEMPT` in the backends); this is its one statement in Rust.
    pub(crate) fn superseded(&self, attempt: u32, scope: Option<&str>, grace: Duration) -> bool {
        let grace = i64::try_from(grace.as_millis()).unwrap_or(i64::MAX);
        self.retried_to > attempt
            && scope.is_some()
            && self.retry_scope.as_deref() == scope
            && self
                .copy_due_in_ms
                .is_some_and(|due| due > grace.saturating_neg())
    }
}

/// A handler's keys by status (see [`Inbox::counts`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct InboxCounts {
    /// Seen, not completed.
    pub pending: u64,
    /// Completed, not yet expired.
    pub completed: u64,
    /// Dead-lettered, not yet expired or released.
    pub dead: u64,
    /// How long ago the stalest pending key last saw an attempt, by the database's clock.
    pub stalest_pending: Option<Duration>,
}

impl InboxCounts {
    /// From (status, count, idle milliseconds of the stalest row) rows.
    fn from_rows(rows: impl IntoIterator<Item = (String, i64, Option<i64>)>) -> Self {
        let mut counts = InboxCounts::default();
        for (status, n, idle_ms) in rows {
            let n = u64::try_from(n).unwrap_or(0);
            match EntryStatus::parse(&status) {
                EntryStatus::Pending => {
                    counts.pending += n;
                    counts.stalest_pending =
                        idle_ms.map(|ms| Duration::from_millis(u64::try_from(ms).unwrap_or(0)));
                }
                EntryStatus::Completed => counts.completed += n,
                EntryStatus::Dead => counts.dead += n,
            }
        }
        counts
    }
}

/// The outcome of counting an attempt.
#[derive(Debug, Clone, PartialEq, Eq)]
#[doc(hidden)]
pub enum Claim {
    /// Run the handler; this is attempt `attempt`.
    Run {
        /// The attempt number, crashes included.
        attempt: u32,
    },
    /// Already completed with the same payload.
    Duplicate,
    /// The key exists with another payload.
    Conflict {
        /// Status of the existing row.
        status: EntryStatus,
    },
    /// Previously dead-lettered.
    Dead {
        /// Attempts counted.
        attempts: u32,
        /// Why.
        last_error: Option<String>,
    },
    /// A newer copy of the message is with the broker (its attempt number is above this
    /// delivery's), on its way to the consumers this delivery came through and not overdue
    /// (see [`InboxEntry::superseded`]): this delivery is a replay of an attempt that already
    /// failed and was retried, so it is acked without running and without counting an attempt.
    Superseded {
        /// The newer copy's attempt number.
        by: u32,
    },
    /// Attempts used up without a recorded outcome.
    Exhausted {
        /// Attempts counted.
        attempts: u32,
        /// The last recorded failure, if any.
        last_error: Option<String>,
    },
}

impl Claim {
    /// Decides from an existing row when the attempt of `item` was not counted.
    pub(crate) fn from_entry(entry: InboxEntry, item: &AttemptItem<'_>, grace: Duration) -> Claim {
        if entry.payload_hash != item.hash {
            return Claim::Conflict {
                status: entry.status,
            };
        }
        match entry.status {
            EntryStatus::Completed => Claim::Duplicate,
            EntryStatus::Dead => Claim::Dead {
                attempts: entry.attempts,
                last_error: entry.last_error,
            },
            EntryStatus::Pending if entry.superseded(item.attempt, item.scope, grace) => {
                Claim::Superseded {
                    by: entry.retried_to,
                }
            }
            EntryStatus::Pending => Claim::Exhausted {
                attempts: entry.attempts,
                last_error: entry.last_error,
            },
        }
    }
}

/// A value bound into a guard's `WHERE` clause.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum GuardValue {
    /// An integer id.
    Int(i64),
    /// A text id or state.
    Text(String),
}

impl From<i64> for GuardValue {
    fn from(v: i64) -> Self {
        GuardValue::Int(v)
    }
}

impl From<i32> for GuardValue {
    fn from(v: i32) -> Self {
        GuardValue::Int(v.into())
    }
}

impl From<&str> for GuardValue {
    fn from(v: &str) -> Self {
        GuardValue::Text(v.to_owned())
    }
}

impl From<String> for GuardValue {
    fn from(v: String) -> Self {
        GuardValue::Text(v)
    }
}

mod private {
    pub trait Sealed {}
    impl Sealed for sqlx::Postgres {}
    impl Sealed for sqlx::Sqlite {}
}

/// A database the inbox supports: PostgreSQL (production, many workers) or SQLite (embedded,
/// one process). Sealed; its methods are the runtime's, not part of the public API.
pub trait Backend: sqlx::Database + private::Sealed {
    #[doc(hidden)]
    const NAME: &'static str;

    #[doc(hidden)]
    fn placeholder(n: usize) -> String;

    #[doc(hidden)]
    fn check_config(names: &TableNames) -> Result<(), Error>;

    /// The statements on the table `names` describes (its `sql` field is not set yet).
    #[doc(hidden)]
    fn statements(names: &TableNames) -> Statements;

    #[doc(hidden)]
    fn migrate<'a>(pool: &'a Pool<Self>, names: &'a TableNames)
        -> BoxFuture<'a, Result<(), Error>>;

    /// The lock namespace of the (migrated) table as the database resolves it, whatever the
    /// configuration's spelling (PostgreSQL: `"schema"."table"` with the schema the name
    /// resolves to); `None` where the backend takes no database locks.
    #[doc(hidden)]
    fn lock_namespace<'a>(
        pool: &'a Pool<Self>,
        names: &'a TableNames,
    ) -> BoxFuture<'a, Result<Option<String>, Error>>;

    #[doc(hidden)]
    fn unlock_keys<'a>(
        conn: &'a mut Self::Connection,
        lock_ids: &'a [i64],
    ) -> BoxFuture<'a, Result<(), sqlx::Error>>;

    /// Takes the key's database lock (`lock_ids`: sorted, distinct; empty on SQLite), then
    /// counts an attempt, durably for a worker crash, before the handler runs. The item's
    /// `attempt` is the delivery's own attempt number
    /// ([`Delivery::attempt`](crate::Delivery::attempt)): a delivery that the row's newest
    /// retry copy supersedes ([`InboxEntry::superseded`]) is not counted.
    #[doc(hidden)]
    fn begin_attempt<'a>(
        conn: &'a mut Self::Connection,
        names: &'a TableNames,
        handler: &'a str,
        item: &'a AttemptItem<'a>,
        max_attempts: u32,
        lock_ids: &'a [i64],
    ) -> BoxFuture<'a, Result<Claim, sqlx::Error>>;

    /// [`Backend::begin_attempt`] for several distinct keys; claims in the same order.
    #[doc(hidden)]
    fn begin_attempts<'a>(
        conn: &'a mut Self::Connection,
        names: &'a TableNames,
        handler: &'a str,
        items: &'a [AttemptItem<'a>],
        max_attempts: u32,
        lock_ids: &'a [i64],
    ) -> BoxFuture<'a, Result<Vec<Claim>, sqlx::Error>> {
        Box::pin(async move {
            let mut claims = Vec::with_capacity(items.len());
            for (i, item) in items.iter().enumerate() {
                // All locks with the first claim, in order.
                let locks = if i == 0 { lock_ids } else { &[] };
                let claim =
                    Self::begin_attempt(conn, names, handler, item, max_attempts, locks).await?;
                claims.push(claim);
            }
            Ok(claims)
        })
    }

    /// [`Backend::complete`] for several keys (`keys[i]` counted as attempt `attempts[i]`),
    /// in the handler's transaction; returns how many were completed.
    #[doc(hidden)]
    #[allow(clippy::too_many_arguments)]
    fn complete_many<'a>(
        conn: &'a mut Self::Connection,
        names: &'a TableNames,
        handler: &'a str,
        keys: &'a [&'a str],
        attempts: &'a [u32],
        retention: Duration,
        unlock: &'a [i64],
    ) -> BoxFuture<'a, Result<u64, sqlx::Error>> {
        Box::pin(async move {
            let mut completed = 0;
            for (i, (key, attempt)) in keys.iter().zip(attempts).enumerate() {
                // All unlocks with the last key, once every row is marked.
                let unlock = if i + 1 == keys.len() { unlock } else { &[] };
                if Self::complete(conn, names, handler, key, *attempt, retention, unlock).await? {
                    completed += 1;
                }
            }
            Ok(completed)
        })
    }

    /// For a delivery never delivered before ([`Delivery::fresh`](crate::Delivery::fresh)),
    /// in the handler's transaction: inserts the key as completed (1 attempt) unless the key
    /// has a row, waiting for a transaction that is inserting it. `true` if this transaction
    /// inserted it; then its commit is the completion, and a rollback leaves no trace.
    #[doc(hidden)]
    fn claim_fresh<'a>(
        conn: &'a mut Self::Connection,
        names: &'a TableNames,
        handler: &'a str,
        key: &'a str,
        payload_hash: &'a str,
        retention: Duration,
    ) -> BoxFuture<'a, Result<bool, sqlx::Error>>;

    /// [`Backend::claim_fresh`] for several distinct keys (`(key, payload_hash)` pairs),
    /// in key order (so two batches sharing keys wait on each other, never deadlock);
    /// returns the keys that had a row already (not inserted): usually none, so the common
    /// case sends and decodes no keys back.
    #[doc(hidden)]
    fn claim_fresh_many<'a>(
        conn: &'a mut Self::Connection,
        names: &'a TableNames,
        handler: &'a str,
        items: &'a [(&'a str, &'a str)],
        retention: Duration,
    ) -> BoxFuture<'a, Result<Vec<String>, sqlx::Error>> {
        Box::pin(async move {
            let mut sorted: Vec<&(&str, &str)> = items.iter().collect();
            sorted.sort_unstable();
            let mut taken = Vec::new();
            for (key, hash) in sorted {
                if !Self::claim_fresh(conn, names, handler, key, hash, retention).await? {
                    taken.push((*key).to_owned());
                }
            }
            Ok(taken)
        })
    }

    /// A fresh delivery's attempt failed and rolled back its claim: counts that attempt
    /// (a pending row with 1 attempt) unless the key has a row by now.
    #[doc(hidden)]
    fn count_fresh_failure<'a>(
        conn: &'a mut Self::Connection,
        names: &'a TableNames,
        handler: &'a str,
        key: &'a str,
        payload_hash: &'a str,
    ) -> BoxFuture<'a, Result<(), sqlx::Error>>;

    /// Raises the log mark of (`handler`, `log`) to at least `to` in its own transaction,
    /// committed before it returns, and returns the mark before (`None`: never set). Two
    /// callers on one mark are serialised, so each sees what the other left.
    #[doc(hidden)]
    fn advance_log_mark<'a>(
        conn: &'a mut Self::Connection,
        names: &'a TableNames,
        handler: &'a str,
        log: &'a str,
        to: i64,
    ) -> BoxFuture<'a, Result<Option<i64>, sqlx::Error>>;

    #[doc(hidden)]
    fn log_mark<'a>(
        pool: &'a Pool<Self>,
        names: &'a TableNames,
        handler: &'a str,
        log: &'a str,
    ) -> BoxFuture<'a, Result<Option<i64>, sqlx::Error>>;

    /// Begins the handler's transaction, bounded by the handler's `timeout`: when the handler
    /// times out, its future is dropped, but a statement it had sent keeps running on the
    /// server, and the rollback waits for it. PostgreSQL sets `statement_timeout` and
    /// `lock_timeout` to `timeout` for the transaction, in the `BEGIN`'s own round trip, so
    /// the server ends such a statement within one timeout. SQLite has no such setting: a
    /// statement still running there delays the rollback until it ends (its waits for the
    /// write lock are bounded by the connection's `busy_timeout`).
    #[doc(hidden)]
    fn begin_handler(
        conn: &mut Self::Connection,
        timeout: Duration,
    ) -> BoxFuture<'_, Result<sqlx::Transaction<'_, Self>, sqlx::Error>>;

    /// Marks the key completed in the handler's transaction, if its row is still pending
    /// and counted at `attempt` (this attempt's own count): `false` if it is not, because
    /// another worker completed the key or counted another attempt on it meanwhile (a second
    /// inbox on the same table whose key locks this one does not see, say). The caller then
    /// rolls back: completing it anyway would commit a second run's effects.
    ///
    /// In the same statement it releases the database locks `unlock` (sorted lock ids; may
    /// be empty). Releasing them before the commit is safe: the row lock this update takes
    /// holds any other worker's attempt count on the key (and so its handler) until this
    /// transaction ends, and then that count sees the committed completion. It saves the
    /// unlock's round trip.
    #[doc(hidden)]
    #[allow(clippy::too_many_arguments)]
    fn complete<'a>(
        conn: &'a mut Self::Connection,
        names: &'a TableNames,
        handler: &'a str,
        key: &'a str,
        attempt: u32,
        retention: Duration,
        unlock: &'a [i64],
    ) -> BoxFuture<'a, Result<bool, sqlx::Error>>;

    /// A retry copy of the key's message carrying attempt number `attempt` is with the
    /// broker, on its way to the consumers named `scope`, due after `delay`: raises the
    /// pending row's [`InboxEntry::retried_to`] to it and records the scope and due time, so
    /// that a redelivery of an older copy through the same consumers is superseded while the
    /// copy can still arrive. Its own statement, committed before it returns.
    #[doc(hidden)]
    #[allow(clippy::too_many_arguments)]
    fn record_retry<'a>(
        pool: &'a Pool<Self>,
        names: &'a TableNames,
        handler: &'a str,
        key: &'a str,
        attempt: u32,
        scope: &'a str,
        delay: Duration,
    ) -> BoxFuture<'a, Result<(), sqlx::Error>>;

    /// Gives back the attempt counted at `attempt` whose outcome is unknown because its
    /// commit failed (a database failover): the key's pending row, still counted at
    /// `attempt`, goes back to `attempt - 1`. `false` if the row has moved on (it committed
    /// after all, or another attempt was counted).
    #[doc(hidden)]
    fn uncount_attempt<'a>(
        pool: &'a Pool<Self>,
        names: &'a TableNames,
        handler: &'a str,
        key: &'a str,
        attempt: u32,
    ) -> BoxFuture<'a, Result<bool, sqlx::Error>>;

    /// Records a failed attempt's error; `dead`: the key is dead-lettered, and its row then
    /// expires after `retention`, like a completed one.
    #[doc(hidden)]
    #[allow(clippy::too_many_arguments)]
    fn record_failure<'a>(
        conn: &'a mut Self::Connection,
        names: &'a TableNames,
        handler: &'a str,
        key: &'a str,
        error: &'a str,
        dead: bool,
        retention: Duration,
    ) -> BoxFuture<'a, Result<(), sqlx::Error>>;

    /// Deletes the key's row if it is dead; `true` if it was.
    #[doc(hidden)]
    fn release_dead<'a>(
        pool: &'a Pool<Self>,
        names: &'a TableNames,
        handler: &'a str,
        key: &'a str,
    ) -> BoxFuture<'a, Result<bool, sqlx::Error>>;

    #[doc(hidden)]
    fn entry<'a>(
        pool: &'a Pool<Self>,
        names: &'a TableNames,
        handler: &'a str,
        key: &'a str,
    ) -> BoxFuture<'a, Result<Option<InboxEntry>, sqlx::Error>>;

    /// The rows of `handler` by status, and the idle time of its stalest pending row.
    #[doc(hidden)]
    fn counts<'a>(
        pool: &'a Pool<Self>,
        names: &'a TableNames,
        handler: &'a str,
    ) -> BoxFuture<'a, Result<InboxCounts, sqlx::Error>>;

    #[doc(hidden)]
    fn purge_expired<'a>(
        pool: &'a Pool<Self>,
        names: &'a TableNames,
        batch: u32,
    ) -> BoxFuture<'a, Result<u64, sqlx::Error>>;

    #[doc(hidden)]
    fn execute_guard<'a>(
        conn: &'a mut Self::Connection,
        sql: &'a str,
        args: Vec<GuardValue>,
    ) -> BoxFuture<'a, Result<u64, sqlx::Error>>;
}

/// The inbox on a connection pool. Cheap to clone.
pub struct Inbox<DB: Backend> {
    pool: Pool<DB>,
    names: Arc<TableNames>,
    locks: Arc<KeyLocks>,
}

impl<DB: Backend> Clone for Inbox<DB> {
    fn clone(&self) -> Self {
        Inbox {
            pool: self.pool.clone(),
            names: self.names.clone(),
            locks: self.locks.clone(),
        }
    }
}

impl<DB: Backend> std::fmt::Debug for Inbox<DB> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Inbox")
            .field("backend", &<DB as Backend>::NAME)
            .field("table", &self.names.inbox)
            .finish_non_exhaustive()
    }
}

impl<DB: Backend> Inbox<DB> {
    /// Validates `config`, runs the shipped migrations (idempotent, safe to race between
    /// workers) and returns the inbox. A bad name fails here, naming the field.
    pub async fn new(pool: Pool<DB>, config: InboxConfig) -> Result<Self, Error> {
        let mut names = TableNames::new(&config)?;
        DB::check_config(&names)?;
        names.sql = DB::statements(&names);
        DB::migrate(&pool, &names).await?;
        if let Some(namespace) = DB::lock_namespace(&pool, &names).await? {
            names.lock_namespace = namespace;
        }
        Ok(Inbox {
            pool,
            names: Arc::new(names),
            locks: Arc::new(KeyLocks::default()),
        })
    }

    /// The pool: use it for your own queries outside handlers.
    pub fn pool(&self) -> &Pool<DB> {
        &self.pool
    }

    /// The quoted, qualified inbox table name.
    pub fn table(&self) -> &str {
        &self.names.inbox
    }

    /// The row for (`handler`, `key`), if any.
    pub async fn entry(&self, handler: &str, key: &str) -> Result<Option<InboxEntry>, Error> {
        Ok(DB::entry(&self.pool, &self.names, handler, key).await?)
    }

    /// Releases a dead-lettered key for a replay: deletes its row if it is `dead`, so the
    /// next delivery of the key (the replayed dead letter) runs as a new message. `false`
    /// (nothing changed) if the key is not dead: a completed key stays a duplicate, a pending
    /// one stays with the delivery that holds it.
    ///
    /// Replay the dead letter after this returns; a replay that arrives first is dead-lettered
    /// again, with the recorded reason.
    pub async fn release(&self, handler: &str, key: &str) -> Result<bool, Error> {
        Ok(DB::release_dead(&self.pool, &self.names, handler, key).await?)
    }

    /// How many keys of `handler` are pending, completed and dead, and how long the stalest
    /// pending key has seen no attempt. A pending key that stays idle long past its backoff
    /// has lost its message (its copy never arrived, its delivery was acked elsewhere): look
    /// at it (`Inbox::entry`) and replay or release it. Reads every row of the handler: an
    /// operator's call, not one for a hot path.
    pub async fn counts(&self, handler: &str) -> Result<InboxCounts, Error> {
        Ok(DB::counts(&self.pool, &self.names, handler).await?)
    }

    /// Deletes completed and dead rows whose retention has expired, `batch` rows per
    /// statement, until none are left. Returns how many were deleted.
    pub async fn purge_expired(&self, batch: u32) -> Result<u64, Error> {
        let batch = batch.max(1);
        let mut total = 0;
        loop {
            let n = DB::purge_expired(&self.pool, &self.names, batch).await?;
            total += n;
            if n < u64::from(batch) {
                return Ok(total);
            }
        }
    }

    /// The log mark of (`handler`, `log`): at least the highest offset of that log the
    /// handler may have been handed (see [`crate::LogPosition`]); `None` if never set.
    pub async fn log_mark(&self, handler: &str, log: &str) -> Result<Option<i64>, Error> {
        Ok(DB::log_mark(&self.pool, &self.names, handler, log).await?)
    }

    /// See [`Backend::record_retry`].
    pub(crate) async fn record_retry(
        &self,
        handler: &str,
        key: &str,
        attempt: u32,
        scope: &str,
        delay: Duration,
    ) -> Result<(), sqlx::Error> {
        DB::record_retry(&self.pool, &self.names, handler, key, attempt, scope, delay).await
    }

    /// See [`Backend::uncount_attempt`].
    pub(crate) async fn uncount_attempt(
        &self,
        handler: &str,
        key: &str,
        attempt: u32,
    ) -> Result<bool, sqlx::Error> {
        DB::uncount_attempt(&self.pool, &self.names, handler, key, attempt).await
    }

    /// See [`Backend::advance_log_mark`].
    pub(crate) async fn advance_log_mark(
        &self,
        handler: &str,
        log: &str,
        to: i64,
    ) -> Result<Option<i64>, sqlx::Error> {
        // A lease without key locks: if this is cancelled mid-transaction, the connection is
        // closed, not pooled (see [`Lease`]).
        let mut lease = self.lease_many(handler, &[] as &[&str]).await?;
        let before = DB::advance_log_mark(lease.conn(), &self.names, handler, log, to).await?;
        lease.release().await;
        Ok(before)
    }

    pub(crate) fn names(&self) -> &TableNames {
        &self.names
    }

    /// Takes the per-key lock (in process, then in the database) on a pooled connection.
    pub(crate) async fn lease(&self, handler: &str, key: &str) -> Result<Lease<DB>, sqlx::Error> {
        self.lease_many(handler, std::slice::from_ref(&key)).await
    }

    /// Takes the in-process locks of several keys, always in ascending lock id order so that
    /// two batches sharing keys cannot deadlock, and a connection. The database locks are
    /// taken by the first statement on it ([`Lease::locking`]).
    pub(crate) async fn lease_many(
        &self,
        handler: &str,
        keys: &[impl AsRef<str>],
    ) -> Result<Lease<DB>, sqlx::Error> {
        let mut lock_ids: Vec<i64> = keys
            .iter()
            .map(|k| lock_id(&self.names.lock_namespace, handler, k.as_ref()))
            .collect();
        lock_ids.sort_unstable();
        lock_ids.dedup();
        let local = self.locks.lock_many(&lock_ids).await;
        let conn = self.pool.acquire().await?;
        Ok(Lease {
            conn: Some(conn),
            released: false,
            db_locked: false,
            lock_ids,
            _local: local,
        })
    }
}

impl Inbox<sqlx::Sqlite> {
    /// The embedded default: an SQLite file at `path` (created if missing) in WAL mode, with
    /// the default table.
    pub async fn open_sqlite(path: impl AsRef<std::path::Path>) -> Result<Self, Error> {
        use sqlx::sqlite::{SqliteConnectOptions, SqliteJournalMode, SqlitePoolOptions};
        let options = SqliteConnectOptions::new()
            .filename(path)
            .create_if_missing(true)
            .journal_mode(SqliteJournalMode::Wal)
            .busy_timeout(Duration::from_secs(30));
        let pool = SqlitePoolOptions::new()
            .max_connections(4)
            .connect_with(options)
            .await?;
        Inbox::new(pool, InboxConfig::default()).await
    }
}

/// A pooled connection holding the key's lock.
///
/// Dropped without [`Lease::release`] (a crash simulation, a cancelled task), it closes its
/// connection instead of returning it to the pool: a pooled connection would keep the
/// PostgreSQL session lock and block its key for good, and a task cancelled just after its
/// `BEGIN` ran (before it got the transaction back) leaves the connection inside a
/// transaction nobody can end (sqlx's SQLite connection then refuses every later `BEGIN`).
pub(crate) struct Lease<DB: Backend> {
    conn: Option<PoolConnection<DB>>,
    /// [`Lease::release`] ran: the connection was used to the end and may be pooled again.
    released: bool,
    db_locked: bool,
    lock_ids: Vec<i64>,
    _local: locks::LocalGuards,
}

impl<DB: Backend> Lease<DB> {
    pub(crate) fn conn(&mut self) -> &mut DB::Connection {
        match self.conn.as_mut() {
            Some(c) => c,
            None => unreachable!("the connection is only taken in Drop"),
        }
    }

    /// The connection and the lock ids, for the statement that takes the database locks.
    /// From here on, dropping the lease closes the connection (see the type's doc).
    pub(crate) fn locking(&mut self) -> (&mut DB::Connection, &[i64]) {
        // Pessimistic: if the statement is dropped while in flight, the server may still
        // grant the locks, so the connection must not go back to the pool.
        self.db_locked = true;
        match self.conn.as_mut() {
            Some(c) => (c, &self.lock_ids),
            None => unreachable!("the connection is only taken in Drop"),
        }
    }

    /// The connection and the lock ids still held in the database (none once released),
    /// for a statement that releases them ([`Backend::complete`]).
    pub(crate) fn held(&mut self) -> (&mut DB::Connection, &[i64]) {
        let held: &[i64] = if self.db_locked { &self.lock_ids } else { &[] };
        match self.conn.as_mut() {
            Some(c) => (c, held),
            None => unreachable!("the connection is only taken in Drop"),
        }
    }

    /// A statement released the database locks: [`Lease::release`] has nothing left to do
    /// in the database, and the connection may go back to the pool even if dropped.
    pub(crate) fn released_in_db(&mut self) {
        self.db_locked = false;
    }

    /// Releases the database lock; the connection goes back to the pool.
    pub(crate) async fn release(mut self) {
        self.released = true;
        if !self.db_locked {
            return;
        }
        let lock_ids = std::mem::take(&mut self.lock_ids);
        match DB::unlock_keys(self.conn(), &lock_ids).await {
            Ok(()) => self.db_locked = false,
            Err(e) => tracing::warn!(error = %e, "could not release key lock; closing connection"),
        }
    }
}

impl<DB: Backend> Drop for Lease<DB> {
    fn drop(&mut self) {
        if let (true, Some(conn)) = (self.db_locked || !self.released, self.conn.as_mut()) {
            conn.close_on_drop();
        }
    }
}

/// The first 8 bytes of the SHA-256 of (namespace, handler, key), big-endian. Workers of
/// different versions must agree on it: keep it stable.
fn lock_id(namespace: &str, handler: &str, key: &str) -> i64 {
    let digest = crate::key::sha256(&[namespace.as_bytes(), handler.as_bytes(), key.as_bytes()]);
    let mut first = [0u8; 8];
    first.copy_from_slice(&digest[..8]);
    i64::from_be_bytes(first)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A task cancelled just after its `BEGIN` ran, before it got the transaction back,
    /// leaves the connection inside a transaction no one can end; its lease, dropped
    /// unreleased, must not hand that connection to the next delivery.
    #[tokio::test]
    async fn a_lease_dropped_unreleased_does_not_pool_its_connection() {
        use sqlx::sqlite::SqlitePoolOptions;
        let pool = SqlitePoolOptions::new()
            .max_connections(1)
            .connect("sqlite::memory:")
            .await
            .unwrap();
        let inbox = Inbox::new(pool, InboxConfig::default()).await.unwrap();
        {
            let mut lease = inbox.lease("h", "k").await.unwrap();
            let tx = <sqlx::Sqlite as Backend>::begin_handler(lease.conn(), Duration::from_secs(1))
                .await
                .unwrap();
            // The transaction's owner is gone without a rollback, as after that cancellation.
            std::mem::forget(tx);
        }
        let mut lease = inbox.lease("h", "k").await.unwrap();
        let tx =
            <sqlx::Sqlite as Backend>::begin_handler(lease.conn(), Duration::from_secs(1)).await;
        assert!(tx.is_ok(), "{:?}", tx.err());
    }

    #[test]
    fn lock_ids_are_stable() {
        // Workers of different versions lock the same key: this value must never change.
        assert_eq!(
            lock_id("\"consumer_inbox\"", "bench", "m-1"),
            5434538691312428815
        );
    }
}
