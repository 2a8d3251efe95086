//! The consumer: a [`consumer_core::transport::Transport`] that survives connection loss.

use std::collections::VecDeque;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};

use futures::{FutureExt, Stream, StreamExt};
use lapin::options::BasicConsumeOptions;
use lapin::types::FieldTable;
use lapin::Connection;
use tokio::sync::{mpsc, watch};

use consumer_core::transport::{Incoming, TransportError};

use crate::acker;
use crate::config::AmqpConfig;
use crate::link::{self, ConfirmChannel, Link};
use crate::redacted_url::RedactedUrl;
use crate::retry_queue;
use crate::topology::{short, Topology};
use crate::Error;

/// A live view of a consumer's connection, usable after the consumer moved into a worker.
#[derive(Debug, Clone)]
pub struct ConsumerHealth(Arc<HealthCounters>);

#[derive(Debug)]
struct HealthCounters {
    connected: AtomicBool,
    sessions: AtomicU64,
    stale: AtomicU64,
    /// The address of the current (or last) connection.
    address: Mutex<Option<RedactedUrl>>,
    /// Set once the background task has ended (its connection closed).
    finished: watch::Sender<bool>,
    /// `connected`, exported (`consumer_amqp_connected`).
    connected_gauge: metrics::Gauge,
}

impl HealthCounters {
    fn set_connected(&self, connected: bool) {
        self.connected.store(connected, Ordering::Release);
        self.connected_gauge.set(if connected { 1.0 } else { 0.0 });
    }
}

impl ConsumerHealth {
    /// The health of a consumer of `queue`, not connected yet.
    fn of_queue(queue: &str) -> Self {
        ConsumerHealth(Arc::new(HealthCounters {
            connected: AtomicBool::new(false),
            sessions: AtomicU64::new(0),
            stale: AtomicU64::new(0),
            address: Mutex::new(None),
            finished: watch::Sender::new(false),
            connected_gauge: metrics::gauge!("consumer_amqp_connected", "queue" => queue.to_owned()),
        }))
    }
}

/// Marks the background task finished however it ends.
struct FinishedOnDrop(ConsumerHealth);

impl Drop for FinishedOnDrop {
    fn drop(&mut self) {
        self.0 .0.set_connected(false);
        self.0 .0.finished.send_replace(true);
    }
}

impl ConsumerHealth {
    /// Whether the consumer is connected and consuming now.
    pub fn is_connected(&self) -> bool {
        self.0.connected.load(Ordering::Acquire)
    }

    /// Connections established so far: 1 after [`AmqpConsumer::connect`], one more per
    /// reconnection.
    pub fn sessions(&self) -> u64 {
        self.0.sessions.load(Ordering::Acquire)
    }

    /// The address (one of [`AmqpConfig::addresses`]) of the current connection, or of the
    /// last one while reconnecting; `None` before the first. Shown only redacted.
    pub fn address(&self) -> Option<RedactedUrl> {
        self.0
            .address
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    fn set_address(&self, url: &RedactedUrl) {
        *self.0.address.lock().unwrap_or_else(|p| p.into_inner()) = Some(url.clone());
    }

    /// Deliveries of a lost connection that were dropped before reaching the worker (the
    /// broker redelivers them).
    pub fn stale_deliveries_dropped(&self) -> u64 {
        self.0.stale.load(Ordering::Relaxed)
    }

    /// Completes once the consumer was dropped and its connection closed: the broker has
    /// then processed every ack sent before, and has requeued what was prefetched but not
    /// processed. A process that exits right after [`consumer_core::Worker::run`] should
    /// wait for this (with a timeout), or its last acks may be lost with the socket.
    pub async fn closed(&self) {
        let mut finished = self.0.finished.subscribe();
        let _ = finished.wait_for(|done| *done).await;
    }
}

enum Item {
    /// Deliveries of one connection, in delivery order.
    Deliveries(Vec<Incoming>, Arc<Link>),
    Error(TransportError),
}

/// Consumes one queue: a [`consumer_core::transport::Transport`] (a stream of [`Incoming`]) to hand
/// to [`consumer_core::Worker::run`].
///
/// A background task owns the connection. When the connection or channel is lost, or the
/// broker cancels the consumer (the queue was deleted), it logs why, reconnects with
/// exponential backoff (`reconnect_min`, doubling to `reconnect_max`, for as long as it
/// takes), re-declares the topology and consumes again; the stream yields one `Err` item
/// per loss, which the worker logs. Deliveries of the lost connection are never acked on the
/// new one: settling them fails with [`Error::ChannelClosed`], the broker redelivers them,
/// and the inbox recognises them.
///
/// Dropping the consumer (the worker does so after settling what was in flight) closes the
/// connection, which returns prefetched but unprocessed deliveries to the queue.
pub struct AmqpConsumer {
    rx: mpsc::Receiver<Item>,
    /// The rest of the last item's deliveries, and their connection.
    ready: VecDeque<Incoming>,
    ready_link: Option<Arc<Link>>,
    health: ConsumerHealth,
    queue: String,
}

impl std::fmt::Debug for AmqpConsumer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AmqpConsumer")
            .field("queue", &self.queue)
            .field("health", &self.health)
            .finish_non_exhaustive()
    }
}

