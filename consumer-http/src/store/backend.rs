//! The sealed [`StoreBackend`] trait, the statements both databases run (written once, with
//! `$n` placeholders and `{now}` for the database's clock), and the code that runs them,
//! expanded once per database by `store_ops!`.

use futures::future::BoxFuture;
use sqlx::Pool;

use super::config::{Names, Statements};
use crate::stored::StoredResponse;
use crate::Error;

/// Claims the key, in the request's transaction: a new row, or takes over a row that has
/// expired (its TTL passed and it is completed or its lease ran out), or an in-progress row
/// *of the same fingerprint* whose lease ran out (only an earlier version of the layer
/// committed a claim before its answer). A row of another fingerprint is never taken over
/// while it lives: that request gets 422. Returns a row only if claimed. A row another
/// request's transaction inserted and has not yet committed or rolled back makes it wait
/// (the primary key), up to the lock timeout on PostgreSQL.
pub(crate) const CLAIM: &str = "INSERT INTO {table} AS r \
     (scope, key, fingerprint, claim, status, lease_until_ms, expires_at_ms) \
     VALUES ($1, $2, $3, $4, 'in_progress', {now} + $5, {now} + $6) \
     ON CONFLICT (scope, key) DO UPDATE SET fingerprint = excluded.fingerprint, \
       claim = excluded.claim, status = 'in_progress', \
       lease_until_ms = excluded.lease_until_ms, expires_at_ms = excluded.expires_at_ms, \
       response_status = NULL, response_headers = NULL, response_body = NULL \
     WHERE (r.expires_at_ms <= {now} AND (r.status = 'completed' OR r.lease_until_ms <= {now})) \
       OR (r.status = 'in_progress' AND r.lease_until_ms <= {now} \
           AND r.fingerprint = excluded.fingerprint) \
     RETURNING claim";

/// A record, with how long its TTL and lease have left (negative: passed).
pub(crate) const FETCH: &str = "SELECT fingerprint, status, response_status, response_headers, \
     response_body, expires_at_ms - {now} AS ttl_left_ms, lease_until_ms - {now} AS lease_left_ms \
     FROM {table} WHERE scope = $1 AND key = $2";

/// In the request's transaction: the answer, only under this request's claim.
pub(crate) const COMPLETE: &str = "UPDATE {table} SET status = 'completed', \
     response_status = $4, response_headers = $5, response_body = $6, \
     expires_at_ms = {now} + $7 \
     WHERE scope = $1 AND key = $2 AND claim = $3 AND status = 'in_progress'";

/// How many records there are of each status (committed ones: a running request's claim
/// is not seen).
pub(crate) const COUNTS: &str = "SELECT status, count(*) FROM {table} GROUP BY status";

/// The columns of an operation, as [`OperationRow`] reads them.
const OPERATION_COLUMNS: &str =
    "id, owner, kind, status, input, result, created_at_ms, updated_at_ms";

/// Starts an operation, pending, in the request's transaction.
pub(crate) const OP_INSERT: &str = "INSERT INTO {operations} \
     (id, owner, kind, status, input, created_at_ms, updated_at_ms) \
     VALUES ($1, $2, $3, 'pending', $4, {now}, {now})";

/// Finishes a pending operation: its status, its result (or error), and when it expires.
pub(crate) const OP_FINISH: &str = "UPDATE {operations} SET status = $2, result = $3, \
     updated_at_ms = {now}, expires_at_ms = {now} + $4 WHERE id = $1 AND status = 'pending'";

/// Deletes up to `$1` finished operations past their expiry.
pub(crate) const OP_PURGE: &str = "DELETE FROM {operations} WHERE id IN (SELECT id FROM \
     {operations} WHERE expires_at_ms <= {now} LIMIT $1)";

