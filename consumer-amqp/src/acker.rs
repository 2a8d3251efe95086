//! From a lapin delivery to an [`Incoming`], and its settlement.

use std::sync::Arc;
use std::time::SystemTime;

use bytes::Bytes;
use futures::future::BoxFuture;
use lapin::options::{BasicAckOptions, BasicNackOptions};
use lapin::types::FieldTable;
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
    let table = properties.headers().as_ref();
    let payload = Bytes::from(data);
    let delivery = Delivery {
        message_id: properties
            .message_id()
            .as_ref()
            .map(|id| id.to_string())
            .filter(|id| !id.is_empty()),
        payload: payload.clone(),
        headers: headers::to_strings(table),
        redelivered,
        attempt: headers::attempt(table),
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
            exchange: exchange.to_string(),
            routing_key: routing_key.to_string(),
            properties,
            payload,
        }),
    }
}

/// Settles one delivery on the channel it came from.
///
/// Each tag is acked on its own (no `multiple`): deliveries finish out of order under
/// concurrency, and acking individually is what keeps "only contiguous settled tags" true
/// without bookkeeping. Against a local broker the ack is not the bottleneck (the handler's
/// commits are), so coalescing was not worth its risk.
struct AmqpAcker {
    link: Arc<Link>,
    acker: lapin::Acker,
    delivery_tag: u64,
    exchange: String,
    routing_key: String,
    properties: BasicProperties,
    payload: Bytes,
}

impl Acknowledger for AmqpAcker {
    fn settle(
        self: Box<Self>,
        settlement: Settlement,
    ) -> BoxFuture<'static, Result<(), TransportError>> {
        Box::pin(async move { self.apply(settlement).await.map_err(TransportError::from) })
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
                self.forward(&bucket.queue, properties).await
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
            Err(e) => {
                // A negative confirm is the broker's answer, not a broken channel; anything
                // else (channel closed, queue missing) calls for a fresh connection and
                // topology.
                if !matches!(e, Error::Nacked { .. }) {
                    self.link.request_reset();
                }
                let requeue = BasicNackOptions {
                    multiple: false,
                    requeue: true,
                };
                if let Err(nack) = self.acker.nack(requeue).await {
                    tracing::debug!(error = %nack, "could not requeue after a failed publish");
                }
                Err(e)
            }
        }
    }

    async fn ack(&self) -> Result<(), Error> {
        if !self.link.is_alive() {
            return Err(Error::ChannelClosed);
        }
        match self.acker.ack(BasicAckOptions { multiple: false }).await {
            Ok(true) => Ok(()),
            // lapin poisons the ackers of a closed channel.
            Ok(false) => Err(Error::ChannelClosed),
            Err(e) => Err(Error::Ack { source: e.into() }),
        }
    }

    /// The original headers plus what every copy carries: where the message was first
    /// published, and when it first failed.
    fn copy_headers(&self, now: SystemTime) -> FieldTable {
        let original = self.properties.headers().as_ref();
        let mut table = original.cloned().unwrap_or_default();
        if !table.contains_key(headers::ORIGINAL_EXCHANGE) {
            headers::set_string(&mut table, headers::ORIGINAL_EXCHANGE, &self.exchange);
        }
        if !table.contains_key(headers::ORIGINAL_ROUTING_KEY) {
            headers::set_string(&mut table, headers::ORIGINAL_ROUTING_KEY, &self.routing_key);
        }
        if !table.contains_key(headers::FIRST_FAILURE) {
            headers::set_string(&mut table, headers::FIRST_FAILURE, &headers::rfc3339(now));
        }
        table
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
