//! PostgreSQL: production, many workers in many processes.

use std::time::Duration;

use futures::future::BoxFuture;
use sqlx::{Connection, PgConnection, Pool, Postgres, Row};

use super::{Backend, Claim, EntryStatus, InboxEntry, TableNames};
use crate::guard::GuardValue;
use crate::Error;

const MIGRATIONS: &[(i32, &str)] = &[(1, include_str!("../../migrations/postgres/0001_inbox.sql"))];

impl Backend for Postgres {
    const NAME: &'static str = "postgres";

    fn placeholder(n: usize) -> String {
        format!("${n}")
    }

    fn check_config(_names: &TableNames) -> Result<(), Error> {
        Ok(())
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
        items: &'a [(String, String)],
        max_attempts: u32,
        lock_ids: &'a [i64],
    ) -> BoxFuture<'a, Result<Vec<Claim>, sqlx::Error>> {
        Box::pin(async move {
            let keys: Vec<&str> = items.iter().map(|(k, _)| k.as_str()).collect();
            let hashes: Vec<&str> = items.iter().map(|(_, h)| h.as_str()).collect();
            // One statement: the locks (in ascending order: the sorted subquery, and the
            // aggregate makes all of them come before any row), asynchronous commit (see
            // `begin_attempt`), and the count.
            let counted: Vec<(String, i32)> = sqlx::query_as(&format!(
                "WITH l AS (SELECT count(pg_advisory_lock(id)) AS n FROM \
                   (SELECT id FROM unnest($5::bigint[]) AS u(id) ORDER BY id) AS s), \
                 c AS (SELECT set_config('synchronous_commit', 'off', true) AS v) \
                 INSERT INTO {t} AS i (handler, key, payload_hash, status, attempts) \
                 SELECT $1, u.key, u.hash, 'pending', 1 \
                 FROM unnest($2::text[], $3::text[]) AS u(key, hash), l, c \
                 ON CONFLICT (handler, key) DO UPDATE SET attempts = i.attempts + 1, updated_at = now() \
                 WHERE i.status = 'pending' AND i.payload_hash = EXCLUDED.payload_hash AND i.attempts < $4 \
                 RETURNING key, attempts",
                t = names.inbox
            ))
            .bind(handler)
            .bind(&keys)
            .bind(&hashes)
            .bind(i64::from(max_attempts))
            .bind(lock_ids)
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
                let rows = sqlx::query(&format!(
                    "SELECT key, status, attempts, payload_hash, last_error FROM {} \
                     WHERE handler = $1 AND key = ANY($2)",
                    names.inbox
                ))
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
                .map(|(key, hash)| match counted.get(key) {
                    Some(attempt) => Ok(Claim::Run {
                        attempt: (*attempt).max(0) as u32,
                    }),
                    None => existing
                        .remove(key)
                        .map(|e| Claim::from_entry(e, hash))
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
    ) -> BoxFuture<'a, Result<(), sqlx::Error>> {
        Box::pin(async move {
            sqlx::query(&format!(
                "UPDATE {} SET status = 'completed', completed_at = now(), updated_at = now(), \
                 expires_at = now() + $3 * interval '1 millisecond', last_error = NULL \
                 WHERE handler = $1 AND key = ANY($2)",
                names.inbox
            ))
            .bind(handler)
            .bind(keys)
            .bind(i64::try_from(retention.as_millis()).unwrap_or(i64::MAX))
            .execute(conn)
            .await?;
            Ok(())
        })
    }

    fn begin_attempt<'a>(
        conn: &'a mut PgConnection,
        names: &'a TableNames,
        handler: &'a str,
        key: &'a str,
        payload_hash: &'a str,
        max_attempts: u32,
        lock_ids: &'a [i64],
    ) -> BoxFuture<'a, Result<Claim, sqlx::Error>> {
        Box::pin(async move {
            // One round trip: take the key's session lock, make this statement's implicit
            // transaction commit asynchronously, count the attempt. The count must survive
            // the worker being killed, not the database server crashing, so it stays off the
            // fsync path; the handler's own transaction commits synchronously. (An INSERT ...
            // ON CONFLICT DO UPDATE sees the latest committed row even if it was committed
            // while this statement waited for the lock.)
            let counted: Option<i32> = sqlx::query_scalar(&format!(
                "WITH l AS (SELECT count(pg_advisory_lock(id)) AS n FROM unnest($5::bigint[]) AS u(id)), \
                 c AS (SELECT set_config('synchronous_commit', 'off', true) AS v) \
                 INSERT INTO {t} AS i (handler, key, payload_hash, status, attempts) \
                 SELECT $1, $2, $3, 'pending', 1 FROM l, c \
                 ON CONFLICT (handler, key) DO UPDATE SET attempts = i.attempts + 1, updated_at = now() \
                 WHERE i.status = 'pending' AND i.payload_hash = EXCLUDED.payload_hash AND i.attempts < $4 \
                 RETURNING attempts",
                t = names.inbox
            ))
            .bind(handler)
            .bind(key)
            .bind(payload_hash)
            .bind(i64::from(max_attempts))
            .bind(lock_ids)
            .fetch_optional(&mut *conn)
            .await?;
            Ok(match counted {
                Some(attempt) => Claim::Run {
                    attempt: attempt.max(0) as u32,
                },
                None => match fetch_entry(conn, names, handler, key).await? {
                    Some(entry) => Claim::from_entry(entry, payload_hash),
                    None => return Err(sqlx::Error::RowNotFound),
                },
            })
        })
    }

    fn begin_handler(
        conn: &mut PgConnection,
    ) -> BoxFuture<'_, Result<sqlx::Transaction<'_, Self>, sqlx::Error>> {
        conn.begin()
    }

    fn complete<'a>(
        conn: &'a mut PgConnection,
        names: &'a TableNames,
        handler: &'a str,
        key: &'a str,
        retention: Duration,
    ) -> BoxFuture<'a, Result<(), sqlx::Error>> {
        Box::pin(async move {
            sqlx::query(&format!(
                "UPDATE {} SET status = 'completed', completed_at = now(), updated_at = now(), \
                 expires_at = now() + $3 * interval '1 millisecond', last_error = NULL \
                 WHERE handler = $1 AND key = $2",
                names.inbox
            ))
            .bind(handler)
            .bind(key)
            .bind(i64::try_from(retention.as_millis()).unwrap_or(i64::MAX))
            .execute(conn)
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
            sqlx::query(&format!(
                "UPDATE {} SET last_error = $3, updated_at = now(), \
                 status = CASE WHEN $4 THEN 'dead' ELSE status END \
                 WHERE handler = $1 AND key = $2 AND status <> 'completed'",
                names.inbox
            ))
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

    fn purge_expired<'a>(
        pool: &'a Pool<Self>,
        names: &'a TableNames,
        batch: u32,
    ) -> BoxFuture<'a, Result<u64, sqlx::Error>> {
        Box::pin(async move {
            let r = sqlx::query(&format!(
                "DELETE FROM {t} WHERE ctid = ANY(ARRAY(\
                 SELECT ctid FROM {t} WHERE status = 'completed' AND expires_at < now() LIMIT $1))",
                t = names.inbox
            ))
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

async fn fetch_entry(
    conn: &mut PgConnection,
    names: &TableNames,
    handler: &str,
    key: &str,
) -> Result<Option<InboxEntry>, sqlx::Error> {
    let row = sqlx::query(&format!(
        "SELECT status, attempts, payload_hash, last_error FROM {} WHERE handler = $1 AND key = $2",
        names.inbox
    ))
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
