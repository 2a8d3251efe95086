//! PostgreSQL: production, many workers in many processes.

use std::time::Duration;

use futures::future::BoxFuture;
use sqlx::{Connection, PgConnection, Pool, Postgres, Row};

use super::{AttemptItem, Backend, Claim, EntryStatus, InboxEntry, Statements, TableNames};
use crate::guard::GuardValue;
use crate::Error;

const MIGRATIONS: &[(i32, &str)] = &[
    (1, include_str!("../../migrations/postgres/0001_inbox.sql")),
    (
        2,
        include_str!("../../migrations/postgres/0002_log_marks.sql"),
    ),
    (
        3,
        include_str!("../../migrations/postgres/0003_retried_to.sql"),
    ),
];

// The statements, with `{inbox}` for the table; rendered once per inbox.

/// One round trip: take the key's session lock, make this statement's implicit transaction
/// commit asynchronously, count the attempt. The count must survive the worker being killed,
/// not the database server crashing, so it stays off the fsync path; the handler's own
/// transaction commits synchronously. (An INSERT ... ON CONFLICT DO UPDATE sees the latest
/// committed row even if it was committed while this statement waited for the lock.) A
/// delivery whose attempt number (`$6`) is below the row's `retried_to` is superseded by a
/// newer copy: not counted (see the migration `0003_retried_to.sql`).
const BEGIN_ATTEMPT: &str =
    "WITH l AS (SELECT count(pg_advisory_lock(id)) AS n FROM unnest($5::bigint[]) AS u(id)), \
     c AS (SELECT set_config('synchronous_commit', 'off', true) AS v) \
     INSERT INTO {inbox} AS i (handler, key, payload_hash, status, attempts) \
     SELECT $1, $2, $3, 'pending', 1 FROM l, c \
     ON CONFLICT (handler, key) DO UPDATE SET attempts = i.attempts + 1, updated_at = now() \
     WHERE i.status = 'pending' AND i.payload_hash = EXCLUDED.payload_hash AND i.attempts < $4 \
     AND i.retried_to <= $6 \
     RETURNING attempts";

/// [`BEGIN_ATTEMPT`] for many keys: the locks in ascending order (the sorted subquery, and
/// the aggregate makes all of them come before any row), asynchronous commit, the counts.
/// Rows go in key order, as [`CLAIM_FRESH_MANY`]'s do, so that a batch waiting on another's
/// uncommitted insert of a key can never be waited on by it for another key.
const BEGIN_ATTEMPTS: &str = "WITH l AS (SELECT count(pg_advisory_lock(id)) AS n FROM \
       (SELECT id FROM unnest($5::bigint[]) AS u(id) ORDER BY id) AS s), \
     c AS (SELECT set_config('synchronous_commit', 'off', true) AS v) \
     INSERT INTO {inbox} AS i (handler, key, payload_hash, status, attempts) \
     SELECT $1, u.key, u.hash, 'pending', 1 \
     FROM unnest($2::text[], $3::text[]) AS u(key, hash), l, c ORDER BY u.key \
     ON CONFLICT (handler, key) DO UPDATE SET attempts = i.attempts + 1, updated_at = now() \
     WHERE i.status = 'pending' AND i.payload_hash = EXCLUDED.payload_hash AND i.attempts < $4 \
     AND i.retried_to <= (SELECT a.attempt FROM unnest($2::text[], $6::int[]) AS a(key, attempt) \
       WHERE a.key = EXCLUDED.key) \
     RETURNING key, attempts";

const SELECT_ENTRIES: &str = "SELECT key, status, attempts, payload_hash, last_error, retried_to \
     FROM {inbox} WHERE handler = $1 AND key = ANY($2)";

const FETCH_ENTRY: &str = "SELECT status, attempts, payload_hash, last_error, retried_to \
     FROM {inbox} WHERE handler = $1 AND key = $2";

/// Marks keys completed; the caller appends the `WHERE`.
const COMPLETE: &str = "UPDATE {inbox} SET status = 'completed', completed_at = now(), \
     updated_at = now(), expires_at = now() + $3 * interval '1 millisecond', last_error = NULL";