/// An operation's row: id, owner, kind, status, input, result, created and updated (Unix
/// milliseconds).
pub(crate) type OperationRow = (
    String,
    String,
    String,
    String,
    Vec<u8>,
    Option<Vec<u8>>,
    i64,
    i64,
);

/// The condition [`CLAIM`] takes a row over on regardless of its fingerprint.
pub(crate) const EXPIRED: &str =
    "expires_at_ms <= {now} AND (status = 'completed' OR lease_until_ms <= {now})";

/// What the layer binds to claim, complete and release a key.
#[derive(Debug, Clone)]
#[doc(hidden)]
pub struct ClaimRequest<'a> {
    pub(crate) scope: &'a str,
    pub(crate) key: &'a str,
    pub(crate) fingerprint: &'a str,
    /// Unique to this request: the completion and the release match it, so a request whose
    /// claim was taken over can neither complete nor release the new claim.
    pub(crate) claim: &'a str,
    pub(crate) lease_ms: i64,
    pub(crate) ttl_ms: i64,
}

/// A record as the layer reads it.
#[derive(Debug, Clone)]
#[doc(hidden)]
pub struct Record {
    pub(crate) fingerprint: String,
    pub(crate) completed: bool,
    /// The claim statement would take it over whatever its fingerprint: gone, in effect.
    pub(crate) expired: bool,
    /// An in-progress record whose lease ran out: a request of its fingerprint may take it
    /// over.
    pub(crate) lease_expired: bool,
    /// A completed record's answer.
    pub(crate) response: Option<StoredResponse>,
    /// How long the record's TTL has left when it was read (zero once passed).
    pub(crate) ttl_left: std::time::Duration,
}

impl Record {
    /// A record from a [`FETCH`] row's columns.
    pub(crate) fn from_columns(
        fingerprint: String,
        status: &str,
        response: Option<(i32, Vec<u8>, Vec<u8>)>,
        ttl_left_ms: i64,
        lease_left_ms: i64,
    ) -> Result<Self, sqlx::Error> {
        let completed = status == "completed";
        let response = match response {
            Some((status, headers, body)) if completed => Some(StoredResponse {
                status: u16::try_from(status).unwrap_or(500),
                headers: StoredResponse::decode_headers(&headers).ok_or_else(|| {
                    sqlx::Error::Decode("a stored response's headers are malformed".into())
                })?,
                body: body.into(),
            }),
            _ => None,
        };
        Ok(Record {
            fingerprint,
            completed: completed && response.is_some(),
            expired: ttl_left_ms <= 0 && (completed || lease_left_ms <= 0),
            lease_expired: !completed && lease_left_ms <= 0,
            response,
            ttl_left: std::time::Duration::from_millis(u64::try_from(ttl_left_ms).unwrap_or(0)),
        })
    }
}

mod sealed {
    pub trait Sealed {}
    impl Sealed for sqlx::Postgres {}
    impl Sealed for sqlx::Sqlite {}
}

/// A database the store supports: PostgreSQL (many processes) or SQLite (one process).
/// Sealed; its items are the store's, not part of the public API.
pub trait StoreBackend: sqlx::Database + sealed::Sealed {
    #[doc(hidden)]
    const BACKEND: &'static str;
    #[doc(hidden)]
    const HAS_SCHEMAS: bool;
    /// The database's clock as Unix milliseconds, an SQL expression.
    #[doc(hidden)]
    const NOW_MS: &'static str;

    /// The statement that begins a request's transaction, before its claim: PostgreSQL bounds
    /// the claim's wait on a running duplicate's row by `wait_ms` (and keeps the
    /// connection's own lock timeout, which the claim statement puts back); SQLite takes the
    /// write lock first.
    #[doc(hidden)]
    fn begin_claim(wait_ms: i64) -> String;

    /// [`CLAIM`] as this database runs it in the request's transaction (returning the
    /// `claim` column when claimed).
    #[doc(hidden)]
    fn claim_template() -> String {
        CLAIM.to_owned()
    }

