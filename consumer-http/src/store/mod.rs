//! The store: one table of records, (scope, key) → claim or stored answer, in PostgreSQL or
//! SQLite.
//!
//! # Layout
//!
//! - `config`: [`StoreConfig`] and the validated names and statements built from it.
//! - `backend`: the sealed [`StoreBackend`] trait and the statements both databases run
//!   alike, written once.
//! - `postgres`, `sqlite`: each database's clock, placeholders and migrations.

mod backend;
mod config;
mod postgres;
mod sqlite;

use std::sync::Arc;

use sqlx::Pool;

pub use backend::StoreBackend;
pub(crate) use backend::{ClaimRequest, Record};
use config::Names;
pub use config::{StoreConfig, StoreConfigBuilder};

use crate::stored::StoredResponse;
use crate::Error;

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

    /// Deletes the records whose TTL has passed (and whose claim, if still in progress, has
    /// lost its lease), `batch` rows per statement, until none are left. Returns how many
    /// were deleted. An expired record is never replayed even before it is purged; this
    /// only reclaims space.
    pub async fn purge_expired(&self, batch: u32) -> Result<u64, Error> {
        let batch = batch.max(1);
        let mut total = 0;
        loop {
            let n = DB::purge(&self.pool, &self.names.sql, i64::from(batch)).await?;
            total += n;
            if n < u64::from(batch) {
                return Ok(total);
            }
        }
    }

    /// Begins a request's transaction.
    pub(crate) async fn begin(&self) -> Result<sqlx::Transaction<'static, DB>, sqlx::Error> {
        match DB::BEGIN {
            Some(statement) => self.pool.begin_with(statement).await,
            None => self.pool.begin().await,
        }
    }

    /// Claims (scope, key) for this request: `true` if the claim is this request's (a new
    /// record, or an expired one, or an in-progress one of the same fingerprint whose lease
    /// has run out, taken over).
    pub(crate) async fn claim(&self, request: &ClaimRequest<'_>) -> Result<bool, sqlx::Error> {
        DB::claim(&self.pool, &self.names.sql, request).await
    }

    /// The record of (scope, key), if any.
    pub(crate) async fn fetch(
        &self,
        scope: &str,
        key: &str,
    ) -> Result<Option<Record>, sqlx::Error> {
        DB::fetch(&self.pool, &self.names.sql, scope, key).await
    }

    /// In the request's transaction: stores the answer under this claim. `false` if the
    /// claim is no longer this request's (its lease ran out and another request took it).
    pub(crate) async fn complete(
        &self,
        conn: &mut DB::Connection,
        request: &ClaimRequest<'_>,
        response: &StoredResponse,
    ) -> Result<bool, sqlx::Error> {
        DB::complete(conn, &self.names.sql, request, response).await
    }

    /// Deletes this claim's in-progress record, so the key's next request runs. `false` if
    /// the claim is gone or completed.
    pub(crate) async fn release(&self, request: &ClaimRequest<'_>) -> Result<bool, sqlx::Error> {
        DB::release(&self.pool, &self.names.sql, request).await
    }
}