/// Follows `WITH done AS (<COMPLETE ...> RETURNING 1)`: releases the session locks `$4`
/// only after the update ran to the end (each unlock waits on the row count of `done`, and a
/// data-modifying CTE runs to completion before its output is complete), so the updated rows
/// are locked by this transaction before any key lock is released.
const UNLOCK_AFTER_DONE: &str = ", d AS (SELECT count(*) AS n FROM done) \
     SELECT count(CASE WHEN d.n >= 0 THEN pg_advisory_unlock(u.id) END) \
     FROM d, unnest($4::bigint[]) AS u(id)";

/// A retry copy carrying attempt `$3` is with the broker (see `Backend::record_retry`). Like
/// the attempt count, it must survive a worker crash, not a database crash (then a replay
/// runs once more, as it would without the record), so it commits asynchronously.
const RECORD_RETRY: &str = "WITH c AS (SELECT set_config('synchronous_commit', 'off', true) AS v) \
     UPDATE {inbox} SET retried_to = GREATEST(retried_to, $3), updated_at = now() FROM c \
     WHERE handler = $1 AND key = $2 AND status = 'pending'";

const RECORD_FAILURE: &str = "UPDATE {inbox} SET last_error = $3, updated_at = now(), \
     status = CASE WHEN $4 THEN 'dead' ELSE status END \
     WHERE handler = $1 AND key = $2 AND status <> 'completed'";

/// A fresh delivery's claim, in the handler's transaction (see `Backend::claim_fresh`): the
/// row is inserted already completed, so the commit that makes the handler's writes durable
/// is the completion, with no attempt counted ahead and no second row version.
const CLAIM_FRESH: &str = "INSERT INTO {inbox} \
     (handler, key, payload_hash, status, attempts, completed_at, expires_at) \
     VALUES ($1, $2, $3, 'completed', 1, now(), now() + $4 * interval '1 millisecond') \
     ON CONFLICT (handler, key) DO NOTHING";

/// [`CLAIM_FRESH`] for many keys, inserted in key order; returns the keys not inserted (a
/// data-modifying CTE runs to completion before the outer query reads it).
const CLAIM_FRESH_MANY: &str = "WITH ins AS (INSERT INTO {inbox} \
     (handler, key, payload_hash, status, attempts, completed_at, expires_at) \
     SELECT $1, u.key, u.hash, 'completed', 1, now(), now() + $4 * interval '1 millisecond' \
     FROM unnest($2::text[], $3::text[]) AS u(key, hash) ORDER BY u.key \
     ON CONFLICT (handler, key) DO NOTHING RETURNING key) \
     SELECT u.key FROM unnest($2::text[]) AS u(key) EXCEPT SELECT key FROM ins";

const COUNT_FRESH_FAILURE: &str = "INSERT INTO {inbox} \
     (handler, key, payload_hash, status, attempts) VALUES ($1, $2, $3, 'pending', 1) \
     ON CONFLICT (handler, key) DO NOTHING";

/// The log mark's statements (see `Backend::advance_log_mark`): the row is created first, so
/// `FOR UPDATE` always has a row to lock and a second advance waits for the first.
const MARK_INSERT: &str = "INSERT INTO {log_marks} (handler, log) VALUES ($1, $2) \
     ON CONFLICT (handler, log) DO NOTHING";
const MARK_SELECT: &str = "SELECT mark FROM {log_marks} WHERE handler = $1 AND log = $2 FOR UPDATE";
const MARK_UPDATE: &str = "UPDATE {log_marks} SET mark = GREATEST(mark, $3), updated_at = now() \
     WHERE handler = $1 AND log = $2";

const PURGE_EXPIRED: &str = "DELETE FROM {inbox} WHERE ctid = ANY(ARRAY(\
     SELECT ctid FROM {inbox} WHERE status = 'completed' AND expires_at < now() LIMIT $1))";

impl Backend for Postgres {
    const NAME: &'static str = "postgres";

    fn placeholder(n: usize) -> String {
        format!("${n}")
    }