impl AmqpConsumer {
    /// Validates `config`, connects, declares the topology and starts consuming.
    ///
    /// Fails naming the field on a bad configuration, and fails if the broker refuses the
    /// credentials or a declaration; an unreachable broker is retried for
    /// `config.startup_timeout` first. Must be called inside a Tokio runtime.
    pub async fn connect(config: AmqpConfig) -> Result<Self, Error> {
        config.validate()?;
        let config = Arc::new(config);
        let topology = Arc::new(Topology::new(&config));
        let health = ConsumerHealth::of_queue(&config.queue);
        let session = link::with_startup_retry(&config, "consumer", || {
            Session::open(&config, &topology, 1, 0)
        })
        .await?;
        health.set_address(&session.url);
        health.0.sessions.store(1, Ordering::Release);
        health.0.set_connected(true);
        tracing::info!(url = %session.url, queue = %config.queue, prefetch = config.prefetch, "consuming");
        // One slot: an item carries every delivery the background task holds (at most
        // `prefetch`, the broker sends no more unacked).
        let (tx, rx) = mpsc::channel(1);
        tokio::spawn(run(config.clone(), topology, session, tx, health.clone()));
        Ok(AmqpConsumer {
            rx,
            ready: VecDeque::new(),
            ready_link: None,
            health,
            queue: config.queue.clone(),
        })
    }

    /// [`AmqpConsumer::connect`] for `worker`, after checking that the worker's handler
    /// timeout is below the broker's consumer timeout
    /// ([`AmqpConfig::check_handler_timeout`]): a worker that could outlast it is refused,
    /// the error naming `amqp.broker_consumer_timeout`.
    pub async fn connect_for<DB, H>(
        config: AmqpConfig,
        worker: &consumer_core::Worker<DB, H>,
    ) -> Result<Self, Error>
    where
        DB: consumer_core::inbox::Backend,
        H: consumer_core::Handler<DB>,
    {
        config.validate()?;
        config.check_handler_timeout(worker.handler_timeout())?;
        Self::connect(config).await
    }

    /// A handle on the connection state that stays usable after the consumer is moved.
    pub fn health(&self) -> ConsumerHealth {
        self.health.clone()
    }
}

impl Stream for AmqpConsumer {
    type Item = Result<Incoming, TransportError>;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        loop {
            if let Some(incoming) = self.ready.pop_front() {
                match &self.ready_link {
                    Some(link) if link.is_alive() => return Poll::Ready(Some(Ok(incoming))),
                    // Buffered before its connection was lost: running the handler would
                    // only produce a delivery that cannot be acked. The broker redelivers it.
                    link => {
                        let generation = link.as_ref().map(|l| l.generation());
                        self.health.0.stale.fetch_add(1, Ordering::Relaxed);
                        tracing::debug!(?generation, "dropped a delivery of a lost connection");
                        continue;
                    }
                }
            }
            let item = match self.rx.poll_recv(cx) {
                Poll::Ready(Some(item)) => item,
                Poll::Ready(None) => return Poll::Ready(None),
                Poll::Pending => return Poll::Pending,
            };
            match item {
                Item::Error(e) => return Poll::Ready(Some(Err(e))),
                Item::Deliveries(deliveries, link) => {
                    self.ready.extend(deliveries);
                    self.ready_link = Some(link);
                }
            }
        }
    }
}

