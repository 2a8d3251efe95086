//! The crate's error type.

use crate::redacted_url::RedactedUrl;

/// A boxed dependency error, kept as a source so lapin's types stay out of public signatures.
pub(crate) type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// Errors of the RabbitMQ transport and publisher.
///
/// No variant carries the broker URL's credentials: URLs appear only as [`RedactedUrl`].
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A configuration value is invalid; `field` names it (e.g. `amqp.prefetch`).
    #[error("invalid configuration `{field}`: {reason}")]
    Config {
        /// The configuration field.
        field: &'static str,
        /// Why it was rejected.
        reason: String,
    },
    /// Connecting (or opening a channel) failed.
    #[error("could not connect to {url}")]
    Connect {
        /// The broker, without credentials.
        url: RedactedUrl,
        /// The underlying error.
        #[source]
        source: BoxError,
    },
    /// Declaring a queue, exchange or binding failed (e.g. it exists with other arguments).
    #[error("could not declare {what}")]
    Topology {
        /// What was being declared, e.g. `queue "orders.dlq"`.
        what: String,
        /// The underlying error.
        #[source]
        source: BoxError,
    },
    /// Sending a message or waiting for its confirm failed; it may or may not have arrived.
    #[error("publishing to exchange {exchange:?} with routing key {routing_key:?} failed")]
    Publish {
        /// The exchange (`""` is the default exchange).
        exchange: String,
        /// The routing key.
        routing_key: String,
        /// The underlying error.
        #[source]
        source: BoxError,
    },
    /// The broker returned a mandatory message: no queue is bound for its routing key.
    #[error(
        "unroutable message: exchange {exchange:?} has no queue bound for routing key {routing_key:?} ({reply})"
    )]
    Unroutable {
        /// The exchange.
        exchange: String,
        /// The routing key.
        routing_key: String,
        /// The broker's reply text, e.g. `NO_ROUTE`.
        reply: String,
    },
    /// The broker refused the message (a negative publisher confirm).
    #[error(
        "the broker refused the message (negative confirm) on exchange {exchange:?}, routing key {routing_key:?}"
    )]
    Nacked {
        /// The exchange.
        exchange: String,
        /// The routing key.
        routing_key: String,
    },
    /// A message to publish is invalid (e.g. a message id longer than 255 bytes).
    #[error("invalid message: {0}")]
    InvalidMessage(String),
    /// The channel that received a delivery is closed, so it can no longer be settled; the
    /// broker redelivers the message and the inbox deduplicates it.
    #[error("the delivery's channel is closed (connection lost); the broker will redeliver it")]
    ChannelClosed,
    /// Acknowledging a delivery failed.
    #[error("acknowledging delivery failed")]
    Ack {
        /// The underlying error.
        #[source]
        source: BoxError,
    },
}

impl Error {
    pub(crate) fn config(field: &'static str, reason: impl Into<String>) -> Self {
        Error::Config {
            field,
            reason: reason.into(),
        }
    }

    pub(crate) fn publish(exchange: &str, routing_key: &str, source: impl Into<BoxError>) -> Self {
        Error::Publish {
            exchange: exchange.to_owned(),
            routing_key: routing_key.to_owned(),
            source: source.into(),
        }
    }

    /// Whether the broker reported the message as unroutable (mandatory flag + return).
    pub fn is_unroutable(&self) -> bool {
        matches!(self, Error::Unroutable { .. })
    }

    /// Whether the failure came from the connection or the channel (I/O, a broker shutting
    /// down, a missed heartbeat, a timeout), so that trying again on a new connection may
    /// succeed. Refused credentials, declaration conflicts, unroutable or refused messages
    /// and channel errors caused by the request itself (e.g. a missing exchange) are not.
    pub fn is_transient(&self) -> bool {
        match self {
            // A declaration fails transiently when its connection does (an operator closed
            // it, the broker is restarting), not because of what was declared.
            Error::Connect { source, .. }
            | Error::Publish { source, .. }
            | Error::Topology { source, .. } => transient(source),
            Error::ChannelClosed | Error::Ack { .. } => true,
            _ => false,
        }
    }

    /// The error and its chain of sources, `: `-separated, for log lines and
    /// [`consumer_core::transport::TransportError`] messages.
    pub(crate) fn chain(&self) -> String {
        let mut text = self.to_string();
        let mut source = std::error::Error::source(self);
        while let Some(s) = source {
            // Some errors (lapin's) already print their source: don't repeat it.
            let part = s.to_string();
            if !text.ends_with(&part) {
                text.push_str(": ");
                text.push_str(&part);
            }
            source = s.source();
        }
        text
    }
}

impl From<Error> for consumer_core::transport::TransportError {
    fn from(e: Error) -> Self {
        consumer_core::transport::TransportError::new(e.chain(), e)
    }
}

impl From<Error> for consumer_core::Error {
    fn from(e: Error) -> Self {
        match e {
            Error::Config { field, reason } => consumer_core::Error::Config { field, reason },
            other => consumer_core::Error::Transport(other.into()),
        }
    }
}

/// Classifies a dependency error: lapin's own kinds, anything else (our timeouts) transient.
fn transient(source: &BoxError) -> bool {
    let Some(e) = source.downcast_ref::<lapin::Error>() else {
        return true;
    };
    match e.kind() {
        lapin::ErrorKind::IOError(_)
        | lapin::ErrorKind::InvalidChannelState(..)
        | lapin::ErrorKind::InvalidConnectionState(_)
        | lapin::ErrorKind::InvalidChannel(_)
        | lapin::ErrorKind::MissingHeartbeatError => true,
        // CONNECTION_FORCED (the broker is shutting down or an operator closed us) and
        // INTERNAL_ERROR; the rest (ACCESS_REFUSED, NOT_FOUND, PRECONDITION_FAILED…) are
        // caused by what was asked and would fail again.
        lapin::ErrorKind::ProtocolError(amqp) => matches!(amqp.get_id(), 320 | 541),
        _ => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn topology(source: lapin::Error) -> Error {
        Error::Topology {
            what: "queue \"q\"".to_owned(),
            source: source.into(),
        }
    }

    fn protocol(id: u16) -> lapin::Error {
        let amqp = lapin::protocol::AMQPError::from_id(id, "test".into()).expect("a known id");
        lapin::ErrorKind::ProtocolError(amqp).into()
    }

    #[test]
    fn a_declaration_failing_with_its_connection_is_transient() {
        assert!(topology(protocol(320)).is_transient(), "CONNECTION_FORCED");
        let reset = std::io::Error::from(std::io::ErrorKind::ConnectionReset);
        assert!(topology(reset.into()).is_transient(), "connection reset");
    }

    #[test]
    fn a_declaration_refused_for_what_it_asks_is_not() {
        assert!(
            !topology(protocol(406)).is_transient(),
            "PRECONDITION_FAILED"
        );
        assert!(!topology(protocol(403)).is_transient(), "ACCESS_REFUSED");
    }
}
