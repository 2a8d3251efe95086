//! SQLite: the embedded default, one process. Cross-worker exclusion comes from the
//! in-process key locks alone, so a database file must not be shared by two processes.

use std::time::Duration;

use futures::future::BoxFuture;
use sqlx::sqlite::{SqliteArguments, SqliteQueryResult, SqliteRow};
use sqlx::{Arguments, Connection, Pool, Row, Sqlite, SqliteConnection};

use super::backend::Backend;
use super::config::{Statements, TableNames};
use super::dialect::{Arg, Dialect};
use super::entry::{EntryStatus, InboxEntry};
use crate::Error;

/// `now` (Unix milliseconds) plus `d`.
fn after(now: i64, d: Duration) -> i64 {
    now.saturating_add(i64::try_from(d.as_millis()).unwrap_or(i64::MAX))
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
        Box::pin(super::migrations::sqlite(pool, names))
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
            handlers: names.render(
                "SELECT handler, count(*), NULL FROM {inbox} GROUP BY handler ORDER BY handler",
            ),
            purge_older: names.render(
                "DELETE FROM {inbox} WHERE status = ?1 AND updated_at <= ?2 - ?3",
            ),
            count_older: names.render(
                "SELECT status, count(*), NULL FROM {inbox} \
                 WHERE status = ?1 AND updated_at <= ?2 - ?3 GROUP BY status",
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
            // See `PURGE_STALE_PENDING` in the PostgreSQL backend.
            purge_stale_pending: names.render(
                "DELETE FROM {inbox} WHERE rowid IN (\
                 SELECT rowid FROM {inbox} WHERE status = 'pending' \
                 AND handler IN (SELECT value FROM json_each(?1)) AND updated_at < ?2 \
                 AND (retry_due_at IS NULL OR retry_due_at < ?3) LIMIT ?4)",
            ),
            alias_keys: names.render(
                "SELECT key, 0 FROM {inbox} WHERE handler IN (SELECT value FROM json_each(?1)) \
                 AND key IN (SELECT value FROM json_each(?2))",
            ),
            // See `ADOPT` in the PostgreSQL backend.
            adopt: names.render(
                "UPDATE {inbox} SET handler = ?1 WHERE rowid = (SELECT rowid FROM {inbox} \
                 WHERE handler IN (SELECT value FROM json_each(?3)) AND key = ?2 \
                 AND NOT EXISTS (SELECT 1 FROM {inbox} WHERE handler = ?1 AND key = ?2) \
                 ORDER BY CASE status WHEN 'completed' THEN 0 WHEN 'dead' THEN 1 ELSE 2 END \
                 LIMIT 1)",
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

    fn begin_handler(
        conn: &mut SqliteConnection,
        _timeout: Duration,
    ) -> BoxFuture<'_, Result<sqlx::Transaction<'_, Self>, sqlx::Error>> {
        // A deferred transaction that reads, then writes, fails at once with SQLITE_BUSY when
        // another connection wrote in between; IMMEDIATE waits for the write lock instead.
        conn.begin_with("BEGIN IMMEDIATE")
    }
}

impl Dialect for Sqlite {
    fn arguments<'q>(args: &[Arg<'q>]) -> Result<SqliteArguments<'q>, sqlx::Error> {
        let mut bound = SqliteArguments::default();
        for arg in args {
            match *arg {
                Arg::Text(v) => bound.add(v),
                Arg::OptText(v) => bound.add(v),
                Arg::Int(v) => bound.add(v),
                Arg::Bool(v) => bound.add(v),
                Arg::Attempt(n) => bound.add(i64::from(n)),
                Arg::Now(now) => bound.add(now.unix_ms()),
                Arg::After(now, d) => bound.add(after(now.unix_ms(), d)),
                // No database locks (see `unlock_keys`).
                Arg::Locks(_) => Ok(()),
                Arg::Before(now, d) => bound.add(
                    now.unix_ms()
                        .saturating_sub(i64::try_from(d.as_millis()).unwrap_or(i64::MAX)),
                ),
                Arg::Bytes(v) => bound.add(v),
                Arg::Ids(ids) => bound.add(super::dialect::json_list(ids)),
                Arg::Texts(texts) => bound.add(super::dialect::json_list(texts)),
                Arg::OptTexts(texts) => bound.add(super::dialect::json_list(texts)),
                Arg::ByteLists(bodies) => bound.add(super::dialect::json_list(bodies)),
            }
            .map_err(sqlx::Error::Encode)?;
        }
        Ok(bound)
    }

    fn rows_affected(done: &SqliteQueryResult) -> u64 {
        done.rows_affected()
    }

    fn counted(row: &SqliteRow) -> Result<u32, sqlx::Error> {
        Ok(u32::try_from(row.try_get::<i64, _>(0)?).unwrap_or(u32::MAX))
    }

    fn entry_from_row(r: &SqliteRow) -> Result<InboxEntry, sqlx::Error> {
        Ok(InboxEntry {
            status: EntryStatus::parse(r.try_get::<&str, _>("status")?),
            attempts: u32::try_from(r.try_get::<i64, _>("attempts")?).unwrap_or(0),
            payload_hash: r.try_get("payload_hash")?,
            last_error: r.try_get("last_error")?,
            retried_to: u32::try_from(r.try_get::<i64, _>("retried_to")?).unwrap_or(0),
            retry_scope: r.try_get("retry_scope")?,
            copy_due_in_ms: r.try_get("copy_due_in_ms")?,
        })
    }

    fn begin_marking(
        conn: &mut SqliteConnection,
    ) -> BoxFuture<'_, Result<sqlx::Transaction<'_, Self>, sqlx::Error>> {
        // IMMEDIATE: the write lock from the start, so the read sees the latest mark.
        conn.begin_with("BEGIN IMMEDIATE")
    }
}
