use consumer_core::{handler, Context, HandlerError};
use sqlx::Postgres;

#[derive(serde::Deserialize)]
struct InvoiceJob {
    order_id: u64,
}

#[handler]
async fn send_invoice(ctx: &mut Context<'_, Postgres>) -> Result<(), HandlerError> {
    let _ = ctx.key();
    Ok(())
}

fn main() {}
