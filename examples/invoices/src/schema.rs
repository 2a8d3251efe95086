//! The tables of the example: `orders`, `invoices` and `provider_calls`, and the chaos
//! suite's `effect_ledger` and `worker_stats`.

use consumer_core::ident::Identifier;
use sqlx::PgPool;

/// The tables, in schema `{schema}`.
///
/// `invoices.order_id` deliberately has no unique constraint, and `provider_calls` records
/// every call: the tests count rows, so a duplicate effect would show instead of being
/// hidden by a constraint. A production schema would add `UNIQUE (order_id)` as a second
/// line of defence.
///
/// `effect_ledger` is the chaos suite's oracle: one row per committed handler run, written
/// by the handler inside its transaction, with no unique key on `(job_id, handler)`, so an
/// effect committed twice shows as two rows. `worker_stats` holds each worker process's
/// counters (a row per process and handler), written periodically and at shutdown when `STATS_INTERVAL_MS` is set.
pub const TABLES: &str = r#"
CREATE TABLE IF NOT EXISTS {schema}.orders (
    id           BIGINT PRIMARY KEY,
    amount       BIGINT NOT NULL,
    email        TEXT NOT NULL,
    invoice_sent BOOLEAN NOT NULL DEFAULT false,
    email_sent   BOOLEAN NOT NULL DEFAULT false
);
CREATE TABLE IF NOT EXISTS {schema}.invoices (
    id         BIGSERIAL PRIMARY KEY,
    order_id   BIGINT NOT NULL REFERENCES {schema}.orders (id),
    amount     BIGINT NOT NULL,
    created_at TIMESTAMPTZ NOT NULL DEFAULT now()
);
CREATE TABLE IF NOT EXISTS {schema}.provider_calls (
    id              BIGSERIAL PRIMARY KEY,
    idempotency_key TEXT NOT NULL,
    recipient       TEXT NOT NULL,
    subject         TEXT NOT NULL,
    received_at     TIMESTAMPTZ NOT NULL DEFAULT now()
);
CREATE INDEX IF NOT EXISTS provider_calls_idempotency_key
    ON {schema}.provider_calls (idempotency_key);
CREATE TABLE IF NOT EXISTS {schema}.effect_ledger (
    job_id      BIGINT NOT NULL,
    handler     TEXT NOT NULL,
    key         TEXT NOT NULL,
    attempt     INTEGER NOT NULL,
    pid         INTEGER NOT NULL,
    recorded_at TIMESTAMPTZ NOT NULL DEFAULT now()
);
CREATE TABLE IF NOT EXISTS {schema}.worker_stats (
    pid           INTEGER NOT NULL,
    started_at    TIMESTAMPTZ NOT NULL,
    handler       TEXT NOT NULL,
    received      BIGINT NOT NULL,
    redelivered   BIGINT NOT NULL,
    handler_runs  BIGINT NOT NULL,
    completed     BIGINT NOT NULL,
    duplicates    BIGINT NOT NULL,
    superseded    BIGINT NOT NULL,
    retries       BIGINT NOT NULL,
    dead_lettered BIGINT NOT NULL,
    quarantined   BIGINT NOT NULL,
    settle_errors BIGINT NOT NULL,
    updated_at    TIMESTAMPTZ NOT NULL DEFAULT now(),
    PRIMARY KEY (pid, started_at, handler)
);
"#;

/// Creates the schema (if missing) and the tables. Safe to run from several workers at once:
/// they take turns on an advisory lock.
pub async fn migrate(pool: &PgPool, schema: &str) -> Result<(), consumer_core::Error> {
    let schema = Identifier::parse("db.schema", schema)?;
    let mut tx = pool.begin().await?;
    sqlx::query("SELECT pg_advisory_xact_lock(hashtext('invoices example schema'))")
        .execute(&mut *tx)
        .await?;
    sqlx::raw_sql(&format!(
        "CREATE SCHEMA IF NOT EXISTS {s};{tables}",
        s = schema.quoted(),
        tables = TABLES.replace("{schema}", &schema.quoted())
    ))
    .execute(&mut *tx)
    .await?;
    tx.commit().await?;
    Ok(())
}

/// Places the orders of `jobs` (the application's part, before any invoice job is published).
/// Existing orders are left alone.
pub async fn place_orders(
    pool: &PgPool,
    jobs: impl IntoIterator<Item = &crate::InvoiceJob>,
) -> Result<(), sqlx::Error> {
    let mut tx = pool.begin().await?;
    for job in jobs {
        sqlx::query(
            "INSERT INTO orders (id, amount, email) VALUES ($1, $2, $3) ON CONFLICT (id) DO NOTHING",
        )
        .bind(job.order_id)
        .bind(job.amount)
        .bind(&job.email)
        .execute(&mut *tx)
        .await?;
    }
    tx.commit().await
}