/// One connection: a confirm channel (declarations, retry and dead-letter copies), a
/// consuming channel, and a channel that returns the retry queues' due copies
/// ([`retry_queue`]).
struct Session {
    connection: Connection,
    /// The address connected to, and its index in [`AmqpConfig::addresses`].
    url: RedactedUrl,
    index: usize,
    consumer: lapin::Consumer,
    link: Arc<Link>,
}

impl Session {
    async fn open(
        config: &AmqpConfig,
        topology: &Arc<Topology>,
        generation: u64,
        start: usize,
    ) -> Result<Session, Error> {
        let (connection, index) = link::connect(config, start, "consumer").await?;
        let url = config
            .addresses()
            .nth(index)
            .cloned()
            .unwrap_or_else(|| config.url.clone());
        match Self::start(config, &url, topology, generation, &connection).await {
            Ok((consumer, link)) => Ok(Session {
                connection,
                url,
                index,
                consumer,
                link,
            }),
            Err(e) => {
                link::close(&connection, "setup failed").await;
                Err(e)
            }
        }
    }

    async fn start(
        config: &AmqpConfig,
        url: &RedactedUrl,
        topology: &Arc<Topology>,
        generation: u64,
        connection: &Connection,
    ) -> Result<(lapin::Consumer, Arc<Link>), Error> {
        let publisher = ConfirmChannel::open(connection, url, config).await?;
        topology.declare(publisher.channel()).await?;
        let channel = link::consuming_channel(connection, url, config.prefetch).await?;
        let consumer = channel
            .basic_consume(
                short(&config.queue),
                short(&config.consumer_tag),
                BasicConsumeOptions::default(),
                FieldTable::default(),
            )
            .await
            .map_err(|e| Error::Topology {
                what: format!("consumer on queue {:?}", config.queue),
                source: e.into(),
            })?;
        let link = Arc::new(Link::new(generation, publisher, topology.clone()));
        if let Err(e) = retry_queue::start(connection, url, config, &link).await {
            link.retire();
            return Err(e);
        }
        Ok((consumer, link))
    }

    async fn close(self, reason: &str) {
        self.link.retire();
        link::close(&self.connection, reason).await;
    }
}

/// Why a session stopped.
enum Stop {
    /// The [`AmqpConsumer`] was dropped.
    Dropped,
    /// The connection or channel failed.
    Lost(lapin::Error),
    /// The broker cancelled the consumer (queue deleted) or the channel closed cleanly.
    Cancelled,
    /// A settlement asked for a new connection.
    Reset,
}

/// Forwards deliveries until the session ends.
///
/// It never stops watching the connection: while the stream is not taking deliveries (the
/// worker is busy) it goes on taking them from lapin, so a lost connection, a cancelled
/// consumer or a reset is seen at once, not when the worker next asks. What it holds is
/// bounded by the prefetch (the broker sends no more unacked), and goes to the stream as
/// one item when there is room: a busy consumer pays one hand-over between the two tasks
/// for many deliveries, not one each.
async fn pump(session: &mut Session, tx: &mpsc::Sender<Item>, queue: &str) -> Stop {
    let mut taken: Vec<Incoming> = Vec::new();
    let mut locations = acker::Locations::new(queue);
    loop {
        tokio::select! {
            biased;
            () = session.link.reset_requested() => return Stop::Reset,
            next = session.consumer.next() => {
                if let Err(stop) = take_ready(session, next, &mut taken, &mut locations) {
                    return stop;
                }
            }
            permit = tx.reserve(), if !taken.is_empty() => match permit {
                Ok(permit) => {
                    permit.send(Item::Deliveries(std::mem::take(&mut taken), session.link.clone()));
                }
                Err(_) => return Stop::Dropped,
            },
            _ = tx.closed(), if taken.is_empty() => return Stop::Dropped,
        }
    }
}

