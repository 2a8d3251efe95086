//! From a lapin delivery to an [`Incoming`], and its settlement.

use std::collections::BTreeMap;
use std::future::Future;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use bytes::Bytes;
use futures::future::BoxFuture;
use lapin::options::{BasicAckOptions, BasicNackOptions};
use lapin::types::{FieldTable, ShortString};
use lapin::BasicProperties;

use consumer_core::transport::{
    AckResults, Acknowledger, DeadLetter, Delivery, Incoming, Location, MessageId, Origin,
    Settlement, Source, TransportError,
};

use crate::ack_book::{AckPlan, ACK_WAIT_FOR_OLDER};
use crate::headers;
use crate::link::Link;
use crate::origin::CopyKind;
use crate::Error;

/// The locations of one queue's deliveries, `<queue> (exchange="…", routing_key="…")`: the
/// last one is kept, so the deliveries that came the same way (most of them) share its text
/// instead of formatting their own.
pub(crate) struct Locations {
    queue: String,
    last: Option<(ShortString, ShortString, Arc<str>)>,
}

impl Locations {
    pub(crate) fn new(queue: &str) -> Self {
        Locations {
            queue: queue.to_owned(),
            last: None,
        }
    }

    /// The location of a delivery that came from `exchange` with `routing_key`.
    fn of(&mut self, exchange: &ShortString, routing_key: &ShortString) -> Location {
        match &self.last {
            Some((e, r, text)) if e == exchange && r == routing_key => Location::Text(text.clone()),
            _ => {
                let text: Arc<str> = Arc::from(format!(
                    "{} (exchange={:?}, routing_key={:?})",
                    self.queue,
                    exchange.as_str(),
                    routing_key.as_str()
                ));
                self.last = Some((exchange.clone(), routing_key.clone(), text.clone()));
                Location::Text(text)
            }
        }
    }
}

/// Builds the runtime's envelope: `message_id` from the AMQP property, `attempt` from
/// [`headers::ATTEMPT`], `redelivered` from the AMQP flag, headers as strings.
pub(crate) fn incoming(
    d: lapin::message::Delivery,
    link: &Arc<Link>,
    locations: &mut Locations,
) -> Incoming {
    let lapin::message::Delivery {
        delivery_tag,
        exchange,
        routing_key,
        redelivered,
        properties,
        data,
        acker,
    } = d;
    link.acks.delivered(delivery_tag);
    let table = properties.headers().as_ref();
    let payload = Bytes::from(data);
    let attempt = headers::attempt(table);
    let delivery = Delivery {
        message_id: properties
            .message_id()
            .as_ref()
            .filter(|id| !id.as_str().is_empty())
            .map(|id| MessageId::from(id.as_str())),
        payload: payload.clone(),
        headers: headers::to_headers(table, &properties),
        redelivered,
        attempt,
        // RabbitMQ flags a delivery redelivered if any consumer may have had it before
        // (requeued, or recovered after a broker restart), and a retry copy carries its
        // attempt: the runtime counts those whatever the origin says.
        origin: Origin::First,
        source: Source {
            transport: "amqp",
            location: locations.of(&exchange, &routing_key),
        },
        // The publisher's `timestamp` property, in seconds, if it set one.
        published_at: properties
            .timestamp()
            .map(|secs| std::time::UNIX_EPOCH + std::time::Duration::from_secs(secs)),
    };
    Incoming {
        delivery,
        acker: Box::new(AmqpAcker {
            link: link.clone(),
            acker,
            delivery_tag,
            exchange,
            routing_key,
            properties,
            payload,
        }),
    }
}

/// How often a retry copy the broker refused is offered again while its original is held
/// for the retry's delay (see [`AmqpAcker::forward_retry`]).
const REFUSED_COPY_RETRY: std::time::Duration = std::time::Duration::from_secs(1);

/// Settles one delivery on the channel it came from; acks go through the channel's
/// [`AckBook`](crate::ack_book::AckBook).
struct AmqpAcker {
    link: Arc<Link>,
    acker: lapin::Acker,
    delivery_tag: u64,
    exchange: ShortString,
    routing_key: ShortString,
    properties: BasicProperties,
    payload: Bytes,
}

