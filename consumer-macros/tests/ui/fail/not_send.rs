// The body's future must be `Send`: holding an `Rc` across an `.await` is reported.
use std::rc::Rc;

use consumer_core::{handler, Context, HandlerError};
use sqlx::Postgres;

#[derive(serde::Deserialize)]
struct InvoiceJob {
    order_id: u64,
}

async fn send() {}

#[handler]
async fn send_invoice(ctx: &mut Context<'_, Postgres>, job: InvoiceJob) -> Result<(), HandlerError> {
    let order = Rc::new(job.order_id);
    send().await;
    let _ = (ctx.key(), order);
    Ok(())
}

fn main() {}
