//! Connections, the publisher-confirm channel every publish of this crate goes through, and
//! what one connection's deliveries share ([`Link`]).

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use lapin::auth::AuthProvider;
use lapin::options::{BasicPublishOptions, BasicQosOptions, ConfirmSelectOptions};
use lapin::types::{LongString, ShortString};
use lapin::uri::{AMQPUri, SASLMechanism};
use lapin::{BasicProperties, Channel, Confirmation, Connection, ConnectionProperties};
use tokio::sync::{watch, Mutex, Notify};
use tokio::time::Instant;

use crate::ack_book::AckBook;
use crate::config::AmqpConfig;
use crate::redacted_url::RedactedUrl;
use crate::topology::{short, Topology};
use crate::Error;

/// Opens a connection to the first of the configured addresses that answers, trying them
/// in their order from `start` (wrapping around): the connection and the index of its
/// address in [`AmqpConfig::addresses`]. With every address failing, the last one's error.
/// (No lapin auto-recovery: reconnection is ours, see the crate doc.)
pub(crate) async fn connect(
    config: &AmqpConfig,
    start: usize,
    role: &str,
) -> Result<(Connection, usize), Error> {
    let addresses: Vec<&RedactedUrl> = config.addresses().collect();
    let mut last = None;
    for step in 0..addresses.len() {
        let index = (start + step) % addresses.len();
        match connect_to(config, addresses[index], role).await {
            Ok(connection) => return Ok((connection, index)),
            Err(e) => {
                if addresses.len() > 1 {
                    tracing::debug!(url = %addresses[index], error = %e.chain(), "{role}: address not reachable; trying the next");
                }
                last = Some(e);
            }
        }
    }
    Err(last.unwrap_or_else(|| Error::config("amqp.url", "no address configured")))
}

/// Opens a connection to `url`.
async fn connect_to(
    config: &AmqpConfig,
    url: &RedactedUrl,
    role: &str,
) -> Result<Connection, Error> {
    let name = format!(
        "{} ({role})",
        config.connection_name.as_deref().unwrap_or("consumer-amqp")
    );
    let mut properties = ConnectionProperties::default().with_connection_name(name.into());
    let (uri, credentials) = split_credentials(url.expose()).map_err(|reason| Error::Connect {
        url: url.clone(),
        source: reason.into(),
    })?;
    if let Some(credentials) = credentials {
        properties = properties.with_auth_provider(credentials);
    }
    let connecting = Connection::connect_uri(uri, properties);
    match tokio::time::timeout(config.connect_timeout, connecting).await {
        Ok(Ok(connection)) => Ok(connection),
        Ok(Err(e)) => Err(Error::Connect {
            url: url.clone(),
            source: e.into(),
        }),
        Err(_) => Err(Error::Connect {
            url: url.clone(),
            source: format!("no connection within {:?}", config.connect_timeout).into(),
        }),
    }
}

/// PLAIN credentials, handed to lapin as an auth provider rather than inside the URI.
struct PlainCredentials {
    username: String,
    password: String,
}

impl AuthProvider for PlainCredentials {
    fn mechanism(&self) -> ShortString {
        SASLMechanism::Plain.name().into()
    }

    fn auth_starter(&self) -> Result<LongString, String> {
        Ok(format!("\0{}\0{}", self.username, self.password).into())
    }
}

/// The URI lapin connects to, without user name and password, plus those as an auth
/// provider: lapin's TCP layer logs the URI it connects to (at TRACE level), password
/// included. URIs asking for another SASL mechanism (e.g. `auth_mechanism=external` with
/// client certificates) are passed on unchanged.
fn split_credentials(url: &str) -> Result<(AMQPUri, Option<PlainCredentials>), String> {
    let mut uri: AMQPUri = url.parse().map_err(|_| "not a valid AMQP URL".to_owned())?;
    if !matches!(uri.query.auth_mechanism, None | Some(SASLMechanism::Plain)) {
        return Ok((uri, None));
    }
    let info = &mut uri.authority.userinfo;
    let credentials = PlainCredentials {
        username: std::mem::take(&mut info.username),
        password: std::mem::take(&mut info.password),
    };
    Ok((uri, Some(credentials)))
}

/// Closes `connection` politely (unacked deliveries go back to their queues), without
/// waiting long for a broker that is gone.
pub(crate) async fn close(connection: &Connection, reason: &str) {
    if connection.status().connected() {
        let closing = connection.close(200, short(reason));
        let _ = tokio::time::timeout(Duration::from_secs(2), closing).await;
    }
}

