//! SQLite: the embedded default, one process. Cross-worker exclusion comes from the
//! in-process key locks alone, so a database file must not be shared by two processes.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use futures::future::BoxFuture;
use sqlx::{Connection, Pool, Row, Sqlite, SqliteConnection};

use super::backend::{Backend, GuardValue};
use super::claim::{AttemptItem, Claim};
use super::config::{Statements, TableNames};
use super::entry::{EntryStatus, InboxCounts, InboxEntry};
use crate::Error;

const MIGRATIONS: &[(i64, &str)] = &[
    (1, include_str!("../../migrations/sqlite/0001_inbox.sql")),
    (
        2,
        include_str!("../../migrations/sqlite/0002_log_marks.sql"),
    ),
    (
        3,
        include_str!("../../migrations/sqlite/0003_retried_to.sql"),
    ),
    (
        4,
        include_str!("../../migrations/sqlite/0004_copy_scope.sql"),
    ),
];

/// `now` (Unix milliseconds) plus `d`.
fn after(now: i64, d: Duration) -> i64 {
    now.saturating_add(i64::try_from(d.as_millis()).unwrap_or(i64::MAX))
}

fn now_ms() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX))
        .unwrap_or_default()
}

impl Backend for Sqlite {
    const NAME: &'static str = "sqlite";

    fn placeholder(n: usize) -> String {
        format!("?{n}")
    }

    fn check_config(names: &TableNames) -> Result<(), Error> {
        match names.schema {
            Some(_) => Err(Error::config(
                "inbox.schema",
                "SQLite has no schemas; leave it unset and choose a table name",
            )),
            None => Ok(()),
        }
    }

