//! The framework's own writes: retry copies, dead letters, user publishing, topic creation.
//! Every write goes through an idempotent producer ([`Producer`], with the thread that
//! serves its delivery reports) and waits for its delivery report.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
use rdkafka::config::{ClientConfig, RDKafkaLogLevel};
use rdkafka::error::KafkaError;
use rdkafka::message::{DeliveryResult, Header, Message, OwnedHeaders};
use rdkafka::producer::{BaseProducer, BaseRecord, ProducerContext};
use rdkafka::types::RDKafkaErrorCode;
use rdkafka::ClientContext;
use tokio::sync::oneshot;

use crate::config::client::producer_client_config;
use crate::config::validate::{validate_brokers, validate_properties, validate_topic};
use crate::{ClientProperties, Error, KafkaConfig, RetryMode};

/// A client context that sends librdkafka's log lines to `tracing`; as the producer's,
/// it also sends each delivery report to the write waiting for it.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct LogContext;

impl ClientContext for LogContext {
    fn log(&self, level: RDKafkaLogLevel, fac: &str, log_message: &str) {
        log_librdkafka(level, fac, log_message);
    }

    fn error(&self, error: KafkaError, reason: &str) {
        tracing::warn!(error = %error, reason, "librdkafka client error");
    }
}

pub(crate) fn log_librdkafka(level: RDKafkaLogLevel, fac: &str, message: &str) {
    match level {
        RDKafkaLogLevel::Emerg
        | RDKafkaLogLevel::Alert
        | RDKafkaLogLevel::Critical
        | RDKafkaLogLevel::Error => tracing::error!(target: "librdkafka", fac, "{message}"),
        RDKafkaLogLevel::Warning => tracing::warn!(target: "librdkafka", fac, "{message}"),
        RDKafkaLogLevel::Notice | RDKafkaLogLevel::Info => {
            tracing::info!(target: "librdkafka", fac, "{message}")
        }
        RDKafkaLogLevel::Debug => tracing::debug!(target: "librdkafka", fac, "{message}"),
    }
}

/// An rdkafka error as this crate's error. Configuration errors quote property values, so
/// they become [`Error::Config`] without the value and without the source.
pub(crate) fn client_error(context: &str, e: KafkaError) -> Error {
    match &e {
        KafkaError::ClientConfig(_, _, name, value) => Error::config(
            format!("properties.{name}"),
            crate::config::validate::redacted_reason(name, value, &e),
        ),
        _ => Error::client(context, e),
    }
}

/// How long the report thread waits for delivery reports in one round, before it checks
/// whether to stop. rdkafka's poll hands its remaining time to librdkafka in whole
/// milliseconds, rounded down, and polls again without waiting until the rest has passed:
/// a round of exactly 100 ms would end in a busy loop of up to a millisecond. The few
/// microseconds over keep what is left after the wait at about nothing.
const REPORT_WAIT: Duration = Duration::from_micros(100_020);

/// While librdkafka's queue of records to send is full, a write tries again this often
/// (until its produce timeout).
const QUEUE_FULL_RETRY: Duration = Duration::from_millis(10);

/// The producer every write of this crate goes through: librdkafka's, with a thread of its
/// own that serves the delivery reports, each to the write waiting for it. Cheap to clone;
/// the last clone dropped stops the thread and the producer.
///
/// Not rdkafka's threaded producer: its thread polls in rounds of exactly 100 ms, and so
/// ends every round busy for up to a millisecond (see [`REPORT_WAIT`]): 0.9 % of a core
/// for an idle producer, as measured on the bench's machine.
#[derive(Clone)]
pub(crate) struct Producer {
    shared: Arc<ProducerShared>,
}

struct ProducerShared {
    base: Arc<BaseProducer<LogContext>>,
    stop: Arc<AtomicBool>,
    reports: Option<std::thread::JoinHandle<()>>,
}

impl Drop for ProducerShared {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(thread) = self.reports.take() {
            // At most one round: the thread checks `stop` after each.
            let _ = thread.join();
        }
        // The producer itself goes with the last handle (here): rdkafka purges what is
        // still queued, and its writes get their reports (failed) as it closes.
    }
}

/// Where a written record's delivery report goes: the write waiting for it.
type ReportTo = Box<oneshot::Sender<Result<Published, KafkaError>>>;

