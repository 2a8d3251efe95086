//! Every option, on a PostgreSQL and a SQLite handler; each option must reach
//! `HandlerOptions` exactly as the builder would set it by hand.

use std::time::Duration;

use consumer_core::{
    handler, BatchContext, ConflictPolicy, Context, Handler, HandlerError, HandlerOptions,
};
use sqlx::{Postgres, Sqlite};

#[derive(serde::Deserialize)]
struct InvoiceJob {
    order_id: u64,
}

#[handler(
    name = "send_invoice",
    key = "invoice-{order_id}",
    max_attempts = 5,
    backoff = "200ms..30s",
    retention = "7d",
    timeout = "30s",
    payload_hash = false,
    on_conflict = "dead_letter",
    batch = "batches::send_invoices",
    aliases = ["send_invoice_v1", "billing.invoice"]
)]
async fn send_invoice(ctx: &mut Context<'_, Postgres>, job: InvoiceJob) -> Result<(), HandlerError> {
    let _ = (ctx.key(), job.order_id);
    Ok(())
}

#[handler(
    on_conflict = "skip",
    payload_hash = true,
    timeout = "1m",
    retention = "12h",
    backoff = "1s..1s",
    max_attempts = 1,
    key = "{{literal}}-{order.id}",
    name = "billing.send-receipt",
)]
async fn send_receipt(ctx: &mut Context<'_, Sqlite>, job: InvoiceJob) -> Result<(), HandlerError> {
    let _ = (ctx.key(), job.order_id);
    Ok(())
}

mod batches {
    use super::*;

    /// The batch function: a path, reached from the generated impl.
    pub(crate) async fn send_invoices(
        ctx: &mut BatchContext<'_, Postgres>,
        jobs: Vec<InvoiceJob>,
    ) -> Result<(), std::io::Error> {
        let _ = (ctx.len(), ctx.key(0), jobs.len());
        Ok(())
    }
}

fn same_options(got: HandlerOptions, want: HandlerOptions) {
    assert_eq!(format!("{got:?}"), format!("{want:?}"));
}

fn main() {
    assert!(Handler::<Postgres>::handles_batches(&send_invoice));
    assert!(!Handler::<Sqlite>::handles_batches(&send_receipt));
    same_options(
        Handler::<Postgres>::options(&send_invoice),
        HandlerOptions::new("send_invoice")
            .key("invoice-{order_id}")
            .max_attempts(5)
            .backoff(Duration::from_millis(200), Duration::from_secs(30))
            .retention(Duration::from_secs(7 * 24 * 3600))
            .timeout(Duration::from_secs(30))
            .payload_hash(false)
            .alias("send_invoice_v1")
            .alias("billing.invoice")
            .on_conflict(ConflictPolicy::DeadLetter),
    );
    same_options(
        Handler::<Sqlite>::options(&send_receipt),
        HandlerOptions::new("billing.send-receipt")
            .key("{{literal}}-{order.id}")
            .max_attempts(1)
            .backoff(Duration::from_secs(1), Duration::from_secs(1))
            .retention(Duration::from_secs(12 * 3600))
            .timeout(Duration::from_secs(60))
            .payload_hash(true)
            .on_conflict(ConflictPolicy::Skip),
    );
}
