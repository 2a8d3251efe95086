//! What every binary does around its handler: logging, settings, database, shutdown.

use std::str::FromStr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context as _;
use consumer_core::{Handler, Inbox, InboxConfig, Stats, Worker, WorkerConfig};
use futures::StreamExt;
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::{PgPool, Postgres};

use crate::ops::Ops;
use crate::provider::EmailProvider;
use crate::settings::Settings;
use crate::{handlers, schema, transport};

/// Logs to stderr; `RUST_LOG` overrides the default (`info`, sqlx's notices off). With
/// `OTEL_EXPORTER_OTLP_ENDPOINT` set, also exports the spans ([`crate::telemetry`]): hold
/// the returned guard until `main` returns, so the last spans are flushed.
pub fn init_tracing() -> crate::telemetry::Telemetry {
    let subscriber = tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| "info,sqlx=warn".into()),
        )
        .finish();
    crate::telemetry::init(subscriber)
}

/// Completes on SIGTERM (what `docker stop` and `kill` send) or Ctrl-C.
///
/// The signals are taken over when this is called, not when the future is first polled:
/// call it first thing, so a SIGTERM that arrives while the worker is still starting (connecting,
/// migrating, joining its group) stops it cleanly instead of killing it with the default action.
pub fn shutdown_signal() -> impl std::future::Future<Output = ()> + Send + 'static {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{signal, SignalKind};
        let term = signal(SignalKind::terminate());
        let int = signal(SignalKind::interrupt());
        async move {
            // Whichever of the two could be registered is listened for: a failure to
            // register one must not drop the other.
            let wait = |s: std::io::Result<tokio::signal::unix::Signal>, name: &'static str| async move {
                match s {
                    Ok(mut s) => {
                        s.recv().await;
                        name
                    }
                    Err(e) => {
                        tracing::warn!(error = %e, "cannot listen for {name}");
                        std::future::pending().await
                    }
                }
            };
            let name = tokio::select! {
                name = wait(term, "SIGTERM") => name,
                name = wait(int, "SIGINT") => name,
            };
            tracing::info!("{name}: finishing in-flight jobs");
        }
    }
    #[cfg(not(unix))]
    {
        async {
            let _ = tokio::signal::ctrl_c().await;
            tracing::info!("Ctrl-C: finishing in-flight jobs");
        }
    }
}

/// How long a worker keeps trying to reach PostgreSQL at startup (a database restarting
/// while the worker starts is not a reason to exit).
const DB_STARTUP_TIMEOUT: Duration = Duration::from_secs(60);

/// A pool whose connections use `settings.schema`, sized for `settings.concurrency` (each
/// delivery holds one connection; the email provider stand-in takes its own). A database
/// that cannot be reached yet (refused, reset, starting up) is retried with backoff for up
/// to a minute, as the brokers are; a bad URL or a refused login fails at once.
pub async fn connect_db(settings: &Settings) -> anyhow::Result<PgPool> {
    let options = PgConnectOptions::from_str(settings.database_url.expose())
        .context("DATABASE_URL is not a valid PostgreSQL URL")?
        .options([("search_path", settings.schema.as_str())]);
    let size = u32::try_from(settings.concurrency * 2 + 2).unwrap_or(u32::MAX);
    let deadline = tokio::time::Instant::now() + DB_STARTUP_TIMEOUT;
    let mut delay = Duration::from_millis(100);
    loop {
        let connected = PgPoolOptions::new()
            .max_connections(size)
            .acquire_timeout(Duration::from_secs(30))
            .connect_with(options.clone())
            .await;
        match connected {
            Ok(pool) => return Ok(pool),
            Err(e) if not_reachable_yet(&e) && tokio::time::Instant::now() + delay < deadline => {
                tracing::warn!(url = %settings.database_url, error = %e, retry_in = ?delay, "database not reachable yet");
                tokio::time::sleep(delay).await;
                delay = (delay * 2).min(Duration::from_secs(2));
            }
            Err(e) => {
                return Err(e).with_context(|| format!("connecting to {}", settings.database_url))
            }
        }
    }
}

/// A connection error that may go away by itself: the server is down, restarting or
/// starting up (SQLSTATE 57P03), or the pool timed out waiting for it.
fn not_reachable_yet(e: &sqlx::Error) -> bool {
    match e {
        sqlx::Error::Io(_) | sqlx::Error::PoolTimedOut => true,
        sqlx::Error::Database(db) => db.code().as_deref() == Some("57P03"),
        _ => false,
    }
}

