//! An in-memory broker with real at-least-once behaviour, for the embedded default and fast
//! tests: unacked deliveries of a dropped consumer, or of one whose connection is lost
//! ([`Connection::lose`]), are redelivered (flagged `redelivered`), retries come back after
//! their delay without blocking anything, and dead letters are kept with their reason, in
//! memory ([`MemoryBroker::dead_letters`]) and, since that memory ends with the process, by
//! the runtime in the inbox's dead-letter table
//! ([`Inbox::dead_letters`](crate::Inbox::dead_letters)).

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::SystemTime;

use bytes::Bytes;
use futures::future::BoxFuture;
use futures::stream::BoxStream;
use futures::{Stream, StreamExt};
use tokio::sync::Notify;

use crate::delivery::{
    Acknowledger, DeadLetter, Delivery, Incoming, Location, Origin, Settlement, Source,
};
use crate::error::TransportError;
use crate::headers::Headers;
use crate::message_id::MessageId;

/// A message to publish.
#[derive(Debug, Clone, Default)]
pub struct Message {
    /// Optional message id.
    pub id: Option<String>,
    /// Payload.
    pub payload: Bytes,
    /// Headers.
    pub headers: BTreeMap<String, String>,
    /// When it was first published: `None` takes the time of [`MemoryBroker::publish`]
    /// (a test sets an older one to stand for a message published long ago).
    pub published_at: Option<SystemTime>,
}

impl Message {
    /// A message with an id and a JSON payload.
    pub fn json(id: impl Into<String>, payload: &serde_json::Value) -> Self {
        Message {
            id: Some(id.into()),
            payload: Bytes::from(payload.to_string()),
            headers: BTreeMap::new(),
            published_at: None,
        }
    }
}

/// A dead-lettered message and why.
#[derive(Debug, Clone)]
pub struct DeadLettered {
    /// The original message.
    pub message: Message,
    /// The reason and details.
    pub dead_letter: DeadLetter,
}

/// How many messages a queue holds in each state.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct QueueDepth {
    /// Waiting to be delivered.
    pub ready: usize,
    /// Delivered, not settled.
    pub unacked: usize,
    /// Waiting for a retry delay.
    pub delayed: usize,
    /// Dead-lettered.
    pub dead: usize,
}

impl QueueDepth {
    /// Nothing ready, in flight or delayed.
    pub fn is_drained(&self) -> bool {
        self.ready == 0 && self.unacked == 0 && self.delayed == 0
    }
}

/// A message as a queue holds it: its headers in the form deliveries share.
struct Stored {
    id: Option<MessageId>,
    payload: Bytes,
    headers: Headers,
    redelivered: bool,
    attempt: u32,
    /// Kept by its retry copies.
    published_at: SystemTime,
}

#[derive(Default)]
struct Queue {
    ready: VecDeque<Stored>,
    unacked: HashMap<u64, (u64, Stored)>,
    delayed: usize,
    dead: Vec<DeadLettered>,
    published: u64,
}

#[derive(Default)]
struct State {
    queues: HashMap<String, Queue>,
    next_tag: u64,
    next_consumer: u64,
}

impl State {
    /// An id no consumer or connection had: what a delivery's acker must still match.
    fn new_consumer_id(&mut self) -> u64 {
        self.next_consumer += 1;
        self.next_consumer
    }
}

impl Queue {
    /// Returns the unsettled deliveries of `consumer` to the front of the queue, in delivery
    /// order, flagged redelivered: their tags can no longer be settled.
    fn requeue(&mut self, consumer: u64) {
        let mut mine: Vec<u64> = self
            .unacked
            .iter()
            .filter(|(_, (c, _))| *c == consumer)
            .map(|(t, _)| *t)
            .collect();
        // Back in delivery order, ahead of newer messages.
        mine.sort_unstable();
        for tag in mine.into_iter().rev() {
            if let Some((_, mut stored)) = self.unacked.remove(&tag) {
                stored.redelivered = true;
                self.ready.push_front(stored);
            }
        }
    }
}

