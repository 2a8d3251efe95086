//! PostgreSQL: production, many workers in many processes.

use std::time::Duration;

use futures::future::BoxFuture;
use sqlx::postgres::{PgArguments, PgQueryResult, PgRow};
use sqlx::{Arguments, Connection, PgConnection, Pool, Postgres, Row};

use super::backend::Backend;
use super::claim::{AttemptItem, Claim};
use super::config::{Statements, TableNames};
use super::dialect::{Arg, Dialect};
use super::entry::{EntryStatus, InboxEntry};
use super::flow;
use crate::Error;

// The statements, with `{inbox}` for the table; rendered once per inbox.

/// One round trip: take the key's session lock, make this statement's implicit transaction
/// commit asynchronously, count the attempt. The count must survive the worker being killed,
/// not the database server crashing, so it stays off the fsync path; the handler's own
/// transaction commits synchronously. (An INSERT ... ON CONFLICT DO UPDATE sees the latest
/// committed row even if it was committed while this statement waited for the lock.) A
/// delivery (attempt number `$6`, copy scope `$7`) that the row's newest retry copy
/// supersedes is not counted: the copy is numbered above it, goes to the same scope, and is
/// not overdue by more than the grace period (`InboxEntry::superseded` states the same rule;
/// see the migrations `0003_retried_to.sql` and `0004_copy_scope.sql`).
const BEGIN_ATTEMPT: &str =
    "WITH l AS (SELECT count(pg_advisory_lock(id)) AS n FROM unnest($5::bigint[]) AS u(id)), \
     c AS (SELECT set_config('synchronous_commit', 'off', true) AS v) \
     INSERT INTO {inbox} AS i (handler, key, payload_hash, status, attempts) \
     SELECT $1, $2, $3, 'pending', 1 FROM l, c \
     ON CONFLICT (handler, key) DO UPDATE SET attempts = i.attempts + 1, updated_at = now() \
     WHERE i.status = 'pending' AND i.payload_hash = EXCLUDED.payload_hash AND i.attempts < $4 \
     AND NOT COALESCE(i.retried_to > $6 AND i.retry_scope = $7 \
       AND i.retry_due_at > now() - {copy_grace_ms} * interval '1 millisecond', false) \
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
     AND NOT EXISTS (SELECT 1 FROM unnest($2::text[], $6::int[], $7::text[]) AS a(key, attempt, scope) \
       WHERE a.key = EXCLUDED.key AND i.retried_to > a.attempt AND i.retry_scope = a.scope \
       AND i.retry_due_at > now() - {copy_grace_ms} * interval '1 millisecond') \
     RETURNING key, attempts";

/// An entry's columns (see `entry_from_row`).
const ENTRY_COLUMNS: &str = "status, attempts, payload_hash, last_error, retried_to, retry_scope, \
     (extract(epoch FROM retry_due_at - now()) * 1000)::bigint AS copy_due_in_ms";

/// Marks keys completed (`i`: the inbox); the caller appends the `FROM` and `WHERE`. Only a
/// pending row counted at this attempt is completed (see `Backend::complete`).
const COMPLETE: &str = "UPDATE {inbox} AS i SET status = 'completed', completed_at = now(), \
     updated_at = now(), expires_at = now() + $3 * interval '1 millisecond', last_error = NULL";

/// [`COMPLETE`]'s condition for one key counted at attempt `$4`.
const COMPLETE_ONE: &str =
    " WHERE i.handler = $1 AND i.key = $2 AND i.status = 'pending' AND i.attempts = $4";

/// [`COMPLETE`]'s condition for the keys `$2`, each counted at its attempt in `$4`.
const COMPLETE_MANY: &str = " FROM unnest($2::text[], $4::int[]) AS u(key, attempt) \
     WHERE i.handler = $1 AND i.key = u.key AND i.status = 'pending' AND i.attempts = u.attempt";