/// The chaos suite's switches from the environment (`CONSUMER_FAULTS`,
/// `CONSUMER_BROKEN_ACK_BEFORE_COMMIT`), with the `chaos` feature.
#[cfg(feature = "chaos")]
fn chaos_switches(settings: &Settings, config: WorkerConfig) -> anyhow::Result<WorkerConfig> {
    use consumer_core::fault::{FaultInjector, RandomFaults};
    let mut config = config.with_broken_ack_before_commit(settings.broken_ack_before_commit);
    if let Some(faults) = RandomFaults::from_env()? {
        tracing::warn!("fault points are on (CONSUMER_FAULTS): this process will abort at random");
        config = config.with_faults(Arc::new(faults) as Arc<dyn FaultInjector>);
    }
    if settings.broken_ack_before_commit {
        tracing::error!(
            "CONSUMER_BROKEN_ACK_BEFORE_COMMIT=1: acking before the handler runs; \
             effects WILL be lost (test-only switch, never in production)"
        );
    }
    Ok(config)
}

/// Without the `chaos` feature, the chaos suite's switches are refused, not ignored.
#[cfg(not(feature = "chaos"))]
fn chaos_switches(settings: &Settings, config: WorkerConfig) -> anyhow::Result<WorkerConfig> {
    let faults = std::env::var_os("CONSUMER_FAULTS").is_some_and(|v| !v.is_empty());
    if faults || settings.broken_ack_before_commit {
        anyhow::bail!(
            "CONSUMER_FAULTS and CONSUMER_BROKEN_ACK_BEFORE_COMMIT need a build with the `chaos` feature"
        );
    }
    Ok(config)
}

/// Runs `handler` on the queue from the settings (`default_queue` unless `QUEUE` is set)
/// until SIGTERM or Ctrl-C, then lets in-flight jobs finish and settle before returning.
pub async fn run_worker<H: Handler<Postgres>>(
    handler: H,
    default_queue: &str,
) -> anyhow::Result<()> {
    // SIGTERM is ours from here on: one that arrives while starting ends the start.
    let mut shutdown_requested = Box::pin(shutdown_signal());
    let settings = Settings::from_env(default_queue)?;
    handlers::set_simulated_work(settings.work);
    handlers::set_slow_jobs(settings.slow_job);
    let start = async {
        // Before the worker is built: it registers its metric handles then.
        let ops = match settings.metrics_addr {
            Some(addr) => {
                let ops = Ops::install()?;
                let bound = ops.serve(addr).await?;
                tracing::info!(%bound, "serving /metrics, /healthz and /readyz");
                Some(ops)
            }
            None => None,
        };
        let pool = connect_db(&settings).await?;
        schema::migrate(&pool, &settings.schema).await?;
        EmailProvider::install(&settings.schema, pool.clone())?;
        let inbox = Inbox::new(
            pool.clone(),
            InboxConfig::in_schema(settings.schema.clone()),
        )
        .await?;
        let config = chaos_switches(
            &settings,
            WorkerConfig::default()
                .with_concurrency(settings.concurrency)
                .with_batch(settings.batch)
                .with_inbox_gauge_interval(settings.inbox_gauge_interval),
        )?;
        let worker = Worker::with_config(inbox, handler, config)?;
        let (transport, closed) = transport::consumer(&settings).await?;
        anyhow::Ok((ops, pool, worker, transport, closed))
    };
    let (ops, pool, worker, transport, closed) = tokio::select! {
        started = start => started?,
        () = &mut shutdown_requested => {
            tracing::info!("stopped while starting: nothing was consumed");
            return Ok(());
        }
    };
    // Counts deliveries the broker flags as delivered before (after a crash or a lost
    // connection): a figure only the transport sees.
    let redelivered = Arc::new(AtomicU64::new(0));
    let transport = {
        let redelivered = redelivered.clone();
        transport
            .inspect(move |r| {
                if r.as_ref().is_ok_and(|i| i.delivery.redelivered) {
                    redelivered.fetch_add(1, Ordering::Relaxed);
                }
            })
            .boxed()
    };
    let stats_task = settings.stats_interval.map(|every| {
        let recorder = StatsRecorder::new(
            pool.clone(),
            worker.handler_name(),
            worker.stats(),
            redelivered.clone(),
        );
        tokio::spawn(async move {
            loop {
                tokio::time::sleep(every).await;
                recorder.write().await;
            }
        })
    });
    tracing::info!(
        handler = worker.handler_name(),
        queue = %settings.queue,
        concurrency = settings.concurrency,
        prefetch = settings.prefetch,
        batch = ?settings.batch.map(|b| b.max_messages),
        database = %settings.database_url,
        "worker started"
    );
    let ready = ops.clone();
    if let Some(ops) = &ops {
        ops.set_ready(true);
    }
    // Not ready once draining: a load balancer or orchestrator stops waiting on it.
    let shutdown = async move {
        shutdown_requested.await;
        if let Some(ops) = ready {
            ops.set_ready(false);
        }
    };
    worker.run(transport, shutdown).await?;
    // The transport is dropped: let it close its connection, so the last acks reach the
    // broker before the process exits.
    if tokio::time::timeout(Duration::from_secs(5), closed)
        .await
        .is_err()
    {
        tracing::warn!("the broker connection did not close within 5s");
    }
    if let Some(task) = stats_task {
        task.abort();
        StatsRecorder::new(
            pool.clone(),
            worker.handler_name(),
            worker.stats(),
            redelivered,
        )
        .write()
        .await;
    }
    let s = worker.snapshot();
    tracing::info!(
        received = s.received,
        completed = s.completed,
        duplicates = s.duplicates,
        superseded = s.superseded,
        retries = s.retries,
        dead_lettered = s.dead_lettered,
        settle_errors = s.settle_errors,
        "worker stopped"
    );
    Ok(())
}