struct Shared {
    state: Mutex<State>,
    notify: Notify,
    /// Distinguishes this broker from any other in the process: a retry copy left with one
    /// broker never reaches the consumers of another (see [`Acknowledger::copy_scope`]).
    id: u64,
}

impl Default for Shared {
    fn default() -> Self {
        static NEXT_ID: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);
        Shared {
            state: Mutex::default(),
            notify: Notify::default(),
            id: NEXT_ID.fetch_add(1, std::sync::atomic::Ordering::Relaxed),
        }
    }
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// The broker. Cheap to clone; clones share queues.
#[derive(Clone, Default)]
pub struct MemoryBroker {
    shared: Arc<Shared>,
}

impl std::fmt::Debug for MemoryBroker {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MemoryBroker").finish_non_exhaustive()
    }
}

/// The relay publishes to the queue named by the message's destination (created on first
/// use); the in-memory broker never refuses a message.
impl crate::outbox::Publisher for MemoryBroker {
    fn publish<'a>(
        &'a self,
        message: &'a crate::outbox::OutboxMessage,
    ) -> BoxFuture<'a, Result<(), crate::outbox::PublishError>> {
        MemoryBroker::publish(
            self,
            &message.destination,
            Message {
                id: message.message_id.clone(),
                payload: message.payload.clone(),
                headers: message.headers.clone(),
                published_at: None,
            },
        );
        Box::pin(async { Ok(()) })
    }
}

impl MemoryBroker {
    /// An empty broker.
    pub fn new() -> Self {
        Self::default()
    }

    /// Appends `message` to `queue` (created on first use).
    pub fn publish(&self, queue: &str, message: Message) {
        self.push(
            queue,
            Stored {
                headers: Headers::from(&message.headers),
                id: message.id.map(MessageId::from),
                payload: message.payload,
                redelivered: false,
                attempt: 1,
                published_at: message.published_at.unwrap_or_else(SystemTime::now),
            },
        );
    }

    fn push(&self, queue: &str, stored: Stored) {
        {
            let mut state = self.shared.lock();
            let q = state.queues.entry(queue.to_owned()).or_default();
            q.published += 1;
            q.ready.push_back(stored);
        }
        self.shared.notify.notify_waiters();
    }

    /// Starts a consumer on `queue`. Dropping it returns its unsettled deliveries to the front
    /// of the queue, flagged redelivered, like a closed AMQP channel.
    pub fn consume(&self, queue: &str) -> MemoryConsumer {
        let link = {
            let mut state = self.shared.lock();
            state.queues.entry(queue.to_owned()).or_default();
            Arc::new(Link {
                id: AtomicU64::new(state.new_consumer_id()),
                lost: AtomicBool::new(false),
            })
        };
        let shared = self.shared.clone();
        // Shared by every delivery and acknowledger of this consumer.
        let names = Arc::new(ConsumerNames {
            queue: Arc::from(queue),
            scope: format!("memory:{}/{queue}", self.shared.id),
        });
        let stream = futures::stream::unfold(link.clone(), move |link| {
            let shared = shared.clone();
            let names = names.clone();
            async move {
                loop {
                    let notified = shared.notify.notified();
                    futures::pin_mut!(notified);
                    notified.as_mut().enable();
                    if link.lost.swap(false, Ordering::AcqRel) {
                        let lost = TransportError::msg("the connection to the broker was lost");
                        return Some((Err(lost), link));
                    }
                    if let Some(incoming) = take(&shared, &names, &link) {
                        return Some((Ok(incoming), link));
                    }
                    notified.await;
                }
            }
        })
        .boxed();
        MemoryConsumer {
            connection: Connection {
                shared: self.shared.clone(),
                queue: queue.to_owned(),
                link,
            },
            stream,
        }
    }

