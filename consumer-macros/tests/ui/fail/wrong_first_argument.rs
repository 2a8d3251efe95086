use consumer_core::{handler, Context, HandlerError};
use sqlx::{PgConnection, Postgres};

#[derive(serde::Deserialize)]
struct InvoiceJob {
    order_id: u64,
}

#[handler]
async fn send_invoice(ctx: &Context<'_, Postgres>, job: InvoiceJob) -> Result<(), HandlerError> {
    let _ = (ctx.key(), job.order_id);
    Ok(())
}

#[handler]
async fn send_receipt(db: &mut PgConnection, job: InvoiceJob) -> Result<(), HandlerError> {
    let _ = (db, job.order_id);
    Ok(())
}

#[handler]
async fn send_reminder(job: InvoiceJob, ctx: &mut Context<'_, Postgres>) -> Result<(), HandlerError> {
    let _ = (ctx.key(), job.order_id);
    Ok(())
}

fn main() {}
