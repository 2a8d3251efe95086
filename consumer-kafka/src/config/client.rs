//! The librdkafka configurations of the consumer, the producer and the admin client, built
//! from a [`KafkaConfig`] with the settings the transport's guarantees rely on.

use rdkafka::config::ClientConfig;

use super::properties::ClientProperties;
use super::{CommitMode, KafkaConfig};

/// The consumer's default `fetch.wait.max.ms` (see `consumer_client_config`).
const FETCH_WAIT_MAX_MS: &str = "100";

/// The consumer's default `queued.max.messages.kbytes`: what librdkafka prefetches of a
/// partition, in KiB. Each partition's records wait in a queue of their own (see
/// `consumer::queues`), and librdkafka applies its prefetch limits to such a queue alone,
/// so its own default (64 MiB) would let a consumer of many partitions hold that much for
/// each of them. 1 MiB, as much as a partition's buffer holds by default
/// (`max_buffered_bytes_per_partition`).
const QUEUED_MAX_KBYTES: &str = "1024";

/// The consumer's default `fetch.queue.backoff.ms`: how long librdkafka waits before it
/// looks again at a partition whose prefetch reached its limit. Its own default, 1 s, would
/// leave a partition unfetched that long after the transport read its prefetch, once the
/// buffers hold less than a second of the handlers' work.
const FETCH_QUEUE_BACKOFF_MS: &str = "10";

/// How often librdkafka reports its statistics to the consumer (the lag gauges, the
/// fetched-record counters).
const STATISTICS_INTERVAL_MS: &str = "5000";

/// How often a producer refreshes its metadata (librdkafka's default: 5 minutes), so that a
/// moved partition leader is learnt within 10 s even when no error prompts a refresh. It does
/// not end librdkafka 2.12.1's stall after a broker's controlled shutdown, where a partition's
/// leader stays unknown for minutes (CHAOS.md).
const PRODUCER_METADATA_REFRESH_MS: &str = "10000";

impl KafkaConfig {
    /// The consumer's librdkafka configuration.
    pub(crate) fn consumer_client_config(&self) -> ClientConfig {
        let mut c = ClientConfig::new();
        c.set("bootstrap.servers", &self.brokers)
            .set("group.id", &self.group_id)
            .set("auto.offset.reset", "earliest")
            .set("enable.partition.eof", "false");
        // A partition's next fetch waits behind the one already at the broker, which holds
        // it up to this long when it asks only for partitions without new records (a retry
        // topic, a drained partition). librdkafka's default, 500 ms, stalls a backlogged
        // partition that long whenever its prefetch runs low (the bench, when a full buffer
        // paused its partition: 4,800 msg/s against 18,000-21,000 with 100 ms). An idle
        // consumer sends 10 fetches a second instead of 2.
        c.set("fetch.wait.max.ms", FETCH_WAIT_MAX_MS);
        c.set("queued.max.messages.kbytes", QUEUED_MAX_KBYTES);
        c.set("fetch.queue.backoff.ms", FETCH_QUEUE_BACKOFF_MS);
        // The statistics the lag gauges and the fetched-record counters come from
        // (`consumer_kafka_lag`, `consumer_kafka_fetched_records_total`); a property of the
        // user's overrides it ("0" turns them off).
        c.set("statistics.interval.ms", STATISTICS_INTERVAL_MS);
        self.properties.apply(&mut c);
        self.consumer_properties.apply(&mut c);
        if let Some(id) = &self.instance_id {
            c.set("group.instance.id", id);
        }
        // Last, so nothing above can override them (validate rejects them anyway).
        c.set(
            "enable.auto.commit",
            if self.commit == CommitMode::AutoStore {
                "true"
            } else {
                "false"
            },
        )
        .set(
            "auto.commit.interval.ms",
            self.commit_interval.as_millis().max(1).to_string(),
        )
        .set("enable.auto.offset.store", "false");
        c
    }