impl Acknowledger for AmqpAcker {
    fn settle(
        self: Box<Self>,
        settlement: Settlement,
    ) -> BoxFuture<'static, Result<(), TransportError>> {
        let link = self.link.clone();
        match settlement {
            // An ack, the usual settlement, gets a future of its own: the one that may also
            // publish a copy is several KiB, which every delivery would allocate and copy.
            Settlement::Ack => Box::pin(or_retired(link, async move { self.ack().await })),
            other => Box::pin(or_retired(link, self.apply(other))),
        }
    }

    /// The deliveries of this channel among `others` are acked with this one as a run: marked
    /// ready together, then acked from the oldest, each `multiple` ack covering as many of
    /// them as the channel's [`AckBook`](crate::ack_book::AckBook) allows (usually all, in
    /// one frame). Each reports success once the frame that acked it was sent. The others (of
    /// another connection, or another transport) are settled on their own.
    fn ack_with(
        self: Box<Self>,
        others: Vec<Box<dyn Acknowledger>>,
    ) -> BoxFuture<'static, AckResults> {
        let link = self.link.clone();
        let same_channel = |a: &AmqpAcker, b: &AmqpAcker| Arc::ptr_eq(&a.link, &b.link);
        consumer_core::transport::ack_together(self, others, same_channel, |run| {
            Box::pin(ack_run(link, run))
        })
    }

    /// A retry publishes a copy to a retry queue (confirmed) before the original is acked;
    /// the retry queue dead-letters it back to this consumer's queue when it is due.
    fn copy_scope(&self) -> Option<&str> {
        Some(&self.link.topology.copy_scope)
    }
}

/// `settling`, unless the session gives its connection up first: a settlement caught in its
/// connection's failure ends then, and the broker redelivers the message (the inbox has it).
async fn or_retired<T>(
    link: Arc<Link>,
    settling: impl Future<Output = Result<T, Error>>,
) -> Result<T, TransportError> {
    tokio::select! {
        biased;
        settled = settling => settled.map_err(TransportError::from),
        () = link.retired() => Err(Error::ChannelClosed.into()),
    }
}

/// Acks `run`, deliveries of `link`'s channel, together (see [`AmqpAcker::ack_with`]): one
/// result each, in their order. Each frame is sent unless the session gives its connection up
/// first ([`or_retired`]); the deliveries acked before keep their success.
// Each came boxed from the runtime: unboxing them would copy every acknowledger.
#[allow(clippy::vec_box)]
async fn ack_run(link: Arc<Link>, run: Vec<Box<AmqpAcker>>) -> AckResults {
    if !link.is_alive() {
        return run
            .iter()
            .map(|_| Err(Error::ChannelClosed.into()))
            .collect();
    }
    link.acks
        .ready_all(run.iter().map(|a| (a.delivery_tag, &a.acker)));
    let mut oldest_first: Vec<usize> = (0..run.len()).collect();
    oldest_first.sort_unstable_by_key(|&i| run[i].delivery_tag);
    let deadline = tokio::time::Instant::now() + ACK_WAIT_FOR_OLDER;
    let mut results: AckResults = run.iter().map(|_| Ok(())).collect();
    // The last tag a frame of this run acked: the deliveries up to it are settled.
    let mut through = None;
    for i in oldest_first {
        let delivery = &run[i];
        if through.is_some_and(|t| delivery.delivery_tag <= t) {
            continue;
        }
        match or_retired(link.clone(), delivery.send_ack(deadline)).await {
            Ok(last) => through = Some(last),
            Err(e) => results[i] = Err(e),
        }
    }
    results
}

impl AmqpAcker {
    async fn apply(self, settlement: Settlement) -> Result<(), Error> {
        if !self.link.is_alive() {
            return Err(Error::ChannelClosed);
        }
        let now = SystemTime::now();
        match settlement {
            Settlement::Ack => self.ack().await,
            Settlement::Retry { delay, attempt } => {
                let bucket = self.link.topology.retry_bucket(delay).clone();
                let properties = self.retry_properties(attempt, now, bucket.delay);
                tracing::debug!(
                    tag = self.delivery_tag,
                    attempt,
                    ?delay,
                    queue = %bucket.queue,
                    "retry copy"
                );
                self.forward_retry(&bucket.queue, properties, delay).await
            }
            Settlement::DeadLetter(dead) => {
                let properties = self.dead_letter_properties(&dead, now);
                let dlq = self.link.topology.dead_letter_queue.clone();
                self.forward(&dlq, properties).await
            }
        }
    }

    /// Publishes the copy to `queue`, waits for its confirm, then acks the original. If the
    /// copy cannot be published the original is not acked: it is returned to its queue at
    /// once (a nack with requeue) rather than left unacked on a live channel, where nothing
    /// would ever redeliver it.
    async fn forward(self, queue: &str, properties: BasicProperties) -> Result<(), Error> {
        let published = self
            .link
            .publisher
            .publish("", queue, &self.payload, properties)
            .await;
        match published {
            Ok(()) => self.ack().await,
            Err(e) => self.requeue(e).await,
        }
    }