    fn check_config(_names: &TableNames) -> Result<(), Error> {
        Ok(())
    }

    fn statements(names: &TableNames) -> Statements {
        Statements {
            begin_attempt: names.render(BEGIN_ATTEMPT),
            begin_attempts: names.render(BEGIN_ATTEMPTS),
            select_entries: names.render(SELECT_ENTRIES),
            fetch_entry: names.render(FETCH_ENTRY),
            complete: names.render(&format!("{COMPLETE} WHERE handler = $1 AND key = $2")),
            complete_and_unlock: names.render(&format!(
                "WITH done AS ({COMPLETE} WHERE handler = $1 AND key = $2 RETURNING 1){UNLOCK_AFTER_DONE}"
            )),
            complete_many: names.render(&format!("{COMPLETE} WHERE handler = $1 AND key = ANY($2)")),
            complete_many_and_unlock: names.render(&format!(
                "WITH done AS ({COMPLETE} WHERE handler = $1 AND key = ANY($2) RETURNING 1){UNLOCK_AFTER_DONE}"
            )),
            record_failure: names.render(RECORD_FAILURE),
            record_retry: names.render(RECORD_RETRY),
            purge_expired: names.render(PURGE_EXPIRED),
            claim_fresh: names.render(CLAIM_FRESH),
            claim_fresh_many: names.render(CLAIM_FRESH_MANY),
            count_fresh_failure: names.render(COUNT_FRESH_FAILURE),
            mark_insert: names.render(MARK_INSERT),
            mark_select: names.render(MARK_SELECT),
            mark_update: names.render(MARK_UPDATE),
        }
    }

