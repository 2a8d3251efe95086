//! What a transport hands the runtime, and how the runtime hands it back.
//!
//! A transport is any [`Stream`] of [`Incoming`] deliveries. Each delivery carries an
//! [`Acknowledger`] that settles exactly that delivery. This fits both broker families
//! without the core knowing either:
//!
//! - RabbitMQ acks per delivery tag; its acknowledger acks (or publishes a retry / dead-letter
//!   copy, then acks) the one tag.
//! - Kafka commits one offset per partition; its acknowledger marks the offset settled, and the
//!   transport commits only up to the last contiguous settled offset.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use futures::future::BoxFuture;
use futures::{FutureExt, Stream};

use crate::error::TransportError;
use crate::headers::Headers;
use crate::message_id::MessageId;

/// Where a delivery came from, for dead-letter reasons and logs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Source {
    /// The transport, e.g. `memory`, `amqp`, `kafka`.
    pub transport: &'static str,
    /// Transport-specific location, e.g. a queue name or `topic/partition@offset`.
    pub location: Location,
}

impl fmt::Display for Source {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}:{}", self.transport, self.location)
    }
}

/// Where a delivery sits at its transport, as its [`Display`](fmt::Display) shows it: a
/// queue (and how the message got there), or a record's `topic/partition@offset`.
///
/// Made of shared parts and formatted only when shown (a log line, a dead letter), so a
/// transport builds one per delivery without formatting or copying text. Two locations are
/// equal when they are the same variant with equal parts; compare their text to compare
/// what they show.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Location {
    /// Text, shared by the deliveries that have it (e.g. a queue's).
    Text(Arc<str>),
    /// A record in a log: `topic/partition@offset`.
    Record {
        /// The topic.
        topic: Arc<str>,
        /// The partition.
        partition: i32,
        /// The record's offset.
        offset: i64,
    },
}

impl fmt::Display for Location {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Location::Text(text) => f.write_str(text),
            Location::Record {
                topic,
                partition,
                offset,
            } => write!(f, "{topic}/{partition}@{offset}"),
        }
    }
}

impl From<&str> for Location {
    fn from(text: &str) -> Self {
        Location::Text(Arc::from(text))
    }
}

/// One message as received: the envelope every transport produces.
#[derive(Debug, Clone)]
pub struct Delivery {
    /// The producer-assigned message id, if any (AMQP `message_id`, a Kafka header). It
    /// reads as a `&str` (`delivery.message_id.as_deref()`); a transport may share it with
    /// the block it read the message's headers into.
    pub message_id: Option<MessageId>,
    /// The raw payload.
    pub payload: Bytes,
    /// Text headers (transport properties the runtime or handlers may read). Shared: a
    /// transport hands every delivery of one message the same block, and cloning a delivery
    /// does not copy them.
    pub headers: Headers,
    /// The broker says it delivered this message before (not acked then).
    pub redelivered: bool,
    /// The delivery attempt as the transport counts it (1 for the first), from a retry header.
    /// The inbox keeps the authoritative count, which also counts crashes.
    pub attempt: u32,
    /// What the transport knows of the message's past. The runtime's inbox alone decides
    /// from it (and from the attempt number and the redelivered flag) whether the delivery
    /// is *fresh*: nobody's repeat, so its attempt need not be counted ahead of the handler
    /// and its key is claimed in the handler's transaction (as a hand-written consumer would
    /// do), one statement and one row version cheaper. [`Origin::Unknown`] is always safe.
    pub origin: Origin,
    /// Where it came from.
    pub source: Source,
    /// When the message was first published, as far as the transport knows (a Kafka
    /// record's timestamp, an AMQP message's `timestamp` property, the in-memory broker's
    /// publish time); `None` if it does not. A delivery older than the handler's retention
    /// may find its key's row purged: see [`crate::WorkerConfig::dead_letter_too_old`].
    pub published_at: Option<std::time::SystemTime>,
}

