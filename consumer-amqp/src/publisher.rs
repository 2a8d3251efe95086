//! A publisher for users, tests and examples: confirmed, mandatory, reconnecting.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex as SyncMutex};
use std::time::{SystemTime, UNIX_EPOCH};

use lapin::types::{AMQPValue, FieldTable, LongString, ShortString};
use lapin::{BasicProperties, Connection};
use serde::Serialize;
use tokio::sync::Mutex;
use tokio::time::Instant;

use crate::config::AmqpConfig;
use crate::link::{self, ConfirmChannel};
use crate::topology::Topology;
use crate::Error;

struct PublisherLink {
    connection: Connection,
    channel: ConfirmChannel,
}

/// Publishes messages and waits for the broker's confirm of each.
///
/// Every publish is *mandatory*: a message no queue is bound for comes back as
/// [`Error::Unroutable`] instead of vanishing. `publish` returns only once the broker
/// confirmed the message (persistent, routed). On a lost connection it reconnects and
/// publishes again, and a message the broker refused (a negative confirm: a quorum queue
/// electing a new leader after its node died, a full queue that rejects publishes) is
/// published again after a backoff, for up to `config.publish_timeout` in all; then the last
/// error is returned. A publish whose confirm was lost
/// with the connection may therefore arrive twice, with the same message id, which is what
/// the consumer's inbox deduplicates.
///
/// Cheap to share: `publish` takes `&self` and may be called from many tasks at once (the
/// confirms are awaited concurrently).
pub struct AmqpPublisher {
    config: Arc<AmqpConfig>,
    /// The topologies to (re-)declare on every connection.
    topologies: SyncMutex<Vec<Topology>>,
    link: Mutex<Option<Arc<PublisherLink>>>,
    /// The index in [`AmqpConfig::addresses`] the next connection tries first: the one
    /// after the last connection's, so a publisher whose node died moves to another.
    next_address: AtomicUsize,
}

impl std::fmt::Debug for AmqpPublisher {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AmqpPublisher")
            .field("url", &self.config.url)
            .field("exchange", &self.config.exchange)
            .finish_non_exhaustive()
    }
}

impl AmqpPublisher {
    /// Validates `config`, connects, and declares its topology (so the work queue exists and
    /// is bound before the first message is published).
    pub async fn connect(config: AmqpConfig) -> Result<Self, Error> {
        config.validate()?;
        let publisher = AmqpPublisher {
            topologies: SyncMutex::new(vec![Topology::new(&config)]),
            config: Arc::new(config),
            link: Mutex::new(None),
            next_address: AtomicUsize::new(0),
        };
        let link =
            link::with_startup_retry(&publisher.config, "publisher", || publisher.open_link())
                .await?;
        *publisher.link.lock().await = Some(link);
        Ok(publisher)
    }

    /// Also declares the topology of `other` (another queue bound to the same exchange, say),
    /// now and after every reconnection. Only its queue, exchange and binding settings are
    /// used; its URL is ignored.
    pub async fn declare(&self, other: &AmqpConfig) -> Result<(), Error> {
        other.validate()?;
        let topology = Topology::new(other);
        let link = self.current_link().await?;
        topology.declare(link.channel.channel()).await?;
        self.topologies
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(topology);
        Ok(())
    }

    /// Publishes `payload` to the configured exchange (the default exchange when none is
    /// configured: then `routing_key` is a queue name) with `message_id` (none if empty) and
    /// string `headers`, persistent, and waits for the confirm.
    pub async fn publish(
        &self,
        routing_key: &str,
        message_id: &str,
        payload: &[u8],
        headers: &BTreeMap<String, String>,
    ) -> Result<(), Error> {
        let properties = properties(message_id, headers)?;
        self.send(routing_key, payload, properties).await
    }

    /// [`AmqpPublisher::publish`] of `value` as JSON, with content type `application/json`.
    pub async fn publish_json<T: Serialize + ?Sized>(
        &self,
        routing_key: &str,
        message_id: &str,
        value: &T,
    ) -> Result<(), Error> {
        let payload = serde_json::to_vec(value)
            .map_err(|e| Error::InvalidMessage(format!("cannot encode as JSON: {e}")))?;
        let properties = properties(message_id, &BTreeMap::new())?
            .with_content_type(ShortString::from("application/json"));
        self.send(routing_key, &payload, properties).await
    }

    /// Closes the connection.
    pub async fn close(&self) {
        if let Some(link) = self.link.lock().await.take() {
            link::close(&link.connection, "publisher closed").await;
        }
    }