    /// Whether `e` is the claim's wait running out on a row another request's transaction
    /// holds.
    #[doc(hidden)]
    fn is_lock_timeout(e: &sqlx::Error) -> bool;

    /// `sql` with its `$n` placeholders in this database's form.
    #[doc(hidden)]
    fn placeholders(sql: &str) -> String;

    #[doc(hidden)]
    fn statements(names: &Names) -> Statements {
        Statements {
            claim: render::<Self>(names, &Self::claim_template()),
            fetch: render::<Self>(names, FETCH),
            complete: render::<Self>(names, COMPLETE),
            purge: render::<Self>(names, &Self::purge_template()),
            counts: render::<Self>(names, COUNTS),
            op_insert: render::<Self>(names, OP_INSERT),
            op_fetch: render::<Self>(
                names,
                &format!("SELECT {OPERATION_COLUMNS} FROM {{operations}} WHERE id = $1"),
            ),
            op_pending: render::<Self>(
                names,
                &format!(
                    "SELECT {OPERATION_COLUMNS} FROM {{operations}} \
                     WHERE status = 'pending' AND kind = $1 ORDER BY created_at_ms, id LIMIT $2"
                ),
            ),
            op_finish: render::<Self>(names, OP_FINISH),
            op_purge: render::<Self>(names, OP_PURGE),
        }
    }

    /// Deletes up to `$1` expired rows.
    #[doc(hidden)]
    fn purge_template() -> String;

    #[doc(hidden)]
    fn migrate<'a>(pool: &'a Pool<Self>, names: &'a Names) -> BoxFuture<'a, Result<(), Error>>;

    #[doc(hidden)]
    fn claim<'a>(
        conn: &'a mut Self::Connection,
        sql: &'a Statements,
        request: &'a ClaimRequest<'a>,
    ) -> BoxFuture<'a, Result<bool, sqlx::Error>>;

    #[doc(hidden)]
    fn fetch<'a>(
        conn: &'a mut Self::Connection,
        sql: &'a Statements,
        scope: &'a str,
        key: &'a str,
    ) -> BoxFuture<'a, Result<Option<Record>, sqlx::Error>>;

    #[doc(hidden)]
    fn complete<'a>(
        conn: &'a mut Self::Connection,
        sql: &'a Statements,
        request: &'a ClaimRequest<'a>,
        response: &'a StoredResponse,
    ) -> BoxFuture<'a, Result<bool, sqlx::Error>>;

    #[doc(hidden)]
    fn purge<'a>(
        pool: &'a Pool<Self>,
        sql: &'a Statements,
        batch: i64,
    ) -> BoxFuture<'a, Result<u64, sqlx::Error>>;

    #[doc(hidden)]
    fn counts<'a>(
        pool: &'a Pool<Self>,
        sql: &'a Statements,
    ) -> BoxFuture<'a, Result<Vec<(String, i64)>, sqlx::Error>>;

    /// Inserts a pending operation (`id`, `owner`, `kind`, `input`) on `conn`.
    #[doc(hidden)]
    fn op_insert<'a>(
        conn: &'a mut Self::Connection,
        sql: &'a Statements,
        op: [&'a str; 3],
        input: &'a [u8],
    ) -> BoxFuture<'a, Result<(), sqlx::Error>>;

    /// The operations one of `sql`'s statements selects: `op_fetch` (binding `text`) or
    /// `op_pending` (binding `text` and `limit`).
    #[doc(hidden)]
    fn op_select<'a>(
        pool: &'a Pool<Self>,
        statement: &'a str,
        text: &'a str,
        limit: Option<i64>,
    ) -> BoxFuture<'a, Result<Vec<OperationRow>, sqlx::Error>>;

    /// Finishes the pending operation `id` with `status` and `result`, expiring `keep_ms`
    /// later; whether it was pending.
    #[doc(hidden)]
    fn op_finish<'a>(
        conn: &'a mut Self::Connection,
        sql: &'a Statements,
        id: &'a str,
        status: &'a str,
        result: &'a [u8],
        keep_ms: i64,
    ) -> BoxFuture<'a, Result<bool, sqlx::Error>>;

    /// Deletes up to `batch` expired operations; how many.
    #[doc(hidden)]
    fn op_purge<'a>(
        pool: &'a Pool<Self>,
        sql: &'a Statements,
        batch: i64,
    ) -> BoxFuture<'a, Result<u64, sqlx::Error>>;
}