/// What a transport knows of a delivery's past (see [`Delivery::origin`]).
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum Origin {
    /// The broker guarantees that no consumer was handed this message before (RabbitMQ: not
    /// flagged redelivered and no retry attempt header; the in-memory broker likewise).
    First,
    /// A record at a position in a log whose offsets survive redeliveries (a Kafka
    /// partition). Kafka cannot say whether a member that died had run it; the runtime
    /// tells from the log's mark in the inbox database (see [`LogPosition`]).
    Log(LogPosition),
    /// The transport cannot tell: the delivery takes the counted path.
    Unknown,
}

/// Where a record sits in a log whose records keep their offsets across redeliveries (a
/// Kafka partition as one consumer group reads it).
///
/// The runtime keeps, per handler and [`LogPosition::log`], the highest offset it may ever
/// have handed out (plus a step), and moves it ahead in the database before it runs a record
/// past it. A record at or past the mark read when its `epoch` began was never run before,
/// so a crash while it runs cannot be one of a crash loop: it takes the fresh path (see
/// [`Context::fresh`](crate::Context::fresh)). Anything below takes the counted path.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LogPosition {
    /// Names the log and its reader, e.g. `group/topic/partition`: two consumer groups
    /// reading one topic are two logs.
    pub log: Arc<str>,
    /// Changes whenever this process's hold on the log may have lapsed (a new partition
    /// assignment): what the runtime learnt of the log in an earlier epoch is not trusted.
    pub epoch: u64,
    /// The record's offset in the log.
    pub offset: i64,
}

/// A delivery plus the means to settle it.
pub struct Incoming {
    /// The message.
    pub delivery: Delivery,
    /// Settles this delivery; used exactly once.
    pub acker: Box<dyn Acknowledger>,
}

impl fmt::Debug for Incoming {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Incoming")
            .field("delivery", &self.delivery)
            .finish_non_exhaustive()
    }
}

/// How the runtime settles a delivery.
#[derive(Debug, Clone)]
pub enum Settlement {
    /// Done (processed and committed, or a recorded duplicate): remove it from the broker.
    Ack,
    /// Deliver it again after `delay`, without blocking other messages. `attempt` is the number
    /// the new copy should carry.
    Retry {
        /// How long to wait before the copy is delivered.
        delay: Duration,
        /// The attempt number of the redelivered copy.
        attempt: u32,
    },
    /// Move it to the dead-letter destination with the reason, then remove it.
    DeadLetter(DeadLetter),
}

/// Why a message was dead-lettered.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum DeadLetterReason {
    /// The payload could not be decoded into the handler's message type.
    Undecodable,
    /// The payload is larger than the worker's `max_payload_bytes`.
    PayloadTooLarge,
    /// No idempotency key could be derived (no message id, template field missing, hashing
    /// not allowed).
    MissingKey,
    /// The derived key cannot be stored: it is empty, longer than
    /// [`MAX_KEY_BYTES`](crate::key::MAX_KEY_BYTES) or holds a control character, or the inbox
    /// database refused it (a data exception or a program limit, named by its SQLSTATE).
    InvalidKey,
    /// The key was seen before with a different payload.
    KeyConflict,
    /// The handler returned a permanent error.
    PermanentError,
    /// The handler failed on its last allowed attempt.
    MaxAttemptsExceeded,
    /// The attempt count was used up by attempts that never reported back (crashes): the
    /// message is not run again.
    Quarantined,
    /// The transport could not write the message's copy (it is larger than the broker or
    /// its producer accepts): the dead letter carries a reference to the original (where it
    /// still is) instead of its body, and the first reason in its error text.
    CopyTooLarge,
    /// The message is older than the handler's retention, so its key's row may have been
    /// purged and a run could repeat its effect; dead-lettered instead of run when the
    /// worker is configured so ([`crate::WorkerConfig::dead_letter_too_old`]).
    TooOld,
}