/// Takes `first` and what else lapin has ready into `taken`, in one round of the pump's
/// select. `Err` when the session ends: what was taken is of the lost connection, and the
/// stream would drop it.
fn take_ready(
    session: &mut Session,
    first: Option<lapin::Result<lapin::message::Delivery>>,
    taken: &mut Vec<Incoming>,
    locations: &mut acker::Locations,
) -> Result<(), Stop> {
    let mut next = Some(first);
    while let Some(delivery) = next {
        match delivery {
            Some(Ok(d)) => taken.push(acker::incoming(d, &session.link, locations)),
            Some(Err(e)) => return Err(Stop::Lost(e)),
            None => return Err(Stop::Cancelled),
        }
        next = session.consumer.next().now_or_never();
    }
    Ok(())
}

/// The background task: pump, and on any loss reconnect for as long as the consumer lives.
/// Each reconnection attempt goes through the addresses from the one after the lost
/// connection's (round-robin), so a worker whose node died moves to another node.
async fn run(
    config: Arc<AmqpConfig>,
    topology: Arc<Topology>,
    mut session: Session,
    tx: mpsc::Sender<Item>,
    health: ConsumerHealth,
) {
    let _finished = FinishedOnDrop(health.clone());
    let queue = config.queue.as_str();
    let addresses = config.addresses().count();
    loop {
        let stop = pump(&mut session, &tx, queue).await;
        health.0.set_connected(false);
        let generation = session.link.generation();
        let lost = session.url.clone();
        let mut next = (session.index + 1) % addresses;
        // Retires the link first: no delivery of this connection is settled from now on,
        // whatever connection comes next (the broker redelivers them).
        session.close("consumer stopping").await;
        let loss = match stop {
            Stop::Dropped => {
                tracing::info!(url = %lost, queue = %queue, "consumer dropped; connection closed");
                return;
            }
            Stop::Lost(e) => {
                tracing::warn!(url = %lost, queue = %queue, error = %e, "connection lost; reconnecting");
                format!("connection to {lost} lost: {e}")
            }
            Stop::Cancelled => {
                tracing::warn!(url = %lost, queue = %queue, "the broker cancelled the consumer (queue deleted?); re-declaring and consuming again");
                format!("the broker cancelled the consumer of queue {queue:?}")
            }
            Stop::Reset => {
                tracing::warn!(url = %lost, queue = %queue, "a settlement could not publish; reconnecting and re-declaring the topology");
                "publishing a retry or dead-letter copy failed; reconnecting".to_owned()
            }
        };
        // Informational (the worker logs it); never wait for room.
        let _ = tx.try_send(Item::Error(TransportError::msg(loss)));

        let mut delay = config.reconnect_min;
        let mut attempts = 0u32;
        session = loop {
            tokio::select! {
                _ = tx.closed() => {
                    tracing::info!(queue = %queue, "consumer dropped while reconnecting");
                    return;
                }
                _ = tokio::time::sleep(delay) => {}
            }
            attempts += 1;
            match Session::open(&config, &topology, generation + 1, next).await {
                Ok(s) => break s,
                Err(e) => {
                    let error = e.chain();
                    if e.is_transient() {
                        tracing::warn!(queue = %queue, attempts, error, retry_in = ?delay, "reconnection failed");
                    } else {
                        tracing::error!(queue = %queue, attempts, error, retry_in = ?delay, "reconnection failed; this looks permanent, retrying anyway");
                    }
                    next = (next + 1) % addresses;
                    delay = (delay * 2).min(config.reconnect_max);
                }
            }
        };
        health.set_address(&session.url);
        health.0.sessions.fetch_add(1, Ordering::AcqRel);
        health.0.set_connected(true);
        metrics::counter!("consumer_amqp_reconnects_total", "queue" => queue.to_owned())
            .increment(1);
        tracing::info!(url = %session.url, queue = %queue, attempts, generation = generation + 1, "reconnected; consuming again");
    }
}
