use consumer_core::{handler, Context, HandlerError};

#[derive(serde::Deserialize)]
struct InvoiceJob {
    order_id: u64,
}

#[handler]
async fn send_invoice<DB: consumer_core::inbox::Backend>(ctx: &mut Context<'_, DB>, job: InvoiceJob) -> Result<(), HandlerError> {
    let _ = (ctx.key(), job.order_id);
    Ok(())
}

fn main() {}
