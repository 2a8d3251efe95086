//! Configuration: the broker URL, the queue and its topology, prefetch, retries, reconnection.
//! Each field is checked by [`AmqpConfig::validate`], in `validate`.

use std::fmt;
use std::str::FromStr;
use std::time::Duration;

use crate::origin::OriginSecret;
use crate::redacted_url::RedactedUrl;
use crate::Error;

mod validate;

/// The longest queue name accepted. AMQP allows 255 bytes; the retry and dead-letter queues
/// derive their names by appending a suffix (`.delayed.<ms>`, `.dlq`), which needs room.
pub const MAX_QUEUE_NAME_LEN: usize = 200;

/// The queue type, chosen by the user: RabbitMQ cannot change it on an existing queue.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum QueueType {
    /// A classic queue (the default): one node, lowest latency.
    #[default]
    Classic,
    /// A quorum queue: replicated (Raft), the recommended type for durable work queues on a
    /// cluster. (The retry queues are quorum queues with either choice; see the crate docs.)
    Quorum,
}

impl QueueType {
    /// `classic` or `quorum`, as in `x-queue-type`.
    pub fn as_str(self) -> &'static str {
        match self {
            QueueType::Classic => "classic",
            QueueType::Quorum => "quorum",
        }
    }
}

impl FromStr for QueueType {
    type Err = Error;

    fn from_str(s: &str) -> Result<Self, Error> {
        match s.trim().to_ascii_lowercase().as_str() {
            "classic" => Ok(QueueType::Classic),
            "quorum" => Ok(QueueType::Quorum),
            other => Err(Error::config(
                "amqp.queue_type",
                format!("{other:?} is not a queue type: use `classic` or `quorum`"),
            )),
        }
    }
}

/// The type of the exchange the queue is bound to, when one is configured.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ExchangeType {
    /// Routes on an exact routing key (the default).
    #[default]
    Direct,
    /// Routes every message to every bound queue.
    Fanout,
    /// Routes on routing key patterns (`*`, `#`).
    Topic,
}

impl ExchangeType {
    pub(crate) fn lapin(self) -> lapin::ExchangeKind {
        match self {
            ExchangeType::Direct => lapin::ExchangeKind::Direct,
            ExchangeType::Fanout => lapin::ExchangeKind::Fanout,
            ExchangeType::Topic => lapin::ExchangeKind::Topic,
        }
    }
}

impl FromStr for ExchangeType {
    type Err = Error;

    fn from_str(s: &str) -> Result<Self, Error> {
        match s.trim().to_ascii_lowercase().as_str() {
            "direct" => Ok(ExchangeType::Direct),
            "fanout" => Ok(ExchangeType::Fanout),
            "topic" => Ok(ExchangeType::Topic),
            other => Err(Error::config(
                "amqp.exchange_type",
                format!("{other:?} is not an exchange type: use `direct`, `fanout` or `topic`"),
            )),
        }
    }
}