/// Runs `purge` (a statement deleting up to its argument's rows, returning how many) with
/// `batch` (at least 1) until it deletes fewer; how many in all.
pub(crate) async fn purge_in_batches<'a, F>(batch: u32, purge: F) -> Result<u64, Error>
where
    F: Fn(i64) -> futures::future::BoxFuture<'a, Result<u64, sqlx::Error>>,
{
    let batch = batch.max(1);
    let mut total = 0;
    loop {
        let n = purge(i64::from(batch)).await?;
        total += n;
        if n < u64::from(batch) {
            return Ok(total);
        }
    }
}

/// `template` with `{table}`, `{expires_index}`, the operations' names and `{now}` (the database's clock in Unix
/// milliseconds) filled in, and its `$n` placeholders in the database's form.
pub(crate) fn render<DB: StoreBackend>(names: &Names, template: &str) -> String {
    let sql = template
        .replace("{table}", &names.table)
        .replace("{expires_index}", &names.expires_index)
        .replace("{operations}", &names.operations)
        .replace(
            "{operations_pending_index}",
            &names.operations_pending_index,
        )
        .replace(
            "{operations_expires_index}",
            &names.operations_expires_index,
        )
        .replace("{now}", DB::NOW_MS);
    DB::placeholders(&sql)
}