/// Follows `WITH done AS (<COMPLETE ...> RETURNING 1)`: returns how many rows were
/// completed, and releases the session locks `$5` only after the update ran to the end (each
/// unlock waits on the row count of `done`, and a data-modifying CTE runs to completion
/// before its output is complete), so the updated rows are locked by this transaction before
/// any key lock is released.
const UNLOCK_AFTER_DONE: &str = ", d AS (SELECT count(*) AS n FROM done) \
     SELECT d.n, count(CASE WHEN d.n >= 0 THEN pg_advisory_unlock(u.id) END) \
     FROM d, unnest($5::bigint[]) AS u(id) GROUP BY d.n";

/// A retry copy carrying attempt `$3` is with the broker, for the scope `$4`, due in `$5`
/// milliseconds (see `Backend::record_retry`); the scope and due time are the newest copy's.
/// Like the attempt count, it must survive a worker crash, not a database crash (then a
/// replay runs once more, as it would without the record), so it commits asynchronously.
const RECORD_RETRY: &str = "WITH c AS (SELECT set_config('synchronous_commit', 'off', true) AS v) \
     UPDATE {inbox} SET retried_to = GREATEST(retried_to, $3), \
     retry_scope = CASE WHEN $3 >= retried_to THEN $4 ELSE retry_scope END, \
     retry_due_at = CASE WHEN $3 >= retried_to THEN now() + $5 * interval '1 millisecond' \
       ELSE retry_due_at END, \
     updated_at = now() FROM c \
     WHERE handler = $1 AND key = $2 AND status = 'pending'";

/// A dead row expires after the retention `$5`, like a completed one.
const RECORD_FAILURE: &str = "UPDATE {inbox} SET last_error = $3, updated_at = now(), \
     status = CASE WHEN $4 THEN 'dead' ELSE status END, \
     expires_at = CASE WHEN $4 THEN now() + $5 * interval '1 millisecond' ELSE expires_at END \
     WHERE handler = $1 AND key = $2 AND status <> 'completed'";

/// Gives back the attempt `$3` whose commit failed (see `Backend::uncount_attempt`).
const UNCOUNT_ATTEMPT: &str = "UPDATE {inbox} SET attempts = attempts - 1, updated_at = now() \
     WHERE handler = $1 AND key = $2 AND status = 'pending' AND attempts = $3";

const RELEASE_DEAD: &str =
    "DELETE FROM {inbox} WHERE handler = $1 AND key = $2 AND status = 'dead'";

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

/// [`CLAIM_FRESH_MANY`] as a plain insert, in the same key order: no speculative insertion
/// and no confirmation record per row, so it costs the database less; a key with a row
/// fails it (a unique violation, see `Backend::claim_new_many`).
const CLAIM_NEW_MANY: &str = "INSERT INTO {inbox} \
     (handler, key, payload_hash, status, attempts, completed_at, expires_at) \
     SELECT $1, u.key, u.hash, 'completed', 1, now(), now() + $4 * interval '1 millisecond' \
     FROM unnest($2::text[], $3::text[]) AS u(key, hash) ORDER BY u.key";

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

/// Each status's condition on its own, so each partial index serves its part.
const PURGE_EXPIRED: &str = "DELETE FROM {inbox} WHERE ctid = ANY(ARRAY(\
     SELECT ctid FROM {inbox} WHERE (status = 'completed' AND expires_at < now()) \
     OR (status = 'dead' AND expires_at < now()) LIMIT $1))";

/// Up to `$4` pending rows of the handlers `$1` that nothing has updated for the retention
/// (`$2` milliseconds) and whose newest retry copy, if any, was due longer ago than the
/// retention plus the copy grace (`$3`): see `Backend::purge_stale_pending`. A row updated
/// between the selection and the delete is a new version, with another `ctid`: it stays.
const PURGE_STALE_PENDING: &str = "DELETE FROM {inbox} WHERE ctid = ANY(ARRAY(\
     SELECT ctid FROM {inbox} WHERE status = 'pending' AND handler = ANY($1) \
     AND updated_at < now() - $2 * interval '1 millisecond' \
     AND (retry_due_at IS NULL OR retry_due_at < now() - $3 * interval '1 millisecond') \
     LIMIT $4))";

