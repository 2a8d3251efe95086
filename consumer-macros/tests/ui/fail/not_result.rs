use consumer_core::{handler, Context};
use sqlx::Postgres;

#[derive(serde::Deserialize)]
struct InvoiceJob {
    order_id: u64,
}

#[handler]
async fn send_invoice(ctx: &mut Context<'_, Postgres>, job: InvoiceJob) -> bool {
    let _ = (ctx.key(), job.order_id);
    true
}

#[handler]
async fn send_receipt(ctx: &mut Context<'_, Postgres>, job: InvoiceJob) {
    let _ = (ctx.key(), job.order_id);
}

fn main() {}
