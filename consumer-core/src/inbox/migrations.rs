//! The shipped migrations of each database, applied by [`crate::migrate`] (those a table has
//! not had yet, recorded in `<table>_migrations`, safe to race between workers).

use sqlx::{Pool, Postgres, Sqlite};

use super::config::TableNames;
use crate::migrate::Ledger;
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
    (
        10,
        include_str!("../../migrations/postgres/0010_outbox_quiet_notify.sql"),
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
    let schema = names.schema.as_ref().map(|s| s.quoted());
    let ledger = Ledger {
        table: &names.migrations,
        schema: schema.as_deref(),
        lock: super::locks::lock_id("migrate", "", &names.inbox),
    };
    crate::migrate::postgres(pool, ledger, POSTGRES, |sql| names.render(sql)).await?;
    Ok(())
}

/// Applies the SQLite migrations `names`' table has not had.
pub(super) async fn sqlite(pool: &Pool<Sqlite>, names: &TableNames) -> Result<(), Error> {
    crate::migrate::sqlite(pool, &names.migrations, SQLITE, |sql| names.render(sql)).await?;
    Ok(())
}
