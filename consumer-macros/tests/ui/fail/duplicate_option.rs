use consumer_core::{handler, Context, HandlerError};
use sqlx::Postgres;

#[derive(serde::Deserialize)]
struct InvoiceJob {
    order_id: u64,
}

#[handler(name = "send_invoice", max_attempts = 3, name = "send_invoice_v2")]
async fn send_invoice(ctx: &mut Context<'_, Postgres>, job: InvoiceJob) -> Result<(), HandlerError> {
    let _ = (ctx.key(), job.order_id);
    Ok(())
}

fn main() {}