impl ProducerContext for LogContext {
    type DeliveryOpaque = ReportTo;

    fn delivery(&self, result: &DeliveryResult<'_>, to: ReportTo) {
        let report = match result {
            Ok(m) => Ok(Published {
                partition: m.partition(),
                offset: m.offset(),
            }),
            Err((e, _)) => Err(e.clone()),
        };
        // The write stopped waiting (its task was dropped): nobody to tell.
        let _ = to.send(report);
    }
}

impl Producer {
    /// Creates the producer and starts its report thread.
    fn start(config: &ClientConfig) -> Result<Self, Error> {
        let base: BaseProducer<LogContext> = config
            .create_with_context(LogContext)
            .map_err(|e| client_error("creating the producer", e))?;
        let base = Arc::new(base);
        let stop = Arc::new(AtomicBool::new(false));
        let (thread_base, thread_stop) = (base.clone(), stop.clone());
        let reports = std::thread::Builder::new()
            .name("kafka-reports".to_owned())
            .spawn(move || {
                while !thread_stop.load(Ordering::Relaxed) {
                    thread_base.poll(REPORT_WAIT);
                }
            })
            .map_err(|e| Error::client("starting the producer's report thread", e))?;
        Ok(Producer {
            shared: Arc::new(ProducerShared {
                base,
                stop,
                reports: Some(reports),
            }),
        })
    }

    /// Hands `record` to librdkafka, trying again while its queue is full until `timeout`
    /// has passed, and waits for its delivery report.
    async fn write(
        &self,
        mut record: BaseRecord<'_, [u8], [u8], ReportTo>,
        report: oneshot::Receiver<Result<Published, KafkaError>>,
        timeout: Duration,
    ) -> Result<Published, KafkaError> {
        let start = Instant::now();
        loop {
            match self.shared.base.send(record) {
                Ok(()) => break,
                Err((KafkaError::MessageProduction(RDKafkaErrorCode::QueueFull), again))
                    if start.elapsed() < timeout =>
                {
                    record = again;
                    tokio::time::sleep(QUEUE_FULL_RETRY).await;
                }
                Err((e, _)) => return Err(e),
            }
        }
        // librdkafka reports every record it took, within `message.timeout.ms` (see
        // `create`); a report lost anyway (the producer closed) is a failed write.
        report.await.unwrap_or(Err(KafkaError::Canceled))
    }
}

pub(crate) fn create(config: &ClientConfig, timeout: Duration) -> Result<Producer, Error> {
    let mut config = config.clone();
    for name in ["message.timeout.ms", "delivery.timeout.ms"] {
        if config.get(name).is_some_and(|v| v.trim() == "0") {
            // Every write waits for its delivery report: it must come.
            return Err(Error::config(
                format!("producer_properties.{name}"),
                "0 (no limit) would let a write wait for its delivery report for good, \
                 holding its record; leave it unset (the produce timeout) or give a limit",
            ));
        }
    }
    if config.get("message.timeout.ms").is_none() && config.get("delivery.timeout.ms").is_none() {
        // A delivery report arrives within the produce timeout, success or not.
        config.set("message.timeout.ms", timeout.as_millis().max(1).to_string());
    }
    Producer::start(&config)
}

/// A record to write, built from a consumed one.
#[derive(Debug, Clone)]
pub(crate) struct OutgoingRecord {
    pub(crate) key: Option<Vec<u8>>,
    pub(crate) payload: Option<Vec<u8>>,
    pub(crate) headers: Vec<(String, Option<Vec<u8>>)>,
}

/// Writes `record` and waits for its delivery report.
pub(crate) async fn send(
    producer: &Producer,
    topic: &str,
    record: &OutgoingRecord,
    timeout: Duration,
) -> Result<Published, Error> {
    let mut headers = OwnedHeaders::new_with_capacity(record.headers.len());
    for (key, value) in &record.headers {
        headers = headers.insert(Header {
            key,
            value: value.as_deref(),
        });
    }
    let (to, report) = oneshot::channel();
    let mut out: BaseRecord<'_, [u8], [u8], ReportTo> =
        BaseRecord::with_opaque_to(topic, Box::new(to)).headers(headers);
    if let Some(k) = &record.key {
        out = out.key(k.as_slice());
    }
    if let Some(p) = &record.payload {
        out = out.payload(p.as_slice());
    }
    producer
        .write(out, report, timeout)
        .await
        .map_err(|e| Error::Produce {
            topic: topic.to_owned(),
            source: Box::new(e),
        })
}

