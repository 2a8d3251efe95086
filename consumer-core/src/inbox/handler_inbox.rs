//! [`HandlerInbox`]: the inbox as one handler's worker uses it. It holds what every one of
//! the worker's calls on the inbox passes alike (the table names, the handler's name, its
//! retention, attempt budget and timeout), so that each call takes only what varies: the
//! connection, the keys and their hashes or attempts, the lock ids, the error text. Where a
//! [`Backend`] operation has a variant for one row and one for many, which only differ in
//! cost, the handle picks it by the number of items.

use std::sync::Arc;
use std::time::Duration;

use super::backend::Backend;
use super::claim::{AttemptItem, Claim};
use super::config::TableNames;
use super::entry::InboxCounts;
use super::handle::Inbox;
use super::kept::Kept;
use super::lease::Lease;
use crate::Error;

/// The inbox of one handler: the [`Inbox`] its worker serves (with the handler's aliases,
/// see [`Inbox::serving`]), the handler's name, and the settings its rows are claimed,
/// counted and kept with. Cheap to clone.
pub(crate) struct HandlerInbox<DB: Backend> {
    inbox: Inbox<DB>,
    name: Arc<str>,
    /// How long a completed or dead row is kept.
    retention: Duration,
    /// How many attempts a key gets, crashes included.
    max_attempts: u32,
    /// The handler's timeout, which bounds its transaction's statements.
    timeout: Duration,
}

impl<DB: Backend> Clone for HandlerInbox<DB> {
    fn clone(&self) -> Self {
        HandlerInbox {
            inbox: self.inbox.clone(),
            name: self.name.clone(),
            retention: self.retention,
            max_attempts: self.max_attempts,
            timeout: self.timeout,
        }
    }
}

impl<DB: Backend> HandlerInbox<DB> {
    /// The handler `name`'s inbox on `inbox` (the serving one, with the handler's aliases).
    pub(crate) fn new(
        inbox: Inbox<DB>,
        name: Arc<str>,
        retention: Duration,
        max_attempts: u32,
        timeout: Duration,
    ) -> Self {
        HandlerInbox {
            inbox,
            name,
            retention,
            max_attempts,
            timeout,
        }
    }

    /// The whole inbox, for what is not the handler's alone: the dead-letter table, the
    /// retention purge, the outbox relays' wake-up.
    pub(crate) fn inbox(&self) -> &Inbox<DB> {
        &self.inbox
    }

    /// The handler's name.
    pub(crate) fn name(&self) -> &Arc<str> {
        &self.name
    }

    /// The table names and statements, which a handler's context writes the outbox with.
    pub(crate) fn names(&self) -> &TableNames {
        self.inbox.names()
    }

    /// The id `key` is locked by in this process (see [`HandlerInbox::lease`]).
    pub(crate) fn local_lock_id(&self, key: &str) -> i64 {
        self.inbox.local_lock_id(&self.name, key)
    }

    /// A connection holding the in-process locks `local_ids` and carrying the database lock
    /// ids of `db_keys`, kept in `kept` between leases (see [`Inbox::lease_ids`]).
    pub(crate) async fn lease(
        &self,
        local_ids: Vec<i64>,
        db_keys: &[&str],
        kept: &Arc<Kept<DB>>,
    ) -> Result<Lease<DB>, sqlx::Error> {
        (self.inbox)
            .lease_ids(&self.name, local_ids, db_keys, Some(kept))
            .await
    }