    fn migrate<'a>(
        pool: &'a Pool<Self>,
        names: &'a TableNames,
    ) -> BoxFuture<'a, Result<(), Error>> {
        Box::pin(migrate(pool, names))
    }

    fn unlock_keys<'a>(
        conn: &'a mut PgConnection,
        lock_ids: &'a [i64],
    ) -> BoxFuture<'a, Result<(), sqlx::Error>> {
        Box::pin(async move {
            sqlx::query("SELECT pg_advisory_unlock(id) FROM unnest($1::bigint[]) AS u(id)")
                .bind(lock_ids)
                .execute(conn)
                .await?;
            Ok(())
        })
    }

    fn begin_attempts<'a>(
        conn: &'a mut PgConnection,
        names: &'a TableNames,
        handler: &'a str,
        items: &'a [AttemptItem<'a>],
        max_attempts: u32,
        lock_ids: &'a [i64],
    ) -> BoxFuture<'a, Result<Vec<Claim>, sqlx::Error>> {
        Box::pin(async move {
            let keys: Vec<&str> = items.iter().map(|i| i.key).collect();
            let hashes: Vec<&str> = items.iter().map(|i| i.hash).collect();
            let attempts: Vec<i32> = items.iter().map(|i| attempt_number(i.attempt)).collect();
            // One statement: see `BEGIN_ATTEMPTS`.
            let counted: Vec<(String, i32)> = sqlx::query_as(&names.sql.begin_attempts)
                .bind(handler)
                .bind(&keys)
                .bind(&hashes)
                .bind(i64::from(max_attempts))
                .bind(lock_ids)
                .bind(&attempts)
                .fetch_all(&mut *conn)
                .await?;
            let counted: std::collections::HashMap<String, i32> = counted.into_iter().collect();
            let missing: Vec<&str> = keys
                .iter()
                .copied()
                .filter(|k| !counted.contains_key(*k))
                .collect();
            let mut existing = std::collections::HashMap::new();
            if !missing.is_empty() {
                let rows = sqlx::query(&names.sql.select_entries)
                    .bind(handler)
                    .bind(&missing)
                    .fetch_all(&mut *conn)
                    .await?;
                for r in rows {
                    existing.insert(r.try_get::<String, _>("key")?, entry_from_row(&r)?);
                }
            }
            items
                .iter()
                .map(|item| match counted.get(item.key) {
                    Some(attempt) => Ok(Claim::Run {
                        attempt: (*attempt).max(0) as u32,
                    }),
                    None => existing
                        .remove(item.key)
                        .map(|e| Claim::from_entry(e, item.hash, item.attempt))
                        .ok_or(sqlx::Error::RowNotFound),
                })
                .collect()
        })
    }

    fn complete_many<'a>(
        conn: &'a mut PgConnection,
        names: &'a TableNames,
        handler: &'a str,
        keys: &'a [String],
        retention: Duration,
        unlock: &'a [i64],
    ) -> BoxFuture<'a, Result<(), sqlx::Error>> {
        Box::pin(async move {
            let sql = if unlock.is_empty() {
                &names.sql.complete_many
            } else {
                &names.sql.complete_many_and_unlock
            };
            let q = sqlx::query(sql)
                .bind(handler)
                .bind(keys)
                .bind(i64::try_from(retention.as_millis()).unwrap_or(i64::MAX));
            let q = if unlock.is_empty() { q } else { q.bind(unlock) };
            q.execute(conn).await?;
            Ok(())
        })
    }

    fn begin_attempt<'a>(
        conn: &'a mut PgConnection,
        names: &'a TableNames,
        handler: &'a str,
        key: &'a str,
        payload_hash: &'a str,
        attempt: u32,
        max_attempts: u32,
        lock_ids: &'a [i64],
    ) -> BoxFuture<'a, Result<Claim, sqlx::Error>> {
        Box::pin(async move {
            // One round trip: see `BEGIN_ATTEMPT`.
            let counted: Option<i32> = sqlx::query_scalar(&names.sql.begin_attempt)
                .bind(handler)
                .bind(key)
                .bind(payload_hash)
                .bind(i64::from(max_attempts))
                .bind(lock_ids)
                .bind(attempt_number(attempt))
                .fetch_optional(&mut *conn)
                .await?;
            Ok(match counted {
                Some(counted) => Claim::Run {
                    attempt: counted.max(0) as u32,
                },
                None => match fetch_entry(conn, names, handler, key).await? {
                    Some(entry) => Claim::from_entry(entry, payload_hash, attempt),
                    None => return Err(sqlx::Error::RowNotFound),
                },
            })
        })
    }

    fn begin_handler(
        conn: &mut PgConnection,
        timeout: Duration,
    ) -> BoxFuture<'_, Result<sqlx::Transaction<'_, Self>, sqlx::Error>> {
        conn.begin_with(begin_with_timeouts(timeout))
    }

    fn claim_fresh<'a>(
        conn: &'a mut PgConnection,
        names: &'a TableNames,
        handler: &'a str,
        key: &'a str,
        payload_hash: &'a str,
        retention: Duration,
    ) -> BoxFuture<'a, Result<bool, sqlx::Error>> {
        Box::pin(async move {
            let done = sqlx::query(&names.sql.claim_fresh)
                .bind(handler)
                .bind(key)
                .bind(payload_hash)
                .bind(i64::try_from(retention.as_millis()).unwrap_or(i64::MAX))
                .execute(conn)
                .await?;
            Ok(done.rows_affected() == 1)
        })
    }

    fn claim_fresh_many<'a>(
        conn: &'a mut PgConnection,
        names: &'a TableNames,
        handler: &'a str,
        items: &'a [(&'a str, &'a str)],
        retention: Duration,
    ) -> BoxFuture<'a, Result<Vec<String>, sqlx::Error>> {
        Box::pin(async move {
            let (keys, hashes): (Vec<&str>, Vec<&str>) = items.iter().copied().unzip();
            sqlx::query_scalar(&names.sql.claim_fresh_many)
                .bind(handler)
                .bind(keys)
                .bind(hashes)
                .bind(i64::try_from(retention.as_millis()).unwrap_or(i64::MAX))
                .fetch_all(conn)
                .await
        })
    }

    fn count_fresh_failure<'a>(
        conn: &'a mut PgConnection,
        names: &'a TableNames,
        handler: &'a str,
        key: &'a str,
        payload_hash: &'a str,
    ) -> BoxFuture<'a, Result<(), sqlx::Error>> {
        Box::pin(async move {
            sqlx::query(&names.sql.count_fresh_failure)
                .bind(handler)
                .bind(key)
                .bind(payload_hash)
                .execute(conn)
                .await?;
            Ok(())
        })
    }

    fn complete<'a>(
        conn: &'a mut PgConnection,
        names: &'a TableNames,
        handler: &'a str,
        key: &'a str,
        retention: Duration,
        unlock: &'a [i64],
    ) -> BoxFuture<'a, Result<(), sqlx::Error>> {
        Box::pin(async move {
            let sql = if unlock.is_empty() {
                &names.sql.complete
            } else {
                &names.sql.complete_and_unlock
            };
            let q = sqlx::query(sql)
                .bind(handler)
                .bind(key)
                .bind(i64::try_from(retention.as_millis()).unwrap_or(i64::MAX));
            let q = if unlock.is_empty() { q } else { q.bind(unlock) };
            q.execute(conn).await?;
            Ok(())
        })
    }

    fn record_retry<'a>(
        pool: &'a Pool<Self>,
        names: &'a TableNames,
        handler: &'a str,
        key: &'a str,
        attempt: u32,
    ) -> BoxFuture<'a, Result<(), sqlx::Error>> {
        Box::pin(async move {
            sqlx::query(&names.sql.record_retry)
                .bind(handler)
                .bind(key)
                .bind(attempt_number(attempt))
                .execute(pool)
                .await?;
            Ok(())
        })
    }

    fn record_failure<'a>(
        conn: &'a mut PgConnection,
        names: &'a TableNames,
        handler: &'a str,
        key: &'a str,
        error: &'a str,
        dead: bool,
    ) -> BoxFuture<'a, Result<(), sqlx::Error>> {
        Box::pin(async move {
            sqlx::query(&names.sql.record_failure)
                .bind(handler)
                .bind(key)
                .bind(error)
                .bind(dead)
                .execute(conn)
                .await?;
            Ok(())
        })
    }

    fn entry<'a>(
        pool: &'a Pool<Self>,
        names: &'a TableNames,
        handler: &'a str,
        key: &'a str,
    ) -> BoxFuture<'a, Result<Option<InboxEntry>, sqlx::Error>> {
        Box::pin(async move {
            let mut conn = pool.acquire().await?;
            fetch_entry(&mut conn, names, handler, key).await
        })
    }

    fn advance_log_mark<'a>(
        conn: &'a mut PgConnection,
        names: &'a TableNames,
        handler: &'a str,
        log: &'a str,
        to: i64,
    ) -> BoxFuture<'a, Result<Option<i64>, sqlx::Error>> {
        Box::pin(async move {
            let mut tx = sqlx::Connection::begin(conn).await?;
            sqlx::query(&names.sql.mark_insert)
                .bind(handler)
                .bind(log)
                .execute(&mut *tx)
                .await?;
            let before: Option<i64> = sqlx::query_scalar(&names.sql.mark_select)
                .bind(handler)
                .bind(log)
                .fetch_one(&mut *tx)
                .await?;
            sqlx::query(&names.sql.mark_update)
                .bind(handler)
                .bind(log)
                .bind(to)
                .execute(&mut *tx)
                .await?;
            tx.commit().await?;
            Ok(before)
        })
    }

    fn log_mark<'a>(
        pool: &'a Pool<Self>,
        names: &'a TableNames,
        handler: &'a str,
        log: &'a str,
    ) -> BoxFuture<'a, Result<Option<i64>, sqlx::Error>> {
        Box::pin(async move {
            let mark: Option<Option<i64>> = sqlx::query_scalar(&names.sql.mark_select)
                .bind(handler)
                .bind(log)
                .fetch_optional(pool)
                .await?;
            Ok(mark.flatten())
        })
    }

    fn purge_expired<'a>(
        pool: &'a Pool<Self>,
        names: &'a TableNames,
        batch: u32,
    ) -> BoxFuture<'a, Result<u64, sqlx::Error>> {
        Box::pin(async move {
            let r = sqlx::query(&names.sql.purge_expired)
                .bind(i64::from(batch))
                .execute(pool)
                .await?;
            Ok(r.rows_affected())
        })
    }

    fn execute_guard<'a>(
        conn: &'a mut PgConnection,
        sql: &'a str,
        args: Vec<GuardValue>,
    ) -> BoxFuture<'a, Result<u64, sqlx::Error>> {
        Box::pin(async move {
            let mut q = sqlx::query(sql);
            for a in args {
                q = match a {
                    GuardValue::Int(v) => q.bind(v),
                    GuardValue::Text(v) => q.bind(v),
                };
            }
            Ok(q.execute(conn).await?.rows_affected())
        })
    }
}