    fn migrate<'a>(
        pool: &'a Pool<Self>,
        names: &'a TableNames,
    ) -> BoxFuture<'a, Result<(), Error>> {
        Box::pin(migrate(pool, names))
    }

    fn statements(names: &TableNames) -> Statements {
        Statements {
            begin_attempt: names.render(
                "INSERT INTO {inbox} AS i (handler, key, payload_hash, status, attempts, first_seen, updated_at) \
                 VALUES (?1, ?2, ?3, 'pending', 1, ?5, ?5) \
                 ON CONFLICT (handler, key) DO UPDATE SET attempts = i.attempts + 1, updated_at = ?5 \
                 WHERE i.status = 'pending' AND i.payload_hash = excluded.payload_hash AND i.attempts < ?4 \
                 AND NOT coalesce(i.retried_to > ?6 AND i.retry_scope = ?7 \
                   AND i.retry_due_at > ?5 - {copy_grace_ms}, 0) \
                 RETURNING attempts",
            ),
            fetch_entry: names.render(
                "SELECT status, attempts, payload_hash, last_error, retried_to, retry_scope, \
                 retry_due_at - ?3 AS copy_due_in_ms FROM {inbox} \
                 WHERE handler = ?1 AND key = ?2",
            ),
            // Only a pending row counted at this attempt (see `Backend::complete`).
            complete: names.render(
                "UPDATE {inbox} SET status = 'completed', completed_at = ?3, updated_at = ?3, \
                 expires_at = ?4, last_error = NULL \
                 WHERE handler = ?1 AND key = ?2 AND status = 'pending' AND attempts = ?5",
            ),
            record_failure: names.render(
                "UPDATE {inbox} SET last_error = ?3, updated_at = ?5, \
                 status = CASE WHEN ?4 THEN 'dead' ELSE status END, \
                 expires_at = CASE WHEN ?4 THEN ?6 ELSE expires_at END \
                 WHERE handler = ?1 AND key = ?2 AND status <> 'completed'",
            ),
            // The scope and due time are the newest copy's.
            record_retry: names.render(
                "UPDATE {inbox} SET retried_to = max(retried_to, ?3), \
                 retry_scope = CASE WHEN ?3 >= retried_to THEN ?5 ELSE retry_scope END, \
                 retry_due_at = CASE WHEN ?3 >= retried_to THEN ?6 ELSE retry_due_at END, \
                 updated_at = ?4 \
                 WHERE handler = ?1 AND key = ?2 AND status = 'pending'",
            ),
            uncount_attempt: names.render(
                "UPDATE {inbox} SET attempts = attempts - 1, updated_at = ?4 \
                 WHERE handler = ?1 AND key = ?2 AND status = 'pending' AND attempts = ?3",
            ),
            counts: names.render(
                "SELECT status, count(*), ?2 - min(updated_at) FROM {inbox} \
                 WHERE handler = ?1 GROUP BY status",
            ),
            release_dead: names.render(
                "DELETE FROM {inbox} WHERE handler = ?1 AND key = ?2 AND status = 'dead'",
            ),
            // Each status's condition on its own, so each partial index serves its part.
            purge_expired: names.render(
                "DELETE FROM {inbox} WHERE rowid IN (\
                 SELECT rowid FROM {inbox} WHERE (status = 'completed' AND expires_at < ?1) \
                 OR (status = 'dead' AND expires_at < ?1) LIMIT ?2)",
            ),
            claim_fresh: names.render(
                "INSERT INTO {inbox} (handler, key, payload_hash, status, attempts, first_seen, \
                 updated_at, completed_at, expires_at) \
                 VALUES (?1, ?2, ?3, 'completed', 1, ?4, ?4, ?4, ?5) \
                 ON CONFLICT (handler, key) DO NOTHING",
            ),
            count_fresh_failure: names.render(
                "INSERT INTO {inbox} (handler, key, payload_hash, status, attempts, first_seen, \
                 updated_at) VALUES (?1, ?2, ?3, 'pending', 1, ?4, ?4) \
                 ON CONFLICT (handler, key) DO NOTHING",
            ),
            mark_insert: names.render(
                "INSERT INTO {log_marks} (handler, log, updated_at) VALUES (?1, ?2, ?3) \
                 ON CONFLICT (handler, log) DO NOTHING",
            ),
            mark_select: names.render(
                "SELECT mark FROM {log_marks} WHERE handler = ?1 AND log = ?2",
            ),
            // SQLite's max() is NULL if an argument is.
            mark_update: names.render(
                "UPDATE {log_marks} SET mark = max(coalesce(mark, ?3), ?3), updated_at = ?4 \
                 WHERE handler = ?1 AND log = ?2",
            ),
            // Batches use the trait's per-key defaults; SQLite has no database locks.
            ..Statements::default()
        }
    }

    fn lock_namespace<'a>(
        _pool: &'a Pool<Self>,
        _names: &'a TableNames,
    ) -> BoxFuture<'a, Result<Option<String>, Error>> {
        Box::pin(async { Ok(None) })
    }

    // The in-process key locks serve one process; there is no database lock. (Two inboxes on
    // one file are kept apart by the completion's condition, see `Backend::complete`.)
    fn unlock_keys<'a>(
        _conn: &'a mut SqliteConnection,
        _lock_ids: &'a [i64],
    ) -> BoxFuture<'a, Result<(), sqlx::Error>> {
        Box::pin(async { Ok(()) })
    }

    fn begin_attempt<'a>(
        conn: &'a mut SqliteConnection,
        names: &'a TableNames,
        handler: &'a str,
        item: &'a AttemptItem<'a>,
        max_attempts: u32,
        _lock_ids: &'a [i64],
    ) -> BoxFuture<'a, Result<Claim, sqlx::Error>> {
        Box::pin(async move {
            let now = now_ms();
            let counted: Option<i64> = sqlx::query_scalar(&names.sql.begin_attempt)
                .bind(handler)
                .bind(item.key)
                .bind(item.hash)
                .bind(i64::from(max_attempts))
                .bind(now)
                .bind(i64::from(item.attempt))
                .bind(item.scope)
                .fetch_optional(&mut *conn)
                .await?;
            Ok(match counted {
                Some(counted) => Claim::Run {
                    attempt: u32::try_from(counted).unwrap_or(u32::MAX),
                },
                None => match fetch_entry(conn, names, handler, item.key).await? {
                    Some(entry) => Claim::from_entry(entry, item, names.copy_grace),
                    None => return Err(sqlx::Error::RowNotFound),
                },
            })
        })
    }

    fn begin_handler(
        conn: &mut SqliteConnection,
        _timeout: Duration,
    ) -> BoxFuture<'_, Result<sqlx::Transaction<'_, Self>, sqlx::Error>> {
        // A deferred transaction that reads, then writes, fails at once with SQLITE_BUSY when
        // another connection wrote in between; IMMEDIATE waits for the write lock instead.
        conn.begin_with("BEGIN IMMEDIATE")
    }

    fn claim_fresh<'a>(
        conn: &'a mut SqliteConnection,
        names: &'a TableNames,
        handler: &'a str,
        key: &'a str,
        payload_hash: &'a str,
        retention: Duration,
    ) -> BoxFuture<'a, Result<bool, sqlx::Error>> {
        Box::pin(async move {
            let now = now_ms();
            let expires =
                now.saturating_add(i64::try_from(retention.as_millis()).unwrap_or(i64::MAX));
            let done = sqlx::query(&names.sql.claim_fresh)
                .bind(handler)
                .bind(key)
                .bind(payload_hash)
                .bind(now)
                .bind(expires)
                .execute(conn)
                .await?;
            Ok(done.rows_affected() == 1)
        })
    }

    fn count_fresh_failure<'a>(
        conn: &'a mut SqliteConnection,
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
                .bind(now_ms())
                .execute(conn)
                .await?;
            Ok(())
        })
    }

    fn complete<'a>(
        conn: &'a mut SqliteConnection,
        names: &'a TableNames,
        handler: &'a str,
        key: &'a str,
        attempt: u32,
        retention: Duration,
        // No database locks on SQLite (see `unlock_keys`).
        _unlock: &'a [i64],
    ) -> BoxFuture<'a, Result<bool, sqlx::Error>> {
        Box::pin(async move {
            let now = now_ms();
            let done = sqlx::query(&names.sql.complete)
                .bind(handler)
                .bind(key)
                .bind(now)
                .bind(after(now, retention))
                .bind(i64::from(attempt))
                .execute(conn)
                .await?;
            Ok(done.rows_affected() == 1)
        })
    }

    fn record_retry<'a>(
        pool: &'a Pool<Self>,
        names: &'a TableNames,
        handler: &'a str,
        key: &'a str,
        attempt: u32,
        scope: &'a str,
        delay: Duration,
    ) -> BoxFuture<'a, Result<(), sqlx::Error>> {
        Box::pin(async move {
            let now = now_ms();
            sqlx::query(&names.sql.record_retry)
                .bind(handler)
                .bind(key)
                .bind(i64::from(attempt))
                .bind(now)
                .bind(scope)
                .bind(after(now, delay))
                .execute(pool)
                .await?;
            Ok(())
        })
    }

    fn uncount_attempt<'a>(
        pool: &'a Pool<Self>,
        names: &'a TableNames,
        handler: &'a str,
        key: &'a str,
        attempt: u32,
    ) -> BoxFuture<'a, Result<bool, sqlx::Error>> {
        Box::pin(async move {
            let done = sqlx::query(&names.sql.uncount_attempt)
                .bind(handler)
                .bind(key)
                .bind(i64::from(attempt))
                .bind(now_ms())
                .execute(pool)
                .await?;
            Ok(done.rows_affected() == 1)
        })
    }

    fn record_failure<'a>(
        conn: &'a mut SqliteConnection,
        names: &'a TableNames,
        handler: &'a str,
        key: &'a str,
        error: &'a str,
        dead: bool,
        retention: Duration,
    ) -> BoxFuture<'a, Result<(), sqlx::Error>> {
        Box::pin(async move {
            let now = now_ms();
            sqlx::query(&names.sql.record_failure)
                .bind(handler)
                .bind(key)
                .bind(error)
                .bind(dead)
                .bind(now)
                .bind(after(now, retention))
                .execute(conn)
                .await?;
            Ok(())
        })
    }

    fn release_dead<'a>(
        pool: &'a Pool<Self>,
        names: &'a TableNames,
        handler: &'a str,
        key: &'a str,
    ) -> BoxFuture<'a, Result<bool, sqlx::Error>> {
        Box::pin(async move {
            let done = sqlx::query(&names.sql.release_dead)
                .bind(handler)
                .bind(key)
                .execute(pool)
                .await?;
            Ok(done.rows_affected() == 1)
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
        conn: &'a mut SqliteConnection,
        names: &'a TableNames,
        handler: &'a str,
        log: &'a str,
        to: i64,
    ) -> BoxFuture<'a, Result<Option<i64>, sqlx::Error>> {
        Box::pin(async move {
            // IMMEDIATE: the write lock from the start, so the read sees the latest mark.
            let mut tx = conn.begin_with("BEGIN IMMEDIATE").await?;
            let now = now_ms();
            sqlx::query(&names.sql.mark_insert)
                .bind(handler)
                .bind(log)
                .bind(now)
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
                .bind(now)
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

    fn counts<'a>(
        pool: &'a Pool<Self>,
        names: &'a TableNames,
        handler: &'a str,
    ) -> BoxFuture<'a, Result<InboxCounts, sqlx::Error>> {
        Box::pin(async move {
            let rows: Vec<(String, i64, Option<i64>)> = sqlx::query_as(&names.sql.counts)
                .bind(handler)
                .bind(now_ms())
                .fetch_all(pool)
                .await?;
            Ok(InboxCounts::from_rows(rows))
        })
    }

    fn purge_expired<'a>(
        pool: &'a Pool<Self>,
        names: &'a TableNames,
        batch: u32,
    ) -> BoxFuture<'a, Result<u64, sqlx::Error>> {
        Box::pin(async move {
            let r = sqlx::query(&names.sql.purge_expired)
                .bind(now_ms())
                .bind(i64::from(batch))
                .execute(pool)
                .await?;
            Ok(r.rows_affected())
        })
    }

    fn execute_guard<'a>(
        conn: &'a mut SqliteConnection,
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

