//! A batch function whose messages are not the handler's: the error points at the string
//! that names it.

use consumer_core::{handler, BatchContext, Context, HandlerError};
use sqlx::Postgres;

#[derive(serde::Deserialize)]
struct InvoiceJob {
    order_id: u64,
}

async fn send_invoices(
    _ctx: &mut BatchContext<'_, Postgres>,
    _jobs: Vec<String>,
) -> Result<(), HandlerError> {
    Ok(())
}

#[handler(batch = "send_invoices")]
async fn send_invoice(_ctx: &mut Context<'_, Postgres>, job: InvoiceJob) -> Result<(), HandlerError> {
    let _ = job.order_id;
    Ok(())
}

fn main() {}
