//! What every binary does around its handlers: logging, settings, database, shutdown, and
//! one [`App`] running the [`Part`]s the binary asks for.

use std::collections::HashMap;
use std::str::FromStr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context as _;
use consumer_core::{App, AppHealth, Inbox, InboxConfig, RelayConfig, WorkerConfig};
use futures::StreamExt;
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::{PgPool, Postgres};

use crate::ops::Ops;
use crate::provider::EmailProvider;
use crate::settings::Settings;
use crate::transport::{BoxTransport, Closed, EventPublisher};
use crate::{handlers, schema, transport, Part};

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

/// The database side of a start: a pool ([`connect_db`]), the example's tables
/// ([`schema::migrate`]) and the inbox. A database that goes away midway (the session
/// terminated by an administrator, the server shutting down or crashing, no connection
/// slot free) is tried again from the start, with backoff, for up to a minute, as a
/// database that cannot be reached yet: a worker restarted during a database fault waits
/// it out instead of exiting.
pub async fn prepare_db(settings: &Settings) -> anyhow::Result<(PgPool, Inbox<Postgres>)> {
    let deadline = tokio::time::Instant::now() + DB_STARTUP_TIMEOUT;
    let mut delay = Duration::from_millis(100);
    loop {
        let pool = connect_db(settings).await?;
        let prepared = async {
            schema::migrate(&pool, &settings.schema).await?;
            Inbox::new(
                pool.clone(),
                InboxConfig::in_schema(settings.schema.clone()),
            )
            .await
        }
        .await;
        match prepared {
            Ok(inbox) => return Ok((pool, inbox)),
            Err(e)
                if e.is_database_unavailable()
                    && tokio::time::Instant::now() + delay < deadline =>
            {
                tracing::warn!(error = %e, retry_in = ?delay, "the database went away while starting");
                pool.close().await;
                tokio::time::sleep(delay).await;
                delay = (delay * 2).min(Duration::from_secs(2));
            }
            Err(e) => return Err(e.into()),
        }
    }
}

/// A connection error that may go away by itself: the server is down, restarting or
/// starting up (SQLSTATE 57P03), shutting down or crashed (57P02) or ended the session
/// (57P01, `pg_terminate_backend` or a fast shutdown), has no connection slot free
/// (53300), or the pool timed out waiting for it.
fn not_reachable_yet(e: &sqlx::Error) -> bool {
    match e {
        sqlx::Error::Io(_) | sqlx::Error::PoolTimedOut | sqlx::Error::PoolClosed => true,
        sqlx::Error::Database(db) => matches!(
            db.code().as_deref(),
            Some("57P01" | "57P02" | "57P03" | "53300")
        ),
        _ => false,
    }
}

/// The chaos suite's switches (`CONSUMER_FAULTS`, `CONSUMER_BROKEN_ACK_BEFORE_COMMIT`),
/// read once per process: one fault schedule for every handler and the relay.
#[derive(Default)]
struct Switches {
    #[cfg(feature = "chaos")]
    faults: Option<Arc<dyn consumer_core::fault::FaultInjector>>,
    #[cfg(feature = "chaos")]
    broken_ack_before_commit: bool,
}

impl Switches {
    /// From the environment, with the `chaos` feature.
    #[cfg(feature = "chaos")]
    fn read(settings: &Settings) -> anyhow::Result<Self> {
        use consumer_core::fault::{FaultInjector, RandomFaults};
        let faults = RandomFaults::from_env()?.map(|f| Arc::new(f) as Arc<dyn FaultInjector>);
        if faults.is_some() {
            tracing::warn!(
                "fault points are on (CONSUMER_FAULTS): this process will abort at random"
            );
        }
        if settings.broken_ack_before_commit {
            tracing::error!(
                "CONSUMER_BROKEN_ACK_BEFORE_COMMIT=1: acking before the handler runs; \
                 effects WILL be lost (test-only switch, never in production)"
            );
        }
        Ok(Switches {
            faults,
            broken_ack_before_commit: settings.broken_ack_before_commit,
        })
    }

    /// Without the `chaos` feature, the chaos suite's switches are refused, not ignored.
    #[cfg(not(feature = "chaos"))]
    fn read(settings: &Settings) -> anyhow::Result<Self> {
        let faults = std::env::var_os("CONSUMER_FAULTS").is_some_and(|v| !v.is_empty());
        if faults || settings.broken_ack_before_commit {
            anyhow::bail!(
                "CONSUMER_FAULTS and CONSUMER_BROKEN_ACK_BEFORE_COMMIT need a build with the `chaos` feature"
            );
        }
        Ok(Switches::default())
    }

