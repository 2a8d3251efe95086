//! Connections a worker's leases gave back clean, kept out of the pool for its next lease.
//!
//! sqlx checks a connection with a round trip each time its pool hands it out (a ping, with
//! the default `test_before_acquire`) and each time it takes it back (a ping that also
//! flushes a dropped transaction's rollback). A worker that takes a connection for every
//! transaction pays both, on top of `BEGIN`, its statements and `COMMIT`: in per-message
//! mode that is two round trips in six. A worker keeps the connections its leases release
//! clean and gives them to its next leases instead, without either check, and gives them
//! back to the pool whenever one of these holds:
//!
//! - the connection is not clean: a statement is still queued on it (a dropped
//!   transaction's rollback) or it is inside a transaction, or a database error was met on
//!   it ([`Lease::spoil`](super::Lease::spoil));
//! - the pool has no other idle connection: someone else may be waiting for one, or would
//!   open a new one, so it goes back to the pool, as it did before;
//! - the worker keeps its concurrency's worth already;
//! - it was kept unused for [`Kept::IDLE`]: an idle worker holds none for long, and a
//!   connection that may have gone stale is checked by the pool again;
//! - it has been in the worker's hands, used and kept over and over, for [`Kept::AT_MOST`]:
//!   the pool's own checks (health, `max_lifetime`) see it again at least that often;
//! - the worker stops.

use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use sqlx::pool::PoolConnection;
use sqlx::{Connection, Pool};

use super::backend::Backend;

/// One kept connection.
struct Entry<DB: Backend> {
    conn: PoolConnection<DB>,
    /// When it was last kept (it has been unused since).
    kept_at: Instant,
    /// When the worker first kept it, since it last came from the pool.
    since: Instant,
}

/// A worker's kept connections (see the module's doc).
pub(crate) struct Kept<DB: Backend> {
    pool: Pool<DB>,
    /// At most this many are kept: the worker's concurrency.
    limit: usize,
    /// Oldest first: a lease takes the newest.
    entries: Mutex<Vec<Entry<DB>>>,
}

impl<DB: Backend> Kept<DB> {
    /// How long a connection stays kept unused before it goes back to the pool.
    pub(crate) const IDLE: Duration = Duration::from_secs(1);
    /// How long a connection may stay in the worker's hands, kept and reused, before it
    /// goes back to the pool.
    pub(crate) const AT_MOST: Duration = Duration::from_secs(30);

    /// Keeps at most `limit` connections of `pool`.
    pub(crate) fn new(pool: Pool<DB>, limit: usize) -> Arc<Self> {
        Arc::new(Kept {
            pool,
            limit,
            entries: Mutex::new(Vec::with_capacity(limit)),
        })
    }

    fn entries(&self) -> std::sync::MutexGuard<'_, Vec<Entry<DB>>> {
        self.entries.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The most recently kept connection, if one was kept less than [`Kept::IDLE`] ago, with
    /// when the worker first kept it (for [`Kept::keep`]); those kept longer go back to the
    /// pool.
    pub(crate) fn take(&self) -> Option<(PoolConnection<DB>, Instant)> {
        let now = Instant::now();
        let (taken, stale) = {
            let mut entries = self.entries();
            let stale = take_stale(&mut entries, now);
            (entries.pop(), stale)
        };
        // Returned to the pool outside the lock (each return spawns the pool's check).
        drop(stale);
        taken.map(|e| (e.conn, e.since))
    }

    /// Keeps `conn`, which a lease released clean (`since`: when the worker first kept it,
    /// if it came from here), or gives it back to the pool (see the module's doc for when).
    pub(crate) fn keep(&self, conn: PoolConnection<DB>, since: Option<Instant>) {
        let now = Instant::now();
        let since = since.unwrap_or(now);
        // `should_flush`: a statement is queued on the connection (sqlx's own test, hidden
        // from its docs; a dropped transaction queues its rollback, which the pool's check
        // on the way back would flush).
        let clean = !conn.should_flush() && !conn.is_in_transaction();
        if !clean || now.duration_since(since) >= Self::AT_MOST || !self.pool_has_room() {
            return;
        }
        let mut entries = self.entries();
        if entries.len() >= self.limit {
            // The guard goes first, then the connection (back to the pool), outside the lock.
            return;
        }
        entries.push(Entry {
            conn,
            kept_at: now,
            since,
        });
    }

    /// Whether the pool could hand out a connection now without this one: an idle one.
    /// Room to open one is not enough: a kept connection is not idle in the pool, so
    /// others would open new connections while the worker keeps its own (a server process
    /// and an authentication each), where giving it back lets them reuse it.
    fn pool_has_room(&self) -> bool {
        self.pool.num_idle() > 0
    }

    /// Gives the connections kept unused for [`Kept::IDLE`] back to the pool.
    pub(crate) fn expire(&self) {
        let stale = take_stale(&mut self.entries(), Instant::now());
        drop(stale);
    }

    /// Gives every kept connection back to the pool.
    pub(crate) fn clear(&self) {
        let all = std::mem::take(&mut *self.entries());
        drop(all);
    }
}

/// The entries of `entries` (oldest first) kept unused for [`Kept::IDLE`] at `now`.
fn take_stale<DB: Backend>(entries: &mut Vec<Entry<DB>>, now: Instant) -> Vec<Entry<DB>> {
    let fresh = entries.partition_point(|e| now.duration_since(e.kept_at) >= Kept::<DB>::IDLE);
    entries.drain(..fresh).collect()
}