    /// [`AmqpAcker::forward`] for a retry copy, which the broker may refuse (a negative
    /// confirm: a `max-length` policy with `overflow: reject-publish` on the retry queue, a
    /// disk alarm). The failed attempt is already counted, so returning the original to its
    /// queue at once would run the next attempt at once: a full retry queue would burn the
    /// whole attempt budget in milliseconds, below the backoff floor. Instead the original
    /// is held, unacked, for the retry's `delay`, and the copy is offered again every
    /// [`REFUSED_COPY_RETRY`] meanwhile: the first copy the broker takes settles it as
    /// usual; if none is taken, the original goes back to its queue once the delay has
    /// passed, so the next attempt still runs no earlier than its backoff. Nothing is lost
    /// (the broker keeps the unacked original, and redelivers it if the connection drops),
    /// and a held delivery occupies its worker slot and prefetch slot (a graceful stop waits
    /// for it, at most the delay): a retry queue that refuses copies slows the consumer down
    /// rather than failing messages. The hold is at most half the broker's consumer timeout
    /// ([`AmqpConfig::broker_consumer_timeout`](crate::AmqpConfig::broker_consumer_timeout)),
    /// which would otherwise close the channel under it.
    ///
    /// Any other failure (channel closed, no confirm in time) requeues at once: the
    /// connection is replaced, and its unacked deliveries return to the queue with it.
    async fn forward_retry(
        self,
        queue: &str,
        properties: BasicProperties,
        delay: std::time::Duration,
    ) -> Result<(), Error> {
        let until = tokio::time::Instant::now() + delay.min(self.link.topology.max_hold);
        loop {
            let published = self
                .link
                .publisher
                .publish("", queue, &self.payload, properties.clone())
                .await;
            let refused = match published {
                Ok(()) => return self.ack().await,
                Err(e @ Error::Nacked { .. }) => e,
                Err(e) => return self.requeue(e).await,
            };
            let now = tokio::time::Instant::now();
            if now >= until {
                return self.requeue(refused).await;
            }
            tracing::warn!(
                tag = self.delivery_tag,
                queue,
                error = %refused,
                held_for = ?(until - now),
                "the broker refused a retry copy; holding the message for its backoff"
            );
            tokio::time::sleep_until(until.min(now + REFUSED_COPY_RETRY)).await;
        }
    }

    /// Returns the original to its queue after its copy failed with `e` (a nack with
    /// requeue), and reports `e`. A negative confirm is the broker's answer, not a broken
    /// channel; anything else (channel closed, queue missing, no confirm) calls for a
    /// fresh connection and topology.
    async fn requeue(self, e: Error) -> Result<(), Error> {
        if !matches!(e, Error::Nacked { .. }) {
            self.link.request_reset();
        }
        let requeue = BasicNackOptions {
            multiple: false,
            requeue: true,
        };
        let book = &self.link.acks;
        {
            let _sending = book.sending.lock().await;
            if let Err(nack) = self.acker.nack(requeue).await {
                tracing::debug!(error = %nack, "could not requeue after a failed publish");
            }
            book.settled(self.delivery_tag);
        }
        Err(e)
    }

    async fn ack(&self) -> Result<(), Error> {
        if !self.link.is_alive() {
            return Err(Error::ChannelClosed);
        }
        self.link.acks.ready(self.delivery_tag, &self.acker);
        // Let the other deliveries settled at the same time (by other tasks) mark
        // themselves ready first: then the first of them acks all of them in one frame.
        tokio::task::yield_now().await;
        let deadline = tokio::time::Instant::now() + ACK_WAIT_FOR_OLDER;
        self.send_ack(deadline).await.map(drop)
    }

    /// Acks this delivery, marked ready: alone, or in a `multiple` ack of the run it ends
    /// or belongs to, or not at all if another delivery's `multiple` ack covered it already
    /// (waiting until `deadline` for older deliveries in flight, see
    /// [`AckBook`](crate::ack_book::AckBook)). Returns the last tag the frame acked.
    async fn send_ack(&self, deadline: tokio::time::Instant) -> Result<u64, Error> {
        if !self.link.is_alive() {
            return Err(Error::ChannelClosed);
        }
        let book = &self.link.acks;
        let tag = self.delivery_tag;
        let (_sending, plan) = book.plan_waiting(tag, deadline).await;
        let (acker, multiple) = match plan {
            AckPlan::Done => return Ok(tag),
            AckPlan::Through(last, acker) => (acker, Some(last)),
            AckPlan::Alone => (self.acker.clone(), None),
        };
        let sent = acker
            .ack(BasicAckOptions {
                multiple: multiple.is_some(),
            })
            .await;
        match sent {
            Ok(true) => Ok(match multiple {
                Some(last) => {
                    book.settled_through(last);
                    last
                }
                None => {
                    book.settled(tag);
                    tag
                }
            }),
            // lapin poisons the ackers of a closed channel.
            Ok(false) => Err(Error::ChannelClosed),
            Err(e) => Err(Error::Ack { source: e.into() }),
        }
    }

