// The error type must convert into `HandlerError`: a `String` does not (it is not a
// `std::error::Error`), and the compiler says so at the return type.
use consumer_core::{handler, Context};
use sqlx::Postgres;

#[derive(serde::Deserialize)]
struct InvoiceJob {
    order_id: u64,
}

#[handler]
async fn send_invoice(ctx: &mut Context<'_, Postgres>, job: InvoiceJob) -> Result<(), String> {
    let _ = (ctx.key(), job.order_id);
    Ok(())
}

fn main() {}
