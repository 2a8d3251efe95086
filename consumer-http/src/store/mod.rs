//! The store: one table of records, (scope, key) → claim or stored answer, in PostgreSQL or
//! SQLite.
//!
//! # Layout
//!
//! - `config`: [`StoreConfig`] and the validated names and statements built from it.
//! - `backend`: the sealed [`StoreBackend`] trait and the statements both databases run
//!   alike, written once.
//! - `postgres`, `sqlite`: each database's clock, placeholders and migrations.
//!
//! Beside the records, the table `<table>_operations` holds the long operations requests
//! started ([`crate::operations`]).

mod backend;
mod config;
mod operations;
mod postgres;
mod sqlite;

use std::sync::Arc;
use std::time::Duration;

use sqlx::pool::PoolConnection;
use sqlx::{Pool, Transaction};

use backend::purge_in_batches;
pub use backend::StoreBackend;
pub(crate) use backend::{ClaimRequest, Record};
pub(crate) use config::Names;
pub use config::{StoreConfig, StoreConfigBuilder};
pub use operations::{Operation, OperationStatus, Operations};

use crate::stored::StoredResponse;
use crate::Error;

/// What a request's claim came to.
pub(crate) enum Claim<DB: StoreBackend> {
    /// The key is this request's: its transaction, which holds the record's row (uncommitted,
    /// so unseen by others) until it commits with the answer or rolls back and frees the key.
    Held(Transaction<'static, DB>),
    /// The key has a committed record this request cannot take: read it again.
    Taken,
    /// Another request's transaction held the key for the whole wait.
    Busy,
}

/// How many committed records a store holds, by status.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub(crate) struct RecordCounts {
    pub(crate) in_progress: u64,
    pub(crate) completed: u64,
}

/// The records of idempotent requests on a connection pool. Cheap to clone.
pub struct IdempotencyStore<DB: StoreBackend> {
    pool: Pool<DB>,
    names: Arc<Names>,
}

impl<DB: StoreBackend> Clone for IdempotencyStore<DB> {
    fn clone(&self) -> Self {
        IdempotencyStore {
            pool: self.pool.clone(),
            names: self.names.clone(),
        }
    }
}

impl<DB: StoreBackend> std::fmt::Debug for IdempotencyStore<DB> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("IdempotencyStore")
            .field("backend", &DB::BACKEND)
            .field("table", &self.names.table)
            .finish_non_exhaustive()
    }
}

impl<DB: StoreBackend> IdempotencyStore<DB> {
    /// Validates `config`, runs the shipped migrations (idempotent, safe to race between
    /// processes) and returns the store. A bad name fails here, naming the field.
    pub async fn new(pool: Pool<DB>, config: StoreConfig) -> Result<Self, Error> {
        let mut names = Names::new(&config, DB::HAS_SCHEMAS, DB::BACKEND)?;
        names.sql = DB::statements(&names);
        DB::migrate(&pool, &names).await?;
        Ok(IdempotencyStore {
            pool,
            names: Arc::new(names),
        })
    }

    /// The pool.
    pub fn pool(&self) -> &Pool<DB> {
        &self.pool
    }

    /// The quoted, qualified table name.
    pub fn table(&self) -> &str {
        &self.names.table
    }

    /// The long operations requests started on this store (see [`crate::operations`]),
    /// for whoever does their work.
    pub fn operations(&self) -> Operations<DB> {
        Operations::new(self.pool.clone(), self.names.clone())
    }

    /// The store's names and statements, for what a request's transaction starts.
    pub(crate) fn names(&self) -> &Arc<Names> {
        &self.names
    }

    /// Deletes the records whose TTL has passed (and whose claim, if still in progress, has
    /// lost its lease), `batch` rows per statement, until none are left. Returns how many
    /// were deleted. An expired record is never replayed even before it is purged; this
    /// only reclaims space.
    pub async fn purge_expired(&self, batch: u32) -> Result<u64, Error> {
        purge_in_batches(batch, |batch| DB::purge(&self.pool, &self.names.sql, batch)).await
    }

    /// How many committed records there are in progress (claims committed by an earlier
    /// version of the layer) and completed, expired ones included until purged.
    pub(crate) async fn counts(&self) -> Result<RecordCounts, sqlx::Error> {
        let mut counts = RecordCounts::default();
        for (status, n) in DB::counts(&self.pool, &self.names.sql).await? {
            let n = u64::try_from(n).unwrap_or(0);
            match status.as_str() {
                "completed" => counts.completed += n,
                _ => counts.in_progress += n,
            }
        }
        Ok(counts)
    }

    /// A connection for one request: its record is read on it, and its transaction begun on
    /// it.
    pub(crate) async fn acquire(&self) -> Result<PoolConnection<DB>, sqlx::Error> {
        self.pool.acquire().await
    }

    /// The record of (scope, key), if any: committed records only, so a claim whose request
    /// still runs is not seen.
    pub(crate) async fn fetch(
        &self,
        conn: &mut DB::Connection,
        scope: &str,
        key: &str,
    ) -> Result<Option<Record>, sqlx::Error> {
        DB::fetch(conn, &self.names.sql, scope, key).await
    }

    /// Begins the request's transaction on `conn` and claims (scope, key) in it: a new
    /// record, or an expired one, or an in-progress one of the same fingerprint whose lease
    /// has run out, taken over. While another request's transaction holds the key (it
    /// claimed it and has not committed or rolled back), waits for it, up to `wait` on
    /// PostgreSQL (the pool's busy timeout on SQLite).
    pub(crate) async fn claim(
        &self,
        conn: PoolConnection<DB>,
        request: &ClaimRequest<'_>,
        wait: Duration,
    ) -> Result<Claim<DB>, sqlx::Error> {
        let begin = DB::begin_claim(i64::try_from(wait.as_millis()).unwrap_or(i64::MAX));
        let mut tx = sqlx::Transaction::begin(conn, Some(begin.into())).await?;
        match DB::claim(&mut tx, &self.names.sql, request).await {
            Ok(true) => Ok(Claim::Held(tx)),
            Ok(false) => {
                tx.rollback().await?;
                Ok(Claim::Taken)
            }
            Err(e) if DB::is_lock_timeout(&e) => {
                let _ = tx.rollback().await;
                Ok(Claim::Busy)
            }
            Err(e) => Err(e),
        }
    }

    /// In the request's transaction: stores the answer under this claim. `false` if the
    /// claim is not this request's (which its transaction's hold on the row rules out).
    pub(crate) async fn complete(
        &self,
        conn: &mut DB::Connection,
        request: &ClaimRequest<'_>,
        response: &StoredResponse,
    ) -> Result<bool, sqlx::Error> {
        DB::complete(conn, &self.names.sql, request, response).await
    }
}
