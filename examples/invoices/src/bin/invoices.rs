//! The whole invoice service in one process: `send_invoice` on the jobs queue, the outbox's
//! relay publishing its `invoice_ready` events, and `send_email` on the events queue, under
//! one shutdown (a `consumer_core::App`).
//!
//! Run with:
//!
//! ```text
//! eval "$(scripts/servers.sh env)"
//! cargo run -p invoices --bin invoices
//! ```
//!
//! Settings come from the environment (`AMQP_URL` or `TRANSPORT=kafka` and `KAFKA_BROKERS`,
//! `DATABASE_URL`, `INVOICE_QUEUE`, `EMAIL_QUEUE`, `CONCURRENCY`, …; see
//! `invoices::settings`). SIGTERM or Ctrl-C stops it gracefully: both handlers finish and
//! settle their in-flight jobs, then the relay publishes what they committed last.

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let _telemetry = invoices::app::init_tracing();
    invoices::app::run(&[invoices::Part::Invoices, invoices::Part::Emails]).await
}