/// Renames the row of key `$2` under one of the aliases `$3` to the handler `$1`, unless
/// `$1` has a row for it; of several, the one that says most (completed, then dead).
const ADOPT: &str = "UPDATE {inbox} SET handler = $1 WHERE ctid = (SELECT ctid FROM {inbox} \
     WHERE handler = ANY($3) AND key = $2 \
     AND NOT EXISTS (SELECT 1 FROM {inbox} WHERE handler = $1 AND key = $2) \
     ORDER BY CASE status WHEN 'completed' THEN 0 WHEN 'dead' THEN 1 ELSE 2 END LIMIT 1)";

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
            select_entries: names.render(&format!(
                "SELECT key, {ENTRY_COLUMNS} FROM {{inbox}} WHERE handler = $1 AND key = ANY($2)"
            )),
            fetch_entry: names.render(&format!(
                "SELECT {ENTRY_COLUMNS} FROM {{inbox}} WHERE handler = $1 AND key = $2"
            )),
            complete: names.render(&format!("{COMPLETE}{COMPLETE_ONE}")),
            complete_and_unlock: names.render(&format!(
                "WITH done AS ({COMPLETE}{COMPLETE_ONE} RETURNING 1){UNLOCK_AFTER_DONE}"
            )),
            complete_many: names.render(&format!("{COMPLETE}{COMPLETE_MANY}")),
            complete_many_and_unlock: names.render(&format!(
                "WITH done AS ({COMPLETE}{COMPLETE_MANY} RETURNING 1){UNLOCK_AFTER_DONE}"
            )),
            record_failure: names.render(RECORD_FAILURE),
            record_retry: names.render(RECORD_RETRY),
            uncount_attempt: names.render(UNCOUNT_ATTEMPT),
            counts: names.render(
                "SELECT status, count(*), \
                 (extract(epoch FROM now() - min(updated_at)) * 1000)::bigint \
                 FROM {inbox} WHERE handler = $1 GROUP BY status",
            ),
            handlers: names.render(
                "SELECT handler, count(*), NULL::bigint FROM {inbox} GROUP BY handler ORDER BY handler",
            ),
            purge_older: names.render(
                "DELETE FROM {inbox} WHERE status = $1 \
                 AND updated_at <= now() - $2 * interval '1 millisecond'",
            ),
            count_older: names.render(
                "SELECT status, count(*), NULL::bigint FROM {inbox} WHERE status = $1 \
                 AND updated_at <= now() - $2 * interval '1 millisecond' GROUP BY status",
            ),
            release_dead: names.render(RELEASE_DEAD),
            purge_expired: names.render(PURGE_EXPIRED),
            purge_stale_pending: names.render(PURGE_STALE_PENDING),
            alias_keys: names.render(
                "SELECT key, 0::bigint FROM {inbox} WHERE handler = ANY($1) AND key = ANY($2)",
            ),
            adopt: names.render(ADOPT),
            claim_fresh: names.render(CLAIM_FRESH),
            claim_fresh_many: names.render(CLAIM_FRESH_MANY),
            claim_new_many: names.render(CLAIM_NEW_MANY),
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
        Box::pin(super::migrations::postgres(pool, names))
    }

    fn lock_namespace<'a>(
        pool: &'a Pool<Self>,
        names: &'a TableNames,
    ) -> BoxFuture<'a, Result<Option<String>, Error>> {
        Box::pin(async move {
            // The schema the table's name resolves to: `consumer_inbox` and
            // `"public"."consumer_inbox"` are one table, and must take one set of locks.
            let schema: Option<String> = sqlx::query_scalar(
                "SELECT n.nspname::text FROM pg_class c \
                 JOIN pg_namespace n ON n.oid = c.relnamespace WHERE c.oid = to_regclass($1)",
            )
            .bind(&names.inbox)
            .fetch_optional(pool)
            .await?;
            let Some(schema) = schema else {
                return Err(Error::config(
                    "inbox.table",
                    format!(
                        "{} does not resolve to a table after the migrations",
                        names.inbox
                    ),
                ));
            };
            Ok(Some(format!(
                "\"{}\".{}",
                schema.replace('"', "\"\""),
                names.unqualified_table()
            )))
        })
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

    // What PostgreSQL does its own way: a batch takes one statement (the trait's defaults
    // loop over the keys), and the completion releases the advisory locks.

    fn begin_attempts<'a>(
        conn: &'a mut PgConnection,
        names: &'a TableNames,
        handler: &'a str,
        items: &'a [AttemptItem<'a>],
        max_attempts: u32,
        lock_ids: &'a [i64],
    ) -> BoxFuture<'a, Result<Vec<Claim>, sqlx::Error>> {
        Box::pin(async move {
            if !names.aliases.is_empty() {
                for item in items {
                    flow::adopt::<Self>(conn, names, handler, item.key).await?;
                }
            }
            let keys: Vec<&str> = items.iter().map(|i| i.key).collect();
            let hashes: Vec<&str> = items.iter().map(|i| i.hash).collect();
            let attempts: Vec<i32> = items.iter().map(|i| attempt_number(i.attempt)).collect();
            let scopes: Vec<Option<&str>> = items.iter().map(|i| i.scope).collect();
            // One statement: see `BEGIN_ATTEMPTS`.
            let counted: Vec<(String, i32)> = sqlx::query_as(&names.sql.begin_attempts)
                .bind(handler)
                .bind(&keys)
                .bind(&hashes)
                .bind(i64::from(max_attempts))
                .bind(lock_ids)
                .bind(&attempts)
                .bind(&scopes)
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
                    existing.insert(r.try_get::<String, _>("key")?, Self::entry_from_row(&r)?);
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
                        .map(|e| Claim::from_entry(e, item, names.copy_grace))
                        .ok_or(sqlx::Error::RowNotFound),
                })
                .collect()
        })
    }

    fn complete_many<'a>(
        conn: &'a mut PgConnection,
        names: &'a TableNames,
        handler: &'a str,
        keys: &'a [&'a str],
        attempts: &'a [u32],
        retention: Duration,
        unlock: &'a [i64],
    ) -> BoxFuture<'a, Result<u64, sqlx::Error>> {
        Box::pin(async move {
            let attempts: Vec<i32> = attempts.iter().map(|a| attempt_number(*a)).collect();
            let (sql, unlock) = match unlock {
                [] => (&names.sql.complete_many, None),
                ids => (&names.sql.complete_many_and_unlock, Some(ids)),
            };
            completing(sql, handler, keys, retention, attempts, unlock, conn).await
        })
    }

    fn begin_handler(
        conn: &mut PgConnection,
        timeout: Duration,
    ) -> BoxFuture<'_, Result<sqlx::Transaction<'_, Self>, sqlx::Error>> {
        conn.begin_with(begin_with_timeouts(timeout))
    }

    fn check_not_aborted<'a>(conn: &'a mut PgConnection) -> BoxFuture<'a, Result<(), sqlx::Error>> {
        // An empty select list: the cheapest statement there is, and like any other it
        // fails on an aborted transaction. A simple query, so one message each way.
        Box::pin(async move { sqlx::Executor::execute(conn, "SELECT").await.map(drop) })
    }

    fn claim_fresh_many<'a>(
        conn: &'a mut PgConnection,
        names: &'a TableNames,
        handler: &'a str,
        items: &'a [(&'a str, &'a str)],
        retention: Duration,
    ) -> BoxFuture<'a, Result<Vec<String>, sqlx::Error>> {
        Box::pin(async move {
            let (items, mut taken) = flow::without_alias_keys::<Self>(conn, names, items).await?;
            if !items.is_empty() {
                let args = claim_arguments(handler, &items, retention)?;
                let had_rows: Vec<String> =
                    sqlx::query_scalar_with(&names.sql.claim_fresh_many, args)
                        .fetch_all(conn)
                        .await?;
                taken.extend(had_rows);
            }
            Ok(taken)
        })
    }

    fn claim_new_many<'a>(
        conn: &'a mut PgConnection,
        names: &'a TableNames,
        handler: &'a str,
        items: &'a [(&'a str, &'a str)],
        retention: Duration,
    ) -> BoxFuture<'a, Result<Vec<String>, sqlx::Error>> {
        Box::pin(async move {
            let (items, taken) = flow::without_alias_keys::<Self>(conn, names, items).await?;
            if !items.is_empty() {
                let args = claim_arguments(handler, &items, retention)?;
                sqlx::query_with(&names.sql.claim_new_many, args)
                    .execute(conn)
                    .await?;
            }
            Ok(taken)
        })
    }

    fn complete<'a>(
        conn: &'a mut PgConnection,
        names: &'a TableNames,
        handler: &'a str,
        key: &'a str,
        attempt: u32,
        retention: Duration,
        unlock: &'a [i64],
    ) -> BoxFuture<'a, Result<bool, sqlx::Error>> {
        Box::pin(async move {
            let (sql, unlock) = match unlock {
                [] => (&names.sql.complete, None),
                ids => (&names.sql.complete_and_unlock, Some(ids)),
            };
            let attempt = attempt_number(attempt);
            Ok(completing(sql, handler, key, retention, attempt, unlock, conn).await? == 1)
        })
    }
}

