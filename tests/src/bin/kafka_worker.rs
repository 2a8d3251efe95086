//! A Kafka worker process, killed with SIGKILL by `tests/kafka_sigkill.rs`.
//!
//! Configured from the environment: `KAFKA_*` as read by `KafkaConfig::from_env`,
//! `DATABASE_URL`, `WORKER_SCHEMA` (the test's PostgreSQL schema, holding the `effects`
//! table) and `WORKER_CONCURRENCY`. Each job inserts one row into `effects` in the handler's
//! transaction. Runs until killed (or Ctrl-C).

use std::str::FromStr;
use std::time::Duration;

use anyhow::Context as _;
use consumer_core::{handler, Context, HandlerError, Inbox, InboxConfig, Worker, WorkerConfig};
use consumer_kafka::{KafkaConfig, KafkaConsumer};
use serde::Deserialize;
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::Postgres;

#[derive(Debug, Deserialize)]
struct Job {
    id: String,
    #[serde(default)]
    sleep_ms: u64,
}

#[handler(name = "kafka_record", max_attempts = 5, backoff = "100ms..1s")]
async fn kafka_record(ctx: &mut Context<'_, Postgres>, job: Job) -> Result<(), HandlerError> {
    tokio::time::sleep(Duration::from_millis(job.sleep_ms)).await;
    let attempt = i32::try_from(ctx.attempt()).unwrap_or(i32::MAX);
    sqlx::query("INSERT INTO effects (job_id, attempt) VALUES ($1, $2)")
        .bind(&job.id)
        .bind(attempt)
        .execute(ctx.db())
        .await?;
    Ok(())
}

fn var(name: &str) -> anyhow::Result<String> {
    std::env::var(name).with_context(|| format!("{name} is not set"))
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn")),
        )
        .with_writer(std::io::stderr)
        .init();
    let schema = var("WORKER_SCHEMA")?;
    let options = PgConnectOptions::from_str(&var("DATABASE_URL")?)?
        .options([("search_path", schema.as_str())]);
    let pool = PgPoolOptions::new()
        .max_connections(6)
        .connect_with(options)
        .await?;
    let inbox = Inbox::new(pool, InboxConfig::in_schema(schema)).await?;
    let concurrency = var("WORKER_CONCURRENCY")
        .ok()
        .and_then(|c| c.parse().ok())
        .unwrap_or(8);
    let worker = Worker::with_config(
        inbox,
        kafka_record,
        WorkerConfig::default()
            .with_concurrency(concurrency)
            .with_retention_interval(None),
    )?;
    let transport = KafkaConsumer::new(KafkaConfig::from_env()?)?;
    worker
        .run(transport, async {
            let _ = tokio::signal::ctrl_c().await;
        })
        .await?;
    Ok(())
}
