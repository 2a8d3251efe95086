//! Exactly-once effects over at-least-once delivery.
//!
//! Brokers deliver at least once. This crate makes a handler's *effects* happen once:
//!
//! - [`handler`] turns an `async fn(&mut Context<'_, DB>, Message)` into a [`Handler`].
//! - [`Inbox`] remembers each (handler, key) in PostgreSQL or SQLite. The key is the
//!   handler's key template, else the message id, else (if allowed) a hash of the payload.
//! - [`Worker`] takes deliveries from a transport, claims the key, runs the handler in the
//!   same transaction that marks the key completed, commits, and only then settles the
//!   delivery. Duplicates are acked without running the handler; failures are retried with
//!   [`ExponentialBackoff`] through the broker, then dead-lettered with a
//!   [`DeadLetterReason`]: to the broker's dead-letter destination, or, for a transport
//!   without one
//!   ([`Acknowledger::keeps_dead_letters`](transport::Acknowledger::keeps_dead_letters)), whole
//!   into the inbox's dead-letter table ([`Inbox::dead_letters`], [`inbox::StoredDeadLetter`])
//!   before it is settled.
//! - [`guard`] holds the tools for effects outside the database: [`FlagGuard`],
//!   [`Transition`] and [`idempotency_key`].
//! - [`memory`] is an in-memory broker with real at-least-once behaviour, the embedded
//!   default.
//! - [`outbox`] carries exactly-once across a publish: [`Context::publish`] writes a message
//!   in the handler's transaction (or [`Outbox::enqueue`] in the application's), and a
//!   [`Relay`] publishes it through a [`Publisher`] once that transaction has committed.
//! - [`App`] runs several handlers, each with its own transport and [`WorkerConfig`], and
//!   the relay in one process, under one shutdown future and one health view
//!   ([`AppHealth`]); they stand or fall together.
//!
//! Transports for RabbitMQ and Kafka live in their own crates and depend on this one only.
//!
//! # Layout
//!
//! The crate's root holds what a handler author needs: the handler and its contexts, the
//! inbox, the worker and the app, the outbox, the retry policy, the guards, and the errors.
//! The public modules hold the rest, by role:
//!
//! - [`transport`] is for transport authors: what a transport hands the runtime
//!   ([`Delivery`](transport::Delivery), [`Incoming`](transport::Incoming) from a
//!   [`Transport`](transport::Transport)) and how the runtime hands it back
//!   ([`Acknowledger`](transport::Acknowledger), [`Settlement`](transport::Settlement)).
//! - [`inbox`]: the inbox's rows, counts and dead letters as an operator reads them, and the
//!   sealed database [`Backend`](inbox::Backend); [`key`]: key templates and the canonical
//!   payload hash; [`retry`]: the backoff policy and its jitter; [`stats`]: a worker's
//!   counts; [`app`]: [`App`] and its health view; [`ident`]: the check of database names
//!   from configuration (schemas, tables); [`guard`], [`outbox`], [`memory`],
//!   [`migrate`], [`trace`] and [`header_names`] as above and in their own docs.
//!
//! Inside, the modules are:
//!
//! - `delivery`: what a transport hands the runtime and how the runtime hands it back;
//!   `acks`: a batch's acks handed back together; `headers`: a delivery's text headers, one
//!   shared block per message; `blocks`: shared blocks a transport copies many messages'
//!   bytes into; `message_id`: a delivery's message id, which can share such a block. The
//!   [`transport`] module re-exports them.
//! - `worker`: the runtime. `worker` itself is its public face ([`Worker`] and its run
//!   loop); `worker::pipeline` runs each batch through one pipeline in four stages:
//!   `worker::job` prepares (decode and key once), `worker::claim` decides what a claim
//!   means, `worker::execute` runs a group of jobs in one transaction (and alone after a
//!   failure), `worker::verdict` decides how each attempt's outcome is settled (recording
//!   failures), `worker::settle` applies those verdicts through the acknowledgers;
//!   `worker::attempt` computes every attempt number, `worker::config` holds
//!   [`WorkerConfig`] and [`BatchConfig`].
//! - `inbox`: the table of (handler, key) rows in PostgreSQL or SQLite, its migrations and
//!   statements, and the key locks; `log_marks`: the log marks that prove a Kafka record
//!   fresh.
//! - `handler`: the [`Handler`] trait, its options and the contexts a handler runs with;
//!   `key`: key templates and the canonical payload hash; `canonical`: whether a payload's
//!   bytes are already its canonical form (then hashed and decoded as they are, without a
//!   JSON tree); `retry`: the backoff policy;
//!   `guard`: guards for effects outside the database; `stats`: the counters and their
//!   metrics; `trace`: W3C trace context from message headers.
//! - `outbox`: the outbox handle, the outgoing message, the publisher trait and the relay;
//!   the outbox's statements live with the inbox's (`inbox::outbox_store`), its table beside
//!   the inbox's.
//! - `app`: [`App`], which builds a worker per handler and the relay on one inbox and
//!   supervises them (one shutdown, one for all on a failure), and its health view.
//! - `memory`: the in-memory broker; `fault` (feature `fault-injection`): fault points for
//!   the chaos suite and the tests.
//!
//! The crate's tests need no server and no broker client: unit tests of the pipeline's
//! stages sit beside them (`worker::tests`, `worker::claim`, `worker::attempt`), and
//! `tests/` runs the exactly-once scenario matrix of the `consumer-scenarios` crate (in the
//! repository's `scenarios/`) and the README's runtime claims on SQLite and the in-memory
//! broker. The workspace tests run the same matrix on PostgreSQL.
//!
//! # Who owns what
//!
//! - **Freshness** (may a delivery skip counting its attempt ahead?): the inbox's
//!   `log_marks::Freshness` alone decides, from what the transport reports (a first delivery
//!   it vouches for, or a position in a log) and the inbox's log marks.
//! - **The attempt number**: a transport reports the number it read; the inbox counts
//!   attempts and its count is the number an attempt runs as ([`Context::attempt`]);
//!   `worker::attempt` computes the rest (the bounded number of a delivery, the number of a
//!   retry copy, retry or dead letter after a failure) and nothing else does.
//!
//! # Metrics
//!
//! Every count of [`stats::Stats`] is also exported through the [`metrics`] facade. The library
//! never installs a recorder: install one (e.g. `metrics-exporter-prometheus`) **before**
//! building the [`Worker`] (or adding its handler to an [`App`]), whose handles are
//! registered when it is built; without one,
//! nothing is recorded and the counts cost an atomic add. Every metric carries the label
//! `handler` (the handler's stable name); no label carries a key or a message id.
//!
//! | metric | type | labels | what |
//! |---|---|---|---|
//! | `consumer_received_total` | counter | | deliveries received |
//! | `consumer_deliveries_total` | counter | `outcome`, `reason` | settled deliveries by outcome: `completed`, `duplicate`, `superseded`, `conflict_skipped`, `retried`, `dead_lettered` (with `reason`, a [`DeadLetterReason::as_str`]; `quarantined` is one) |
//! | `consumer_conflicts_total` | counter | | key conflicts (same key, other payload), dead-lettered or skipped |
//! | `consumer_handler_runs_total` | counter | | handler runs (attempts) |
//! | `consumer_fresh_completed_total` | counter | | completions on the fresh path |
//! | `consumer_handler_duration_seconds` | histogram | | time in the handler (a batch function's run once) |
//! | `consumer_handler_panics_total`, `consumer_handler_timeouts_total` | counter | | caught panics, timeouts |
//! | `consumer_batch_size` | histogram | | deliveries a batched worker took together |
//! | `consumer_batches_total`, `consumer_batch_reruns_total` | counter | | committed batches; runs rolled back with a failed batch |
//! | `consumer_db_errors_total` | counter | | inbox database errors outside handlers |
//! | `consumer_settle_errors_total` | counter | | settlements the transport failed to apply |
//! | `consumer_inbox_purged_total` | counter | | expired inbox rows deleted by retention |
//! | `consumer_inbox_pending_purged_total` | counter | | pending rows deleted by `WorkerConfig::pending_retention` |
//! | `consumer_inbox_keys` | gauge | `status` | the handler's inbox rows: `pending`, `completed`, `dead` |
//! | `consumer_inbox_stalest_pending_seconds` | gauge | | how long ago the stalest pending key last saw an attempt (0: none) |
//! | `consumer_outbox_published_total` | counter | `outbox` | messages the relay published (confirmed) and marked |
//! | `consumer_outbox_publish_failures_total` | counter | `outbox`, `kind` | publishes that failed: `unavailable` (tried again), `refused` (the broker refused the message; it stays) |
//! | `consumer_outbox_pending`, `consumer_outbox_failing` | gauge | `outbox` | rows not published yet; of those, rows whose last publish failed |
//! | `consumer_outbox_oldest_pending_seconds` | gauge | `outbox` | age of the oldest unpublished row (0: none) |
//!
//! The inbox gauges are read by a background task every
//! [`WorkerConfig::inbox_gauge_interval`] (30 s by default), the outbox gauges by the relay
//! every [`RelayConfig::gauge_interval`] (30 s). The outbox metrics are labelled `outbox`
//! (the table, unquoted), not `handler`. The transports add their own
//! (unacked deliveries and reconnections on RabbitMQ, lag per partition on Kafka: see
//! their crate docs).
//!
//! # Features
//!
//! - `fault-injection`: fault points (`fault`), `WorkerConfig::faults`, the deliberately
//!   broken ack-before-commit switch and `Error::Crashed`. The chaos suite and the tests
//!   enable it; a production build has none of them.
//! - `opentelemetry`: a delivery's span gets the message's W3C trace context as its parent,
//!   and the transports write the span's own context on the copies they publish
//!   ([`trace`]). It pins `opentelemetry` 0.33 and `tracing-opentelemetry` 0.34; the
//!   application installs the `tracing-opentelemetry` layer and its exporter.