impl Dialect for Postgres {
    fn arguments<'q>(args: &[Arg<'q>]) -> Result<PgArguments, sqlx::Error> {
        let mut bound = PgArguments::default();
        for arg in args {
            match *arg {
                Arg::Text(v) => bound.add(v),
                Arg::OptText(v) => bound.add(v),
                Arg::Int(v) => bound.add(v),
                Arg::Bool(v) => bound.add(v),
                Arg::Attempt(n) => bound.add(attempt_number(n)),
                // The statements read the server's clock, `now()`.
                Arg::Now(_) => Ok(()),
                Arg::After(_, d) => bound.add(millis(d)),
                Arg::Locks(ids) => bound.add(ids),
                Arg::Before(_, d) => bound.add(millis(d)),
                Arg::Bytes(v) => bound.add(v),
                Arg::Ids(ids) => bound.add(ids),
                Arg::Texts(texts) => bound.add(texts),
                Arg::OptTexts(texts) => bound.add(texts),
                Arg::ByteLists(bodies) => bound.add(bodies),
            }
            .map_err(sqlx::Error::Encode)?;
        }
        Ok(bound)
    }

    fn rows_affected(done: &PgQueryResult) -> u64 {
        done.rows_affected()
    }

    fn counted(row: &PgRow) -> Result<u32, sqlx::Error> {
        Ok(row.try_get::<i32, _>(0)?.max(0) as u32)
    }

    fn entry_from_row(r: &PgRow) -> Result<InboxEntry, sqlx::Error> {
        Ok(InboxEntry {
            status: EntryStatus::parse(r.try_get::<&str, _>("status")?),
            attempts: r.try_get::<i32, _>("attempts")?.max(0) as u32,
            payload_hash: r.try_get("payload_hash")?,
            last_error: r.try_get("last_error")?,
            retried_to: r.try_get::<i32, _>("retried_to")?.max(0) as u32,
            retry_scope: r.try_get("retry_scope")?,
            copy_due_in_ms: r.try_get("copy_due_in_ms")?,
        })
    }

    fn begin_marking(
        conn: &mut PgConnection,
    ) -> BoxFuture<'_, Result<sqlx::Transaction<'_, Self>, sqlx::Error>> {
        sqlx::Connection::begin(conn)
    }
}

