//! From a lapin delivery to an [`Incoming`], and its settlement.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::SystemTime;

use bytes::Bytes;
use futures::future::BoxFuture;
use lapin::options::{BasicAckOptions, BasicNackOptions};
use lapin::types::{AMQPValue, FieldTable, ShortString};
use lapin::BasicProperties;

use consumer_core::{
    Acknowledger, DeadLetter, Delivery, Incoming, Settlement, Source, TransportError,
};

use crate::consumer::Link;
use crate::headers;
use crate::Error;

/// Builds the runtime's envelope: `message_id` from the AMQP property, `attempt` from
/// [`headers::ATTEMPT`], `redelivered` from the AMQP flag, headers as strings.
pub(crate) fn incoming(d: lapin::message::Delivery, link: &Arc<Link>, queue: &str) -> Incoming {
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
            .map(|id| id.to_string())
            .filter(|id| !id.is_empty()),
        payload: payload.clone(),
        headers: Arc::new(headers::to_strings(table)),
        redelivered,
        attempt,
        // RabbitMQ flags a delivery redelivered if any consumer may have had it before
        // (requeued, or recovered after a broker restart); a retry copy carries its attempt.
        fresh: !redelivered && attempt == 1,
        position: None,
        source: Source {
            transport: "amqp",
            location: format!(
                "{queue} (exchange={:?}, routing_key={:?})",
                exchange.as_str(),
                routing_key.as_str()
            ),
        },
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

/// The deliveries of one consuming channel that are not settled yet, so that acks can be
/// coalesced into one `multiple` ack where that is safe.
///
/// A `multiple` ack of tag T settles every unsettled delivery up to T on the channel, so it
/// is sent only for a run of deliveries that starts at the oldest unsettled one and whose
/// outcomes are all durable and waiting for their ack. A delivery still in flight, or one
/// about to be requeued, stops the run: it is never acked by another's `multiple` ack.
///
/// A delivery that finishes while an older one is still in flight (a batch that commits
/// before the batch ahead of it, with several running at once) waits up to
/// [`ACK_WAIT_FOR_OLDER`] for the older one to leave the book, whose `multiple` ack then
/// covers it too; it is acked on its own only if that does not come in time. Concurrent
/// batches then cost the broker one frame each, as a hand-written consumer completing its
/// batches in order sends, not one per delivery; a delivery that never settles (its handler
/// hangs) costs the ones behind it that wait, not a stall.
pub(crate) struct AckBook<A = lapin::Acker> {
    /// Delivery tag to its acker once it only waits for its ack (`None` while in flight).
    pending: Mutex<BTreeMap<u64, Option<A>>>,
    /// Held while an ack or nack is being sent, so that frames leave in the order they were
    /// planned in: a `multiple` ack never overtakes a requeue it must not cover.
    sending: tokio::sync::Mutex<()>,
    /// Signalled whenever deliveries leave the book (acked, or requeued), so that those
    /// waiting behind an older delivery plan again.
    changed: tokio::sync::Notify,
}

/// How long a finished delivery waits for an older one still in flight before it is acked
/// on its own (see [`AckBook`]): long enough for the batch ahead of it to commit, short
/// enough that one slow handler does not hold the acks behind it for long.
const ACK_WAIT_FOR_OLDER: std::time::Duration = std::time::Duration::from_millis(25);

/// How often a retry copy the broker refused is offered again while its original is held
/// for the retry's delay (see [`AmqpAcker::forward_retry`]).
const REFUSED_COPY_RETRY: std::time::Duration = std::time::Duration::from_secs(1);

impl<A> Default for AckBook<A> {
    fn default() -> Self {
        AckBook {
            pending: Mutex::new(BTreeMap::new()),
            sending: tokio::sync::Mutex::new(()),
            changed: tokio::sync::Notify::new(),
        }
    }
}

/// What to send to settle one ready delivery.
#[derive(Debug, PartialEq, Eq)]
enum AckPlan<A> {
    /// Already acked by another delivery's `multiple` ack.
    Done,
    /// Ack the deliveries up to and including this tag, with this acker, in one frame.
    Through(u64, A),
    /// Ack this delivery alone.
    Alone,
}

impl<A: Clone> AckBook<A> {
    pub(crate) fn delivered(&self, tag: u64) {
        self.entries().insert(tag, None);
    }

    fn entries(&self) -> std::sync::MutexGuard<'_, BTreeMap<u64, Option<A>>> {
        self.pending.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn ready(&self, tag: u64, acker: &A) {
        if let Some(slot) = self.entries().get_mut(&tag) {
            *slot = Some(acker.clone());
        }
    }

    /// Called with `sending` held.
    fn plan(&self, tag: u64) -> AckPlan<A> {
        let entries = self.entries();
        if !entries.contains_key(&tag) {
            return AckPlan::Done;
        }
        // The run of ready deliveries from the oldest unsettled one.
        let mut last = None;
        for (t, acker) in entries.iter() {
            match acker {
                Some(acker) => last = Some((*t, acker)),
                None => break,
            }
        }
        match last {
            // `tag` is ready, so it is in the run exactly when the run reaches it.
            Some((last, acker)) if last >= tag => AckPlan::Through(last, acker.clone()),
            _ => AckPlan::Alone,
        }
    }

    /// Plans the ack of ready `tag` and returns the plan with `sending` held. While an older
    /// delivery is in flight the plan is to ack alone; until `deadline` it waits instead for
    /// deliveries to leave the book and plans again.
    async fn plan_waiting(
        &self,
        tag: u64,
        deadline: tokio::time::Instant,
    ) -> (tokio::sync::MutexGuard<'_, ()>, AckPlan<A>) {
        loop {
            // Registered before planning, so that a change in between is not missed.
            let changed = self.changed.notified();
            tokio::pin!(changed);
            changed.as_mut().enable();
            let sending = self.sending.lock().await;
            match self.plan(tag) {
                AckPlan::Alone if tokio::time::Instant::now() < deadline => drop(sending),
                plan => return (sending, plan),
            }
            // Past the deadline the next round plans to ack alone.
            let _ = tokio::time::timeout_at(deadline, changed).await;
        }
    }

    /// Forgets the deliveries up to and including `tag` (settled by one `multiple` frame).
    fn settled_through(&self, tag: u64) {
        self.entries().retain(|t, _| *t > tag);
        self.changed.notify_waiters();
    }

    fn settled(&self, tag: u64) {
        self.entries().remove(&tag);
        self.changed.notify_waiters();
    }
}

/// Settles one delivery on the channel it came from; acks go through the channel's
/// [`AckBook`].
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
        Box::pin(async move {
            let link = self.link.clone();
            // A settlement caught in its connection's failure ends when the session gives
            // the connection up: the broker redelivers the message, the inbox has it.
            tokio::select! {
                biased;
                settled = self.apply(settlement) => settled.map_err(TransportError::from),
                () = link.retired() => Err(Error::ChannelClosed.into()),
            }
        })
    }

    /// A retry publishes a copy to a retry queue (confirmed) before the original is acked;
    /// the retry queue dead-letters it back to this consumer's queue when it is due.
    fn copy_scope(&self) -> Option<&str> {
        Some(&self.link.topology.copy_scope)
    }
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
                let properties = self.retry_properties(attempt, now);
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
    /// rather than failing messages.
    ///
    /// Any other failure (channel closed, no confirm in time) requeues at once: the
    /// connection is replaced, and its unacked deliveries return to the queue with it.
    async fn forward_retry(
        self,
        queue: &str,
        properties: BasicProperties,
        delay: std::time::Duration,
    ) -> Result<(), Error> {
        let until = tokio::time::Instant::now() + delay;
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
        let book = &self.link.acks;
        let tag = self.delivery_tag;
        book.ready(tag, &self.acker);
        // Let the other deliveries of a batch, settled together, mark themselves ready
        // first: then the first of them acks all of them in one frame.
        tokio::task::yield_now().await;
        let deadline = tokio::time::Instant::now() + ACK_WAIT_FOR_OLDER;
        let (_sending, plan) = book.plan_waiting(tag, deadline).await;
        let (acker, multiple) = match plan {
            AckPlan::Done => return Ok(()),
            AckPlan::Through(last, acker) => (acker, Some(last)),
            AckPlan::Alone => (self.acker.clone(), None),
        };
        let sent = acker
            .ack(BasicAckOptions {
                multiple: multiple.is_some(),
            })
            .await;
        match sent {
            Ok(true) => {
                match multiple {
                    Some(last) => book.settled_through(last),
                    None => book.settled(tag),
                }
                Ok(())
            }
            // lapin poisons the ackers of a closed channel.
            Ok(false) => Err(Error::ChannelClosed),
            Err(e) => Err(Error::Ack { source: e.into() }),
        }
    }

    /// The original headers plus what every copy carries: where the message was first
    /// published, and when it first failed.
    ///
    /// Those (and the dead-letter headers) belong to the framework: they are kept only from
    /// our own retry copy ([`AmqpAcker::is_own_retry_copy`]), which wrote them; a producer's
    /// values of them are replaced, so a dead letter says where and when the framework saw
    /// the message, not what its producer claimed.
    fn copy_headers(&self, now: SystemTime) -> FieldTable {
        let original = self.properties.headers().as_ref();
        let own = self.is_own_retry_copy();
        let mut table: FieldTable = original
            .map(|t| {
                t.inner()
                    .iter()
                    .filter(|(k, _)| {
                        let k = k.as_str();
                        !headers::DEAD_LETTER.contains(&k) && (own || !headers::ORIGIN.contains(&k))
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
        table
    }

    /// Whether this delivery is a retry copy this transport wrote: it carries an attempt
    /// number and came back from one of this queue's retry queues, whose expiry the broker
    /// records in `x-death`. (A producer could forge both; it then only misstates the origin
    /// of its own message.)
    fn is_own_retry_copy(&self) -> bool {
        let table = self.properties.headers().as_ref();
        if headers::attempt(table) < 2 {
            return false;
        }
        let Some(AMQPValue::FieldArray(deaths)) = table.and_then(|t| t.inner().get("x-death"))
        else {
            return false;
        };
        let retry_queues = format!("{}.retry.", self.link.topology.queue);
        let text = |t: &FieldTable, k: &str| match t.inner().get(k) {
            Some(AMQPValue::LongString(s)) => Some(s.to_string()),
            Some(AMQPValue::ShortString(s)) => Some(s.to_string()),
            _ => None,
        };
        deaths.as_slice().iter().any(|d| match d {
            AMQPValue::FieldTable(t) => {
                text(t, "reason").as_deref() == Some("expired")
                    && text(t, "queue").is_some_and(|q| q.starts_with(&retry_queues))
            }
            _ => false,
        })
    }

    fn retry_properties(&self, attempt: u32, now: SystemTime) -> BasicProperties {
        let mut table = self.copy_headers(now);
        headers::set_int(&mut table, headers::ATTEMPT, attempt);
        copy_properties(&self.properties, table)
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
        copy_properties(&self.properties, table)
    }
}

/// The original properties with `headers`, made persistent, minus two that would defeat the
/// copy: `expiration` (a per-message TTL would expire it from the retry or dead-letter
/// queue) and `user_id` (RabbitMQ refuses a publish whose `user_id` is not the connection's
/// user, closing the channel).
fn copy_properties(original: &BasicProperties, headers: FieldTable) -> BasicProperties {
    let mut p = BasicProperties::default()
        .with_headers(headers)
        .with_delivery_mode(2);
    if let Some(v) = original.content_type() {
        p = p.with_content_type(v.clone());
    }
    if let Some(v) = original.content_encoding() {
        p = p.with_content_encoding(v.clone());
    }
    if let Some(v) = original.priority() {
        p = p.with_priority(*v);
    }
    if let Some(v) = original.correlation_id() {
        p = p.with_correlation_id(v.clone());
    }
    if let Some(v) = original.reply_to() {
        p = p.with_reply_to(v.clone());
    }
    if let Some(v) = original.message_id() {
        p = p.with_message_id(v.clone());
    }
    if let Some(v) = original.timestamp() {
        p = p.with_timestamp(*v);
    }
    if let Some(v) = original.kind() {
        p = p.with_type(v.clone());
    }
    if let Some(v) = original.app_id() {
        p = p.with_app_id(v.clone());
    }
    if let Some(v) = original.cluster_id() {
        p = p.with_cluster_id(v.clone());
    }
    p
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_multiple_ack_never_covers_a_delivery_in_flight() {
        let book = AckBook::<&str>::default();
        for tag in 1..=6 {
            book.delivered(tag);
        }
        // 2 is ready but 1 is in flight: 2 is acked alone.
        book.ready(2, &"a2");
        assert_eq!(book.plan(2), AckPlan::Alone);
        book.settled(2);
        // 1, 3 and 4 ready (2 settled): one frame through 4, sent with 4's acker.
        book.ready(3, &"a3");
        book.ready(4, &"a4");
        book.ready(1, &"a1");
        assert_eq!(book.plan(1), AckPlan::Through(4, "a4"));
        book.settled_through(4);
        assert_eq!(book.plan(3), AckPlan::Done);
        assert_eq!(book.plan(4), AckPlan::Done);
        // 5 in flight (say, being requeued), 6 ready: 6 alone, 5 never covered.
        book.ready(6, &"a6");
        assert_eq!(book.plan(6), AckPlan::Alone);
        book.settled(6);
        book.settled(5);
        assert!(book.entries().is_empty());
    }

    /// Each test runs on one thread: a spawned waiter runs only when the test yields, so
    /// `yield_now` lets it plan (to ack alone, 1 in flight) and start waiting.
    fn book_with_2_ready_behind_1() -> Arc<AckBook<&'static str>> {
        let book = Arc::new(AckBook::<&str>::default());
        book.delivered(1);
        book.delivered(2);
        book.ready(2, &"a2");
        book
    }

    fn wait_for_2(
        book: &Arc<AckBook<&'static str>>,
        wait: std::time::Duration,
    ) -> tokio::task::JoinHandle<AckPlan<&'static str>> {
        let book = book.clone();
        let deadline = tokio::time::Instant::now() + wait;
        tokio::spawn(async move { book.plan_waiting(2, deadline).await.1 })
    }

    /// The book of [`book_with_2_ready_behind_1`] and 2 waiting in it (60 s deadline).
    async fn waiting_behind_1() -> (
        Arc<AckBook<&'static str>>,
        tokio::task::JoinHandle<AckPlan<&'static str>>,
    ) {
        let book = book_with_2_ready_behind_1();
        let waiting = wait_for_2(&book, std::time::Duration::from_secs(60));
        tokio::task::yield_now().await;
        assert!(!waiting.is_finished(), "2 waits while 1 is in flight");
        (book, waiting)
    }

    /// The waiter's plan once the book changed: well before its 60 s deadline, or it was
    /// not woken.
    async fn woken(
        waiting: tokio::task::JoinHandle<AckPlan<&'static str>>,
    ) -> AckPlan<&'static str> {
        tokio::time::timeout(std::time::Duration::from_secs(10), waiting)
            .await
            .expect("woken by the change, not by its deadline")
            .unwrap()
    }

    #[tokio::test(flavor = "current_thread")]
    async fn a_delivery_behind_one_in_flight_is_covered_by_its_multiple_ack() {
        let (book, waiting) = waiting_behind_1().await;
        // 1 finishes: one frame through 2, and 2 has nothing left to send.
        book.ready(1, &"a1");
        let (sending, plan) = book.plan_waiting(1, tokio::time::Instant::now()).await;
        assert_eq!(plan, AckPlan::Through(2, "a2"));
        book.settled_through(2);
        drop(sending);
        assert_eq!(woken(waiting).await, AckPlan::Done);
    }

    #[tokio::test(flavor = "current_thread")]
    async fn a_delivery_behind_a_requeued_one_acks_itself_then() {
        let (book, waiting) = waiting_behind_1().await;
        // 1 is requeued (a nack leaves the book): 2 leads now and acks through itself.
        book.settled(1);
        assert_eq!(woken(waiting).await, AckPlan::Through(2, "a2"));
    }

    #[tokio::test(flavor = "current_thread")]
    async fn a_delivery_behind_one_that_stays_in_flight_is_acked_alone_at_the_deadline() {
        let book = book_with_2_ready_behind_1();
        let start = tokio::time::Instant::now();
        let wait = std::time::Duration::from_millis(20);
        let plan = wait_for_2(&book, wait).await.unwrap();
        assert_eq!(plan, AckPlan::Alone);
        assert!(start.elapsed() >= wait, "acked alone only at the deadline");
    }

    #[test]
    fn copies_keep_properties_but_expiration_and_user_id() {
        let original = BasicProperties::default()
            .with_message_id("m-1".into())
            .with_content_type("application/json".into())
            .with_correlation_id("c".into())
            .with_expiration("1000".into())
            .with_user_id("alice".into())
            .with_delivery_mode(1)
            .with_priority(3);
        let copy = copy_properties(&original, FieldTable::default());
        assert_eq!(copy.message_id().as_ref().map(|s| s.as_str()), Some("m-1"));
        assert_eq!(
            copy.content_type().as_ref().map(|s| s.as_str()),
            Some("application/json")
        );
        assert_eq!(
            copy.correlation_id().as_ref().map(|s| s.as_str()),
            Some("c")
        );
        assert_eq!(*copy.priority(), Some(3));
        assert_eq!(*copy.delivery_mode(), Some(2));
        assert!(copy.expiration().is_none());
        assert!(copy.user_id().is_none());
    }
}
