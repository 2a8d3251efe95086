//! The sealed [`Backend`] trait: what the runtime asks of a database, and the values a guard
//! binds through it.

use std::time::Duration;

use futures::future::BoxFuture;
use sqlx::Pool;

use super::claim::{AttemptItem, Claim};
use super::config::{Statements, TableNames};
use super::dead_letter_store::DeadLetterStore;
use super::dialect::{Arg, Execute};
use super::entry::{InboxCounts, InboxEntry};
use super::flow;
use super::outbox_store::OutboxStore;
use crate::Error;

/// A value bound into a guard's `WHERE` clause.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum GuardValue {
    /// An integer id.
    Int(i64),
    /// A text id or state.
    Text(String),
}

impl GuardValue {
    /// As an inbox statement binds it.
    fn arg(&self) -> Arg<'_> {
        match self {
            GuardValue::Int(v) => Arg::Int(*v),
            GuardValue::Text(v) => Arg::Text(v),
        }
    }
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

// What both databases do alike is written once, in the provided methods: they run the
// shared operations (`flow`) on the dialect's statements through `Execute`. Each database
// implements the rest, and overrides what it does its own way. The supertrait cannot be
// named outside this crate, which seals the trait.

/// A database the inbox supports: PostgreSQL (production, many workers) or SQLite (embedded,
/// one process). Sealed; its methods are the runtime's, not part of the public API.
pub trait Backend: Execute + OutboxStore + DeadLetterStore {
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
    /// ([`Delivery::attempt`](crate::transport::Delivery::attempt)): a delivery that the row's
    /// newest retry copy supersedes ([`InboxEntry::superseded`]) is not counted.
    #[doc(hidden)]
    fn begin_attempt<'a>(
        conn: &'a mut Self::Connection,
        names: &'a TableNames,
        handler: &'a str,
        item: &'a AttemptItem<'a>,
        max_attempts: u32,
        lock_ids: &'a [i64],
    ) -> BoxFuture<'a, Result<Claim, sqlx::Error>> {
        Box::pin(flow::begin_attempt::<Self>(
            conn,
            names,
            handler,
            item,
            max_attempts,
            lock_ids,
        ))
    }

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

    /// For a delivery never delivered before
    /// ([`Delivery::fresh`](crate::transport::Delivery::fresh)), in the handler's transaction:
    /// inserts the key as completed (1 attempt) unless the key has a row, waiting for a transaction
    /// that is inserting it. `true` if this transaction inserted it; then its commit is the
    /// completion, and a rollback leaves no trace.
    #[doc(hidden)]
    fn claim_fresh<'a>(
        conn: &'a mut Self::Connection,
        names: &'a TableNames,
        handler: &'a str,
        key: &'a str,
        payload_hash: &'a str,
        retention: Duration,
    ) -> BoxFuture<'a, Result<bool, sqlx::Error>> {
        Box::pin(flow::claim_fresh::<Self>(
            conn,
            names,
            handler,
            key,
            payload_hash,
            retention,
        ))
    }

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

    /// [`Backend::claim_fresh_many`] for a batch whose keys are expected to have no rows
    /// (the usual case of fresh deliveries): a backend may claim them with a plain insert,
    /// which costs the database less than one that tolerates rows, and then fails with a
    /// unique violation if a key has a row after all. That leaves the transaction to be
    /// rolled back; the caller claims again with [`Backend::claim_fresh_many`] in a new one.
    /// By default the same as [`Backend::claim_fresh_many`].
    #[doc(hidden)]
    fn claim_new_many<'a>(
        conn: &'a mut Self::Connection,
        names: &'a TableNames,
        handler: &'a str,
        items: &'a [(&'a str, &'a str)],
        retention: Duration,
    ) -> BoxFuture<'a, Result<Vec<String>, sqlx::Error>> {
        Self::claim_fresh_many(conn, names, handler, items, retention)
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
    ) -> BoxFuture<'a, Result<(), sqlx::Error>> {
        Box::pin(flow::count_fresh_failure::<Self>(
            conn,
            names,
            handler,
            key,
            payload_hash,
        ))
    }

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
    ) -> BoxFuture<'a, Result<Option<i64>, sqlx::Error>> {
        Box::pin(flow::advance_log_mark::<Self>(
            conn, names, handler, log, to,
        ))
    }

    #[doc(hidden)]
    fn log_mark<'a>(
        pool: &'a Pool<Self>,
        names: &'a TableNames,
        handler: &'a str,
        log: &'a str,
    ) -> BoxFuture<'a, Result<Option<i64>, sqlx::Error>> {
        Box::pin(flow::log_mark(pool, names, handler, log))
    }

    /// Begins the handler's transaction, bounded by the handler's `timeout`: when the handler
    /// times out, its future is dropped, but a statement it had sent keeps running on the
    /// server, and the rollback waits for it. PostgreSQL sets `statement_timeout` to
    /// `timeout` for the transaction, in the `BEGIN`'s own round trip, so the server ends
    /// such a statement, or its wait for a lock, within one timeout. SQLite has no such setting: a
    /// statement still running there delays the rollback until it ends (its waits for the
    /// write lock are bounded by the connection's `busy_timeout`).
    #[doc(hidden)]
    fn begin_handler(
        conn: &mut Self::Connection,
        timeout: Duration,
    ) -> BoxFuture<'_, Result<sqlx::Transaction<'_, Self>, sqlx::Error>>;

    /// Fails if the handler's transaction can no longer commit what it wrote. PostgreSQL
    /// aborts a transaction at its first failed statement: every later statement fails, and
    /// `COMMIT` then rolls back without an error. A handler that ignores a failed statement
    /// and returns `Ok` would have its message acked with nothing committed. On an aborted
    /// transaction this check fails with SQLSTATE `25P02` (`in_failed_sql_transaction`), one round
    /// trip. SQLite undoes a failed statement alone and keeps the transaction, so it has
    /// nothing to check (where it does roll the whole transaction back, its `COMMIT` fails).
    #[doc(hidden)]
    fn check_not_aborted<'a>(
        conn: &'a mut Self::Connection,
    ) -> BoxFuture<'a, Result<(), sqlx::Error>> {
        let _ = conn;
        Box::pin(async { Ok(()) })
    }

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
    ) -> BoxFuture<'a, Result<bool, sqlx::Error>> {
        // Without database locks (SQLite) there is nothing to release; PostgreSQL overrides
        // this to release its advisory locks in the completing statement.
        let _ = unlock;
        Box::pin(flow::complete::<Self>(
            conn, names, handler, key, attempt, retention,
        ))
    }

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
    ) -> BoxFuture<'a, Result<(), sqlx::Error>> {
        Box::pin(flow::record_retry(
            pool, names, handler, key, attempt, scope, delay,
        ))
    }

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
    ) -> BoxFuture<'a, Result<bool, sqlx::Error>> {
        Box::pin(flow::uncount_attempt(pool, names, handler, key, attempt))
    }

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
    ) -> BoxFuture<'a, Result<(), sqlx::Error>> {
        Box::pin(flow::record_failure::<Self>(
            conn, names, handler, key, error, dead, retention,
        ))
    }

    /// Deletes the key's row if it is dead; `true` if it was.
    #[doc(hidden)]
    fn release_dead<'a>(
        pool: &'a Pool<Self>,
        names: &'a TableNames,
        handler: &'a str,
        key: &'a str,
    ) -> BoxFuture<'a, Result<bool, sqlx::Error>> {
        Box::pin(flow::release_dead(pool, names, handler, key))
    }

    #[doc(hidden)]
    fn entry<'a>(
        pool: &'a Pool<Self>,
        names: &'a TableNames,
        handler: &'a str,
        key: &'a str,
    ) -> BoxFuture<'a, Result<Option<InboxEntry>, sqlx::Error>> {
        Box::pin(flow::entry(pool, names, handler, key))
    }

    /// The rows of `handler` by status, and the idle time of its stalest pending row.
    #[doc(hidden)]
    fn counts<'a>(
        pool: &'a Pool<Self>,
        names: &'a TableNames,
        handler: &'a str,
    ) -> BoxFuture<'a, Result<InboxCounts, sqlx::Error>> {
        Box::pin(flow::counts(pool, names, handler))
    }

    /// Every handler with rows, and how many.
    #[doc(hidden)]
    fn handlers<'a>(
        pool: &'a Pool<Self>,
        names: &'a TableNames,
    ) -> BoxFuture<'a, Result<Vec<(String, u64)>, sqlx::Error>> {
        Box::pin(flow::handlers(pool, names))
    }

    /// Deletes (or counts) the rows of one status not updated for a while.
    #[doc(hidden)]
    fn purge_older<'a>(
        pool: &'a Pool<Self>,
        names: &'a TableNames,
        status: &'a str,
        older_than: Duration,
        dry_run: bool,
    ) -> BoxFuture<'a, Result<u64, sqlx::Error>> {
        Box::pin(flow::purge_older(pool, names, status, older_than, dry_run))
    }

    #[doc(hidden)]
    fn purge_expired<'a>(
        pool: &'a Pool<Self>,
        names: &'a TableNames,
        batch: u32,
    ) -> BoxFuture<'a, Result<u64, sqlx::Error>> {
        Box::pin(flow::purge_expired(pool, names, batch))
    }

    /// Deletes up to `batch` pending rows of `handlers` that no copy of their message can
    /// still reach; how many it deleted. A row qualifies when nothing has updated it for
    /// `retention` (no attempt counted, no failure or retry copy recorded) and its newest
    /// retry copy, if it has one, was due longer ago than `retention` plus the inbox's copy
    /// grace.
    ///
    /// Why that is safe: a pending row records no effect (a key's effects commit only with
    /// its completion), so deleting it can never make an effect happen twice. What it does
    /// for a message still on its way is count the attempts and let a newer copy supersede
    /// an older delivery; past its copy's due time and grace the copy is taken as lost
    /// already (see [`InboxConfig::copy_grace`](crate::InboxConfig::copy_grace)), and a
    /// delivery that still arrives afterwards runs as a new message, with its attempts
    /// counted from one. The worker refuses a retention not longer than the handler's
    /// timeout, so an attempt in flight always has a recent row.
    #[doc(hidden)]
    fn purge_stale_pending<'a>(
        pool: &'a Pool<Self>,
        names: &'a TableNames,
        handlers: &'a [String],
        retention: Duration,
        batch: u32,
    ) -> BoxFuture<'a, Result<u64, sqlx::Error>> {
        Box::pin(flow::purge_stale_pending(
            pool, names, handlers, retention, batch,
        ))
    }

    #[doc(hidden)]
    fn execute_guard<'a>(
        conn: &'a mut Self::Connection,
        sql: &'a str,
        args: Vec<GuardValue>,
    ) -> BoxFuture<'a, Result<u64, sqlx::Error>> {
        Box::pin(async move {
            let args: Vec<Arg<'_>> = args.iter().map(GuardValue::arg).collect();
            Self::execute(conn, sql, &args).await
        })
    }
}

/// Whether a statement failed because its transaction had been aborted by an earlier
/// failed statement (PostgreSQL's SQLSTATE `25P02`, `in_failed_sql_transaction`): the
/// code that ran that statement and went on failed, not the database. The runtime counts
/// it as the handler's failed attempt; the HTTP layer answers it as the handler's error.
pub fn is_aborted(e: &sqlx::Error) -> bool {
    e.as_database_error()
        .and_then(|d| d.code())
        .is_some_and(|code| code == "25P02")
}