/// Retries `open` on transient errors until `config.startup_timeout` has passed: the broker
/// may still be starting (a container started alongside it). Other errors (credentials, a
/// queue declared with other arguments) fail at once.
pub(crate) async fn with_startup_retry<T, F, Fut>(
    config: &AmqpConfig,
    what: &str,
    mut open: F,
) -> Result<T, Error>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<T, Error>>,
{
    let deadline = Instant::now() + config.startup_timeout;
    let mut delay = config.reconnect_min;
    loop {
        match open().await {
            Ok(t) => return Ok(t),
            Err(e) if e.is_transient() && Instant::now() + delay < deadline => {
                tracing::warn!(addresses = config.addresses().count(), error = %e.chain(), retry_in = ?delay, "{what}: broker not reachable yet");
                tokio::time::sleep(delay).await;
                delay = (delay * 2).min(config.reconnect_max);
            }
            Err(e) => return Err(e),
        }
    }
}

/// Opens a channel on `connection` for consuming, at most `prefetch` unacked deliveries per
/// consumer (`basic.qos`, not global).
pub(crate) async fn consuming_channel(
    connection: &Connection,
    url: &RedactedUrl,
    prefetch: u16,
) -> Result<Channel, Error> {
    let connect_error = |e: lapin::Error| Error::Connect {
        url: url.clone(),
        source: e.into(),
    };
    let channel = connection.create_channel().await.map_err(connect_error)?;
    channel
        .basic_qos(prefetch, BasicQosOptions { global: false })
        .await
        .map_err(connect_error)?;
    Ok(channel)
}

/// What one connection's deliveries share: the confirm channel for retry and dead-letter
/// copies, and whether the connection is still the current one.
pub(crate) struct Link {
    generation: u64,
    alive: AtomicBool,
    /// Becomes `true` when the session gives the connection up (with `alive`).
    retired: watch::Sender<bool>,
    pub(crate) publisher: ConfirmChannel,
    pub(crate) topology: Arc<Topology>,
    /// The consuming channel's unsettled deliveries, for coalesced acks.
    pub(crate) acks: AckBook,
    reset: Notify,
}

impl Link {
    /// The link of connection `generation` (1 for the first), alive until it is retired.
    pub(crate) fn new(generation: u64, publisher: ConfirmChannel, topology: Arc<Topology>) -> Self {
        let unacked = metrics::gauge!("consumer_amqp_unacked", "queue" => topology.queue.clone());
        Link {
            generation,
            alive: AtomicBool::new(true),
            retired: watch::Sender::new(false),
            publisher,
            topology,
            acks: AckBook::counted_by(unacked),
            reset: Notify::new(),
        }
    }

    /// Whether deliveries of this connection may still be settled. Once the session gives
    /// a connection up, none of its delivery tags is ever used again.
    pub(crate) fn is_alive(&self) -> bool {
        self.alive.load(Ordering::Acquire)
    }

    /// Which connection this is (1 for the first).
    pub(crate) fn generation(&self) -> u64 {
        self.generation
    }

    /// Asks the session to drop this connection and open a new one (e.g. after the confirm
    /// channel failed, or a retry queue turned out missing).
    pub(crate) fn request_reset(&self) {
        self.reset.notify_one();
    }

    /// Completes once the session has given this connection up (at once if it has).
    /// Every wait on the broker through this connection races it: lapin does not promise
    /// that a publish, confirm or ack caught in a connection's failure ever completes.
    pub(crate) async fn retired(&self) {
        let mut retired = self.retired.subscribe();
        let _ = retired.wait_for(|r| *r).await;
    }

    /// Completes when a settlement asked for a new connection ([`Link::request_reset`]).
    pub(crate) async fn reset_requested(&self) {
        self.reset.notified().await;
    }

    /// Gives the connection up: from now on none of its deliveries can be settled.
    pub(crate) fn retire(&self) {
        self.alive.store(false, Ordering::Release);
        self.retired.send_replace(true);
    }
}

/// A channel in confirm mode. Every publish is mandatory and waits for the broker's confirm,
/// so "published" means "the broker has it, routed to a queue".
pub(crate) struct ConfirmChannel {
    channel: Channel,
    /// Serialises the sending of frames: lapin numbers a publish for confirms before it
    /// queues its frames, so two tasks publishing at once could swap sequence numbers and
    /// one could be told about the other's confirm or return.
    sending: Mutex<()>,
    /// Longest wait for one confirm ([`AmqpConfig::confirm_timeout`]).
    confirm_timeout: Duration,
}

