//! Signatures the macro accepts beyond the plain form: a qualified `Context` path with named
//! lifetimes, a destructuring pattern, the caller's own error type, `pub` with docs, and
//! other attributes, which stay on the body.

use consumer_core::Handler;

#[derive(serde::Deserialize)]
pub struct Refund {
    order_id: u64,
}

#[derive(Debug)]
pub struct RefundError;

impl std::fmt::Display for RefundError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("refund failed")
    }
}

impl std::error::Error for RefundError {}

/// Refunds an order.
#[consumer_core::handler(max_attempts = 3)]
#[allow(clippy::needless_lifetimes)]
pub async fn refund<'a, 'c: 'a>(
    ctx: &'a mut consumer_core::Context<'c, sqlx::Sqlite>,
    Refund { order_id }: Refund,
) -> std::result::Result<(), RefundError> {
    if order_id == 0 || ctx.attempt() > 3 {
        return Err(RefundError);
    }
    Ok(())
}

fn is_handler<DB: consumer_core::inbox::Backend, H: Handler<DB>>(_: H) {}

fn main() {
    is_handler::<sqlx::Sqlite, _>(refund);
    assert_eq!(Handler::<sqlx::Sqlite>::options(&refund).name(), "refund");
    assert_eq!(Handler::<sqlx::Sqlite>::options(&refund).get_max_attempts(), 3);
    // The unit struct derives these.
    let copy = refund;
    let _ = (refund::default(), copy.clone(), format!("{copy:?}"));
}
