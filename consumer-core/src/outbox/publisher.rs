//! What the relay publishes through: a broker's confirmed publish.

use std::fmt;

use futures::future::BoxFuture;

use super::message::OutboxMessage;

/// Publishes an outbox message to a broker, confirmed.
///
/// `publish` returns `Ok` only once the broker has the message (a RabbitMQ publisher
/// confirm for a routed, persistent message; a Kafka delivery report from an idempotent
/// producer): the relay then marks the row published. It may be called for several messages
/// at once (never for two of one ordering key). The transports' publishers implement it, as
/// does [`MemoryBroker`](crate::memory::MemoryBroker).
///
/// The message's id goes where the consumer's transport reads a message id (AMQP
/// `message_id`, the Kafka message id header), so the receiving inbox deduplicates a re-send.
pub trait Publisher: Send + Sync + 'static {
    /// Publishes `message` (its `message_id` is always set) and waits for the broker.
    fn publish<'a>(&'a self, message: &'a OutboxMessage)
        -> BoxFuture<'a, Result<(), PublishError>>;
}

impl<P: Publisher + ?Sized> Publisher for std::sync::Arc<P> {
    fn publish<'a>(
        &'a self,
        message: &'a OutboxMessage,
    ) -> BoxFuture<'a, Result<(), PublishError>> {
        (**self).publish(message)
    }
}

/// Why a publish failed. Either way the row stays in the outbox and is tried again after a
/// backoff; nothing is dropped.
#[derive(Debug)]
pub struct PublishError {
    refused: bool,
    message: String,
    source: Option<Box<dyn std::error::Error + Send + Sync>>,
}

impl PublishError {
    /// The broker could not be reached or did not confirm in time: a later try should work.
    pub fn unavailable(
        message: impl Into<String>,
        source: impl Into<Box<dyn std::error::Error + Send + Sync>>,
    ) -> Self {
        PublishError {
            refused: false,
            message: message.into(),
            source: Some(source.into()),
        }
    }

    /// The broker refused this message (unroutable, too large, an unknown topic, no such
    /// queue): it needs an operator, and the relay reports it at error level.
    pub fn refused(message: impl Into<String>) -> Self {
        PublishError {
            refused: true,
            message: message.into(),
            source: None,
        }
    }

    /// [`PublishError::refused`], with the broker's error as its source.
    pub fn refused_by(
        message: impl Into<String>,
        source: impl Into<Box<dyn std::error::Error + Send + Sync>>,
    ) -> Self {
        PublishError {
            source: Some(source.into()),
            ..PublishError::refused(message)
        }
    }

    /// Whether the broker refused the message itself (rather than being unavailable).
    pub fn is_refused(&self) -> bool {
        self.refused
    }
}

impl fmt::Display for PublishError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.message)?;
        let mut source = self.source.as_deref().map(|s| s as &dyn std::error::Error);
        while let Some(s) = source {
            write!(f, ": {s}")?;
            source = s.source();
        }
        Ok(())
    }
}

impl std::error::Error for PublishError {}