    #[cfg(feature = "chaos")]
    fn worker(&self, config: WorkerConfig) -> WorkerConfig {
        let config = config.with_broken_ack_before_commit(self.broken_ack_before_commit);
        match &self.faults {
            Some(faults) => config.with_faults(faults.clone()),
            None => config,
        }
    }

    #[cfg(not(feature = "chaos"))]
    fn worker(&self, config: WorkerConfig) -> WorkerConfig {
        config
    }

    #[cfg(feature = "chaos")]
    fn relay(&self, config: RelayConfig) -> RelayConfig {
        match &self.faults {
            Some(faults) => config.with_faults(faults.clone()),
            None => config,
        }
    }

    #[cfg(not(feature = "chaos"))]
    fn relay(&self, config: RelayConfig) -> RelayConfig {
        config
    }
}

/// What a started process holds while it runs.
struct Started {
    ops: Option<Ops>,
    pool: PgPool,
    app: App<Postgres>,
    closed: Vec<Closed>,
    redelivered: Redelivered,
}

/// Per handler, the deliveries the broker flagged as delivered before (after a crash or a
/// lost connection): a figure only the transport sees.
type Redelivered = HashMap<&'static str, Arc<AtomicU64>>;

/// Counts the redeliveries of `transport` in `redelivered` as they pass.
fn counting(transport: BoxTransport, redelivered: Arc<AtomicU64>) -> BoxTransport {
    transport
        .inspect(move |r| {
            if r.as_ref().is_ok_and(|i| i.delivery.redelivered) {
                redelivered.fetch_add(1, Ordering::Relaxed);
            }
        })
        .boxed()
}

/// Connects, migrates and builds the app of `parts`: each handler on its own queue, and with
/// [`Part::Invoices`] the outbox's relay, which publishes the `invoice_ready` events.
async fn start(settings: &Settings, parts: &[Part]) -> anyhow::Result<Started> {
    // Before the workers are built: they register their metric handles then.
    let ops = match settings.metrics_addr {
        Some(addr) => {
            let ops = Ops::install()?;
            let bound = ops.serve(addr).await?;
            tracing::info!(%bound, "serving /metrics, /healthz and /readyz");
            Some(ops)
        }
        None => None,
    };
    let (pool, inbox) = prepare_db(settings).await?;
    EmailProvider::install(&settings.schema, pool.clone())?;
    let switches = Switches::read(settings)?;
    let mut redelivered = Redelivered::new();
    let mut app = App::new(inbox);
    let mut closed = Vec::new();
    for &part in parts {
        let config = switches.worker(
            WorkerConfig::default()
                .with_concurrency(settings.concurrency)
                .with_batch(settings.batch)
                .with_inbox_gauge_interval(settings.inbox_gauge_interval),
        );
        let (consumer, done) = transport::consumer(settings, part).await?;
        closed.push(done);
        let counter = Arc::new(AtomicU64::new(0));
        redelivered.insert(part.handler(), counter.clone());
        let consumer = counting(consumer, counter);
        app = match part {
            Part::Invoices => app
                .handler_with(handlers::send_invoice, consumer, config)
                .relay_with(
                    EventPublisher::connect(settings).await?,
                    switches.relay(RelayConfig::default()),
                ),
            Part::Emails => app.handler_with(handlers::send_email, consumer, config),
        };
    }
    Ok(Started {
        ops,
        pool,
        app,
        closed,
        redelivered,
    })
}