    async fn send(
        &self,
        routing_key: &str,
        payload: &[u8],
        properties: BasicProperties,
    ) -> Result<(), Error> {
        let exchange = self.config.exchange.as_str();
        let deadline = Instant::now() + self.config.publish_timeout;
        let mut delay = self.config.reconnect_min;
        loop {
            let mut used = None;
            let attempt = async {
                let link = self.current_link().await?;
                used = Some(link.clone());
                link.channel
                    .publish(exchange, routing_key, payload, properties.clone())
                    .await
            };
            let e = match attempt.await {
                Ok(()) => return Ok(()),
                Err(e) => e,
            };
            // A refused message (a negative confirm: a quorum queue whose leader's node
            // died, a full queue that rejects publishes) is sent again like one whose
            // connection failed: a channel that published while its queue lost its leader
            // can go on being refused (RabbitMQ 3.10 did, for minutes, in
            // `tests/tests/amqp_cluster.rs`), and a new connection is not.
            let retry = matches!(e, Error::Nacked { .. }) || e.is_transient();
            if !retry || Instant::now() + delay >= deadline {
                return Err(e);
            }
            tracing::warn!(error = %e.chain(), retry_in = ?delay, "publish failed; reconnecting and publishing again");
            // The channel may still look open (a confirm that never came): the next try
            // goes through a new connection either way. Only the link this try used is
            // replaced; one another task opened since then is kept.
            if let Some(used) = used {
                self.retire(&used).await;
            }
            tokio::time::sleep(delay).await;
            delay = (delay * 2).min(self.config.reconnect_max);
        }
    }

    /// Closes `used` and clears it from the slot, unless the slot already holds another link.
    async fn retire(&self, used: &Arc<PublisherLink>) {
        let mut slot = self.link.lock().await;
        if slot.as_ref().is_some_and(|l| Arc::ptr_eq(l, used)) {
            *slot = None;
        }
        drop(slot);
        link::close(&used.connection, "publish failed").await;
    }

    /// The open link, or a new one if the last one broke.
    async fn current_link(&self) -> Result<Arc<PublisherLink>, Error> {
        let mut slot = self.link.lock().await;
        if let Some(link) = slot.as_ref() {
            if link.channel.is_open() {
                return Ok(link.clone());
            }
            link::close(&link.connection, "channel broken").await;
            *slot = None;
        }
        let link = self.open_link().await?;
        *slot = Some(link.clone());
        Ok(link)
    }

    async fn open_link(&self) -> Result<Arc<PublisherLink>, Error> {
        let start = self.next_address.load(Ordering::Relaxed);
        let (connection, index) = link::connect(&self.config, start, "publisher").await?;
        let count = self.config.addresses().count();
        self.next_address
            .store((index + 1) % count, Ordering::Relaxed);
        let url = self
            .config
            .addresses()
            .nth(index)
            .cloned()
            .unwrap_or_else(|| self.config.url.clone());
        let setup = async {
            let channel = ConfirmChannel::open(&connection, &url, &self.config).await?;
            let topologies = self
                .topologies
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .clone();
            for topology in &topologies {
                topology.declare(channel.channel()).await?;
            }
            Ok::<_, Error>(channel)
        };
        match setup.await {
            Ok(channel) => Ok(Arc::new(PublisherLink {
                connection,
                channel,
            })),
            Err(e) => {
                link::close(&connection, "setup failed").await;
                Err(e)
            }
        }
    }
}

fn properties(
    message_id: &str,
    headers: &BTreeMap<String, String>,
) -> Result<BasicProperties, Error> {
    let mut table = FieldTable::default();
    for (k, v) in headers {
        let key = ShortString::try_new(k.as_str())
            .map_err(|e| Error::InvalidMessage(format!("header name {k:?}: {e}")))?;
        table.insert(key, AMQPValue::LongString(LongString::from(v.as_str())));
    }
    let now = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or_default();
    let mut p = BasicProperties::default()
        .with_delivery_mode(2)
        .with_timestamp(now)
        .with_headers(table);
    if !message_id.is_empty() {
        let id = ShortString::try_new(message_id)
            .map_err(|e| Error::InvalidMessage(format!("message id: {e}")))?;
        p = p.with_message_id(id);
    }
    // A reply's correlation id goes in the property its requester reads.
    if let Some(c) = headers.get(consumer_core::header_names::CORRELATION_ID) {
        let id = ShortString::try_new(c.as_str())
            .map_err(|e| Error::InvalidMessage(format!("correlation id: {e}")))?;
        p = p.with_correlation_id(id);
    }
    Ok(p)
}

/// The outbox relay publishes a message with the message's destination as the routing key on
/// the configured exchange (on the default exchange: the queue), its id as `message_id` and
/// its headers as text, mandatory and confirmed. An unroutable message, or one the broker
/// refuses for what it is, is reported as refused; a lost connection or a timeout as
/// unavailable.
impl consumer_core::Publisher for AmqpPublisher {
    fn publish<'a>(
        &'a self,
        message: &'a consumer_core::OutboxMessage,
    ) -> futures::future::BoxFuture<'a, Result<(), consumer_core::PublishError>> {
        Box::pin(async move {
            let id = message.message_id.as_deref().unwrap_or_default();
            let result = self
                .publish(&message.destination, id, &message.payload, &message.headers)
                .await;
            result.map_err(|e| {
                if e.is_transient() {
                    consumer_core::PublishError::unavailable(
                        "rabbitmq did not confirm the message",
                        e,
                    )
                } else {
                    consumer_core::PublishError::refused_by("rabbitmq refused the message", e)
                }
            })
        })
    }
}
