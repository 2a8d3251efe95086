//! Creates the invoice of each order: consumes invoice jobs and runs `send_invoice` exactly
//! once per order, on PostgreSQL, and runs the outbox's relay, which publishes each new
//! invoice's `invoice_ready` event for the email worker.
//!
//! Run with:
//!
//! ```text
//! eval "$(scripts/servers.sh env)"
//! cargo run -p invoices --bin invoice_worker
//! ```
//!
//! Settings come from the environment (`AMQP_URL`, `DATABASE_URL`, `INVOICE_QUEUE`,
//! `CONCURRENCY`, `PREFETCH`, …; see `invoices::settings`). SIGTERM or Ctrl-C stops it
//! gracefully: no new jobs are taken, in-flight ones finish and are acked, and the relay
//! publishes the events they committed. Several may run: the relays share the outbox
//! without publishing a row twice in the normal case.

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let _telemetry = invoices::app::init_tracing();
    invoices::app::run(&[invoices::Part::Invoices]).await
}