mod acks;
pub mod app;
mod blocks;
mod canonical;
mod delivery;
mod error;
#[cfg(feature = "fault-injection")]
pub mod fault;
#[cfg(not(feature = "fault-injection"))]
mod fault;
pub mod guard;
mod handler;
pub mod header_names;
mod headers;
pub mod ident;
pub mod inbox;
pub mod key;
mod log_marks;
pub mod memory;
mod message_id;
pub mod migrate;
pub mod outbox;
pub mod retry;
pub mod stats;
pub mod trace;
pub mod transport;
mod worker;

pub use app::{App, AppHealth};
pub use consumer_macros::handler;
pub use delivery::DeadLetterReason;
pub use error::{Error, ErrorKind, HandlerError};
pub use guard::{idempotency_key, FlagGuard, Transition};
pub use handler::{BatchContext, ConflictPolicy, Context, Handler, HandlerOptions};
pub use inbox::{Inbox, InboxConfig};
pub use outbox::{Outbox, OutboxMessage, PublishError, Publisher, Relay, RelayConfig};
pub use retry::ExponentialBackoff;
pub use worker::{BatchConfig, Worker, WorkerConfig};

/// Re-exports for code generated by `#[handler]`. Not a public API.
#[doc(hidden)]
pub mod __private {
    pub use crate::handler::{BatchContext, ConflictPolicy, Context, Handler, HandlerOptions};
    pub use crate::HandlerError;
    pub use futures::future::BoxFuture;
    pub use std::time::Duration;
}