/// Runs `parts` (each handler on its queue from the settings, and the relay with
/// [`Part::Invoices`]) until SIGTERM or Ctrl-C, then lets every handler finish and settle
/// its in-flight jobs, and the relay its round, before returning.
pub async fn run(parts: &[Part]) -> anyhow::Result<()> {
    // SIGTERM is ours from here on: one that arrives while starting ends the start.
    let mut shutdown_requested = Box::pin(shutdown_signal());
    let settings = Settings::from_env()?;
    handlers::set_simulated_work(settings.work);
    handlers::set_slow_jobs(settings.slow_job);
    let Started {
        ops,
        pool,
        app,
        closed,
        redelivered,
    } = tokio::select! {
        started = start(&settings, parts) => started?,
        () = &mut shutdown_requested => {
            tracing::info!("stopped while starting: nothing was consumed");
            return Ok(());
        }
    };
    let health = app.health();
    let recorder = StatsRecorder::new(pool.clone(), health.clone(), redelivered);
    let stats_task = settings.stats_interval.map(|every| {
        let recorder = recorder.clone();
        tokio::spawn(async move {
            loop {
                tokio::time::sleep(every).await;
                recorder.write().await;
            }
        })
    });
    tracing::info!(
        handlers = ?parts.iter().map(|p| p.handler()).collect::<Vec<_>>(),
        relay = parts.contains(&Part::Invoices),
        jobs = %settings.invoice_queue,
        events = %settings.email_queue,
        concurrency = settings.concurrency,
        prefetch = settings.prefetch,
        batch = ?settings.batch.map(|b| b.max_messages),
        database = %settings.database_url,
        "started"
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
    let result = app.run(shutdown).await;
    // The transports are dropped: let them close their connections, so the last acks reach
    // the broker before the process exits.
    let all_closed = futures::future::join_all(closed);
    if tokio::time::timeout(Duration::from_secs(5), all_closed)
        .await
        .is_err()
    {
        tracing::warn!("the broker connections did not close within 5s");
    }
    if let Some(task) = stats_task {
        task.abort();
        recorder.write().await;
    }
    for h in health.handlers() {
        let s = &h.stats;
        tracing::info!(
            handler = h.name,
            received = s.received,
            completed = s.completed,
            duplicates = s.duplicates,
            superseded = s.superseded,
            retries = s.retries,
            dead_lettered = s.dead_lettered,
            settle_errors = s.settle_errors,
            "handler stopped"
        );
    }
    Ok(result?)
}

/// Writes one process's counters to `worker_stats` (one row per process and handler,
/// upserted), so the chaos suite can total them after processes were killed. A killed
/// process loses what it counted since its last write.
#[derive(Clone)]
struct StatsRecorder {
    pool: PgPool,
    health: AppHealth,
    redelivered: Redelivered,
    pid: i32,
}

/// When this process started (the row's identity, with the pid, which the OS may reuse).
fn started_at() -> std::time::SystemTime {
    static STARTED: std::sync::OnceLock<std::time::SystemTime> = std::sync::OnceLock::new();
    *STARTED.get_or_init(std::time::SystemTime::now)
}

impl StatsRecorder {
    fn new(pool: PgPool, health: AppHealth, redelivered: Redelivered) -> Self {
        let _ = started_at();
        StatsRecorder {
            pool,
            health,
            redelivered,
            pid: i32::try_from(std::process::id()).unwrap_or(i32::MAX),
        }
    }

    async fn write(&self) {
        for handler in self.health.handlers() {
            let redelivered = self
                .redelivered
                .get(handler.name.as_str())
                .map_or(0, |n| n.load(Ordering::Relaxed));
            if let Err(e) = self.write_one(&handler, redelivered).await {
                tracing::warn!(error = %e, "cannot write worker_stats");
            }
        }
    }

    async fn write_one(
        &self,
        handler: &consumer_core::app::HandlerHealth,
        redelivered: u64,
    ) -> Result<(), sqlx::Error> {
        let s = &handler.stats;
        let n = |v: u64| i64::try_from(v).unwrap_or(i64::MAX);
        let started = started_at()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_secs_f64())
            .unwrap_or(0.0);
        sqlx::query(
            "INSERT INTO worker_stats (pid, started_at, handler, received, redelivered, \
             handler_runs, completed, duplicates, superseded, retries, dead_lettered, quarantined, \
             settle_errors) \
             VALUES ($1, to_timestamp($2), $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13) \
             ON CONFLICT (pid, started_at, handler) DO UPDATE SET received = EXCLUDED.received, \
             redelivered = EXCLUDED.redelivered, handler_runs = EXCLUDED.handler_runs, \
             completed = EXCLUDED.completed, duplicates = EXCLUDED.duplicates, \
             superseded = EXCLUDED.superseded, \
             retries = EXCLUDED.retries, dead_lettered = EXCLUDED.dead_lettered, \
             quarantined = EXCLUDED.quarantined, settle_errors = EXCLUDED.settle_errors, \
             updated_at = now()",
        )
        .bind(self.pid)
        .bind(started)
        .bind(&handler.name)
        .bind(n(s.received))
        .bind(n(redelivered))
        .bind(n(s.handler_runs))
        .bind(n(s.completed))
        .bind(n(s.duplicates))
        .bind(n(s.superseded))
        .bind(n(s.retries))
        .bind(n(s.dead_lettered))
        .bind(n(s.quarantined))
        .bind(n(s.settle_errors))
        .execute(&self.pool)
        .await?;
        Ok(())
    }
}
