//! The invoice job from our seed articles, on RabbitMQ or Kafka and PostgreSQL: the shared
//! domain of the `invoices`, `invoice_worker`, `email_worker` and `publish_jobs` binaries (in
//! `src/bin/`).
//!
//! - [`InvoiceJob`] is the job: `{"order_id", "amount", "email"}`; [`InvoiceReady`] is the
//!   event `send_invoice` publishes through the outbox once the invoice exists.
//! - [`schema`] creates the `orders`, `invoices` and `provider_calls` tables, plus the
//!   chaos suite's oracle: the append-only `effect_ledger` and the `worker_stats` counters.
//! - [`handlers`] holds the two `#[handler]`s: [`send_invoice`] creates the invoice, sets
//!   `orders.invoice_sent` with a guarded update and writes an [`InvoiceReady`] event to the
//!   outbox, all in the handler's transaction; [`send_email`] consumes those events and sends
//!   the "invoice ready" email through the [`provider`] stand-in, guarded by
//!   `orders.email_sent`, with a stable idempotency key.
//! - [`settings`] reads the environment; [`transport`] is the one place that picks the
//!   broker; [`app`] runs the parts a binary asks for ([`Part`]: the invoice handler with the
//!   outbox's relay, the email handler, or both) until SIGTERM or Ctrl-C; [`ops`] serves the
//!   metrics and health endpoints; [`telemetry`] exports the spans over OTLP (the
//!   `opentelemetry` feature).
//!
//! `publish_jobs` publishes each job once to the jobs exchange (`invoice_jobs`). The relay
//! publishes each committed invoice's event once (at least once: a re-send after a crash
//! carries the same message id, and the email handler's inbox drops it) to the events
//! exchange (`invoice_ready`), which the email queue is bound to. So an email goes out only
//! for an invoice that was committed, and once.

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

/// An invoice job: create the invoice of an order (then, through the [`InvoiceReady`] event,
/// email the customer).
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
    /// ([`POISON_ORDERS`]), and `send_invoice` fails it transiently every time, so it ends in
    /// the dead-letter queue after `max_attempts` (and no event is published for it).
    pub fn is_poison(&self) -> bool {
        POISON_ORDERS.contains(&self.order_id)
    }

    /// A slow job (order ids ending in `37`: 1 %): the handlers sleep `SLOW_JOB_MS` on it
    /// when that setting is non-zero (the chaos suite's Kafka run; off by default).
    pub fn is_slow(&self) -> bool {
        is_slow_order(self.order_id)
    }
}

/// The event `send_invoice` publishes through the outbox when it created an invoice; the
/// email handler consumes it. Its message id is fixed when it is written (the same on every
/// attempt of the job), so a re-send is a duplicate to the email handler's inbox.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct InvoiceReady {
    /// The order.
    pub order_id: i64,
    /// The invoice's row in `invoices`.
    pub invoice_id: i64,
    /// Where the "invoice ready" email goes.
    pub email: String,
}

/// What a process runs: the binaries pick their parts, the `invoices` binary both.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Part {
    /// `send_invoice` on the jobs queue (`INVOICE_QUEUE`), plus the outbox's relay, which
    /// publishes its [`InvoiceReady`] events.
    Invoices,
    /// `send_email` on the events queue (`EMAIL_QUEUE`).
    Emails,
}

impl Part {
    /// The handler's name (in the inbox, the metrics and the dead-letter headers).
    pub fn handler(self) -> &'static str {
        match self {
            Part::Invoices => "send_invoice",
            Part::Emails => "send_email",
        }
    }
}

/// Whether jobs of `order_id` are slow jobs (order ids ending in `37`: 1 %): the handlers
/// sleep `SLOW_JOB_MS` on them when that setting is non-zero.
pub fn is_slow_order(order_id: i64) -> bool {
    order_id % 100 == 37
}

/// Order ids reserved for poison jobs (the chaos suite's always-failing jobs). No real order
/// uses them.
pub const POISON_ORDERS: std::ops::Range<i64> = 900_000_000..1_000_000_000;