    /// The dead letters of `queue`.
    pub fn dead_letters(&self, queue: &str) -> Vec<DeadLettered> {
        let state = self.shared.lock();
        state
            .queues
            .get(queue)
            .map(|q| q.dead.clone())
            .unwrap_or_default()
    }

    /// The depth of `queue`.
    pub fn depth(&self, queue: &str) -> QueueDepth {
        let state = self.shared.lock();
        state
            .queues
            .get(queue)
            .map(|q| QueueDepth {
                ready: q.ready.len(),
                unacked: q.unacked.len(),
                delayed: q.delayed,
                dead: q.dead.len(),
            })
            .unwrap_or_default()
    }

    /// Waits until `queue` holds nothing ready, unacked or delayed.
    pub async fn drained(&self, queue: &str) {
        loop {
            let notified = self.shared.notify.notified();
            futures::pin_mut!(notified);
            notified.as_mut().enable();
            if self.depth(queue).is_drained() {
                return;
            }
            notified.await;
        }
    }
}

/// A consumer's queue name and retry scope, shared by its deliveries.
struct ConsumerNames {
    queue: Arc<str>,
    /// `memory:<broker id>/<queue>`: where its deliveries' retry copies come back.
    scope: String,
}

/// A consumer's connection: its current id (a new one after each loss: the deliveries of a
/// lost connection keep the old one, which no longer settles), and whether its stream is yet
/// to report a loss.
struct Link {
    /// Changed only under the broker's lock, and read under it by [`take`].
    id: AtomicU64,
    lost: AtomicBool,
}

fn take(shared: &Arc<Shared>, names: &Arc<ConsumerNames>, link: &Link) -> Option<Incoming> {
    let queue = &*names.queue;
    let mut state = shared.lock();
    let consumer = link.id.load(Ordering::Acquire);
    state.next_tag += 1;
    let tag = state.next_tag;
    let q = state.queues.get_mut(queue)?;
    let stored = q.ready.pop_front()?;
    let delivery = Delivery {
        message_id: stored.id.clone(),
        payload: stored.payload.clone(),
        headers: stored.headers.clone(),
        redelivered: stored.redelivered,
        attempt: stored.attempt,
        origin: Origin::First,
        source: Source {
            transport: "memory",
            location: Location::Text(names.queue.clone()),
        },
        published_at: Some(stored.published_at),
    };
    q.unacked.insert(tag, (consumer, stored));
    Some(Incoming {
        delivery,
        acker: Box::new(MemoryAcker {
            names: names.clone(),
            broker: MemoryBroker {
                shared: shared.clone(),
            },
            tag,
            consumer,
        }),
    })
}

/// A consumer of one queue: a [`crate::transport::Transport`].
pub struct MemoryConsumer {
    connection: Connection,
    stream: BoxStream<'static, Result<Incoming, TransportError>>,
}

impl MemoryConsumer {
    /// A handle on this consumer's connection, to lose it while the consumer is in use (see
    /// [`Connection::lose`]).
    pub fn connection(&self) -> Connection {
        self.connection.clone()
    }
}

impl std::fmt::Debug for MemoryConsumer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MemoryConsumer")
            .field("queue", &self.connection.queue)
            .field("id", &self.connection.link.id.load(Ordering::Relaxed))
            .finish_non_exhaustive()
    }
}

impl Stream for MemoryConsumer {
    type Item = Result<Incoming, TransportError>;

    fn poll_next(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Self::Item>> {
        self.stream.poll_next_unpin(cx)
    }
}

impl Drop for MemoryConsumer {
    fn drop(&mut self) {
        self.connection.requeue(false);
    }
}

/// The connection of a [`MemoryConsumer`], to make it fail as a broker connection does.
#[derive(Clone)]
pub struct Connection {
    shared: Arc<Shared>,
    queue: String,
    link: Arc<Link>,
}

impl std::fmt::Debug for Connection {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Connection")
            .field("queue", &self.queue)
            .finish_non_exhaustive()
    }
}

