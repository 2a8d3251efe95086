//! Shared by the integration tests: real PostgreSQL (a fresh schema per test), and the
//! server-free fixtures of `consumer-scenarios` (SQLite, unique names, waiting with a
//! deadline), which own them.

use std::str::FromStr;
use std::time::Duration;

use consumer_core::{Inbox, InboxConfig};
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::{PgPool, Postgres};

pub use consumer_scenarios::env::{
    database_url, redis_url, run_until, unique, wait_for, wait_until, SqliteEnv, DEADLINE,
};

/// A fresh PostgreSQL schema with the test tables; connections use it as `search_path`.
pub struct PgEnv {
    /// The schema's name, unique to the test.
    pub schema: String,
}

impl PgEnv {
    /// Creates the schema with its `ledger` and `orders` tables.
    pub async fn new() -> PgEnv {
        let schema = unique("t");
        let pool = PgPoolOptions::new()
            .max_connections(1)
            .connect(&database_url())
            .await
            .expect("connect to PostgreSQL");
        sqlx::raw_sql(&format!(
            "CREATE SCHEMA \"{schema}\";
             CREATE TABLE \"{schema}\".ledger (job_id TEXT NOT NULL, attempt INTEGER NOT NULL);
             CREATE TABLE \"{schema}\".orders (id BIGINT PRIMARY KEY, invoice_sent BOOLEAN NOT NULL DEFAULT false, status TEXT NOT NULL DEFAULT 'created');"
        ))
        .execute(&pool)
        .await
        .expect("create test schema");
        pool.close().await;
        PgEnv { schema }
    }

    /// A new pool and inbox, as another process would have (own pool, own in-process locks).
    pub async fn inbox(&self) -> Inbox<Postgres> {
        self.inbox_with(InboxConfig::in_schema(self.schema.clone()))
            .await
    }

    /// [`PgEnv::inbox`] with `config` (an unqualified table resolves to this schema).
    pub async fn inbox_with(&self, config: InboxConfig) -> Inbox<Postgres> {
        Inbox::new(self.pool(6).await, config).await.expect("inbox")
    }

    /// A new pool of up to `max` connections whose `search_path` is this schema.
    pub async fn pool(&self, max: u32) -> PgPool {
        let options = PgConnectOptions::from_str(&database_url())
            .expect("DATABASE_URL")
            .options([("search_path", self.schema.as_str())])
            // Names the schema's connections, so a test can find them (see `harness`).
            .application_name(&self.schema);
        PgPoolOptions::new()
            .max_connections(max)
            .acquire_timeout(Duration::from_secs(30))
            .connect_with(options)
            .await
            .expect("connect to PostgreSQL")
    }
}

/// Logs to the test's output, filtered by `RUST_LOG` (default: warnings).
pub fn init_tracing() {
    let _ = tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn")),
        )
        .with_test_writer()
        .try_init();
}

/// Waits, up to [`DEADLINE`], until a session named `application` (its
/// `application_name`), other than `conn`'s own, waits for a lock, then terminates it with
/// `pg_terminate_backend` through `conn`.
pub async fn terminate_when_waiting_for_a_lock(conn: &mut sqlx::PgConnection, application: &str) {
    let deadline = tokio::time::Instant::now() + DEADLINE;
    let pid: i32 = loop {
        let waiting = sqlx::query_scalar(
            "SELECT pid FROM pg_stat_activity WHERE application_name = $1 \
             AND wait_event_type = 'Lock' AND pid <> pg_backend_pid()",
        )
        .bind(application)
        .fetch_optional(&mut *conn)
        .await
        .expect("read pg_stat_activity");
        if let Some(pid) = waiting {
            break pid;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "no session of {application} waited for a lock within {DEADLINE:?}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    let terminated: bool = sqlx::query_scalar("SELECT pg_terminate_backend($1)")
        .bind(pid)
        .fetch_one(&mut *conn)
        .await
        .expect("terminate the waiting session");
    assert!(terminated, "the waiting session {pid} was terminated");
}