impl DeadLetterReason {
    /// The stable, machine-readable name used in headers and logs.
    pub fn as_str(self) -> &'static str {
        match self {
            DeadLetterReason::Undecodable => "undecodable",
            DeadLetterReason::PayloadTooLarge => "payload_too_large",
            DeadLetterReason::MissingKey => "missing_key",
            DeadLetterReason::InvalidKey => "invalid_key",
            DeadLetterReason::KeyConflict => "key_conflict",
            DeadLetterReason::PermanentError => "permanent_error",
            DeadLetterReason::MaxAttemptsExceeded => "max_attempts_exceeded",
            DeadLetterReason::Quarantined => "quarantined",
            DeadLetterReason::CopyTooLarge => "copy_too_large",
            DeadLetterReason::TooOld => "too_old",
        }
    }

    /// Parses [`DeadLetterReason::as_str`] back.
    pub fn parse(s: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|r| r.as_str() == s)
    }

    /// Every reason, in a stable order.
    pub(crate) const ALL: [DeadLetterReason; 10] = [
        DeadLetterReason::Undecodable,
        DeadLetterReason::PayloadTooLarge,
        DeadLetterReason::MissingKey,
        DeadLetterReason::InvalidKey,
        DeadLetterReason::KeyConflict,
        DeadLetterReason::PermanentError,
        DeadLetterReason::MaxAttemptsExceeded,
        DeadLetterReason::Quarantined,
        DeadLetterReason::CopyTooLarge,
        DeadLetterReason::TooOld,
    ];
}

impl fmt::Display for DeadLetterReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Everything a dead-letter destination records about a failed message.
#[derive(Debug, Clone)]
pub struct DeadLetter {
    /// The reason.
    pub reason: DeadLetterReason,
    /// The handler's stable name.
    pub handler: String,
    /// The idempotency key, when one was derived.
    pub key: Option<String>,
    /// Attempts counted by the inbox (0 when the handler never ran).
    pub attempts: u32,
    /// The error text.
    pub error: String,
    /// Where the message came from.
    pub source: Source,
}

/// Settles one delivery with its broker.
///
/// Called at most once per delivery, and only after the handler's transaction has committed
/// (or the runtime decided the message must not run). An implementation must not report
/// success before the broker has the outcome (for instance a retry copy must be confirmed
/// before the original is acked).
pub trait Acknowledger: std::any::Any + Send {
    /// Applies `settlement` to the delivery.
    fn settle(
        self: Box<Self>,
        settlement: Settlement,
    ) -> BoxFuture<'static, Result<(), TransportError>>;

    /// Acks this delivery and `others` (deliveries of the same batch, all to be acked, in
    /// the order they were delivered), and returns one result each, this delivery's first.
    ///
    /// The runtime calls it once per batch that acks more than one delivery, with all of
    /// them, on the acknowledger of the first ([`Acknowledger::settle`] applies every other
    /// settlement, and a lone ack). Each result means what `settle`'s would: success once
    /// that delivery's ack is applied. The default settles each on its own
    /// with [`Settlement::Ack`], all under way at once. A transport for which acking several
    /// deliveries is one step (RabbitMQ's `multiple` ack) overrides it: it takes from `others`
    /// those of its own kind and channel ([`crate::transport::ack_together`]) and acks them
    /// together, and settles the rest on their own. A wrapper around another acknowledger overrides
    /// it to pass the batch on ([`crate::transport::downcast_acker`]).
    fn ack_with(
        self: Box<Self>,
        others: Vec<Box<dyn Acknowledger>>,
    ) -> BoxFuture<'static, AckResults> {
        let first = self.settle(Settlement::Ack);
        settle_each(first, others, Settlement::Ack)
    }

    /// Where the copies of a [`Settlement::Retry`] that returns `Ok` go, when such a retry
    /// leaves a new copy of the message with the broker, carrying the new attempt number (a
    /// retry queue or topic), rather than putting this delivery back in place: a name for the
    /// consumers that will read the copy (e.g. `amqp:<queue>`, `kafka:<group>:<retry suffix>`,
    /// the in-memory broker's instance and queue). `None` (the default) when a retry writes
    /// no copy.
    ///
    /// The runtime records the copy's attempt number, this scope and the copy's due time in
    /// the inbox. A later delivery of the same pending key with a lower attempt number (a
    /// Kafka record replayed after a rebalance, a RabbitMQ delivery whose ack was lost) is
    /// then superseded — acked without running and without counting an attempt, so the
    /// message keeps the backoff and the attempt budget its copies were given — but only if
    /// it arrives through an acknowledger of the same scope (so the copy will reach the same
    /// consumers) and before the copy is overdue by the worker's grace period. Otherwise the
    /// copy may never be read (another consumer group, a retry queue deleted, a retry topic
    /// no longer consumed or past its retention), and the delivery runs as one more attempt.
    ///
    /// The scope must be stable across restarts of the same consumers and differ between
    /// consumers that do not read each other's copies. `None` is always safe: such a
    /// redelivery then runs as one more attempt.
    fn copy_scope(&self) -> Option<&str> {
        None
    }

    /// Whether a [`Settlement::DeadLetter`] leaves the message with the broker, in a
    /// dead-letter queue or topic an operator can read and replay from: `true` (the
    /// default) for RabbitMQ and Kafka. A transport without one returns `false` (the
    /// webhook ingress, which only answers the provider; the in-memory broker, which lives
    /// and dies with its process): the runtime then keeps the whole message (body, headers,
    /// message id, source, handler, key, reason, error, attempts) in the inbox's
    /// dead-letter table ([`Inbox::dead_letters`](crate::Inbox::dead_letters)) *before* it
    /// settles the dead letter; if that write fails, it settles a retry instead, so that
    /// nothing is dropped. A wrapper around another acknowledger passes its answer on.
    fn keeps_dead_letters(&self) -> bool {
        true
    }
}