impl Connection {
    /// Loses the connection, as a RabbitMQ connection loss does: the consumer's unsettled
    /// deliveries go back to the front of the queue, flagged redelivered, and can no longer
    /// be settled (settling one fails, as a delivery tag of a closed channel does). The
    /// consumer's stream then yields one [`TransportError`] and consumes again on a new
    /// connection, as `consumer-amqp`'s consumer reconnects; a transport that does not
    /// reconnect ends its stream there instead.
    pub fn lose(&self) {
        self.requeue(true);
    }

    /// Requeues the unsettled deliveries of the current connection; with `reconnect`, the
    /// consumer goes on under a new one and reports the loss.
    fn requeue(&self, reconnect: bool) {
        {
            let mut state = self.shared.lock();
            let old = self.link.id.load(Ordering::Acquire);
            if reconnect {
                let new = state.new_consumer_id();
                self.link.id.store(new, Ordering::Release);
                self.link.lost.store(true, Ordering::Release);
            }
            if let Some(q) = state.queues.get_mut(&self.queue) {
                q.requeue(old);
            }
        }
        self.shared.notify.notify_waiters();
    }
}

struct MemoryAcker {
    /// Its queue, and where its retry copies come back.
    names: Arc<ConsumerNames>,
    broker: MemoryBroker,
    tag: u64,
    consumer: u64,
}

impl Acknowledger for MemoryAcker {
    fn settle(
        self: Box<Self>,
        settlement: Settlement,
    ) -> BoxFuture<'static, Result<(), TransportError>> {
        Box::pin(async move {
            let stored = {
                let mut state = self.broker.shared.lock();
                let q = state
                    .queues
                    .get_mut(&*self.names.queue)
                    .ok_or_else(|| TransportError::msg("queue vanished"))?;
                match q.unacked.get(&self.tag) {
                    // Like an AMQP delivery tag of a closed channel: it cannot be settled.
                    Some((c, _)) if *c == self.consumer => {}
                    _ => {
                        return Err(TransportError::msg(
                            "stale delivery tag: the consumer is gone",
                        ))
                    }
                }
                let Some((_, stored)) = q.unacked.remove(&self.tag) else {
                    return Err(TransportError::msg("stale delivery tag"));
                };
                match settlement {
                    Settlement::Ack => None,
                    Settlement::DeadLetter(dead_letter) => {
                        q.dead.push(DeadLettered {
                            message: Message {
                                id: stored.id.map(String::from),
                                payload: stored.payload,
                                headers: stored.headers.to_map(),
                                published_at: Some(stored.published_at),
                            },
                            dead_letter,
                        });
                        None
                    }
                    Settlement::Retry { delay, attempt } => {
                        q.delayed += 1;
                        Some((stored, delay, attempt))
                    }
                }
            };
            self.broker.shared.notify.notify_waiters();
            if let Some((mut stored, delay, attempt)) = stored {
                let broker = self.broker.clone();
                let queue = self.names.queue.to_string();
                // The delay runs on its own task: nothing else waits for it.
                tokio::spawn(async move {
                    tokio::time::sleep(delay).await;
                    stored.attempt = attempt;
                    stored.redelivered = false;
                    stored
                        .headers
                        .insert(crate::header_names::ATTEMPT, attempt.to_string());
                    {
                        let mut state = broker.shared.lock();
                        let q = state.queues.entry(queue).or_default();
                        q.delayed = q.delayed.saturating_sub(1);
                        q.ready.push_back(stored);
                    }
                    broker.shared.notify.notify_waiters();
                });
            }
            Ok(())
        })
    }

    /// A retry removes the delivery and queues a copy carrying the new attempt number, on
    /// this broker and queue.
    fn copy_scope(&self) -> Option<&str> {
        Some(&self.names.scope)
    }

    /// The broker's dead letters ([`MemoryBroker::dead_letters`]) end with the process: the
    /// runtime also keeps each in the inbox's dead-letter table.
    fn keeps_dead_letters(&self) -> bool {
        false
    }
}

#[cfg(test)]
mod tests;
