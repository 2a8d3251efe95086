//! The crate's error type.

/// A boxed error from a dependency, kept as a source (its type is not part of the API).
pub(crate) type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// Errors of the Kafka transport: bad configuration, client failures, failed writes.
///
/// Messages never contain credentials: configuration errors name the field and redact the
/// values of sensitive properties, and librdkafka's configuration errors (which echo values)
/// are never kept as sources.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A configuration value is invalid; `field` names it (a [`crate::KafkaConfig`] field, a
    /// client property as `properties.<name>`, or an environment variable).
    #[error("invalid configuration `{field}`: {reason}")]
    Config {
        /// The field, property or environment variable.
        field: String,
        /// Why it was rejected.
        reason: String,
    },
    /// Creating a Kafka client, subscribing, or an admin request failed.
    #[error("kafka client error: {context}")]
    Client {
        /// What was being done.
        context: String,
        /// The underlying error.
        #[source]
        source: BoxError,
    },
    /// A record could not be written (its delivery report was an error).
    #[error("producing to topic `{topic}` failed")]
    Produce {
        /// The destination topic.
        topic: String,
        /// The underlying error.
        #[source]
        source: BoxError,
    },
}

impl Error {
    pub(crate) fn config(field: impl Into<String>, reason: impl Into<String>) -> Self {
        Error::Config {
            field: field.into(),
            reason: reason.into(),
        }
    }

    pub(crate) fn client(context: impl Into<String>, source: impl Into<BoxError>) -> Self {
        Error::Client {
            context: context.into(),
            source: source.into(),
        }
    }

    /// Whether this is a configuration error (the process should not retry starting).
    pub fn is_config(&self) -> bool {
        matches!(self, Error::Config { .. })
    }
}
