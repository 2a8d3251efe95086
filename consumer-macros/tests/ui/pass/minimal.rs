//! No options: the name defaults to the function's name, everything else to
//! `HandlerOptions::new`'s defaults. One handler per database.

use consumer_core::{handler, Context, Handler, HandlerError, HandlerOptions};
use sqlx::{Postgres, Sqlite};

#[derive(serde::Deserialize)]
struct InvoiceJob {
    order_id: u64,
}

#[handler]
async fn send_invoice(ctx: &mut Context<'_, Postgres>, job: InvoiceJob) -> Result<(), HandlerError> {
    let _ = (ctx.key(), job.order_id);
    Ok(())
}

#[handler]
async fn send_receipt(ctx: &mut Context<'_, Sqlite>, job: InvoiceJob) -> Result<(), HandlerError> {
    let _ = (ctx.key(), job.order_id);
    Ok(())
}

// The body stays callable directly, e.g. from a unit test.
async fn call_directly(ctx: &mut Context<'_, Postgres>) -> Result<(), HandlerError> {
    send_invoice::call(ctx, InvoiceJob { order_id: 1 }).await
}

fn same_options(got: HandlerOptions, want: HandlerOptions) {
    assert_eq!(format!("{got:?}"), format!("{want:?}"));
}

fn main() {
    same_options(
        Handler::<Postgres>::options(&send_invoice),
        HandlerOptions::new("send_invoice"),
    );
    same_options(
        Handler::<Sqlite>::options(&send_receipt),
        HandlerOptions::new("send_receipt"),
    );
    let _ = call_directly;
}
