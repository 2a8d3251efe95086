//! An in-memory broker with real at-least-once behaviour, for the embedded default and fast
//! tests: unacked deliveries of a dropped consumer are redelivered (flagged `redelivered`),
//! retries come back after their delay without blocking anything, and dead letters are kept
//! with their reason, in memory ([`MemoryBroker::dead_letters`]) and, since that memory ends
//! with the process, by the runtime in the inbox's dead-letter table
//! ([`Inbox::dead_letters`](crate::Inbox::dead_letters)).

use std::collections::{BTreeMap, HashMap, VecDeque};
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
use crate::{Headers, MessageId, TransportError};

/// The header carrying the attempt number of a retried copy.
pub const ATTEMPT_HEADER: &str = "x-attempt";

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
        let id = {
            let mut state = self.shared.lock();
            state.queues.entry(queue.to_owned()).or_default();
            state.next_consumer += 1;
            state.next_consumer
        };
        let shared = self.shared.clone();
        // Shared by every delivery and acknowledger of this consumer.
        let names = Arc::new(ConsumerNames {
            queue: Arc::from(queue),
            scope: format!("memory:{}/{queue}", self.shared.id),
        });
        let stream = futures::stream::unfold((), move |()| {
            let shared = shared.clone();
            let names = names.clone();
            async move {
                loop {
                    let notified = shared.notify.notified();
                    futures::pin_mut!(notified);
                    notified.as_mut().enable();
                    if let Some(incoming) = take(&shared, &names, id) {
                        return Some((Ok(incoming), ()));
                    }
                    notified.await;
                }
            }
        })
        .boxed();
        MemoryConsumer {
            shared: self.shared.clone(),
            queue: queue.to_owned(),
            id,
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

fn take(shared: &Arc<Shared>, names: &Arc<ConsumerNames>, consumer: u64) -> Option<Incoming> {
    let queue = &*names.queue;
    let mut state = shared.lock();
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

/// A consumer of one queue: a [`crate::Transport`].
pub struct MemoryConsumer {
    shared: Arc<Shared>,
    queue: String,
    id: u64,
    stream: BoxStream<'static, Result<Incoming, TransportError>>,
}

impl std::fmt::Debug for MemoryConsumer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MemoryConsumer")
            .field("queue", &self.queue)
            .field("id", &self.id)
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
        {
            let mut state = self.shared.lock();
            if let Some(q) = state.queues.get_mut(&self.queue) {
                let mut mine: Vec<u64> = q
                    .unacked
                    .iter()
                    .filter(|(_, (c, _))| *c == self.id)
                    .map(|(t, _)| *t)
                    .collect();
                // Back in delivery order, ahead of newer messages.
                mine.sort_unstable();
                for tag in mine.into_iter().rev() {
                    if let Some((_, mut stored)) = q.unacked.remove(&tag) {
                        stored.redelivered = true;
                        q.ready.push_front(stored);
                    }
                }
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
                    stored.headers.insert(ATTEMPT_HEADER, attempt.to_string());
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
mod tests {
    use super::*;
    use std::time::Duration;

    fn msg(id: &str) -> Message {
        Message::json(id, &serde_json::json!({"id": id}))
    }

    #[tokio::test]
    async fn unacked_deliveries_of_a_dropped_consumer_come_back_redelivered() {
        let broker = MemoryBroker::new();
        broker.publish("q", msg("a"));
        broker.publish("q", msg("b"));
        let mut c1 = broker.consume("q");
        let a = c1.next().await.unwrap().unwrap();
        assert!(!a.delivery.redelivered);
        drop(a);
        drop(c1);
        let mut c2 = broker.consume("q");
        let again = c2.next().await.unwrap().unwrap();
        assert_eq!(again.delivery.message_id.as_deref(), Some("a"));
        assert!(again.delivery.redelivered);
        again.acker.settle(Settlement::Ack).await.unwrap();
        let b = c2.next().await.unwrap().unwrap();
        assert_eq!(b.delivery.message_id.as_deref(), Some("b"));
        b.acker.settle(Settlement::Ack).await.unwrap();
        assert!(broker.depth("q").is_drained());
    }

    #[tokio::test(start_paused = true)]
    async fn retry_comes_back_after_its_delay_without_blocking_others() {
        let broker = MemoryBroker::new();
        broker.publish("q", msg("slow"));
        let mut c = broker.consume("q");
        let first = c.next().await.unwrap().unwrap();
        first
            .acker
            .settle(Settlement::Retry {
                delay: Duration::from_secs(5),
                attempt: 2,
            })
            .await
            .unwrap();
        broker.publish("q", msg("fast"));
        let fast = c.next().await.unwrap().unwrap();
        assert_eq!(fast.delivery.message_id.as_deref(), Some("fast"));
        assert_eq!(broker.depth("q").delayed, 1);
        let start = tokio::time::Instant::now();
        let retried = c.next().await.unwrap().unwrap();
        assert!(start.elapsed() >= Duration::from_secs(4));
        assert_eq!(retried.delivery.attempt, 2);
        assert_eq!(retried.delivery.headers.get(ATTEMPT_HEADER), Some("2"));
    }

    #[tokio::test]
    async fn stale_tags_cannot_be_settled() {
        let broker = MemoryBroker::new();
        broker.publish("q", msg("a"));
        let mut c1 = broker.consume("q");
        let a = c1.next().await.unwrap().unwrap();
        drop(c1);
        assert!(a.acker.settle(Settlement::Ack).await.is_err());
        assert_eq!(broker.depth("q").ready, 1);
    }
}