/// Everything the consumer and the publisher need to know about the broker and the queue.
///
/// Build it with [`AmqpConfig::new`] and adjust the public fields; [`AmqpConfig::validate`]
/// (called by [`crate::AmqpConsumer::connect`] and [`crate::AmqpPublisher::connect`]) rejects
/// a bad value at startup, naming the field.
///
/// The topology declared from it (all durable, re-declared after every reconnect):
///
/// - the work queue `queue`, of type `queue_type`;
/// - `<queue>.delayed.<ms>` for each of `retry_delays`: a quorum queue (whatever
///   `queue_type` is) where retry copies wait `<ms>`; every consumer of the work queue also
///   consumes these and returns each copy to the work queue once it is due;
/// - the dead-letter queue (`dead_letter_queue`, default `<queue>.dlq`);
/// - when `exchange` is set: that exchange (unless it is a predeclared `amq.*` one) and one
///   binding of the work queue per entry of `binding_keys` (default: the queue's name).
#[derive(Clone)]
#[non_exhaustive]
pub struct AmqpConfig {
    /// `amqp://user:pass@host:5672/vhost` or `amqps://…`. Shown only redacted.
    pub url: RedactedUrl,
    /// More addresses of the same broker, e.g. the other nodes of a RabbitMQ cluster
    /// (default none). A connection goes to the first of `url`, then these, that answers;
    /// after a lost connection the next attempt starts with the address after the lost
    /// one, round-robin (see [`AmqpConfig::addresses`]). Shown only redacted.
    pub failover_urls: Vec<RedactedUrl>,
    /// The work queue.
    pub queue: String,
    /// Classic (default) or quorum; applies to the work and dead-letter queues (the retry
    /// queues are always quorum queues: see the crate docs).
    pub queue_type: QueueType,
    /// An exchange to bind the queue to; empty (the default) publishes through the default
    /// exchange, where the routing key is the queue's name.
    pub exchange: String,
    /// The exchange's type, when `exchange` is set (default direct).
    pub exchange_type: ExchangeType,
    /// Binding keys of the queue on `exchange` (default: the queue's name).
    pub binding_keys: Vec<String>,
    /// Deliveries the broker sends ahead of acks (`basic.qos`), at least 1 (default 32).
    /// Keep it above the worker's concurrency, or workers sit idle: a delivery whose ack is
    /// on its way still counts here, but no longer holds one of the worker's slots.
    pub prefetch: u16,
    /// The consumer tag; empty (the default) lets the broker choose one.
    pub consumer_tag: String,
    /// The retry delays available as queues. A retry after `d` goes to the smallest delay
    /// `>= d` (the largest if none is): never earlier than asked, at most one bucket later.
    /// Default 1s, 5s, 15s, 60s, 300s.
    pub retry_delays: Vec<Duration>,
    /// The dead-letter queue; `None` (the default) means `<queue>.dlq`.
    pub dead_letter_queue: Option<String>,
    /// Longest wait for one connection attempt, handshake included (default 10s).
    pub connect_timeout: Duration,
    /// How long the first connection is retried (while the broker is still starting) before
    /// `connect` fails (default 30s). Authentication and declaration errors fail at once.
    pub startup_timeout: Duration,
    /// First delay between reconnection attempts, doubled up to `reconnect_max`
    /// (default 100ms).
    pub reconnect_min: Duration,
    /// Longest delay between reconnection attempts (default 5s).
    pub reconnect_max: Duration,
    /// How long [`crate::AmqpPublisher::publish`] keeps retrying over connection failures
    /// and refused messages (negative confirms) (default 30s).
    pub publish_timeout: Duration,
    /// Longest wait for the broker's confirm of one publish: a retry or dead-letter copy,
    /// or one try of [`crate::AmqpPublisher::publish`] (default 30s). A confirm that does
    /// not come in time is a transient publish error: the copy's original is returned to
    /// its queue and the connection replaced, as for a lost connection, since the copy may
    /// or may not have arrived (the inbox deduplicates either way).
    pub confirm_timeout: Duration,
    /// The broker's delivery acknowledgement timeout (RabbitMQ's `consumer_timeout`,
    /// 30 minutes by default; default here the same). The broker closes the channel of a
    /// delivery left unacked longer, and clients cannot read the setting: set this to the
    /// broker's value. A worker whose handler timeout is not below it is refused at startup
    /// ([`AmqpConfig::check_handler_timeout`], [`crate::AmqpConsumer::connect_for`]), and a
    /// delivery held unacked while the broker refuses its retry copy is held at most half
    /// of it. See the crate docs ("The broker's consumer timeout").
    pub broker_consumer_timeout: Duration,
    /// A connection name shown in the management UI; `None` uses `consumer-amqp`.
    pub connection_name: Option<String>,
    /// The key that signs the origin of the retry and dead-letter copies, shared by every
    /// worker of the queue and by the `consumer` command (see [`OriginSecret`]); typically
    /// [`OriginSecret::from_env`]. `None` (the default): no copy's origin can be verified,
    /// so each attempt's copy records where that attempt came from, and `consumer dlq
    /// replay` needs an explicit destination. Never shown.
    pub origin_secret: Option<OriginSecret>,
}

impl fmt::Debug for AmqpConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("AmqpConfig")
            .field("url", &self.url)
            .field("failover_urls", &self.failover_urls)
            .field("queue", &self.queue)
            .field("queue_type", &self.queue_type)
            .field("exchange", &self.exchange)
            .field("exchange_type", &self.exchange_type)
            .field("binding_keys", &self.binding_keys)
            .field("prefetch", &self.prefetch)
            .field("consumer_tag", &self.consumer_tag)
            .field("retry_delays", &self.retry_delays)
            .field("dead_letter_queue", &self.dead_letter_queue)
            .field("connect_timeout", &self.connect_timeout)
            .field("startup_timeout", &self.startup_timeout)
            .field("reconnect_min", &self.reconnect_min)
            .field("reconnect_max", &self.reconnect_max)
            .field("publish_timeout", &self.publish_timeout)
            .field("confirm_timeout", &self.confirm_timeout)
            .field("broker_consumer_timeout", &self.broker_consumer_timeout)
            .field("connection_name", &self.connection_name)
            .field("origin_secret", &self.origin_secret)
            .finish()
    }
}

impl AmqpConfig {
    /// A configuration for `queue` on the broker at `url`, with the defaults documented on
    /// each field.
    pub fn new(url: impl Into<String>, queue: impl Into<String>) -> Self {
        AmqpConfig {
            url: RedactedUrl::new(url),
            failover_urls: Vec::new(),
            queue: queue.into(),
            queue_type: QueueType::Classic,
            exchange: String::new(),
            exchange_type: ExchangeType::Direct,
            binding_keys: Vec::new(),
            prefetch: 32,
            consumer_tag: String::new(),
            retry_delays: [1, 5, 15, 60, 300]
                .into_iter()
                .map(Duration::from_secs)
                .collect(),
            dead_letter_queue: None,
            connect_timeout: Duration::from_secs(10),
            startup_timeout: Duration::from_secs(30),
            reconnect_min: Duration::from_millis(100),
            reconnect_max: Duration::from_secs(5),
            publish_timeout: Duration::from_secs(30),
            confirm_timeout: Duration::from_secs(30),
            broker_consumer_timeout: Duration::from_secs(30 * 60),
            connection_name: None,
            origin_secret: None,
        }
    }

