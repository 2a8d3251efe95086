//! What every binary does around its handler: logging, settings, database, shutdown.

use std::str::FromStr;
use std::time::Duration;

use anyhow::Context as _;
use consumer_core::{Handler, Inbox, InboxConfig, Worker, WorkerConfig};
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::{PgPool, Postgres};

use crate::provider::EmailProvider;
use crate::settings::Settings;
use crate::{handlers, schema, transport};

/// Logs to stderr; `RUST_LOG` overrides the default (`info`, sqlx's notices off).
pub fn init_tracing() {
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| "info,sqlx=warn".into()),
        )
        .init();
}

/// Completes on SIGTERM (what `docker stop` and `kill` send) or Ctrl-C.
pub async fn shutdown_signal() {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{signal, SignalKind};
        match signal(SignalKind::terminate()) {
            Ok(mut term) => {
                tokio::select! {
                    _ = term.recv() => tracing::info!("SIGTERM: finishing in-flight jobs"),
                    _ = tokio::signal::ctrl_c() => tracing::info!("Ctrl-C: finishing in-flight jobs"),
                }
            }
            Err(e) => {
                tracing::warn!(error = %e, "cannot listen for SIGTERM; Ctrl-C only");
                let _ = tokio::signal::ctrl_c().await;
            }
        }
    }
    #[cfg(not(unix))]
    {
        let _ = tokio::signal::ctrl_c().await;
        tracing::info!("Ctrl-C: finishing in-flight jobs");
    }
}

/// A pool whose connections use `settings.schema`, sized for `settings.concurrency` (each
/// delivery holds one connection; the email provider stand-in takes its own).
pub async fn connect_db(settings: &Settings) -> anyhow::Result<PgPool> {
    let options = PgConnectOptions::from_str(settings.database_url.expose())
        .context("DATABASE_URL is not a valid PostgreSQL URL")?
        .options([("search_path", settings.schema.as_str())]);
    let size = u32::try_from(settings.concurrency * 2 + 2).unwrap_or(u32::MAX);
    PgPoolOptions::new()
        .max_connections(size)
        .acquire_timeout(Duration::from_secs(30))
        .connect_with(options)
        .await
        .with_context(|| format!("connecting to {}", settings.database_url))
}

/// Runs `handler` on the queue from the settings (`default_queue` unless `QUEUE` is set)
/// until SIGTERM or Ctrl-C, then lets in-flight jobs finish and settle before returning.
pub async fn run_worker<H: Handler<Postgres>>(
    handler: H,
    default_queue: &str,
) -> anyhow::Result<()> {
    let settings = Settings::from_env(default_queue)?;
    handlers::set_simulated_work(settings.work);
    let pool = connect_db(&settings).await?;
    schema::migrate(&pool, &settings.schema).await?;
    EmailProvider::install(&settings.schema, pool.clone())?;
    let inbox = Inbox::new(pool, InboxConfig::in_schema(settings.schema.clone())).await?;
    let config = WorkerConfig {
        concurrency: settings.concurrency,
        ..WorkerConfig::default()
    };
    let worker = Worker::with_config(inbox, handler, config)?;
    let (transport, closed) = transport::consumer(&settings).await?;
    tracing::info!(
        handler = worker.handler_name(),
        queue = %settings.queue,
        concurrency = settings.concurrency,
        prefetch = settings.prefetch,
        database = %settings.database_url,
        "worker started"
    );
    worker.run(transport, shutdown_signal()).await?;
    // The transport is dropped: let it close its connection, so the last acks reach the
    // broker before the process exits.
    if tokio::time::timeout(Duration::from_secs(5), closed)
        .await
        .is_err()
    {
        tracing::warn!("the broker connection did not close within 5s");
    }
    let s = worker.snapshot();
    tracing::info!(
        received = s.received,
        completed = s.completed,
        duplicates = s.duplicates,
        retries = s.retries,
        dead_lettered = s.dead_lettered,
        settle_errors = s.settle_errors,
        "worker stopped"
    );
    Ok(())
}
