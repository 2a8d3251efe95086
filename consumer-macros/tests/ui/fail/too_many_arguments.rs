use consumer_core::{handler, Context, HandlerError};
use sqlx::Postgres;

#[derive(serde::Deserialize)]
struct InvoiceJob {
    order_id: u64,
}

#[handler]
async fn send_invoice(ctx: &mut Context<'_, Postgres>, job: InvoiceJob, _retries: u32, _dry_run: bool) -> Result<(), HandlerError> {
    let _ = (ctx.key(), job.order_id);
    Ok(())
}

fn main() {}