    /// A configuration for `queue` on the broker at the comma-separated `addresses`, e.g.
    /// the nodes of a cluster (`amqp://u:p@node1:5672/%2f,amqp://u:p@node2:5672/%2f`): the
    /// first is [`AmqpConfig::url`], the others [`AmqpConfig::failover_urls`]. Spaces
    /// around each address are ignored; a comma inside a password must be percent-escaped
    /// (`%2C`).
    pub fn with_addresses(addresses: &str, queue: impl Into<String>) -> Self {
        let mut urls = addresses.split(',').map(|a| RedactedUrl::new(a.trim()));
        let mut config = AmqpConfig::new(
            urls.next()
                .map(|u| u.expose().to_owned())
                .unwrap_or_default(),
            queue,
        );
        config.failover_urls = urls.collect();
        config
    }

    /// Every address a connection may go to, in the order they are tried: `url`, then
    /// `failover_urls`.
    pub fn addresses(&self) -> impl Iterator<Item = &RedactedUrl> {
        std::iter::once(&self.url).chain(&self.failover_urls)
    }

    /// Refuses a handler timeout that is not below [`AmqpConfig::broker_consumer_timeout`]:
    /// such a handler could outlast the broker's patience, which closes the channel and
    /// redelivers what was unacked on it (nothing is lost, but the work repeats, and a
    /// handler that always takes that long never completes). The error names
    /// `amqp.broker_consumer_timeout`.
    pub fn check_handler_timeout(&self, handler_timeout: Duration) -> Result<(), Error> {
        if handler_timeout >= self.broker_consumer_timeout {
            return Err(Error::config(
                "amqp.broker_consumer_timeout",
                format!(
                    "the handler's timeout {handler_timeout:?} is not below the broker's consumer timeout {:?}: \
                     the broker would close the channel of a delivery still running; lower the handler's \
                     timeout, or raise consumer_timeout on the broker and here",
                    self.broker_consumer_timeout
                ),
            ));
        }
        Ok(())
    }

    /// The dead-letter queue's name.
    pub fn dead_letter_queue_name(&self) -> String {
        self.dead_letter_queue
            .clone()
            .unwrap_or_else(|| format!("{}.dlq", self.queue))
    }

    /// The retry queue's name for a bucket of `delay`: `<queue>.delayed.<ms>`.
    pub fn retry_queue_name(&self, delay: Duration) -> String {
        format!("{}.delayed.{}", self.queue, delay.as_millis())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const URL: &str = "amqp://app:s3cret@rabbit.internal:5672/%2f";

    #[test]
    fn debug_of_config_hides_the_password() {
        let mut c = AmqpConfig::new(URL, "orders");
        c.origin_secret = Some(OriginSecret::new("origin-s3cret-0123456789").unwrap());
        let shown = format!("{c:?}");
        assert!(!shown.contains("origin-s3cret"), "{shown}");
        assert!(!shown.contains("s3cret"), "{shown}");
        assert!(!shown.contains("app:"), "{shown}");
        assert!(shown.contains("rabbit.internal"), "{shown}");
    }

    #[test]
    fn a_list_of_addresses_is_the_url_then_the_failover_urls() {
        let c = AmqpConfig::with_addresses(
            "amqp://app:s3cret@n1:5672/%2f, amqp://app:s3cret@n2:5672/%2f,amqp://app:s3cret@n3/%2f",
            "orders",
        );
        c.validate().unwrap();
        let shown: Vec<String> = c.addresses().map(ToString::to_string).collect();
        assert_eq!(
            shown,
            [
                "amqp://***@n1:5672/%2f",
                "amqp://***@n2:5672/%2f",
                "amqp://***@n3/%2f"
            ]
        );
        assert!(!format!("{c:?}").contains("s3cret"));
        let single = AmqpConfig::with_addresses(URL, "orders");
        assert_eq!(single.url.expose(), URL);
        assert!(single.failover_urls.is_empty());
    }

    #[test]
    fn a_handler_timeout_not_below_the_broker_consumer_timeout_is_refused() {
        let mut c = AmqpConfig::new(URL, "orders");
        c.check_handler_timeout(Duration::from_secs(30)).unwrap();
        c.broker_consumer_timeout = Duration::from_secs(60);
        for timeout in [Duration::from_secs(60), Duration::from_secs(61)] {
            match c.check_handler_timeout(timeout).unwrap_err() {
                Error::Config { field, reason } => {
                    assert_eq!(field, "amqp.broker_consumer_timeout");
                    assert!(reason.contains("60s"), "{reason}");
                }
                other => panic!("{other}"),
            }
        }
    }

    #[test]
    fn defaults_are_valid() {
        let c = AmqpConfig::new(URL, "orders");
        c.validate().unwrap();
        assert_eq!(c.dead_letter_queue_name(), "orders.dlq");
        assert_eq!(
            c.retry_queue_name(Duration::from_secs(5)),
            "orders.delayed.5000"
        );
    }
}
