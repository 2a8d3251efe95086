//! The store's side of long operations (see [`crate::operations`]): what an operation is,
//! and the handle whoever does their work reads and finishes them with.

use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use sqlx::Pool;

use super::backend::{purge_in_batches, OperationRow, StoreBackend};
use super::config::Names;
use crate::config::DEFAULT_TTL;
use crate::Error;

/// Where an operation is in its life.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum OperationStatus {
    /// Started, not finished.
    Pending,
    /// Finished with a result ([`Operations::succeed`]).
    Succeeded,
    /// Finished with an error ([`Operations::fail`]).
    Failed,
}

impl OperationStatus {
    /// The status as stored and as the status route says it: `pending`, `succeeded` or
    /// `failed`.
    pub fn as_str(self) -> &'static str {
        match self {
            OperationStatus::Pending => "pending",
            OperationStatus::Succeeded => "succeeded",
            OperationStatus::Failed => "failed",
        }
    }

    fn parse(s: &str) -> Result<Self, sqlx::Error> {
        match s {
            "pending" => Ok(OperationStatus::Pending),
            "succeeded" => Ok(OperationStatus::Succeeded),
            "failed" => Ok(OperationStatus::Failed),
            other => Err(sqlx::Error::Decode(
                format!("an operation's status is {other:?}").into(),
            )),
        }
    }
}

/// An operation as stored.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct Operation {
    /// Its id: `op_` and 32 hex digits.
    pub id: String,
    /// What the request that started it named it (`refund`).
    pub kind: String,
    /// Where it is.
    pub status: OperationStatus,
    /// What the request gave it to work on.
    pub input: serde_json::Value,
    /// Its result once succeeded, its error once failed.
    pub result: Option<serde_json::Value>,
    /// When it was started.
    pub created: SystemTime,
    /// When it was started or finished.
    pub updated: SystemTime,
    /// The caller part of the scope of the request that started it.
    pub(crate) owner: String,
}

impl Operation {
    pub(crate) fn from_row(row: OperationRow) -> Result<Self, sqlx::Error> {
        let (id, owner, kind, status, input, result, created, updated) = row;
        let json = |bytes: &[u8]| {
            serde_json::from_slice(bytes).map_err(|e| sqlx::Error::Decode(Box::new(e)))
        };
        let at = |ms: i64| UNIX_EPOCH + Duration::from_millis(u64::try_from(ms).unwrap_or(0));
        Ok(Operation {
            id,
            kind,
            status: OperationStatus::parse(&status)?,
            input: json(&input)?,
            result: result.as_deref().map(json).transpose()?,
            created: at(created),
            updated: at(updated),
            owner,
        })
    }
}

/// The operations of a store, for whoever does their work: read the pending ones, finish
/// each in the transaction of its effects. Cheap to clone; from
/// [`IdempotencyStore::operations`](crate::IdempotencyStore::operations).
pub struct Operations<DB: StoreBackend> {
    pool: Pool<DB>,
    names: Arc<Names>,
    keep: Duration,
}

impl<DB: StoreBackend> Clone for Operations<DB> {
    fn clone(&self) -> Self {
        Operations {
            pool: self.pool.clone(),
            names: self.names.clone(),
            keep: self.keep,
        }
    }
}

impl<DB: StoreBackend> std::fmt::Debug for Operations<DB> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Operations")
            .field("table", &self.names.operations)
            .field("keep", &self.keep)
            .finish_non_exhaustive()
    }
}

impl<DB: StoreBackend> Operations<DB> {
    pub(crate) fn new(pool: Pool<DB>, names: Arc<Names>) -> Self {
        Operations {
            pool,
            names,
            keep: DEFAULT_TTL,
        }
    }

    /// The same, keeping a finished operation for `keep` before the purge may delete it.
    /// The default is the layer's default TTL ([`DEFAULT_TTL`], 24 h): keep it at least the
    /// layer's [`ttl`](crate::IdempotencyConfigBuilder::ttl), so that a replayed 202 never
    /// points at an operation gone; a layer given a longer TTL wants
    /// `keep_finished(that ttl)`. Longer than a `BIGINT` of milliseconds is kept as long as
    /// that.
    pub fn keep_finished(mut self, keep: Duration) -> Self {
        self.keep = keep;
        self
    }

    /// Operation `id`, if it exists (whoever started it).
    pub async fn get(&self, id: &str) -> Result<Option<Operation>, Error> {
        let rows = DB::op_select(&self.pool, &self.names.sql.op_fetch, id, None).await?;
        Ok(rows
            .into_iter()
            .next()
            .map(Operation::from_row)
            .transpose()?)
    }

    /// Up to `limit` pending operations of `kind`, oldest first.
    pub async fn pending(&self, kind: &str, limit: u32) -> Result<Vec<Operation>, Error> {
        let limit = Some(i64::from(limit));
        let rows = DB::op_select(&self.pool, &self.names.sql.op_pending, kind, limit).await?;
        Ok(rows
            .into_iter()
            .map(Operation::from_row)
            .collect::<Result<_, _>>()?)
    }

    /// Finishes the pending operation `id` as succeeded with `result`, on `conn` (the
    /// transaction of the operation's effects, so both commit or neither). `false` if it is
    /// not pending (finished already, or unknown): the caller's transaction should then
    /// roll back its effects.
    pub async fn succeed(
        &self,
        conn: &mut DB::Connection,
        id: &str,
        result: &serde_json::Value,
    ) -> Result<bool, Error> {
        self.finish(conn, id, OperationStatus::Succeeded, result)
            .await
    }

    /// Finishes the pending operation `id` as failed with `error` (what the status route
    /// shows the caller: no internals, no credentials), as [`Operations::succeed`] does.
    pub async fn fail(
        &self,
        conn: &mut DB::Connection,
        id: &str,
        error: &serde_json::Value,
    ) -> Result<bool, Error> {
        self.finish(conn, id, OperationStatus::Failed, error).await
    }

    async fn finish(
        &self,
        conn: &mut DB::Connection,
        id: &str,
        status: OperationStatus,
        result: &serde_json::Value,
    ) -> Result<bool, Error> {
        let result = serde_json::to_vec(result)
            .map_err(|e| Error::Database(sqlx::Error::Encode(Box::new(e))))?;
        let keep_ms = i64::try_from(self.keep.as_millis()).unwrap_or(i64::MAX / 2);
        let sql = &self.names.sql;
        Ok(DB::op_finish(conn, sql, id, status.as_str(), &result, keep_ms).await?)
    }

    /// Deletes the finished operations past their keep, `batch` rows a statement, until
    /// none are left; how many. The layer's purge runs it with its own.
    pub async fn purge_finished(&self, batch: u32) -> Result<u64, Error> {
        purge_in_batches(batch, |batch| {
            DB::op_purge(&self.pool, &self.names.sql, batch)
        })
        .await
    }
}
