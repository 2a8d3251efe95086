//! The database faults: the run's worker backends terminated (`pg_terminate_backend`),
//! PostgreSQL restarted in `fast` or `immediate` mode, and pool-exhaustion windows in
//! which the runner holds every connection slot the server has left, so the workers get
//! none. Only this run's workers are targeted: their connections carry the run's prefix as
//! their `application_name` (set in the `DATABASE_URL` the runner gives them), and other
//! runs sharing the server are never terminated.

use std::path::Path;
use std::str::FromStr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use anyhow::{bail, Context as _};
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::{Connection as _, PgConnection, PgPool};

use crate::rng::Rng;

/// Connection slots an exhaustion window leaves free: the runner's own pool (its drain
/// checks and oracle), other runs' runners, and an admin.
const SLOTS_LEFT_FREE: i64 = 4;

/// How long the runner keeps retrying its own database work while PostgreSQL is
/// restarting or its slots are held (by this run or another one on the same server).
const RUNNER_DB_PATIENCE: Duration = Duration::from_secs(180);

/// How `scripts/postgres.sh restart` stops the server (`CONSUMER_PG_STOP_MODE`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum StopMode {
    /// Connections closed, a shutdown checkpoint written.
    Fast,
    /// Every process killed at once, as in a crash: WAL recovery on the next start.
    Immediate,
}

impl StopMode {
    fn as_str(self) -> &'static str {
        match self {
            StopMode::Fast => "fast",
            StopMode::Immediate => "immediate",
        }
    }
}

/// What the database faults did, for the summary table.
#[derive(Debug, Default)]
pub(crate) struct DbFigures {
    /// Worker backends terminated.
    pub(crate) terminated: AtomicU64,
    /// PostgreSQL restarts, by mode.
    pub(crate) restarts_fast: AtomicU64,
    pub(crate) restarts_immediate: AtomicU64,
    /// Pool-exhaustion windows held, and the most connections held in one.
    pub(crate) windows: AtomicU64,
    pub(crate) most_held: AtomicU64,
    /// The most worker backends the server showed during a window's last second (0: the
    /// workers got no connection at all then).
    pub(crate) workers_at_window_end: AtomicU64,
}

/// The connection options the run uses, and the name its workers' connections carry.
#[derive(Debug, Clone)]
pub(crate) struct Db {
    url: String,
    /// The workers' `application_name`: the run's prefix.
    workers: String,
    options: PgConnectOptions,
}

impl Db {
    /// From `DATABASE_URL`, for the run with this prefix and schema.
    pub(crate) fn from_env(prefix: &str, schema: &str) -> anyhow::Result<Self> {
        let url = std::env::var("DATABASE_URL")
            .context("DATABASE_URL is not set: eval \"$(scripts/servers.sh env)\" first")?;
        let options = PgConnectOptions::from_str(&url)
            .context("DATABASE_URL is not a valid PostgreSQL URL")?
            .options([("search_path", schema)]);
        Ok(Db {
            url,
            workers: prefix.to_owned(),
            options,
        })
    }

    /// The `DATABASE_URL` for the workers: the run's, with their `application_name`.
    pub(crate) fn worker_url(&self) -> String {
        let sep = if self.url.contains('?') { '&' } else { '?' };
        format!("{}{sep}application_name={}", self.url, self.workers)
    }

    fn named(&self, role: &str) -> PgConnectOptions {
        self.options
            .clone()
            .application_name(&format!("{}-{role}", self.workers))
    }

    /// The runner's own pool (drain checks, the oracle), waiting out restarts and full
    /// servers.
    pub(crate) async fn runner_pool(&self) -> anyhow::Result<PgPool> {
        let options = self.named("runner");
        patiently("connect the runner to PostgreSQL", || {
            PgPoolOptions::new()
                .max_connections(4)
                .min_connections(2)
                .acquire_timeout(Duration::from_secs(60))
                .connect_with(options.clone())
        })
        .await
    }

    /// Terminates one of this run's worker backends at random; `true` if one was.
    pub(crate) async fn terminate_one(&self, pool: &PgPool, rng: &mut Rng) -> bool {
        let pids: Vec<i32> = sqlx::query_scalar(
            "SELECT pid FROM pg_stat_activity \
             WHERE application_name = $1 AND datname = current_database() ORDER BY pid",
        )
        .bind(&self.workers)
        .fetch_all(pool)
        .await
        .unwrap_or_default();
        if pids.is_empty() {
            return false;
        }
        let pid = pids[usize::try_from(rng.below(pids.len() as u64)).unwrap_or(0)];
        sqlx::query_scalar("SELECT pg_terminate_backend($1)")
            .bind(pid)
            .fetch_one(pool)
            .await
            .unwrap_or(false)
    }

