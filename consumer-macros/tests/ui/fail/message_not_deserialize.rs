// The message type must be decodable: the compiler points at it.
use consumer_core::{handler, Context, HandlerError};
use sqlx::Postgres;

struct InvoiceJob {
    order_id: u64,
}

#[handler]
async fn send_invoice(ctx: &mut Context<'_, Postgres>, job: InvoiceJob) -> Result<(), HandlerError> {
    let _ = (ctx.key(), job.order_id);
    Ok(())
}

fn main() {}