/// `BEGIN` and the handler's timeout as the transaction's `statement_timeout` (see
/// `Backend::begin_handler`): one simple query, so one round trip, as a bare `BEGIN` is.
/// The timeout bounds a statement's waits for locks too, so no `lock_timeout` is set (an
/// equal one would end the same waits at the same moment, at one more statement's cost to
/// every transaction). `SET LOCAL` ends with the transaction, so a pooled connection keeps
/// its own settings. In whole milliseconds, at least 1 (0 would turn the timeout off) and
/// at most the setting's maximum.
fn begin_with_timeouts(timeout: Duration) -> String {
    let ms = timeout.as_millis().clamp(1, i32::MAX as u128);
    format!("BEGIN; SET LOCAL statement_timeout = {ms}")
}

/// Arguments for `values` values whose encoding takes about `bytes` bytes, sized once: sqlx
/// grows its buffer by doubling as values are added, and a batch's arrays (64 short keys and
/// their hashes take about 5 KiB) would otherwise be copied into a larger buffer several
/// times a statement. Room for each value's length prefix, or a number, is added here.
fn sized(values: usize, bytes: usize) -> PgArguments {
    let mut args = PgArguments::default();
    args.reserve(values, bytes + 12 * values);
    args
}

/// About how many bytes an array of `texts` takes in the binary protocol: its header (with
/// one dimension) and each element's length and text.
fn text_array(texts: &[&str]) -> usize {
    20 + texts.iter().map(|t| 4 + t.len()).sum::<usize>()
}

