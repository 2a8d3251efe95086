//! Places sample orders and publishes their invoice jobs, republishing some (same message
//! id) as an at-least-once broker or a retrying producer would.
//!
//! Run with:
//!
//! ```text
//! eval "$(scripts/servers.sh env)"
//! JOBS=1000 DUPLICATE_PERCENT=10 cargo run -p invoices --bin publish_jobs
//! ```
//!
//! Besides the workers' settings it reads `JOBS` (default 100), `DUPLICATE_PERCENT`
//! (default 10) and `FIRST_ORDER` (default 1). It declares the invoice queue
//! (`INVOICE_QUEUE`) before anything is published.

use anyhow::Context as _;
use futures::{StreamExt, TryStreamExt};
use invoices::settings::Settings;
use invoices::transport::JobPublisher;
use invoices::{app, schema, InvoiceJob};

fn number(name: &str, default: i64) -> anyhow::Result<i64> {
    match std::env::var(name) {
        Ok(v) if !v.trim().is_empty() => v
            .trim()
            .parse()
            .with_context(|| format!("{name}={v:?} is not a whole number")),
        _ => Ok(default),
    }
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let _telemetry = app::init_tracing();
    let settings = Settings::from_env()?;
    let jobs = number("JOBS", 100)?;
    let duplicate_percent = number("DUPLICATE_PERCENT", 10)?;
    let first = number("FIRST_ORDER", 1)?;

    let pool = app::connect_db(&settings).await?;
    schema::migrate(&pool, &settings.schema).await?;
    let all: Vec<InvoiceJob> = (first..first + jobs).map(InvoiceJob::sample).collect();
    schema::place_orders(&pool, &all).await?;

    let publisher = JobPublisher::connect(&settings).await?;
    let duplicates: Vec<&InvoiceJob> = all
        .iter()
        .filter(|j| (j.order_id - first) % 100 < duplicate_percent)
        .collect();
    // Up to 64 unconfirmed at a time: confirms are awaited concurrently.
    futures::stream::iter(all.iter().chain(duplicates.iter().copied()))
        .map(|job| publisher.publish(job))
        .buffer_unordered(64)
        .try_collect::<Vec<()>>()
        .await?;
    publisher.close().await;
    tracing::info!(
        jobs,
        republished = duplicates.len(),
        queue = %settings.invoice_queue,
        "published and confirmed"
    );
    Ok(())
}