/// `BEGIN` and the handler's timeout as the transaction's `statement_timeout` and
/// `lock_timeout` (see `Backend::begin_handler`): one simple query, so one round trip, as a
/// bare `BEGIN` is. `SET LOCAL` ends with the transaction, so a pooled connection keeps its
/// own settings. In whole milliseconds, at least 1 (0 would turn the timeouts off) and at
/// most the settings' maximum.
fn begin_with_timeouts(timeout: Duration) -> String {
    let ms = timeout.as_millis().clamp(1, i32::MAX as u128);
    format!("BEGIN; SET LOCAL statement_timeout = {ms}; SET LOCAL lock_timeout = {ms}")
}

/// An attempt number as the `INTEGER` columns hold it.
fn attempt_number(attempt: u32) -> i32 {
    i32::try_from(attempt).unwrap_or(i32::MAX)
}

async fn fetch_entry(
    conn: &mut PgConnection,
    names: &TableNames,
    handler: &str,
    key: &str,
) -> Result<Option<InboxEntry>, sqlx::Error> {
    let row = sqlx::query(&names.sql.fetch_entry)
        .bind(handler)
        .bind(key)
        .fetch_optional(conn)
        .await?;
    row.as_ref().map(entry_from_row).transpose()
}

fn entry_from_row(r: &sqlx::postgres::PgRow) -> Result<InboxEntry, sqlx::Error> {
    Ok(InboxEntry {
        status: EntryStatus::parse(r.try_get::<&str, _>("status")?),
        attempts: r.try_get::<i32, _>("attempts")?.max(0) as u32,
        payload_hash: r.try_get("payload_hash")?,
        last_error: r.try_get("last_error")?,
        retried_to: r.try_get::<i32, _>("retried_to")?.max(0) as u32,
    })
}