    /// Begins the handler's transaction on `conn`, bounded by the handler's timeout (see
    /// [`Backend::begin_handler`]).
    pub(crate) async fn begin<'c>(
        &self,
        conn: &'c mut DB::Connection,
    ) -> Result<sqlx::Transaction<'c, DB>, sqlx::Error> {
        DB::begin_handler(conn, self.timeout).await
    }

    /// Fails if the handler's transaction can no longer commit what it wrote (see
    /// [`Backend::check_not_aborted`]).
    pub(crate) async fn check_not_aborted(
        &self,
        tx: &mut DB::Connection,
    ) -> Result<(), sqlx::Error> {
        DB::check_not_aborted(tx).await
    }

    /// Claims the fresh keys `items` (`(key, payload_hash)` pairs, distinct) in the handler's
    /// transaction `tx`, and returns the keys that had a row already (not claimed).
    ///
    /// One key is claimed by [`Backend::claim_fresh`]. Several are claimed in one statement:
    /// with `optimistic`, the plain insert of [`Backend::claim_new_many`], which fails the
    /// transaction with a unique violation if a key has a row after all (the caller then
    /// claims again, not optimistic, in a new transaction); otherwise
    /// [`Backend::claim_fresh_many`], which tolerates rows.
    pub(crate) async fn claim_fresh(
        &self,
        tx: &mut DB::Connection,
        items: &[(&str, &str)],
        optimistic: bool,
    ) -> Result<Vec<String>, sqlx::Error> {
        let (names, name, retention) = (self.inbox.names(), &*self.name, self.retention);
        match items {
            [(key, hash)] => {
                let claimed = DB::claim_fresh(tx, names, name, key, hash, retention).await?;
                Ok(if claimed {
                    Vec::new()
                } else {
                    vec![(*key).to_owned()]
                })
            }
            _ if optimistic => DB::claim_new_many(tx, names, name, items, retention).await,
            _ => DB::claim_fresh_many(tx, names, name, items, retention).await,
        }
    }

    /// Takes the lease's database locks and counts an attempt for each of `items`, durably,
    /// before the handlers run (see [`Backend::begin_attempt`]); the claims, in the same order.
    pub(crate) async fn begin_attempts(
        &self,
        lease: &mut Lease<DB>,
        items: &[AttemptItem<'_>],
    ) -> Result<Vec<Claim>, sqlx::Error> {
        let (conn, lock_ids) = lease.locking();
        let (names, name, max) = (self.inbox.names(), &*self.name, self.max_attempts);
        match items {
            [item] => DB::begin_attempt(conn, names, name, item, max, lock_ids)
                .await
                .map(|claim| vec![claim]),
            _ => DB::begin_attempts(conn, names, name, items, max, lock_ids).await,
        }
    }

    /// Marks the counted keys `items` (`(key, attempt)` pairs) completed in the handler's
    /// transaction `tx`, each only if its row is still pending at that attempt, and releases
    /// the database locks `unlock` in the same statement (see [`Backend::complete`]); how
    /// many were completed.
    pub(crate) async fn complete(
        &self,
        tx: &mut DB::Connection,
        items: &[(&str, u32)],
        unlock: &[i64],
    ) -> Result<u64, sqlx::Error> {
        let (names, name, retention) = (self.inbox.names(), &*self.name, self.retention);
        match items {
            [(key, attempt)] => DB::complete(tx, names, name, key, *attempt, retention, unlock)
                .await
                .map(u64::from),
            _ => {
                let keys: Vec<&str> = items.iter().map(|(key, _)| *key).collect();
                let attempts: Vec<u32> = items.iter().map(|(_, attempt)| *attempt).collect();
                DB::complete_many(tx, names, name, &keys, &attempts, retention, unlock).await
            }
        }
    }

    /// Counts the failed attempt of a fresh delivery, whose claim rolled back with it (see
    /// [`Backend::count_fresh_failure`]).
    pub(crate) async fn count_fresh_failure(
        &self,
        conn: &mut DB::Connection,
        key: &str,
        payload_hash: &str,
    ) -> Result<(), sqlx::Error> {
        DB::count_fresh_failure(conn, self.inbox.names(), &self.name, key, payload_hash).await
    }

    /// Records a failed attempt's `error` in the key's row; `dead`: the key is dead-lettered,
    /// and its row expires after the handler's retention (see [`Backend::record_failure`]).
    pub(crate) async fn record_failure(
        &self,
        conn: &mut DB::Connection,
        key: &str,
        error: &str,
        dead: bool,
    ) -> Result<(), sqlx::Error> {
        let (names, name, retention) = (self.inbox.names(), &*self.name, self.retention);
        DB::record_failure(conn, names, name, key, error, dead, retention).await
    }

    /// Gives back the attempt counted at `attempt` whose commit failed (see
    /// [`Backend::uncount_attempt`]); `false` if the row has moved on.
    pub(crate) async fn uncount_attempt(
        &self,
        key: &str,
        attempt: u32,
    ) -> Result<bool, sqlx::Error> {
        let (pool, names) = (&self.inbox.pool, self.inbox.names());
        DB::uncount_attempt(pool, names, &self.name, key, attempt).await
    }

    /// Records that a retry copy of the key's message is with the broker (see
    /// [`Backend::record_retry`]).
    pub(crate) async fn record_retry(
        &self,
        key: &str,
        attempt: u32,
        scope: &str,
        delay: Duration,
    ) -> Result<(), sqlx::Error> {
        let (pool, names) = (&self.inbox.pool, self.inbox.names());
        DB::record_retry(pool, names, &self.name, key, attempt, scope, delay).await
    }

    /// Writes the reply kept with the key to the outbox again, for `to` and with the
    /// `correlation` id of the duplicate it answers, and wakes this process's relays;
    /// whether there was one (see [`crate::Context::reply`]).
    pub(crate) async fn resend_reply(
        &self,
        key: &str,
        to: &str,
        correlation: Option<&str>,
    ) -> Result<bool, sqlx::Error> {
        let (pool, names) = (&self.inbox.pool, self.inbox.names());
        let resent = DB::outbox_resend_reply(pool, names, &self.name, key, to, correlation).await?;
        if resent {
            self.inbox.outbox_written();
        }
        Ok(resent)
    }

    /// The handler's rows by status, and the idle time of its stalest pending row (see
    /// [`Inbox::counts`]).
    pub(crate) async fn counts(&self) -> Result<InboxCounts, Error> {
        self.inbox.counts(&self.name).await
    }
}
