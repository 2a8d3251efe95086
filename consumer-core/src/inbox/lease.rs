//! Leases: a pooled connection holding keys' locks, and how an [`Inbox`] hands them out.

use std::sync::Arc;
use std::time::Instant;

use sqlx::pool::PoolConnection;

use super::backend::Backend;
use super::handle::Inbox;
use super::kept::Kept;
use super::locks::{self, lock_id};

impl<DB: Backend> Inbox<DB> {
    /// Takes the in-process locks `local_ids` (the keys' ids from [`Inbox::local_lock_id`],
    /// in any order) always in ascending order, so that two batches sharing keys cannot
    /// deadlock, and a connection. The lease also carries the database lock ids of `db_keys`
    /// (sorted), which the first statement on it takes ([`Lease::locking`]); with none, it
    /// takes none and computes none. With `kept`, the connection is one kept there if there
    /// is one, and the lease's release keeps it there again (see [`Kept`]).
    pub(crate) async fn lease_ids(
        &self,
        handler: &str,
        local_ids: Vec<i64>,
        db_keys: &[impl AsRef<str>],
        kept: Option<&Arc<Kept<DB>>>,
    ) -> Result<Lease<DB>, sqlx::Error> {
        let local_ids = sorted(local_ids);
        let namespace = &self.names.lock_namespace;
        let lock_ids = sorted(
            db_keys
                .iter()
                .map(|k| lock_id(namespace, handler, k.as_ref()))
                .collect(),
        );
        let local = self.locks.lock_many(&local_ids).await;
        let (conn, kept_since) = match kept.and_then(|k| k.take()) {
            Some((conn, since)) => (conn, Some(since)),
            None => (self.pool.acquire().await?, None),
        };
        Ok(Lease {
            conn: Some(conn),
            kept: kept.cloned(),
            kept_since,
            spoiled: false,
            released: false,
            db_locked: false,
            lock_ids,
            _local: local,
        })
    }

    /// The id `key` of `handler` is locked by in this process (see [`Inbox::lease_ids`]).
    pub(crate) fn local_lock_id(&self, handler: &str, key: &str) -> i64 {
        self.locks.local_id(handler, key)
    }
}

/// `ids` in ascending order, each once: the order every lease takes its locks in.
fn sorted(mut ids: Vec<i64>) -> Vec<i64> {
    ids.sort_unstable();
    ids.dedup();
    ids
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
    /// Where a clean release keeps the connection, if anywhere.
    kept: Option<Arc<Kept<DB>>>,
    /// When `kept` first kept the connection, if it came from there.
    kept_since: Option<Instant>,
    /// A database error was met on the connection ([`Lease::spoil`]): it goes back to the
    /// pool, which checks it, rather than to `kept`.
    spoiled: bool,
    /// [`Lease::release`] ran: the connection was used to the end and may be pooled again.
    released: bool,
    db_locked: bool,
    /// The keys' database lock ids, sorted; empty for a lease made without them.
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

    /// The connection and the lock ids, for the statement that takes the database locks
    /// (of a lease made with `db_locks`). From here on, dropping the lease closes the
    /// connection (see the type's doc).
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

    /// A database error was met on the connection: its release gives it back to the pool,
    /// which checks it before handing it out again, rather than keep it.
    pub(crate) fn spoil(&mut self) {
        self.spoiled = true;
    }

    /// Releases the database lock; the connection goes back to the pool, or to the lease's
    /// [`Kept`] if it has one and the connection is clean.
    pub(crate) async fn release(mut self) {
        self.released = true;
        if self.db_locked {
            let lock_ids = std::mem::take(&mut self.lock_ids);
            match DB::unlock_keys(self.conn(), &lock_ids).await {
                Ok(()) => self.db_locked = false,
                Err(e) => {
                    tracing::warn!(error = %e, "could not release key lock; closing connection");
                    return;
                }
            }
        }
        if self.spoiled {
            return;
        }
        if let (Some(kept), Some(conn)) = (self.kept.take(), self.conn.take()) {
            kept.keep(conn, self.kept_since);
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
