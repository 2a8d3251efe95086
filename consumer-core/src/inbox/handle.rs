//! The [`Inbox`] handle: a pool and a table, and the operator's calls on them.

use std::sync::Arc;
use std::time::Duration;

use sqlx::Pool;

use super::backend::Backend;
use super::config::{InboxConfig, TableNames};
use super::dead_letter_store::{LetterToKeep, StoredDeadLetter};
use super::entry::{EntryStatus, InboxCounts, InboxEntry};
use super::locks::KeyLocks;
use crate::Error;

/// The inbox on a connection pool. Cheap to clone.
pub struct Inbox<DB: Backend> {
    pub(crate) pool: Pool<DB>,
    pub(crate) names: Arc<TableNames>,
    pub(super) locks: Arc<KeyLocks>,
    /// Wakes this process's outbox relays after a commit that wrote outbox rows.
    pub(crate) outbox_written: Arc<tokio::sync::Notify>,
}

impl<DB: Backend> Clone for Inbox<DB> {
    fn clone(&self) -> Self {
        Inbox {
            pool: self.pool.clone(),
            names: self.names.clone(),
            locks: self.locks.clone(),
            outbox_written: self.outbox_written.clone(),
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
        names.outbox_sql = DB::outbox_sql(&names);
        names.dead_letter_sql = DB::dead_letter_sql(&names);
        DB::migrate(&pool, &names).await?;
        if let Some(namespace) = DB::lock_namespace(&pool, &names).await? {
            names.lock_namespace = namespace;
        }
        Ok(Inbox {
            pool,
            names: Arc::new(names),
            locks: Arc::new(KeyLocks::default()),
            outbox_written: Arc::default(),
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

    /// Wakes this process's relays: rows were committed to the outbox.
    pub(crate) fn outbox_written(&self) {
        self.outbox_written.notify_one();
    }

    /// Keeps a dead letter in the dead-letter table, or counts one more delivery on the row
    /// of the same message.
    pub(crate) async fn keep_dead_letter(
        &self,
        letter: LetterToKeep<'_>,
    ) -> Result<(), sqlx::Error> {
        DB::dead_letter_keep(&self.pool, &self.names, letter).await
    }

    /// The dead letters kept in this inbox's dead-letter table, oldest first: those of the
    /// transports that have no dead-letter destination of their own (the webhook ingress,
    /// the in-memory broker; see [`crate::transport::Acknowledger::keeps_dead_letters`]). Each
    /// keeps the whole message until it is discarded ([`Inbox::discard_dead_letter`]).
    pub async fn dead_letters(&self) -> Result<Vec<StoredDeadLetter>, Error> {
        Ok(DB::dead_letter_list(&self.pool, &self.names).await?)
    }

    /// The kept dead letter `id`, if there is one.
    pub async fn dead_letter(&self, id: i64) -> Result<Option<StoredDeadLetter>, Error> {
        Ok(DB::dead_letter_fetch(&self.pool, &self.names, id).await?)
    }

    /// Deletes the kept dead letter `id` for good (after a replay, or to drop it); whether
    /// it was there.
    pub async fn discard_dead_letter(&self, id: i64) -> Result<bool, Error> {
        Ok(DB::dead_letter_delete(&self.pool, &self.names, id).await?)
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

    /// Every handler with rows in the inbox, sorted by name, with how many rows it has.
    pub async fn handlers(&self) -> Result<Vec<(String, u64)>, Error> {
        Ok(DB::handlers(&self.pool, &self.names).await?)
    }

    /// Deletes the rows of `status` (completed or dead) that nothing has updated for
    /// `older_than` or longer (zero takes every one), whatever their retention, and returns
    /// how many; with `dry_run` only counts them. Pending rows are refused: they belong to
    /// messages still on their way (use [`Inbox::release`] for one dead key).
    pub async fn purge_older(
        &self,
        status: EntryStatus,
        older_than: std::time::Duration,
        dry_run: bool,
    ) -> Result<u64, Error> {
        let status = match status {
            EntryStatus::Completed => "completed",
            EntryStatus::Dead => "dead",
            EntryStatus::Pending => {
                return Err(Error::config(
                    "status",
                    "pending rows cannot be purged: their messages are still on their way",
                ))
            }
        };
        Ok(DB::purge_older(&self.pool, &self.names, status, older_than, dry_run).await?)
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

    /// Deletes the pending rows of `handlers` (a handler's name and its aliases) that no
    /// copy of their message can still reach, `batch` rows per statement, until none are
    /// left; how many were deleted. See [`WorkerConfig::pending_retention`](crate::WorkerConfig::pending_retention)
    /// for the rule and why it is safe.
    pub(crate) async fn purge_stale_pending(
        &self,
        handlers: &[String],
        retention: Duration,
        batch: u32,
    ) -> Result<u64, Error> {
        let batch = batch.max(1);
        let mut total = 0;
        loop {
            let n = DB::purge_stale_pending(&self.pool, &self.names, handlers, retention, batch)
                .await?;
            total += n;
            if n < u64::from(batch) {
                return Ok(total);
            }
        }
    }

    /// The log mark of (`handler`, `log`): at least the highest offset of that log the
    /// handler may have been handed (see [`crate::transport::LogPosition`]); `None` if never set.
    pub async fn log_mark(&self, handler: &str, log: &str) -> Result<Option<i64>, Error> {
        Ok(DB::log_mark(&self.pool, &self.names, handler, log).await?)
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
        let mut lease = self
            .lease_ids(handler, Vec::new(), &[] as &[&str], None)
            .await?;
        let before = DB::advance_log_mark(lease.conn(), &self.names, handler, log, to).await?;
        lease.release().await;
        Ok(before)
    }

    /// This inbox as a worker of a handler with the former names `aliases` uses it: its
    /// claims adopt a key's row found under an alias (see [`crate::HandlerOptions::alias`]).
    /// The same handle when there are none.
    pub(crate) fn serving(&self, aliases: &[String]) -> Self {
        let mut inbox = self.clone();
        if !aliases.is_empty() {
            let mut names = TableNames::clone(&self.names);
            names.aliases = aliases.to_vec();
            inbox.names = Arc::new(names);
        }
        inbox
    }

    /// The validated names and the statements rendered on them, for the runtime's calls on
    /// the backend.
    pub(crate) fn names(&self) -> &TableNames {
        &self.names
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
        let key = || vec![inbox.local_lock_id("h", "k")];
        {
            let mut lease = inbox
                .lease_ids("h", key(), &[] as &[&str], None)
                .await
                .unwrap();
            let tx = <sqlx::Sqlite as Backend>::begin_handler(lease.conn(), Duration::from_secs(1))
                .await
                .unwrap();
            // The transaction's owner is gone without a rollback, as after that cancellation.
            std::mem::forget(tx);
        }
        let mut lease = inbox
            .lease_ids("h", key(), &[] as &[&str], None)
            .await
            .unwrap();
        let tx =
            <sqlx::Sqlite as Backend>::begin_handler(lease.conn(), Duration::from_secs(1)).await;
        assert!(tx.is_ok(), "{:?}", tx.err());
    }
}
