//! Shared by the integration tests: real PostgreSQL (a fresh schema per test) and
//! SQLite (a fresh file per test).

use std::future::Future;
use std::str::FromStr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use consumer_core::{Inbox, InboxConfig};
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::{Postgres, Sqlite};

/// The longest any test waits for a condition.
pub const DEADLINE: Duration = Duration::from_secs(60);

/// The PostgreSQL URL started by `scripts/postgres.sh` (see the README's test command).
pub fn database_url() -> String {
    std::env::var("DATABASE_URL").expect(
        "DATABASE_URL is not set: run the tests with `scripts/test.sh`, which starts PostgreSQL",
    )
}

/// A name unique to this test run and call, usable as a schema, queue or topic name.
pub fn unique(prefix: &str) -> String {
    static N: AtomicU64 = AtomicU64::new(0);
    let n = N.fetch_add(1, Ordering::Relaxed);
    let t = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_micros())
        .unwrap_or_default();
    format!("{prefix}_{}_{t}_{n}", std::process::id())
}

/// Waits for `cond` with [`DEADLINE`], polling; panics naming `what` on timeout.
pub async fn wait_until<F, Fut>(what: &str, cond: F)
where
    F: FnMut() -> Fut,
    Fut: Future<Output = bool>,
{
    wait_for(what, DEADLINE, cond).await;
}

/// Waits for `cond` up to `limit`, polling every 20 ms; panics naming `what` on timeout.
pub async fn wait_for<F, Fut>(what: &str, limit: Duration, mut cond: F)
where
    F: FnMut() -> Fut,
    Fut: Future<Output = bool>,
{
    let start = tokio::time::Instant::now();
    while !cond().await {
        assert!(
            start.elapsed() < limit,
            "timed out after {limit:?} waiting for {what}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Runs `worker` on `deliveries` until `done` holds, then stops it gracefully.
pub async fn run_until<DB, H, T, F, Fut>(
    worker: &consumer_core::Worker<DB, H>,
    deliveries: T,
    what: &str,
    done: F,
) where
    DB: consumer_core::Backend,
    H: consumer_core::Handler<DB>,
    T: consumer_core::Transport,
    F: FnMut() -> Fut,
    Fut: Future<Output = bool>,
{
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let running = tokio::spawn({
        let worker = worker.clone();
        async move {
            worker
                .run(deliveries, async {
                    let _ = stopped.await;
                })
                .await
        }
    });
    wait_until(what, done).await;
    stop.send(()).expect("the worker is still running");
    running
        .await
        .expect("the worker task")
        .expect("the worker stopped cleanly");
}

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
        let options = PgConnectOptions::from_str(&database_url())
            .expect("DATABASE_URL")
            .options([("search_path", self.schema.as_str())]);
        let pool = PgPoolOptions::new()
            .max_connections(6)
            .acquire_timeout(Duration::from_secs(30))
            .connect_with(options)
            .await
            .expect("connect to PostgreSQL");
        Inbox::new(pool, config).await.expect("inbox")
    }
}

/// A fresh SQLite file.
pub struct SqliteEnv {
    /// The directory holding the database file, removed when dropped.
    pub dir: tempfile::TempDir,
    /// The inbox on the file, which also holds the `ledger` and `orders` tables.
    pub inbox: Inbox<Sqlite>,
}

impl SqliteEnv {
    /// Creates the file, its inbox and the `ledger` and `orders` tables.
    pub async fn new() -> SqliteEnv {
        let dir = tempfile::tempdir().expect("tempdir");
        let inbox = Inbox::open_sqlite(dir.path().join("inbox.db"))
            .await
            .expect("inbox");
        sqlx::raw_sql(
            "CREATE TABLE ledger (job_id TEXT NOT NULL, attempt INTEGER NOT NULL);
             CREATE TABLE orders (id INTEGER PRIMARY KEY, invoice_sent BOOLEAN NOT NULL DEFAULT false, status TEXT NOT NULL DEFAULT 'created');",
        )
        .execute(inbox.pool())
        .await
        .expect("create test tables");
        SqliteEnv { dir, inbox }
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
