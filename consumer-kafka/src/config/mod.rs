//! Configuration: what to consume, how to order and retry, and the client properties passed
//! through to librdkafka. Everything is checked by [`KafkaConfig::validate`] before a client
//! is created, and a bad value fails naming its field.

use std::time::Duration;

use properties::ClientProperties;

pub(crate) mod client;
mod env;
pub(crate) mod properties;
pub(crate) mod validate;

/// In which order the records of one partition are handed to the worker.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ProcessingOrder {
    /// One record of a partition at a time, in offset order: the next one is handed out only
    /// after the previous one settled (the default).
    #[default]
    Partition,
    /// Records with different Kafka keys may run concurrently; records of one key (records
    /// without a key count as one key) stay in offset order.
    Key,
}

/// What a [`consumer_core::transport::Settlement::Retry`] does.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum RetryMode {
    /// Write a copy to the retry topic (`<topic><retry_topic_suffix>`) with its due time and
    /// attempt in headers, then commit past the original: the partition is not blocked. The
    /// transport consumes the retry topic too and holds each copy until it is due. Handlers
    /// must tolerate reordering (the default).
    #[default]
    RetryTopic,
    /// Keep the record in place and hand it out again after the delay: nothing behind it in
    /// its partition (or, with [`ProcessingOrder::Key`], of its key) runs meanwhile. For
    /// handlers that need strict order.
    Blocking,
}

/// How settled offsets reach the group coordinator.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum CommitMode {
    /// The transport commits every `commit_interval`, on revoke and on close (the default).
    #[default]
    Manual,
    /// The transport stores offsets and librdkafka's auto-committer commits them
    /// (`enable.auto.commit=true`, `enable.auto.offset.store=false`).
    AutoStore,
}

/// Everything the Kafka transport needs. Build it with [`KafkaConfig::new`] (or
/// [`KafkaConfig::from_env`]) and adjust the fields; [`crate::KafkaConsumer::new`] validates
/// it before creating any client.
#[derive(Clone, Debug)]
#[non_exhaustive]
pub struct KafkaConfig {
    /// Bootstrap brokers, `host:port[,host:port...]`.
    pub brokers: String,
    /// The consumer group.
    pub group_id: String,
    /// Topics to consume (their retry topics are added in [`RetryMode::RetryTopic`]).
    pub topics: Vec<String>,
    /// Properties for every client (consumer, producer, admin): security settings go here,
    /// e.g. `security.protocol`, `sasl.mechanism`, `sasl.username`, `sasl.password`.
    pub properties: ClientProperties,
    /// Properties for the consumer only, e.g. `session.timeout.ms`, `max.poll.interval.ms`,
    /// `auto.offset.reset` (default `earliest`), `partition.assignment.strategy`,
    /// `fetch.wait.max.ms` (default 100, not librdkafka's 500: a partition's next fetch can
    /// wait up to this long behind one already at the broker), `queued.max.messages.kbytes`
    /// (default 1024: librdkafka's prefetch, which holds for each partition on its own, as
    /// each partition's records come in a queue of their own), `fetch.queue.backoff.ms`
    /// (default 10, not librdkafka's 1000: how soon a partition whose prefetch reached that
    /// limit is fetched again once it is read).
    pub consumer_properties: ClientProperties,
    /// Properties for the producer only, e.g. `linger.ms`, `compression.type`.
    pub producer_properties: ClientProperties,
    /// Order of records within a partition (default [`ProcessingOrder::Partition`]).
    pub order: ProcessingOrder,
    /// What a retry does (default [`RetryMode::RetryTopic`]).
    pub retry: RetryMode,
    /// Retry topic of `t` is `t` + this (default `.retry`).
    pub retry_topic_suffix: String,
    /// Dead-letter topic of `t` is `t` + this (default `.dlq`).
    pub dead_letter_topic_suffix: String,
    /// The header holding the producer's message id (default `message_id`).
    pub message_id_header: String,
    /// When a record has no message id header, use `topic/partition@offset` as its id.
    /// Off by default: an offset-based id cannot recognise a republished duplicate.
    pub offset_message_ids: bool,
    /// How offsets are committed (default [`CommitMode::Manual`]).
    pub commit: CommitMode,
    /// How often settled offsets are committed or stored (default 500ms); for 5 s after a
    /// partition is assigned, every 20 ms (so a worker that crashes soon after each start
    /// still moves its partitions forward).
    pub commit_interval: Duration,
    /// Records buffered per partition before the partition is left unread (default 5,000);
    /// it is read again when the buffer is half empty. The buffer holds the records between
    /// the committed position and the fetch position: waiting, in flight, and settled behind
    /// a record still in flight.
    pub max_buffered_per_partition: usize,
    /// Bytes (payloads, keys and headers) buffered per partition before it is left unread
    /// (default 1 MiB), whichever of the two limits comes first; read again at half. With the
    /// record limit this bounds the consumer's memory for any message size: records are
    /// copied into 8 KiB blocks shared with the records fetched beside them, so a record held
    /// long (a slow handler, a blocking retry) keeps at most one such block alive.
    ///
    /// What librdkafka prefetched of a partition left unread waits in the partition's own
    /// queue, up to `queued.max.messages.kbytes` (see
    /// [`KafkaConfig::consumer_properties`]), and is read from there: a partition holds at
    /// most its buffer and that much.
    pub max_buffered_bytes_per_partition: usize,
    /// How long a revoke waits for in-flight records of the revoked partitions to settle
    /// (default 10s). Settlements arriving later are dropped; the new owner redelivers and
    /// the inbox deduplicates. The wait runs inside the poll, so it must stay under half of
    /// `max.poll.interval.ms` when that is set ([`KafkaConfig::validate`] checks).
    pub revoke_timeout: Duration,
    /// Longest wait for a retry or dead-letter copy's delivery report (default 30s).
    pub produce_timeout: Duration,
    /// How long the group's coordinator may stay out of reach before the consumer is
    /// replaced by a new one (default 60s): its partitions are forgotten as lost, and the
    /// new consumer finds the coordinator and joins again. After a broker restart
    /// librdkafka can keep a consumer's coordinator connection down for good while every
    /// broker answers; by then the member's session has lapsed and it owns nothing. Seen in
    /// librdkafka's statistics, so it works only while they are on (`statistics.interval.ms`,
    /// default 5000 here; with it, the timeout is met within one interval).
    pub coordinator_timeout: Duration,
    /// Static group membership (`group.instance.id`, KIP-345): a name this worker keeps
    /// across restarts, unique in its group, e.g. a StatefulSet pod's name or a process
    /// slot. Off by default (`None`).
    ///
    /// With it, a worker that restarts within the session timeout takes its partitions
    /// back at once, without a rebalance of the group; without it, a killed worker's
    /// partitions wait for the session timeout, then for a rebalance. The price: a static
    /// member that stops, even cleanly, does not leave the group, so its partitions wait
    /// for the session timeout when it does not come back. A member told that another has
    /// its name (`FENCED_INSTANCE_ID`, classic protocol, also seen after the member's session
    /// lapsed while the coordinator moved; `UNRELEASED_INSTANCE_ID`, consumer protocol)
    /// forgets its partitions and joins again with a new consumer, waiting 1 s, then twice
    /// as long each time up to 16 s; two live workers with the same name take it from each
    /// other until one of them has been told so for two minutes, and stops with the error.
    pub instance_id: Option<String>,
}