impl ConfirmChannel {
    /// Opens a channel on `connection` and turns confirms on.
    pub(crate) async fn open(
        connection: &Connection,
        url: &RedactedUrl,
        config: &AmqpConfig,
    ) -> Result<Self, Error> {
        let connect_error = |e: lapin::Error| Error::Connect {
            url: url.clone(),
            source: e.into(),
        };
        let channel = connection.create_channel().await.map_err(connect_error)?;
        channel
            .confirm_select(ConfirmSelectOptions::default())
            .await
            .map_err(connect_error)?;
        Ok(ConfirmChannel {
            channel,
            sending: Mutex::new(()),
            confirm_timeout: config.confirm_timeout,
        })
    }

    /// The underlying channel (for declarations).
    pub(crate) fn channel(&self) -> &Channel {
        &self.channel
    }

    /// Whether the channel can still publish.
    pub(crate) fn is_open(&self) -> bool {
        self.channel.status().connected()
    }

    /// Publishes with the mandatory flag and waits for the confirm. An unroutable message
    /// (returned by the broker) and a negative confirm are errors, and so is a confirm that
    /// does not come within the confirm timeout: lapin waits for it as long as the
    /// connection lives, and a broker that stopped answering on a connection whose
    /// heartbeats still flow (or with heartbeats off) would hold the caller for good.
    pub(crate) async fn publish(
        &self,
        exchange: &str,
        routing_key: &str,
        payload: &[u8],
        properties: BasicProperties,
    ) -> Result<(), Error> {
        let exchange_name = lapin::types::ShortString::try_new(exchange)
            .map_err(|e| Error::InvalidMessage(format!("exchange: {e}")))?;
        let key = lapin::types::ShortString::try_new(routing_key)
            .map_err(|e| Error::InvalidMessage(format!("routing key: {e}")))?;
        let deadline = Instant::now() + self.confirm_timeout;
        let timed_out = || {
            Error::publish(
                exchange,
                routing_key,
                format!("no publisher confirm within {:?}", self.confirm_timeout),
            )
        };
        let confirm = {
            let _sending = tokio::time::timeout_at(deadline, self.sending.lock())
                .await
                .map_err(|_| timed_out())?;
            let publishing = self.channel.basic_publish(
                exchange_name,
                key,
                BasicPublishOptions {
                    mandatory: true,
                    immediate: false,
                },
                payload,
                properties,
            );
            tokio::time::timeout_at(deadline, publishing)
                .await
                .map_err(|_| timed_out())?
                .map_err(|e| Error::publish(exchange, routing_key, e))?
        };
        let confirmation = tokio::time::timeout_at(deadline, confirm)
            .await
            .map_err(|_| timed_out())?
            .map_err(|e| Error::publish(exchange, routing_key, e))?;
        match confirmation {
            Confirmation::Ack(None) => Ok(()),
            Confirmation::Ack(Some(returned)) | Confirmation::Nack(Some(returned)) => {
                Err(Error::Unroutable {
                    exchange: exchange.to_owned(),
                    routing_key: routing_key.to_owned(),
                    reply: format!("{} {}", returned.reply_code, returned.reply_text),
                })
            }
            Confirmation::Nack(None) => Err(Error::Nacked {
                exchange: exchange.to_owned(),
                routing_key: routing_key.to_owned(),
            }),
            Confirmation::NotRequested => Err(Error::publish(
                exchange,
                routing_key,
                "the channel is not in confirm mode",
            )),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_uri_given_to_lapin_carries_no_credentials() {
        let (uri, credentials) =
            split_credentials("amqp://app:s3cret@rabbit:5672/%2f?heartbeat=10").unwrap();
        let shown = format!("{uri:?}");
        assert!(
            !shown.contains("s3cret") && !shown.contains("app"),
            "{shown}"
        );
        assert_eq!(uri.authority.host, "rabbit");
        assert_eq!(uri.query.heartbeat, Some(10));
        let c = credentials.unwrap();
        assert_eq!(c.auth_starter().unwrap().to_string(), "\0app\0s3cret");
        assert_eq!(c.mechanism().as_str(), "PLAIN");
        // Another mechanism keeps the URI as it is.
        let (_, none) = split_credentials("amqps://h/?auth_mechanism=external").unwrap();
        assert!(none.is_none());
    }
}
