//! Sends the "invoice ready" email of each new invoice: consumes the `invoice_ready` events
//! the invoice worker's relay publishes and runs `send_email`, which calls the provider
//! stand-in (recorded in `provider_calls`) at most once per order among committed attempts.
//!
//! Run with:
//!
//! ```text
//! eval "$(scripts/servers.sh env)"
//! cargo run -p invoices --bin email_worker
//! ```
//!
//! Settings come from the environment (`AMQP_URL`, `DATABASE_URL`, `EMAIL_QUEUE`, `EVENTS`,
//! `CONCURRENCY`, `PREFETCH`, …; see `invoices::settings`). SIGTERM or Ctrl-C stops it
//! gracefully.

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let _telemetry = invoices::app::init_tracing();
    invoices::app::run(&[invoices::Part::Emails]).await
}