async fn migrate(pool: &Pool<Postgres>, names: &TableNames) -> Result<(), Error> {
    let mut tx = pool.begin().await?;
    // Workers starting together would race on CREATE ... IF NOT EXISTS (it is not
    // atomic in PostgreSQL); one transaction-scoped lock serialises them.
    sqlx::query("SELECT pg_advisory_xact_lock($1)")
        .bind(super::lock_id("migrate", "", &names.inbox))
        .execute(&mut *tx)
        .await?;
    if let Some(schema) = &names.schema {
        sqlx::query(&format!("CREATE SCHEMA IF NOT EXISTS {}", schema.quoted()))
            .execute(&mut *tx)
            .await?;
    }
    sqlx::query(&format!(
        "CREATE TABLE IF NOT EXISTS {} (version INTEGER PRIMARY KEY, \
             applied_at TIMESTAMPTZ NOT NULL DEFAULT now())",
        names.migrations
    ))
    .execute(&mut *tx)
    .await?;
    let current: Option<i32> =
        sqlx::query_scalar(&format!("SELECT max(version) FROM {}", names.migrations))
            .fetch_one(&mut *tx)
            .await?;
    for (version, sql) in MIGRATIONS {
        if current.is_some_and(|c| c >= *version) {
            continue;
        }
        let script = names.render(sql);
        // A plain string runs unprepared, so the script may hold several statements.
        sqlx::Executor::execute(&mut *tx, script.as_str()).await?;
        sqlx::query(&format!(
            "INSERT INTO {} (version) VALUES ($1)",
            names.migrations
        ))
        .bind(version)
        .execute(&mut *tx)
        .await?;
    }
    tx.commit().await?;
    Ok(())
}