    /// The original headers plus what every copy carries: where the message was first
    /// published, and when it first failed.
    ///
    /// Those (and the dead-letter headers) belong to the framework: they are kept only from
    /// our own retry copy ([`AmqpAcker::is_own_retry_copy`], signed), which wrote them; a
    /// producer's values of them are replaced, so a dead letter says where and when the
    /// framework saw the message, not what its producer claimed. The copy is signed anew
    /// once finished ([`AmqpAcker::sign`]).
    fn copy_headers(&self, now: SystemTime) -> FieldTable {
        let original = self.properties.headers().as_ref();
        let own = self.is_own_retry_copy();
        let mut table: FieldTable = original
            .map(|t| {
                t.inner()
                    .iter()
                    .filter(|(k, _)| {
                        let k = k.as_str();
                        !headers::DEAD_LETTER.contains(&k)
                            && k != headers::RETRY_DUE
                            && (own || !headers::ORIGIN.contains(&k))
                    })
                    .map(|(k, v)| (k.clone(), v.clone()))
                    .collect::<BTreeMap<_, _>>()
                    .into()
            })
            .unwrap_or_default();
        if !table.contains_key(headers::ORIGINAL_EXCHANGE) {
            headers::set_string(
                &mut table,
                headers::ORIGINAL_EXCHANGE,
                self.exchange.as_str(),
            );
        }
        if !table.contains_key(headers::ORIGINAL_ROUTING_KEY) {
            headers::set_string(
                &mut table,
                headers::ORIGINAL_ROUTING_KEY,
                self.routing_key.as_str(),
            );
        }
        if !table.contains_key(headers::FIRST_FAILURE) {
            headers::set_string(&mut table, headers::FIRST_FAILURE, &headers::rfc3339(now));
        }
        // The delivery span's own trace context (with core's `opentelemetry` feature), so
        // the copy's attempt is its child; else the message's header, carried above.
        if let Some(parent) = consumer_core::trace::current_traceparent() {
            headers::set_string(&mut table, consumer_core::trace::TRACEPARENT, &parent);
        }
        table
    }

    /// Whether this delivery is a retry copy this transport wrote for this queue: its
    /// [`headers::ORIGIN_SIGNATURE`] verifies under the queue's origin secret (see
    /// [`crate::OriginSecret`]). An attempt number and RabbitMQ's `x-death` prove nothing:
    /// a producer can write both. Without a secret, no delivery is.
    fn is_own_retry_copy(&self) -> bool {
        let topology = &self.link.topology;
        topology.origin_secret.as_ref().is_some_and(|secret| {
            secret.verifies(CopyKind::Retry, &topology.queue, &self.properties)
        })
    }

    /// Signs the origin in `table`, the finished headers of a copy of `kind` for `queue`;
    /// without a secret the copy goes unsigned.
    fn sign(&self, kind: CopyKind, queue: &str, table: &mut FieldTable) {
        if let Some(secret) = &self.link.topology.origin_secret {
            let message_id = self.properties.message_id().as_ref().map(|s| s.as_str());
            secret.sign(kind, queue, message_id, table);
        }
    }

    /// A retry copy's properties: the copy's headers, its attempt, and when it is due (the
    /// retry queue's `delay` after `now`).
    fn retry_properties(&self, attempt: u32, now: SystemTime, delay: Duration) -> BasicProperties {
        let mut table = self.copy_headers(now);
        headers::set_int(&mut table, headers::ATTEMPT, attempt);
        headers::set_millis(&mut table, headers::RETRY_DUE, now + delay);
        self.sign(CopyKind::Retry, &self.link.topology.queue, &mut table);
        headers::copy_properties(&self.properties, table)
    }

    fn dead_letter_properties(&self, dead: &DeadLetter, now: SystemTime) -> BasicProperties {
        let mut table = self.copy_headers(now);
        headers::set_string(
            &mut table,
            headers::DEAD_LETTER_REASON,
            dead.reason.as_str(),
        );
        headers::set_string(&mut table, headers::HANDLER, &dead.handler);
        if let Some(key) = &dead.key {
            headers::set_string(&mut table, headers::KEY, key);
        }
        headers::set_int(&mut table, headers::ATTEMPTS, dead.attempts);
        headers::set_string(
            &mut table,
            headers::ERROR,
            &headers::truncate(&dead.error, headers::MAX_ERROR_LEN),
        );
        headers::set_string(&mut table, headers::LAST_FAILURE, &headers::rfc3339(now));
        let dlq = &self.link.topology.dead_letter_queue;
        self.sign(CopyKind::DeadLetter, dlq, &mut table);
        headers::copy_properties(&self.properties, table)
    }
}
