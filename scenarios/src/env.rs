//! Server-free fixtures shared by every test in the workspace: names unique to a test,
//! waiting on a condition with a deadline, running a worker until a condition holds, and a
//! fresh SQLite file with the test tables.

use std::future::Future;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use consumer_core::Inbox;
use sqlx::Sqlite;

/// The longest any test waits for a condition.
pub const DEADLINE: Duration = Duration::from_secs(60);

/// The PostgreSQL URL the test command starts (see the README's test command).
pub fn database_url() -> String {
    std::env::var("DATABASE_URL").expect(
        "DATABASE_URL is not set: run the tests with `scripts/test.sh`, which starts PostgreSQL",
    )
}

/// The Redis URL the test command starts (see the README's test command).
pub fn redis_url() -> String {
    std::env::var("REDIS_URL")
        .expect("REDIS_URL is not set: run the tests with `scripts/test.sh`, which starts Redis")
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
    DB: consumer_core::inbox::Backend,
    H: consumer_core::Handler<DB>,
    T: consumer_core::transport::Transport,
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
