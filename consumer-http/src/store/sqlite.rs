//! SQLite: one process (a database file must not be shared by two); the clock is SQLite's.

use futures::future::BoxFuture;
use sqlx::{Pool, Sqlite};

use super::backend::{render, store_ops, StoreBackend, EXPIRED};
use super::config::Names;
use crate::Error;

const MIGRATIONS: &[(i64, &str)] = &[
    (
        1,
        include_str!("../../migrations/sqlite/0001_idempotency.sql"),
    ),
    (
        2,
        include_str!("../../migrations/sqlite/0002_operations.sql"),
    ),
];

impl StoreBackend for Sqlite {
    const BACKEND: &'static str = "SQLite";
    const HAS_SCHEMAS: bool = false;
    // Julian days to Unix milliseconds; `'now'` has millisecond precision and is the same
    // throughout one statement.
    const NOW_MS: &'static str = "CAST((julianday('now') - 2440587.5) * 86400000 AS INTEGER)";

    fn begin_claim(_wait_ms: i64) -> String {
        // The write lock first (waiting up to the pool's busy timeout): the claim and the
        // answer are written in this transaction, and a deferred one that had read first
        // would fail to upgrade (`SQLITE_BUSY_SNAPSHOT`) once another request had written.
        "BEGIN IMMEDIATE".to_owned()
    }

    fn is_lock_timeout(_e: &sqlx::Error) -> bool {
        // One writer at a time: a duplicate waits for the write lock, not for a row.
        false
    }

    fn placeholders(sql: &str) -> String {
        // `$n` to `?n`: the statements hold no other `$`.
        sql.replace('$', "?")
    }

    fn purge_template() -> String {
        format!(
            "DELETE FROM {{table}} WHERE rowid IN (\
             SELECT rowid FROM {{table}} WHERE {EXPIRED} LIMIT $1)"
        )
    }

    fn migrate<'a>(pool: &'a Pool<Self>, names: &'a Names) -> BoxFuture<'a, Result<(), Error>> {
        Box::pin(migrate(pool, names))
    }

    store_ops!(Sqlite);
}

async fn migrate(pool: &Pool<Sqlite>, names: &Names) -> Result<(), Error> {
    consumer_core::migrate::sqlite(pool, &names.migrations, MIGRATIONS, |sql| {
        render::<Sqlite>(names, sql)
    })
    .await?;
    Ok(())
}
