//! Sends the "invoice ready" email of each order once its invoice exists: consumes invoice
//! jobs from RabbitMQ and runs `send_email`, which calls the provider stand-in (recorded in
//! `provider_calls`) at most once per order among committed attempts.
//!
//! Run with:
//!
//! ```text
//! eval "$(scripts/servers.sh env)"
//! cargo run -p invoices --bin email_worker
//! ```
//!
//! Settings come from the environment (`AMQP_URL`, `DATABASE_URL`, `QUEUE`, `CONCURRENCY`,
//! `PREFETCH`, …; see `invoices::settings`). SIGTERM or Ctrl-C stops it gracefully.

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let _telemetry = invoices::app::init_tracing();
    invoices::app::run_worker(invoices::send_email, "emails").await
}