    /// Holds every connection slot a non-superuser can get, but [`SLOTS_LEFT_FREE`], for
    /// `hold`, taking each slot that frees up meanwhile (a killed worker's, a terminated
    /// backend's); then lets them all go.
    pub(crate) async fn exhaust(&self, hold: Duration, figures: &DbFigures) -> anyhow::Result<()> {
        let options = self.named("holder");
        let until = tokio::time::Instant::now() + hold;
        // Another run's window or a restart may leave no slot for a while.
        let first = loop {
            match PgConnection::connect_with(&options).await {
                Ok(c) => break c,
                Err(_) if tokio::time::Instant::now() < until => {
                    tokio::time::sleep(Duration::from_millis(200)).await;
                }
                Err(e) => return Err(e).context("no connection slot for the whole window"),
            }
        };
        let mut held = vec![first];
        let (max, reserved): (i64, i64) = sqlx::query_as(
            "SELECT current_setting('max_connections')::bigint, \
             current_setting('superuser_reserved_connections')::bigint \
             + coalesce(current_setting('reserved_connections', true)::bigint, 0)",
        )
        .fetch_one(&mut held[0])
        .await?;
        let limit = max - reserved - SLOTS_LEFT_FREE;
        // The workers' pools lose their connections and must reconnect into a full server.
        let terminated: Vec<bool> = sqlx::query_scalar(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity \
             WHERE application_name = $1 AND datname = current_database()",
        )
        .bind(&self.workers)
        .fetch_all(&mut held[0])
        .await?;
        let n = terminated.into_iter().filter(|t| *t).count();
        figures.terminated.fetch_add(n as u64, Ordering::Relaxed);
        let mut workers_seen = 0;
        while tokio::time::Instant::now() < until {
            let (in_use, workers): (i64, i64) = sqlx::query_as(
                "SELECT count(*), count(*) FILTER (WHERE application_name = $1) \
                 FROM pg_stat_activity WHERE backend_type = 'client backend'",
            )
            .bind(&self.workers)
            .fetch_one(&mut held[0])
            .await?;
            if until - tokio::time::Instant::now() < Duration::from_secs(1) {
                workers_seen = workers_seen.max(workers);
            }
            let wanted = usize::try_from(limit - in_use).unwrap_or(0).min(32);
            let opened = futures::future::join_all(
                (0..wanted).map(|_| PgConnection::connect_with(&options)),
            )
            .await;
            // A refused one (the slots went to someone else first) is tried again next round.
            held.extend(opened.into_iter().filter_map(Result::ok));
            figures
                .most_held
                .fetch_max(held.len() as u64, Ordering::Relaxed);
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        figures
            .workers_at_window_end
            .fetch_max(u64::try_from(workers_seen).unwrap_or(0), Ordering::Relaxed);
        for c in held {
            let _ = c.close().await;
        }
        figures.windows.fetch_add(1, Ordering::Relaxed);
        Ok(())
    }
}

/// The database's figures as summary rows.
pub(crate) fn rows(figures: &DbFigures) -> Vec<(&'static str, String)> {
    let get = |a: &AtomicU64| a.load(Ordering::Relaxed).to_string();
    vec![
        ("backends terminated", get(&figures.terminated)),
        (
            "PG restarts fast / immediate",
            format!(
                "{} / {}",
                get(&figures.restarts_fast),
                get(&figures.restarts_immediate)
            ),
        ),
        ("pool-exhaustion windows", get(&figures.windows)),
        ("  most connections held", get(&figures.most_held)),
        (
            "  worker backends at the end",
            get(&figures.workers_at_window_end),
        ),
    ]
}

/// Restarts PostgreSQL with `scripts/postgres.sh restart` in `mode`. `CHAOS_PG_STATE_DIR`,
/// when set, is the script's `CONSUMER_STATE_DIR` (a PostgreSQL of the run's own).
pub(crate) async fn restart(
    scripts: &Path,
    mode: StopMode,
    figures: &DbFigures,
) -> anyhow::Result<()> {
    let script = scripts.join("postgres.sh");
    let mut cmd = tokio::process::Command::new(&script);
    cmd.arg("restart")
        .env("CONSUMER_PG_STOP_MODE", mode.as_str());
    if let Ok(dir) = std::env::var("CHAOS_PG_STATE_DIR") {
        cmd.env("CONSUMER_STATE_DIR", dir);
    }
    let out = cmd
        .output()
        .await
        .with_context(|| format!("run {}", script.display()))?;
    if !out.status.success() {
        bail!(
            "{} restart ({}) failed: {}",
            script.display(),
            mode.as_str(),
            String::from_utf8_lossy(&out.stderr)
        );
    }
    match mode {
        StopMode::Fast => &figures.restarts_fast,
        StopMode::Immediate => &figures.restarts_immediate,
    }
    .fetch_add(1, Ordering::Relaxed);
    Ok(())
}

/// Terminates one of the run's worker backends about every `every` (seeded jitter, half to
/// one and a half times), until the task is aborted.
pub(crate) fn spawn_terminator(
    db: Db,
    pool: PgPool,
    every: Duration,
    seed: u64,
    figures: Arc<DbFigures>,
) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        let mut rng = Rng::new(seed ^ 0x7465_726d_696e_6174);
        loop {
            let jitter = 500 + rng.below(1001);
            tokio::time::sleep(every * u32::try_from(jitter).unwrap_or(1000) / 1000).await;
            if db.terminate_one(&pool, &mut rng).await {
                figures.terminated.fetch_add(1, Ordering::Relaxed);
            }
        }
    })
}

/// Runs `attempt` until it succeeds or [`RUNNER_DB_PATIENCE`] has passed: the runner's
/// own database work must outlast restarts and exhaustion windows, this run's and other
/// runs' on the same server.
pub(crate) async fn patiently<T, E, F, Fut>(what: &str, mut attempt: F) -> anyhow::Result<T>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<T, E>>,
    E: Into<anyhow::Error>,
{
    let deadline = tokio::time::Instant::now() + RUNNER_DB_PATIENCE;
    loop {
        match attempt().await {
            Ok(v) => return Ok(v),
            Err(e) => {
                let e: anyhow::Error = e.into();
                if tokio::time::Instant::now() >= deadline {
                    return Err(e.context(format!("{what}: gave up after {RUNNER_DB_PATIENCE:?}")));
                }
                eprintln!("chaos: {what}: {e:#}; retrying");
                tokio::time::sleep(Duration::from_secs(1)).await;
            }
        }
    }
}
