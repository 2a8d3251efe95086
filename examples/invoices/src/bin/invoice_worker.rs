//! Creates the invoice of each order: consumes invoice jobs from RabbitMQ and runs
//! `send_invoice` exactly once per order, on PostgreSQL.
//!
//! Run with:
//!
//! ```text
//! eval "$(scripts/servers.sh env)"
//! cargo run -p invoices --bin invoice_worker
//! ```
//!
//! Settings come from the environment (`AMQP_URL`, `DATABASE_URL`, `QUEUE`, `CONCURRENCY`,
//! `PREFETCH`, …; see `invoices::settings`). SIGTERM or Ctrl-C stops it gracefully: no new
//! jobs are taken, in-flight ones finish and are acked.

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let _telemetry = invoices::app::init_tracing();
    invoices::app::run_worker(invoices::send_invoice, "invoices").await
}
