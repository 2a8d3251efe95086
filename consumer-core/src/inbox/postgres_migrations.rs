//! PostgreSQL's migrations of the inbox's tables: the scripts, in order, and how they are
//! applied once per database, however many workers start together.

use sqlx::{Pool, Postgres};

use super::config::TableNames;
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
];

pub(super) async fn migrate(pool: &Pool<Postgres>, names: &TableNames) -> Result<(), Error> {
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