async fn fetch_entry(
    conn: &mut SqliteConnection,
    names: &TableNames,
    handler: &str,
    key: &str,
) -> Result<Option<InboxEntry>, sqlx::Error> {
    let row = sqlx::query(&names.sql.fetch_entry)
        .bind(handler)
        .bind(key)
        .bind(now_ms())
        .fetch_optional(conn)
        .await?;
    row.map(|r| {
        Ok(InboxEntry {
            status: EntryStatus::parse(r.try_get::<&str, _>("status")?),
            attempts: u32::try_from(r.try_get::<i64, _>("attempts")?).unwrap_or(0),
            payload_hash: r.try_get("payload_hash")?,
            last_error: r.try_get("last_error")?,
            retried_to: u32::try_from(r.try_get::<i64, _>("retried_to")?).unwrap_or(0),
            retry_scope: r.try_get("retry_scope")?,
            copy_due_in_ms: r.try_get("copy_due_in_ms")?,
        })
    })
    .transpose()
}

async fn migrate(pool: &Pool<Sqlite>, names: &TableNames) -> Result<(), Error> {
    let mut conn = pool.acquire().await?;
    // IMMEDIATE takes the write lock up front: two starters serialise here.
    let mut tx = conn.begin_with("BEGIN IMMEDIATE").await?;
    sqlx::query(&format!(
        "CREATE TABLE IF NOT EXISTS {} (version INTEGER PRIMARY KEY, applied_at INTEGER NOT NULL)",
        names.migrations
    ))
    .execute(&mut *tx)
    .await?;
    let current: Option<i64> =
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
            "INSERT INTO {} (version, applied_at) VALUES (?1, ?2)",
            names.migrations
        ))
        .bind(version)
        .bind(now_ms())
        .execute(&mut *tx)
        .await?;
    }
    tx.commit().await?;
    Ok(())
}