/// The arguments of a batch's fresh claim ([`CLAIM_FRESH_MANY`], [`CLAIM_NEW_MANY`]): the
/// handler, the keys, their payload hashes, the retention.
fn claim_arguments(
    handler: &str,
    items: &[(&str, &str)],
    retention: Duration,
) -> Result<PgArguments, sqlx::Error> {
    let (keys, hashes): (Vec<&str>, Vec<&str>) = items.iter().copied().unzip();
    let mut args = sized(4, handler.len() + text_array(&keys) + text_array(&hashes));
    args.add(handler).map_err(sqlx::Error::Encode)?;
    args.add(keys).map_err(sqlx::Error::Encode)?;
    args.add(hashes).map_err(sqlx::Error::Encode)?;
    args.add(millis(retention)).map_err(sqlx::Error::Encode)?;
    Ok(args)
}

/// An attempt number as the `INTEGER` columns hold it.
fn attempt_number(attempt: u32) -> i32 {
    i32::try_from(attempt).unwrap_or(i32::MAX)
}

/// A duration as the statements' millisecond parameters take it.
fn millis(d: Duration) -> i64 {
    i64::try_from(d.as_millis()).unwrap_or(i64::MAX)
}

/// Runs a completing statement (`$1` handler, `$2` key(s), `$3` retention, `$4` attempt(s),
/// `$5` the locks to release, for the `_and_unlock` forms) and returns how many rows it
/// completed.
async fn completing<'q, K, A>(
    sql: &'q str,
    handler: &'q str,
    keys: K,
    retention: Duration,
    attempts: A,
    unlock: Option<&'q [i64]>,
    conn: &mut PgConnection,
) -> Result<u64, sqlx::Error>
where
    K: 'q + Send + sqlx::Encode<'q, Postgres> + sqlx::Type<Postgres>,
    A: 'q + Send + sqlx::Encode<'q, Postgres> + sqlx::Type<Postgres>,
{
    let q = sqlx::query(sql)
        .bind(handler)
        .bind(keys)
        .bind(millis(retention))
        .bind(attempts);
    match unlock {
        None => Ok(q.execute(conn).await?.rows_affected()),
        Some(ids) => {
            let row = q.bind(ids).fetch_one(conn).await?;
            Ok(row.try_get::<i64, _>(0)?.max(0) as u64)
        }
    }
}
