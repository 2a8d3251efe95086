//! RabbitMQ transport for `consumer-core`, on [lapin](https://docs.rs/lapin).
//!
//! - [`AmqpConfig`]: the broker URL (or the addresses of a cluster's nodes), the queue and its topology, prefetch, retry delays,
//!   reconnection. [`AmqpConfig::validate`] rejects a bad value at startup, naming the field
//!   (`amqp.prefetch`, …). The URL is a [`RedactedUrl`]: credentials never reach a log line
//!   or an error.
//! - [`AmqpConsumer`]: a [`consumer_core::transport::Transport`] for
//!   [`consumer_core::Worker::run`].
//! - [`AmqpPublisher`]: publishes with a message id, waits for the confirm, reports
//!   unroutable messages.
//! - [`headers`]: the names of the headers on retry and dead-letter copies.
//!
//! ```no_run
//! # async fn run() -> Result<(), Box<dyn std::error::Error>> {
//! use consumer_amqp::{AmqpConfig, AmqpConsumer};
//! # #[consumer_core::handler(name = "send_invoice")]
//! # async fn send_invoice(_: &mut consumer_core::Context<'_, sqlx::Postgres>, _: serde_json::Value) -> Result<(), consumer_core::HandlerError> { Ok(()) }
//! # let inbox: consumer_core::Inbox<sqlx::Postgres> = todo!();
//! let config = AmqpConfig::new("amqp://app:secret@localhost:5672/%2f", "invoices");
//! let consumer = AmqpConsumer::connect(config).await?;
//! let worker = consumer_core::Worker::new(inbox, send_invoice)?;
//! worker.run(consumer, async { let _ = tokio::signal::ctrl_c().await; }).await?;
//! # Ok(()) }
//! ```
//!
//! # Settlement
//!
//! The runtime settles a delivery only after the handler's transaction committed (or the
//! inbox recorded a duplicate). Then:
//!
//! - `Ack`: `basic.ack` of that delivery tag. Acks settled together (a batch, whose acks the
//!   runtime hands over at once through `Acknowledger::ack_with`, or batches completing at
//!   the same time) are coalesced into one `basic.ack` with `multiple`, but only over a run
//!   of deliveries that starts at the channel's oldest unsettled delivery and whose outcomes
//!   are all durable: a `multiple` ack never covers a delivery that is still running or
//!   being requeued. A delivery that finishes out of order waits briefly for the older ones,
//!   and is acked alone if they do not finish.
//! - `Retry { delay, attempt }`: a copy (same body, properties and message id, plus
//!   [`headers::ATTEMPT`] = `attempt`, [`headers::FIRST_FAILURE`] and the original exchange
//!   and routing key) is published to the retry queue for `delay`; once the broker
//!   *confirmed* the copy, the original is acked. The copy carries
//!   [`headers::RETRY_DUE`] (when it is due back) and waits in its retry queue; every
//!   consumer of the work queue also consumes the retry queues, holds each copy until it is
//!   due, publishes it back to the work queue (confirmed) and then acks it (see "Why
//!   per-delay retry queues" below). No handler slot waits and nothing blocks other
//!   messages.
//! - `DeadLetter`: the same, to the dead-letter queue (`<queue>.dlq` by default), with the
//!   original body and properties plus [`headers::DEAD_LETTER_REASON`], [`headers::HANDLER`],
//!   [`headers::KEY`], [`headers::ATTEMPTS`], [`headers::ERROR`],
//!   [`headers::ORIGINAL_EXCHANGE`], [`headers::ORIGINAL_ROUTING_KEY`],
//!   [`headers::FIRST_FAILURE`] and [`headers::LAST_FAILURE`].
//!
//! With an [`OriginSecret`] ([`AmqpConfig::origin_secret`]), each copy also carries
//! [`headers::ORIGIN_SIGNATURE`] (see "Origin of copies" below).
//!
//! Every publish the framework makes uses publisher confirms and the mandatory flag. If a
//! copy cannot be published, the original is not acked but requeued (`basic.nack`), and the
//! consumer reconnects to re-declare its topology: the message runs again and the inbox
//! counts the attempt.
//!
//! ## Why per-delay retry queues, and why buckets
//!
//! RabbitMQ has no native delayed delivery without a plugin, so a copy waits in a queue
//! for its delay. Each delay has its own queue, `<queue>.delayed.<ms>`: every copy in it
//! waits the same time, so the copies come due in the order they arrived, and the one at
//! the head is always the next one due (in one shared queue a 60s retry would hold back a
//! 1s retry queued behind it).
//!
//! The runtime's backoff is jittered, so exact delays would mean a queue per
//! millisecond. Instead the delays are rounded *up* to a small fixed set,
//! [`AmqpConfig::retry_delays`] (default 1s, 5s, 15s, 60s, 300s; longer delays use the
//! longest). Rounding up keeps the backoff's promise ("not before"), and a fixed set means
//! every queue is declared at startup and after every reconnect, so there is no lazily
//! declared queue to race with, and a copy is never published to a queue that does not
//! exist yet. Choose buckets that match your handlers' backoff.
//!
//! The copies come back through the workers, not through the broker: each connection of
//! an [`AmqpConsumer`] consumes the retry queues too (up to [`AmqpConfig::prefetch`] copies
//! per queue), holds each copy until [`headers::RETRY_DUE`], publishes it to the work queue
//! with a publisher confirm and only then acks it. A copy is unacked in its retry queue
//! until the work queue has it, so a killed worker, a lost connection or a dead node
//! returns it to the retry queue and nothing is lost; a copy returned twice (its ack lost)
//! is a duplicate the inbox recognises. A due time is the publishing worker's clock: keep
//! the workers' clocks in sync (NTP), or a retry runs up to their difference early or late
//! (never later than the queue's delay after a worker took the copy). A copy is held at
//! most half of [`AmqpConfig::broker_consumer_timeout`] at a time; one due later goes to the
//! tail of its own queue and waits again. The retry queues are quorum queues whatever
//! [`AmqpConfig::queue_type`] says (replicated: a copy survives the node it was on), which
//! needs RabbitMQ 3.8 or newer.
//!
//! A broker TTL with dead-lettering back to the work queue would need no worker, but it
//! loses or strands copies: a classic queue moves an expired message at most once (a broker
//! stopping at that moment drops a copy whose original was acked: the chaos suite caught
//! that), and a quorum queue's at-least-once dead-lettering stopped forwarding for minutes
//! after the node holding the retry queue's leader was killed (RabbitMQ 3.10, the cluster
//! tests). Queues named `<queue>.retry.<ms>` were declared that way by earlier versions of
//! this crate: they still return their copies by themselves, and can be deleted once empty.
//!
//! ## Origin of copies
//!
//! The origin headers are trusted only when the framework can prove it wrote them: a
//! producer can set `x-attempt`, RabbitMQ's `x-death` and `x-original-*` itself, and a dead
//! letter's origin is where `consumer dlq replay` republishes it, with the operator's
//! credentials. Every worker of a queue (and the `consumer` command) is given the same
//! [`OriginSecret`], usually from [`ORIGIN_SECRET_VAR`] (`AMQP_ORIGIN_SECRET`) through
//! [`OriginSecret::from_env`]; each retry copy and dead letter is signed with an
//! HMAC-SHA256 over its kind, the queue it is written for, its message id, its attempt and
//! its origin headers. A delivery whose signature verifies is the framework's own retry
//! copy, and its origin and first failure are carried on; any other (a producer's message,
//! however its headers look) gets the origin of its own delivery. Without a secret nothing
//! verifies, so each attempt's copy records where that attempt came from (a retried
//! message's dead letter then names the retry route back to the work queue) and a replay
//! needs `--to`. The secret never appears in a log line or an error.
//!
//! # Message identity
//!
//! [`consumer_core::transport::Delivery::message_id`] is the AMQP `message_id` property; the
//! runtime prefers the handler's key template, then the message id, then (if allowed) a payload
//! hash. `attempt` comes from [`headers::ATTEMPT`] (1 when absent), `redelivered` from the
//! AMQP flag, and the source reads `amqp:<queue> (exchange="…", routing_key="…")`.
//!
//! # Connection loss
//!
//! lapin's own auto-recovery is off. [`AmqpConsumer`] runs its connection in a background
//! task and replaces it whole: on a lost connection or channel, a consumer cancelled by the
//! broker (queue deleted) or a failed settlement publish, it logs why, reconnects with
//! exponential backoff for as long as the consumer lives, re-declares the topology (which
//! recreates a deleted queue) and consumes again. Owning this lets the crate re-declare
//! its retry and dead-letter queues, keep retrying past lapin's fixed number of attempts,
//! and draw a hard line between connections: every delivery belongs to one connection, and
//! once that connection is given up its deliveries can no longer be settled (settling
//! returns [`Error::ChannelClosed`], the runtime logs it), so a stale delivery tag is never
//! sent on a new channel, where it would ack a different message. The broker redelivers
//! those messages, flagged `redelivered`, and the inbox skips the ones already processed.
//!
//! # Clusters: several addresses
//!
//! [`AmqpConfig::failover_urls`] (or [`AmqpConfig::with_addresses`], one comma-separated
//! list) adds addresses of the same broker, e.g. every node of a RabbitMQ cluster. A
//! connection goes to the first address that answers ([`AmqpConfig::addresses`] order);
//! after a loss, each reconnection attempt starts with the address after the one lost and
//! goes round the list, so a worker whose node died moves to another node at its next
//! attempt. The line between connections above is what keeps this safe: the dead node's
//! delivery tags are never acked on the new node's channel, the broker redelivers those
//! messages (from a surviving replica of a quorum queue) and the inbox deduplicates them.
//! [`AmqpPublisher`] goes round the same list. [`ConsumerHealth::address`] tells which
//! address a consumer uses.
//!
//! # The broker's consumer timeout
//!
//! RabbitMQ closes a channel (`406 PRECONDITION_FAILED`) when one of its deliveries stays
//! unacked longer than the broker's `consumer_timeout` (30 minutes by default; per node in
//! 3.10, also per queue from 3.12). A client cannot read it, so
//! [`AmqpConfig::broker_consumer_timeout`] says what it is: [`AmqpConsumer::connect_for`]
//! refuses a worker whose handler timeout is not below it, and a delivery held unacked
//! while the broker refuses its retry copy, or a retry copy held until it is due, is held
//! at most half of it. A delivery can still
//! outlast it (waiting in the prefetch behind slow ones, or a broker set lower than the
//! configuration): the channel closes, the consumer reconnects as after any loss, the
//! delivery comes back and the inbox recognises it if its handler had completed. Nothing is
//! lost or applied twice; the work on that channel is delayed.
//!
//! # Credentials
//!
//! The URL is kept in a [`RedactedUrl`], whose `Display` and `Debug` print
//! `amqp://***@host:port/vhost`; every log line and error of this crate goes through it.
//! lapin receives the URL without user name and password (those go through an auth
//! provider), because its TCP layer logs the URI it connects to. One leak is lapin's own and
//! cannot be avoided from here: at TRACE level its `lapin::io_loop` target logs every frame
//! sent, including the login's SASL response, i.e. the password as bytes. Never run
//! production with `lapin=trace`.
//!
//! lapin also logs each connection loss itself, at ERROR level, before this crate logs the
//! same event at WARN with the queue and the reconnection plan; filter `lapin` if that is
//! noise. A silently dead TCP peer is noticed through heartbeats: add `?heartbeat=10` to the
//! URL to notice within 10 to 20 seconds, rather than about a minute with RabbitMQ's default
//! timeout of 60 seconds.
//!
//! # Metrics
//!
//! Through the `metrics` facade, as consumer-core's (whose crate doc has the table), labelled
//! with the `queue`:
//!
//! | metric | type | what |
//! |---|---|---|
//! | `consumer_amqp_unacked` | gauge | deliveries of the consuming channel not settled yet |
//! | `consumer_amqp_connected` | gauge | 1 while the consumer is connected and consuming, else 0 |
//! | `consumer_amqp_reconnects_total` | counter | reconnections after a lost connection or a cancelled consumer |
//! | `consumer_amqp_retry_copies_total` | counter | retry copies taken from a retry queue, by `moved`: `returned` (to the work queue, due) or `requeued` (to the tail of their retry queue, due after the longest hold) |
//!
//! # Layout
//!
//! `config` (configuration; `validate` checks it), `redacted_url` (the URL shown without
//! credentials), `origin` (signing and verifying the origin of copies), `topology` (what is
//! declared, retry buckets), `link` (connections, the confirm channel, and what one
//! connection's deliveries share), `consumer` (the reconnecting stream), `retry_queue`
//! (returning due retry copies to the work queue), `acker` (deliveries and their settlement: acks, retry and
//! dead-letter copies, requeues), `ack_book` (which acks may be coalesced into one
//! `multiple` ack), `publisher`, `headers` (the headers and properties of deliveries and
//! their copies), `error`.

mod ack_book;
mod acker;
mod config;
mod consumer;
mod error;
pub mod headers;
mod link;
mod origin;
mod publisher;
mod redacted_url;
mod retry_queue;
mod topology;

pub use config::{AmqpConfig, ExchangeType, QueueType, MAX_QUEUE_NAME_LEN};
pub use consumer::{AmqpConsumer, ConsumerHealth};
pub use error::Error;
pub use origin::{OriginSecret, MIN_ORIGIN_SECRET_LEN, ORIGIN_SECRET_VAR};
pub use publisher::AmqpPublisher;
pub use redacted_url::RedactedUrl;
