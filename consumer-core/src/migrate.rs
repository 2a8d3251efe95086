//! The migration runner of the framework's tables, for core's inbox and for the crates built
//! on core that keep tables of their own (`consumer-http`'s idempotency store): a numbered
//! list of scripts, applied in order, each once, recorded in a ledger table next to the
//! tables they create, in one transaction that processes starting together take in turn.
//!
//! A script may hold several statements (it runs unprepared); the caller renders its names
//! (validated, quoted identifiers) before it runs.

use sqlx::{Connection, Pool, Postgres, Sqlite};

use crate::inbox::dialect::Clock;

/// Where a family of tables records its migrations, and how its migrators take turns.
#[derive(Debug, Clone, Copy)]
pub struct Ledger<'a> {
    /// The quoted, qualified ledger table (`"schema"."table_migrations"`), created if
    /// missing.
    pub table: &'a str,
    /// The quoted schema to create first, if the tables live in one (PostgreSQL).
    pub schema: Option<&'a str>,
    /// The advisory lock that serialises the migrators of these tables (PostgreSQL: `CREATE
    /// ... IF NOT EXISTS` is not atomic there); SQLite takes its write lock instead.
    pub lock: i64,
}

/// Applies the scripts of `scripts` (version, script, in ascending order) that `ledger` has
/// not recorded, each rendered by `render`, on PostgreSQL.
pub async fn postgres(
    pool: &Pool<Postgres>,
    ledger: Ledger<'_>,
    scripts: &[(i32, &str)],
    render: impl Fn(&str) -> String,
) -> Result<(), sqlx::Error> {
    let mut tx = pool.begin().await?;
    sqlx::query("SELECT pg_advisory_xact_lock($1)")
        .bind(ledger.lock)
        .execute(&mut *tx)
        .await?;
    if let Some(schema) = ledger.schema {
        sqlx::query(&format!("CREATE SCHEMA IF NOT EXISTS {schema}"))
            .execute(&mut *tx)
            .await?;
    }
    sqlx::query(&format!(
        "CREATE TABLE IF NOT EXISTS {} (version INTEGER PRIMARY KEY, \
         applied_at TIMESTAMPTZ NOT NULL DEFAULT now())",
        ledger.table
    ))
    .execute(&mut *tx)
    .await?;
    let current: Option<i32> =
        sqlx::query_scalar(&format!("SELECT max(version) FROM {}", ledger.table))
            .fetch_one(&mut *tx)
            .await?;
    for (version, script) in scripts {
        if current.is_some_and(|c| c >= *version) {
            continue;
        }
        let script = render(script);
        sqlx::Executor::execute(&mut *tx, script.as_str()).await?;
        sqlx::query(&format!(
            "INSERT INTO {} (version) VALUES ($1)",
            ledger.table
        ))
        .bind(version)
        .execute(&mut *tx)
        .await?;
    }
    tx.commit().await
}

/// [`postgres`] on SQLite: the write lock taken first (`BEGIN IMMEDIATE`), so two pools
/// migrating one file wait on each other; no schema, no advisory lock.
pub async fn sqlite(
    pool: &Pool<Sqlite>,
    ledger: &str,
    scripts: &[(i64, &str)],
    render: impl Fn(&str) -> String,
) -> Result<(), sqlx::Error> {
    let mut conn = pool.acquire().await?;
    let mut tx = conn.begin_with("BEGIN IMMEDIATE").await?;
    sqlx::query(&format!(
        "CREATE TABLE IF NOT EXISTS {ledger} (version INTEGER PRIMARY KEY, applied_at INTEGER NOT NULL)"
    ))
    .execute(&mut *tx)
    .await?;
    let current: Option<i64> = sqlx::query_scalar(&format!("SELECT max(version) FROM {ledger}"))
        .fetch_one(&mut *tx)
        .await?;
    for (version, script) in scripts {
        if current.is_some_and(|c| c >= *version) {
            continue;
        }
        let script = render(script);
        sqlx::Executor::execute(&mut *tx, script.as_str()).await?;
        sqlx::query(&format!(
            "INSERT INTO {ledger} (version, applied_at) VALUES (?1, ?2)"
        ))
        .bind(version)
        .bind(Clock::read().unix_ms())
        .execute(&mut *tx)
        .await?;
    }
    tx.commit().await
}