/// The bodies of [`StoreBackend`]'s statement methods for the database `$db`: the same code
/// for both, which sqlx's per-database types make simpler to expand twice than to bound
/// generically.
macro_rules! store_ops {
    ($db:ty) => {
        fn claim<'a>(
            conn: &'a mut <$db as sqlx::Database>::Connection,
            sql: &'a $crate::store::config::Statements,
            r: &'a $crate::store::backend::ClaimRequest<'a>,
        ) -> futures::future::BoxFuture<'a, Result<bool, sqlx::Error>> {
            Box::pin(async move {
                let row = sqlx::query(&sql.claim)
                    .bind(r.scope)
                    .bind(r.key)
                    .bind(r.fingerprint)
                    .bind(r.claim)
                    .bind(r.lease_ms)
                    .bind(r.ttl_ms)
                    .fetch_optional(conn)
                    .await?;
                Ok(row.is_some())
            })
        }

        fn fetch<'a>(
            conn: &'a mut <$db as sqlx::Database>::Connection,
            sql: &'a $crate::store::config::Statements,
            scope: &'a str,
            key: &'a str,
        ) -> futures::future::BoxFuture<
            'a,
            Result<Option<$crate::store::backend::Record>, sqlx::Error>,
        > {
            Box::pin(async move {
                use sqlx::Row;
                let Some(row) = sqlx::query(&sql.fetch)
                    .bind(scope)
                    .bind(key)
                    .fetch_optional(conn)
                    .await?
                else {
                    return Ok(None);
                };
                let status: Option<i32> = row.try_get("response_status")?;
                let headers: Option<Vec<u8>> = row.try_get("response_headers")?;
                let body: Option<Vec<u8>> = row.try_get("response_body")?;
                let response = match (status, headers, body) {
                    (Some(s), Some(h), Some(b)) => Some((s, h, b)),
                    _ => None,
                };
                $crate::store::backend::Record::from_columns(
                    row.try_get("fingerprint")?,
                    row.try_get::<&str, _>("status")?,
                    response,
                    row.try_get("ttl_left_ms")?,
                    row.try_get("lease_left_ms")?,
                )
                .map(Some)
            })
        }

        fn complete<'a>(
            conn: &'a mut <$db as sqlx::Database>::Connection,
            sql: &'a $crate::store::config::Statements,
            r: &'a $crate::store::backend::ClaimRequest<'a>,
            response: &'a $crate::stored::StoredResponse,
        ) -> futures::future::BoxFuture<'a, Result<bool, sqlx::Error>> {
            Box::pin(async move {
                let done = sqlx::query(&sql.complete)
                    .bind(r.scope)
                    .bind(r.key)
                    .bind(r.claim)
                    .bind(i32::from(response.status))
                    .bind(response.encode_headers())
                    .bind(response.body.to_vec())
                    .bind(r.ttl_ms)
                    .execute(conn)
                    .await?;
                Ok(done.rows_affected() == 1)
            })
        }

        fn purge<'a>(
            pool: &'a sqlx::Pool<$db>,
            sql: &'a $crate::store::config::Statements,
            batch: i64,
        ) -> futures::future::BoxFuture<'a, Result<u64, sqlx::Error>> {
            Box::pin(async move {
                let done = sqlx::query(&sql.purge).bind(batch).execute(pool).await?;
                Ok(done.rows_affected())
            })
        }

        fn counts<'a>(
            pool: &'a sqlx::Pool<$db>,
            sql: &'a $crate::store::config::Statements,
        ) -> futures::future::BoxFuture<'a, Result<Vec<(String, i64)>, sqlx::Error>> {
            Box::pin(async move { sqlx::query_as(&sql.counts).fetch_all(pool).await })
        }

        fn op_insert<'a>(
            conn: &'a mut <$db as sqlx::Database>::Connection,
            sql: &'a $crate::store::config::Statements,
            [id, owner, kind]: [&'a str; 3],
            input: &'a [u8],
        ) -> futures::future::BoxFuture<'a, Result<(), sqlx::Error>> {
            Box::pin(async move {
                sqlx::query(&sql.op_insert)
                    .bind(id)
                    .bind(owner)
                    .bind(kind)
                    .bind(input)
                    .execute(conn)
                    .await?;
                Ok(())
            })
        }

        fn op_select<'a>(
            pool: &'a sqlx::Pool<$db>,
            statement: &'a str,
            text: &'a str,
            limit: Option<i64>,
        ) -> futures::future::BoxFuture<
            'a,
            Result<Vec<$crate::store::backend::OperationRow>, sqlx::Error>,
        > {
            Box::pin(async move {
                let query = sqlx::query_as(statement).bind(text);
                match limit {
                    Some(limit) => query.bind(limit).fetch_all(pool).await,
                    None => query.fetch_all(pool).await,
                }
            })
        }

        fn op_finish<'a>(
            conn: &'a mut <$db as sqlx::Database>::Connection,
            sql: &'a $crate::store::config::Statements,
            id: &'a str,
            status: &'a str,
            result: &'a [u8],
            keep_ms: i64,
        ) -> futures::future::BoxFuture<'a, Result<bool, sqlx::Error>> {
            Box::pin(async move {
                let done = sqlx::query(&sql.op_finish)
                    .bind(id)
                    .bind(status)
                    .bind(result)
                    .bind(keep_ms)
                    .execute(conn)
                    .await?;
                Ok(done.rows_affected() == 1)
            })
        }

        fn op_purge<'a>(
            pool: &'a sqlx::Pool<$db>,
            sql: &'a $crate::store::config::Statements,
            batch: i64,
        ) -> futures::future::BoxFuture<'a, Result<u64, sqlx::Error>> {
            Box::pin(async move {
                let done = sqlx::query(&sql.op_purge).bind(batch).execute(pool).await?;
                Ok(done.rows_affected())
            })
        }
    };
}

pub(crate) use store_ops;
