//! The invoice job from our seed articles, on RabbitMQ and PostgreSQL: the shared domain of
//! the `invoice_worker`, `email_worker` and `publish_jobs` binaries (in `src/bin/`).
//!
//! - [`InvoiceJob`] is the message: `{"order_id", "amount", "email"}`.
//! - [`schema`] creates the `orders`, `invoices` and `provider_calls` tables, plus the
//!   chaos suite's oracle: the append-only `effect_ledger` and the `worker_stats` counters.
//! - [`handlers`] holds the two `#[handler]`s: [`send_invoice`] creates the invoice and sets
//!   `orders.invoice_sent` with a guarded update, in the handler's transaction;
//!   [`send_email`] sends the "invoice ready" email through the [`provider`] stand-in, guarded
//!   by `orders.email_sent`, with a stable idempotency key.
//! - [`settings`] reads the environment; [`transport`] is the one place that picks the
//!   broker; [`app`] runs a worker until SIGTERM or Ctrl-C; [`ops`] serves its metrics and
//!   health endpoints; [`telemetry`] exports the spans over OTLP (the `opentelemetry`
//!   feature).
//!
//! `publish_jobs` publishes each job once to a fanout exchange (`invoice_jobs`) bound to
//! both queues, so each worker gets its own copy. The email worker retries (transiently)
//! until the invoice worker has created the invoice.

pub mod app;
pub mod handlers;
pub mod ops;
pub mod provider;
pub mod schema;
pub mod settings;
pub mod telemetry;
pub mod transport;

pub use handlers::{send_email, send_invoice};

use serde::{Deserialize, Serialize};

/// An invoice job: create the invoice of an order, then email the customer.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct InvoiceJob {
    /// The order (a row of `orders`, created when the order was placed).
    pub order_id: i64,
    /// The amount, in cents.
    pub amount: i64,
    /// Where the "invoice ready" email goes.
    pub email: String,
}

impl InvoiceJob {
    /// The sample job for `order_id`.
    pub fn sample(order_id: i64) -> Self {
        InvoiceJob {
            order_id,
            amount: 100 + order_id % 900,
            email: format!("customer{order_id}@example.com"),
        }
    }

    /// The message id the publisher gives this job; a republished job keeps it.
    pub fn message_id(&self) -> String {
        format!("invoice-job-{}", self.order_id)
    }

    /// A poison job: its order id is in the range reserved for the chaos suite
    /// ([`POISON_ORDERS`]), and both handlers fail it transiently every time, so it ends in
    /// the dead-letter queue after `max_attempts`.
    pub fn is_poison(&self) -> bool {
        POISON_ORDERS.contains(&self.order_id)
    }

    /// A slow job (order ids ending in `37`: 1 %): the handlers sleep `SLOW_JOB_MS` on it
    /// when that setting is non-zero (the chaos suite's Kafka run; off by default).
    pub fn is_slow(&self) -> bool {
        self.order_id % 100 == 37
    }
}

/// Order ids reserved for poison jobs (the chaos suite's always-failing jobs). No real order
/// uses them.
pub const POISON_ORDERS: std::ops::Range<i64> = 900_000_000..1_000_000_000;