/// The results of acking a batch's deliveries: one each, in the batch's order.
pub type AckResults = Vec<Result<(), TransportError>>;

/// The settlements `first` (already under way) and `settlement` of each of `others`, as one
/// future of their results in that order. Each is polled once at once: those applied then
/// (a Kafka ack, say) are not kept, and only the rest are joined.
pub fn settle_each(
    first: BoxFuture<'static, Result<(), TransportError>>,
    others: Vec<Box<dyn Acknowledger>>,
    settlement: Settlement,
) -> BoxFuture<'static, AckResults> {
    let mut done = Vec::with_capacity(1 + others.len());
    let mut waiting = Vec::new();
    let settling = std::iter::once(first).chain(
        others
            .into_iter()
            .map(|acker| acker.settle(settlement.clone())),
    );
    for (i, mut settling) in settling.enumerate() {
        match (&mut settling).now_or_never() {
            Some(result) => done.push(result),
            None => {
                done.push(Ok(()));
                waiting.push(settling.map(move |result| (i, result)));
            }
        }
    }
    if waiting.is_empty() {
        return Box::pin(std::future::ready(done));
    }
    Box::pin(async move {
        for (i, result) in futures::future::join_all(waiting).await {
            done[i] = result;
        }
        done
    })
}

/// The future of a settlement an [`Acknowledger`] has already applied, before returning:
/// `Ok(())` at once. It holds nothing, so boxing it allocates nothing (an `async` block
/// would be one allocation a delivery): for a transport whose ack is a local step, such as
/// marking a Kafka offset settled.
pub fn settled_now() -> BoxFuture<'static, Result<(), TransportError>> {
    Box::pin(SettledNow)
}

/// See [`settled_now`].
struct SettledNow;

impl std::future::Future for SettledNow {
    type Output = Result<(), TransportError>;

    fn poll(
        self: std::pin::Pin<&mut Self>,
        _: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Self::Output> {
        std::task::Poll::Ready(Ok(()))
    }
}

/// A source of deliveries: any stream of [`Incoming`].
///
/// An `Err` item is logged and consumption continues; the stream ending ends the worker.
pub trait Transport:
    Stream<Item = Result<Incoming, TransportError>> + Send + Unpin + 'static
{
}

impl<S> Transport for S where
    S: Stream<Item = Result<Incoming, TransportError>> + Send + Unpin + 'static
{
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_location_reads_as_its_text() {
        let record = Location::Record {
            topic: Arc::from("jobs"),
            partition: 3,
            offset: 41,
        };
        assert_eq!(record.to_string(), "jobs/3@41");
        let queue = Location::from("q (exchange=\"\", routing_key=\"q\")");
        assert_eq!(queue.to_string(), "q (exchange=\"\", routing_key=\"q\")");
        let source = Source {
            transport: "kafka",
            location: record,
        };
        assert_eq!(source.to_string(), "kafka:jobs/3@41");
    }

    #[tokio::test]
    async fn a_settlement_already_applied_is_ready_at_once() {
        assert!(settled_now().await.is_ok());
    }
}
