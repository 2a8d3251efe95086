//! [`KafkaPublisher`]: the users' and the outbox relay's way to write records, through the
//! crate's producer ([`crate::producer`]).

use std::time::Duration;

use rdkafka::error::KafkaError;
use rdkafka::types::RDKafkaErrorCode;

use crate::config::client::producer_client_config;
use crate::config::validate::{validate_brokers, validate_properties, validate_topic};
use crate::producer::{create, send, OutgoingRecord, Producer, Published};
use crate::{ClientProperties, Error, KafkaConfig};

/// Publishes records with an idempotent producer (`enable.idempotence=true`), each call
/// returning only once the broker has acknowledged the record. Cheap to clone.
#[derive(Clone)]
pub struct KafkaPublisher {
    producer: Producer,
    message_id_header: String,
    timeout: Duration,
}

impl std::fmt::Debug for KafkaPublisher {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KafkaPublisher")
            .field("message_id_header", &self.message_id_header)
            .field("timeout", &self.timeout)
            .finish_non_exhaustive()
    }
}

impl KafkaPublisher {
    /// A publisher for the brokers, common and producer properties and message id header of
    /// `config` (its topics and group are not used).
    pub fn new(config: &KafkaConfig) -> Result<Self, Error> {
        validate_brokers(&config.brokers)?;
        validate_properties("properties", &config.properties)?;
        validate_properties("producer_properties", &config.producer_properties)?;
        if config.message_id_header.trim().is_empty() {
            return Err(Error::config("message_id_header", "must not be empty"));
        }
        let producer = create(&config.producer_client_config(), config.produce_timeout)?;
        Ok(Self::from_producer(
            producer,
            config.message_id_header.clone(),
            config.produce_timeout,
        ))
    }

    /// A publisher for `brokers` with `properties` and the default message id header.
    pub fn connect(brokers: &str, properties: &ClientProperties) -> Result<Self, Error> {
        validate_brokers(brokers)?;
        validate_properties("properties", properties)?;
        let timeout = Duration::from_secs(30);
        let producer = create(
            &producer_client_config(brokers, properties, &ClientProperties::new()),
            timeout,
        )?;
        Ok(Self::from_producer(
            producer,
            "message_id".to_owned(),
            timeout,
        ))
    }

    pub(crate) fn from_producer(
        producer: Producer,
        message_id_header: String,
        timeout: Duration,
    ) -> Self {
        KafkaPublisher {
            producer,
            message_id_header,
            timeout,
        }
    }

    /// Writes one record to `topic` and waits for the broker's acknowledgement.
    ///
    /// `key` picks the partition (and, with [`crate::ProcessingOrder::Key`], the ordering
    /// group); `message_id` goes in the message id header, which the inbox uses to recognise
    /// a republished duplicate; `headers` are added as UTF-8 text.
    pub async fn publish(
        &self,
        topic: &str,
        key: Option<&[u8]>,
        message_id: Option<&str>,
        payload: &[u8],
        headers: &[(&str, &str)],
    ) -> Result<Published, Error> {
        self.publish_raw(topic, key, message_id, Some(payload), headers)
            .await
    }

    /// Like [`KafkaPublisher::publish`], with a null payload allowed (a tombstone).
    pub async fn publish_raw(
        &self,
        topic: &str,
        key: Option<&[u8]>,
        message_id: Option<&str>,
        payload: Option<&[u8]>,
        headers: &[(&str, &str)],
    ) -> Result<Published, Error> {
        validate_topic("topic", topic)?;
        let mut hs: Vec<(String, Option<Vec<u8>>)> = headers
            .iter()
            .map(|(k, v)| ((*k).to_owned(), Some(v.as_bytes().to_vec())))
            .collect();
        if let Some(id) = message_id {
            hs.push((self.message_id_header.clone(), Some(id.as_bytes().to_vec())));
        }
        let record = OutgoingRecord {
            key: key.map(<[u8]>::to_vec),
            payload: payload.map(<[u8]>::to_vec),
            headers: hs,
        };
        send(&self.producer, topic, &record, self.timeout).await
    }
}

/// The outbox relay publishes a message to the topic named by its destination, with its
/// ordering key as the record key (so one key's messages share a partition and keep their
/// order), its id in the message id header and its headers as text. A bad topic name, a
/// record too large, an unknown topic or a refused authorisation is reported as refused;
/// anything else (a broker down, a timeout) as unavailable.
impl consumer_core::Publisher for KafkaPublisher {
    fn publish<'a>(
        &'a self,
        message: &'a consumer_core::OutboxMessage,
    ) -> futures::future::BoxFuture<'a, Result<(), consumer_core::PublishError>> {
        Box::pin(async move {
            let headers: Vec<(&str, &str)> = message
                .headers
                .iter()
                .map(|(k, v)| (k.as_str(), v.as_str()))
                .collect();
            let result = self
                .publish(
                    &message.destination,
                    message.key.as_deref().map(str::as_bytes),
                    message.message_id.as_deref(),
                    &message.payload,
                    &headers,
                )
                .await;
            result.map(|_| ()).map_err(outbox_error)
        })
    }
}

/// How the relay should treat a failed publish (see the `Publisher` impl).
fn outbox_error(e: Error) -> consumer_core::PublishError {
    use consumer_core::PublishError;
    let refused = match &e {
        Error::Config { .. } => true,
        Error::Produce { source, .. } => matches!(
            source
                .downcast_ref::<KafkaError>()
                .and_then(KafkaError::rdkafka_error_code),
            Some(
                RDKafkaErrorCode::MessageSizeTooLarge
                    | RDKafkaErrorCode::UnknownTopicOrPartition
                    | RDKafkaErrorCode::UnknownTopic
                    | RDKafkaErrorCode::TopicAuthorizationFailed
                    | RDKafkaErrorCode::InvalidMessage
                    | RDKafkaErrorCode::InvalidRecord
            )
        ),
        Error::Client { .. } => false,
    };
    if refused {
        PublishError::refused_by("kafka refused the message", e)
    } else {
        PublishError::unavailable("kafka did not take the message", e)
    }
}
