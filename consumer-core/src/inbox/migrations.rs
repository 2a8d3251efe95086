//! The shipped migrations of each database, and the runner that applies those a table has
//! not had yet (recorded in `<table>_migrations`), safe to race between workers.

use sqlx::{Connection, Pool, Postgres, Sqlite};

use super::config::TableNames;
use super::dialect::Clock;
use crate::Error;

const POSTGRES: &[(i32, &str)] = &[
    (1, include_str!("../../migrations/postgres/0001_inbox.sql")),
    (
        2,
        include_str!("../../migrations/postgres/0002_log_marks.sql"),
    ),
    (
        3,
        include_str!("../../migrations/postgres/0003_retried_to.sql"),
    ),
    (
        4,
        include_str!("../../migrations/postgres/0004_copy_scope.sql"),
    ),
    (5, include_str!("../../migrations/postgres/0005_outbox.sql")),
    (
        6,
        include_str!("../../migrations/postgres/0006_replies.sql"),
    ),
    (
        7,
        include_str!("../../migrations/postgres/0007_dead_letters.sql"),
    ),
    (
        8,
        include_str!("../../migrations/postgres/0008_pending_retention.sql"),
    ),
    (
        9,
        include_str!("../../migrations/postgres/0009_key_templates.sql"),
    ),
];

const SQLITE: &[(i64, &str)] = &[
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
    (5, include_str!("../../migrations/sqlite/0005_outbox.sql")),
    (6, include_str!("../../migrations/sqlite/0006_replies.sql")),
    (
        7,
        include_str!("../../migrations/sqlite/0007_dead_letters.sql"),
    ),
    (
        8,
        include_str!("../../migrations/sqlite/0008_pending_retention.sql"),
    ),
    (
        9,
        include_str!("../../migrations/sqlite/0009_key_templates.sql"),
    ),
];

/// Applies the PostgreSQL migrations `names`' table has not had.
pub(super) async fn postgres(pool: &Pool<Postgres>, names: &TableNames) -> Result<(), Error> {
    let mut tx = pool.begin().await?;
    // Workers starting together would race on CREATE ... IF NOT EXISTS (it is not
    // atomic in PostgreSQL); one transaction-scoped lock serialises them.
    sqlx::query("SELECT pg_advisory_xact_lock($1)")
        .bind(super::locks::lock_id("migrate", "", &names.inbox))
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
    for (version, sql) in POSTGRES {
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

/// Applies the SQLite migrations `names`' table has not had.
pub(super) async fn sqlite(pool: &Pool<Sqlite>, names: &TableNames) -> Result<(), Error> {
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
    for (version, sql) in SQLITE {
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
        .bind(Clock::read().unix_ms())
        .execute(&mut *tx)
        .await?;
    }
    tx.commit().await?;
    Ok(())
}