/// Where a published record landed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Published {
    /// Partition.
    pub partition: i32,
    /// Offset.
    pub offset: i64,
}

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

/// Creates the topics of `config`, and their retry (in [`RetryMode::RetryTopic`]) and
/// dead-letter topics, with `partitions` partitions and `replication` replicas each. Topics
/// that exist already are left as they are.
pub async fn create_topics(
    config: &KafkaConfig,
    partitions: i32,
    replication: i32,
) -> Result<(), Error> {
    validate_brokers(&config.brokers)?;
    validate_properties("properties", &config.properties)?;
    if partitions < 1 {
        return Err(Error::config("partitions", "must be at least 1"));
    }
    if replication < 1 {
        return Err(Error::config("replication", "must be at least 1"));
    }
    let mut names = Vec::new();
    for t in &config.topics {
        validate_topic("topics", t)?;
        names.push(t.clone());
        if config.retry == RetryMode::RetryTopic {
            names.push(config.retry_topic(t));
        }
        names.push(config.dead_letter_topic(t));
    }
    let admin: AdminClient<LogContext> = config
        .admin_client_config()
        .create_with_context(LogContext)
        .map_err(|e| client_error("creating the admin client", e))?;
    let specs: Vec<NewTopic<'_>> = names
        .iter()
        .map(|n| NewTopic::new(n, partitions, TopicReplication::Fixed(replication)))
        .collect();
    let options = AdminOptions::new().operation_timeout(Some(Duration::from_secs(30)));
    let results = admin
        .create_topics(specs.iter(), &options)
        .await
        .map_err(|e| client_error("creating topics", e))?;
    for r in results {
        match r {
            Ok(_) | Err((_, RDKafkaErrorCode::TopicAlreadyExists)) => {}
            Err((topic, code)) => {
                return Err(Error::client(
                    format!("creating topic {topic:?}"),
                    KafkaError::AdminOp(code),
                ))
            }
        }
    }
    Ok(())
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_delivery_report_wait_is_bounded() {
        let base = producer_client_config(
            "127.0.0.1:9092",
            &ClientProperties::new(),
            &ClientProperties::new(),
        );
        let _producer = create(&base, Duration::from_secs(7)).expect("the default is bounded");
        for name in ["message.timeout.ms", "delivery.timeout.ms"] {
            let mut c = base.clone();
            c.set(name, "0");
            let e = create(&c, Duration::from_secs(7)).err().expect("refused");
            assert!(e.to_string().contains(name), "{e}");
        }
    }

    #[tokio::test]
    async fn a_write_that_finds_the_queue_full_tries_until_its_timeout_then_fails() {
        // No broker listens there, so the one record the queue holds stays in it.
        let mut c = producer_client_config(
            "127.0.0.1:1",
            &ClientProperties::new(),
            &ClientProperties::new(),
        );
        c.set("queue.buffering.max.messages", "1");
        let producer = create(&c, Duration::from_secs(30)).expect("created");
        let record = OutgoingRecord {
            key: None,
            payload: Some(b"x".to_vec()),
            headers: Vec::new(),
        };
        let first = send(&producer, "t", &record, Duration::from_secs(30));
        futures::pin_mut!(first);
        assert!(
            futures::poll!(first.as_mut()).is_pending(),
            "queued, unreported"
        );
        let start = Instant::now();
        let patience = Duration::from_millis(200);
        let second = tokio::time::timeout(
            Duration::from_secs(10),
            send(&producer, "t", &record, patience),
        )
        .await
        .expect("gives up within its timeout");
        assert!(start.elapsed() >= patience, "tried again until the timeout");
        match second {
            Err(Error::Produce { source, .. }) => assert_eq!(
                source.downcast_ref::<KafkaError>(),
                Some(&KafkaError::MessageProduction(RDKafkaErrorCode::QueueFull))
            ),
            other => panic!("expected a full queue, got {other:?}"),
        }
    }
}
