//! The client every write of the framework goes through (retry copies, dead letters, the
//! [`crate::KafkaPublisher`]'s records): an idempotent producer ([`Producer`], with the
//! thread that serves its delivery reports); each write waits for its delivery report.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use rdkafka::config::{ClientConfig, RDKafkaLogLevel};
use rdkafka::error::KafkaError;
use rdkafka::message::{DeliveryResult, Header, Message, OwnedHeaders};
use rdkafka::producer::{BaseProducer, BaseRecord, ProducerContext};
use rdkafka::types::RDKafkaErrorCode;
use rdkafka::ClientContext;
use tokio::sync::oneshot;

use crate::Error;

/// A client context that sends librdkafka's log lines to `tracing`; as the producer's,
/// it also sends each delivery report to the write waiting for it.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct LogContext;

impl ClientContext for LogContext {
    fn log(&self, level: RDKafkaLogLevel, fac: &str, log_message: &str) {
        log_librdkafka(level, fac, log_message);
    }

    fn error(&self, error: KafkaError, reason: &str) {
        log_client_error(&error, reason);
    }
}

/// Logs an error librdkafka hands a client's error callback. A failed connection to a
/// broker is also a line of librdkafka's own log, at error level and with repeats counted
/// rather than written: the callback's copy of it goes to debug, so that a node that is down
/// fills the log with one line per attempt, not two or three.
pub(crate) fn log_client_error(error: &KafkaError, reason: &str) {
    if is_connection_failure(error) {
        tracing::debug!(error = %error, reason, "librdkafka client error");
    } else {
        tracing::warn!(error = %error, reason, "librdkafka client error");
    }
}

/// Whether `error` is a failed connection to a broker, which librdkafka logs itself.
pub(crate) fn is_connection_failure(error: &KafkaError) -> bool {
    error.rdkafka_error_code() == Some(RDKafkaErrorCode::BrokerTransportFailure)
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
            format!("kafka.properties.{name}"),
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
///
/// A write whose record timed out in librdkafka replaces the client with a new one from the
/// same configuration (writes already handed to the old one still get its reports). After a
/// controlled shutdown of a broker, librdkafka 2.12.1's idempotent producer was seen to keep
/// a partition's leader unknown, and to time out every write to it, for minutes, though the
/// broker was back and new clients wrote to it at once; a new client starts from fresh
/// metadata. The idempotence state starts over with it, so a record written again after the
/// timeout may be stored twice: with the same message id, which the inbox drops.
#[derive(Clone)]
pub(crate) struct Producer {
    slot: Arc<ProducerSlot>,
}

struct ProducerSlot {
    /// What each client is created from.
    config: ClientConfig,
    /// The client new writes go through.
    current: std::sync::Mutex<Arc<ProducerShared>>,
    /// How many times the client was replaced.
    replaced: std::sync::atomic::AtomicU64,
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

impl ProducerShared {
    /// Creates a client and starts its report thread.
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
        Ok(ProducerShared {
            base,
            stop,
            reports: Some(reports),
        })
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
        let client = ProducerShared::start(config)?;
        Ok(Producer {
            slot: Arc::new(ProducerSlot {
                config: config.clone(),
                current: std::sync::Mutex::new(Arc::new(client)),
                replaced: std::sync::atomic::AtomicU64::new(0),
            }),
        })
    }

    /// The client new writes go through.
    fn client(&self) -> Arc<ProducerShared> {
        self.slot
            .current
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// How many times the client was replaced after a timed-out write.
    #[cfg(test)]
    fn replaced(&self) -> u64 {
        self.slot.replaced.load(Ordering::Relaxed)
    }

    /// Replaces `used` with a new client, unless another write replaced it already. If the
    /// new client cannot be created, the old one stays.
    fn replace(&self, used: &Arc<ProducerShared>) {
        let mut current = self.slot.current.lock().unwrap_or_else(|p| p.into_inner());
        if !Arc::ptr_eq(&current, used) {
            return;
        }
        match ProducerShared::start(&self.slot.config) {
            Ok(client) => {
                // Not the old client's last handle: `used` is one. It stops when the last
                // write through it has its report.
                *current = Arc::new(client);
                drop(current);
                let n = self.slot.replaced.fetch_add(1, Ordering::Relaxed) + 1;
                metrics::counter!("consumer_kafka_producer_replaced_total").increment(1);
                tracing::warn!(
                    replaced = n,
                    "a write timed out in the Kafka producer; its client is replaced by a new one"
                );
            }
            Err(e) => {
                tracing::warn!(error = %e, "a write timed out in the Kafka producer; a new client could not be created, the old one is kept")
            }
        }
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
        let client = self.client();
        loop {
            match client.base.send(record) {
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
        let reported = report.await.unwrap_or(Err(KafkaError::Canceled));
        if matches!(
            reported,
            Err(KafkaError::MessageProduction(
                RDKafkaErrorCode::MessageTimedOut
            ))
        ) {
            self.replace(&client);
        }
        reported
    }
}

pub(crate) fn create(config: &ClientConfig, timeout: Duration) -> Result<Producer, Error> {
    let mut config = config.clone();
    for name in ["message.timeout.ms", "delivery.timeout.ms"] {
        if config.get(name).is_some_and(|v| v.trim() == "0") {
            // Every write waits for its delivery report: it must come.
            return Err(Error::config(
                format!("kafka.producer_properties.{name}"),
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::client::producer_client_config;
    use crate::ClientProperties;

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
    async fn a_write_that_times_out_replaces_the_client_for_the_next_writes() {
        // No broker listens there: the record times out in librdkafka.
        let mut c = producer_client_config(
            "127.0.0.1:1",
            &ClientProperties::new(),
            &ClientProperties::new(),
        );
        c.set("message.timeout.ms", "200");
        let producer = create(&c, Duration::from_secs(30)).expect("created");
        let before = producer.client();
        let record = OutgoingRecord {
            key: None,
            payload: Some(b"x".to_vec()),
            headers: Vec::new(),
        };
        let sent = tokio::time::timeout(
            Duration::from_secs(10),
            send(&producer, "t", &record, Duration::from_secs(30)),
        )
        .await
        .expect("reported within message.timeout.ms");
        match sent {
            Err(Error::Produce { source, .. }) => assert_eq!(
                source.downcast_ref::<KafkaError>(),
                Some(&KafkaError::MessageProduction(
                    RDKafkaErrorCode::MessageTimedOut
                ))
            ),
            other => panic!("expected a timed-out record, got {other:?}"),
        }
        assert_eq!(producer.replaced(), 1);
        assert!(
            !Arc::ptr_eq(&before, &producer.client()),
            "the next writes go through a new client"
        );
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