impl KafkaConfig {
    /// A configuration with the defaults documented on each field.
    pub fn new(
        brokers: impl Into<String>,
        group_id: impl Into<String>,
        topics: impl IntoIterator<Item = impl Into<String>>,
    ) -> Self {
        KafkaConfig {
            brokers: brokers.into(),
            group_id: group_id.into(),
            topics: topics.into_iter().map(Into::into).collect(),
            properties: ClientProperties::new(),
            consumer_properties: ClientProperties::new(),
            producer_properties: ClientProperties::new(),
            order: ProcessingOrder::Partition,
            retry: RetryMode::RetryTopic,
            retry_topic_suffix: ".retry".to_owned(),
            dead_letter_topic_suffix: ".dlq".to_owned(),
            message_id_header: "message_id".to_owned(),
            offset_message_ids: false,
            commit: CommitMode::Manual,
            commit_interval: Duration::from_millis(500),
            max_buffered_per_partition: 5_000,
            max_buffered_bytes_per_partition: 1 << 20,
            revoke_timeout: Duration::from_secs(10),
            produce_timeout: Duration::from_secs(30),
            coordinator_timeout: Duration::from_secs(60),
            instance_id: None,
        }
    }

    /// The retry topic of `topic`.
    pub fn retry_topic(&self, topic: &str) -> String {
        format!("{topic}{}", self.retry_topic_suffix)
    }

    /// The dead-letter topic of `topic`.
    pub fn dead_letter_topic(&self, topic: &str) -> String {
        format!("{topic}{}", self.dead_letter_topic_suffix)
    }

    /// Every topic the consumer subscribes to: the topics and, in
    /// [`RetryMode::RetryTopic`], their retry topics.
    pub fn subscribed_topics(&self) -> Vec<String> {
        let mut all = self.topics.clone();
        if self.retry == RetryMode::RetryTopic {
            all.extend(self.topics.iter().map(|t| self.retry_topic(t)));
        }
        all
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    pub(super) fn valid() -> KafkaConfig {
        KafkaConfig::new("127.0.0.1:9092", "group", ["orders"])
    }

    #[test]
    fn defaults_are_valid() {
        valid().validate().unwrap();
        assert_eq!(
            valid().subscribed_topics(),
            vec!["orders".to_owned(), "orders.retry".to_owned()]
        );
    }
}