/// Writes one process's counters to `worker_stats` (one row per process, upserted), so the
/// chaos suite can total them after processes were killed. A killed process loses what it
/// counted since its last write.
struct StatsRecorder {
    pool: PgPool,
    handler: String,
    stats: Arc<Stats>,
    redelivered: Arc<AtomicU64>,
    pid: i32,
}

/// When this process started (the row's identity, with the pid, which the OS may reuse).
fn started_at() -> std::time::SystemTime {
    static STARTED: std::sync::OnceLock<std::time::SystemTime> = std::sync::OnceLock::new();
    *STARTED.get_or_init(std::time::SystemTime::now)
}

impl StatsRecorder {
    fn new(pool: PgPool, handler: &str, stats: Arc<Stats>, redelivered: Arc<AtomicU64>) -> Self {
        let _ = started_at();
        StatsRecorder {
            pool,
            handler: handler.to_owned(),
            stats,
            redelivered,
            pid: i32::try_from(std::process::id()).unwrap_or(i32::MAX),
        }
    }

    async fn write(&self) {
        let s = self.stats.snapshot();
        let n = |v: u64| i64::try_from(v).unwrap_or(i64::MAX);
        let started = started_at()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_secs_f64())
            .unwrap_or(0.0);
        let result = sqlx::query(
            "INSERT INTO worker_stats (pid, started_at, handler, received, redelivered, \
             handler_runs, completed, duplicates, superseded, retries, dead_lettered, quarantined, \
             settle_errors) \
             VALUES ($1, to_timestamp($2), $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13) \
             ON CONFLICT (pid, started_at) DO UPDATE SET received = EXCLUDED.received, \
             redelivered = EXCLUDED.redelivered, handler_runs = EXCLUDED.handler_runs, \
             completed = EXCLUDED.completed, duplicates = EXCLUDED.duplicates, \
             superseded = EXCLUDED.superseded, \
             retries = EXCLUDED.retries, dead_lettered = EXCLUDED.dead_lettered, \
             quarantined = EXCLUDED.quarantined, settle_errors = EXCLUDED.settle_errors, \
             updated_at = now()",
        )
        .bind(self.pid)
        .bind(started)
        .bind(&self.handler)
        .bind(n(s.received))
        .bind(n(self.redelivered.load(Ordering::Relaxed)))
        .bind(n(s.handler_runs))
        .bind(n(s.completed))
        .bind(n(s.duplicates))
        .bind(n(s.superseded))
        .bind(n(s.retries))
        .bind(n(s.dead_lettered))
        .bind(n(s.quarantined))
        .bind(n(s.settle_errors))
        .execute(&self.pool)
        .await;
        if let Err(e) = result {
            tracing::warn!(error = %e, "cannot write worker_stats");
        }
    }
}