    /// The producer's librdkafka configuration (retry and dead-letter copies, publishing).
    pub(crate) fn producer_client_config(&self) -> ClientConfig {
        producer_client_config(&self.brokers, &self.properties, &self.producer_properties)
    }

    /// An admin client's librdkafka configuration.
    pub(crate) fn admin_client_config(&self) -> ClientConfig {
        let mut c = ClientConfig::new();
        c.set("bootstrap.servers", &self.brokers);
        self.properties.apply(&mut c);
        c
    }
}

pub(crate) fn producer_client_config(
    brokers: &str,
    common: &ClientProperties,
    producer: &ClientProperties,
) -> ClientConfig {
    let mut c = ClientConfig::new();
    c.set("bootstrap.servers", brokers);
    common.apply(&mut c);
    producer.apply(&mut c);
    c.set("enable.idempotence", "true");
    if c.get("topic.metadata.refresh.interval.ms").is_none() {
        c.set(
            "topic.metadata.refresh.interval.ms",
            PRODUCER_METADATA_REFRESH_MS,
        );
    }
    if c.get("message.max.bytes").is_none() {
        c.set("message.max.bytes", COPY_MAX_BYTES.to_string());
    }
    c
}

/// The producer's `message.max.bytes` unless set in the properties: the largest payload
/// the worker accepts by default (`WorkerConfig::max_payload_bytes`, 1 MiB) plus room for
/// the key and the headers a copy adds, so that every record the worker runs can be
/// copied to a retry or dead-letter topic. librdkafka's own default (1,000,000 bytes) is
/// below that: a record of 1 MiB could be run but never copied. Raise both together (and
/// the topics' `max.message.bytes` on the broker). A copy larger still is dead-lettered
/// with a reference to the original instead of its body (reason `copy_too_large`).
pub const COPY_MAX_BYTES: usize =
    consumer_core::WorkerConfig::DEFAULT_MAX_PAYLOAD_BYTES + COPY_HEADER_ROOM;

/// Room for the key and headers in [`COPY_MAX_BYTES`].
pub const COPY_HEADER_ROOM: usize = 64 * 1024;

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::tests::valid;

    #[test]
    fn fetch_wait_defaults_to_100ms_and_can_be_set() {
        let c = valid().consumer_client_config();
        assert_eq!(c.get("fetch.wait.max.ms"), Some(FETCH_WAIT_MAX_MS));
        let mut c = valid();
        c.consumer_properties.set("fetch.wait.max.ms", "500");
        assert_eq!(
            c.consumer_client_config().get("fetch.wait.max.ms"),
            Some("500")
        );
    }

    #[test]
    fn the_prefetch_of_a_partition_is_bounded_and_can_be_set() {
        let c = valid().consumer_client_config();
        assert_eq!(c.get("queued.max.messages.kbytes"), Some(QUEUED_MAX_KBYTES));
        assert_eq!(
            c.get("fetch.queue.backoff.ms"),
            Some(FETCH_QUEUE_BACKOFF_MS)
        );
        let mut c = valid();
        c.consumer_properties
            .set("queued.max.messages.kbytes", "65536");
        assert_eq!(
            c.consumer_client_config().get("queued.max.messages.kbytes"),
            Some("65536")
        );
    }

    #[test]
    fn copies_fit_what_the_worker_accepts() {
        let accepted = consumer_core::WorkerConfig::default().max_payload_bytes;
        assert!(COPY_MAX_BYTES >= accepted + COPY_HEADER_ROOM);
        let limit = |c: &KafkaConfig| {
            c.producer_client_config()
                .get("message.max.bytes")
                .map(str::to_owned)
        };
        assert_eq!(limit(&valid()), Some(COPY_MAX_BYTES.to_string()));
        let mut c = valid();
        c.producer_properties.set("message.max.bytes", "16777216");
        assert_eq!(
            limit(&c).as_deref(),
            Some("16777216"),
            "a set value is kept"
        );
    }
}
