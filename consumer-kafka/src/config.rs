//! Configuration: what to consume, how to order and retry, and the client properties passed
//! through to librdkafka. Everything is checked by [`KafkaConfig::validate`] before a client
//! is created, and a bad value fails naming its field.

use std::collections::BTreeMap;
use std::fmt;
use std::time::Duration;

use rdkafka::config::ClientConfig;
use rdkafka::error::KafkaError;

use crate::Error;

/// Longest Kafka topic name.
const MAX_TOPIC_LEN: usize = 249;
/// The consumer's default `fetch.wait.max.ms` (see `consumer_client_config`).
const FETCH_WAIT_MAX_MS: &str = "100";

/// Properties the transport sets itself; passing them through would break its guarantees.
const RESERVED: &[(&str, &str)] = &[
    ("bootstrap.servers", "set `brokers` instead"),
    ("metadata.broker.list", "set `brokers` instead"),
    ("group.id", "set `group_id` instead"),
    (
        "enable.auto.commit",
        "set `commit` instead (offsets are committed only up to the last contiguous settled record)",
    ),
    (
        "enable.auto.offset.store",
        "the transport stores offsets itself, only after settlement",
    ),
    (
        "enable.idempotence",
        "the transport's producer always runs with enable.idempotence=true",
    ),
];

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

/// What a [`consumer_core::Settlement::Retry`] does.
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

/// librdkafka client properties (`name = value`), passed through as given.
///
/// Its `Debug` output redacts the values of credentials (`sasl.password`,
/// `ssl.key.password`, anything containing `password`, `secret`, `jaas`, `token`, or a PEM
/// key), so a logged configuration never leaks them.
#[derive(Clone, Default, PartialEq, Eq)]
pub struct ClientProperties {
    map: BTreeMap<String, String>,
}

impl ClientProperties {
    /// No properties.
    pub fn new() -> Self {
        Self::default()
    }

    /// Sets `name` to `value`, replacing an earlier value.
    pub fn set(&mut self, name: impl Into<String>, value: impl Into<String>) -> &mut Self {
        self.map.insert(name.into(), value.into());
        self
    }

    /// The value of `name`, if set.
    pub fn get(&self, name: &str) -> Option<&str> {
        self.map.get(name).map(String::as_str)
    }

    /// Removes `name`.
    pub fn remove(&mut self, name: &str) -> Option<String> {
        self.map.remove(name)
    }

    /// Every property, in name order.
    pub fn iter(&self) -> impl Iterator<Item = (&str, &str)> {
        self.map.iter().map(|(k, v)| (k.as_str(), v.as_str()))
    }

    /// No property is set.
    pub fn is_empty(&self) -> bool {
        self.map.is_empty()
    }

    /// Whether the value of `name` is a credential that must never be shown.
    pub fn is_sensitive(name: &str) -> bool {
        let n = name.to_ascii_lowercase();
        [
            "password", "secret", "jaas", "token", "key.pem", "ssl_key", "ssl.key",
        ]
        .iter()
        .any(|s| n.contains(s))
            || n == "sasl.oauthbearer.config"
    }

    fn apply(&self, config: &mut ClientConfig) {
        for (k, v) in &self.map {
            config.set(k, v);
        }
    }
}

impl fmt::Debug for ClientProperties {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_map()
            .entries(self.map.iter().map(|(k, v)| {
                let shown = if ClientProperties::is_sensitive(k) {
                    "<redacted>"
                } else {
                    v.as_str()
                };
                (k, shown)
            }))
            .finish()
    }
}

impl<K: Into<String>, V: Into<String>> FromIterator<(K, V)> for ClientProperties {
    fn from_iter<I: IntoIterator<Item = (K, V)>>(iter: I) -> Self {
        ClientProperties {
            map: iter
                .into_iter()
                .map(|(k, v)| (k.into(), v.into()))
                .collect(),
        }
    }
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
    /// `fetch.wait.max.ms` (default 100, not librdkafka's 500: a partition paused because its
    /// buffer was full fetches again when it resumes, and waits up to this long for it).
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
    /// How often settled offsets are committed or stored (default 500ms).
    pub commit_interval: Duration,
    /// Records buffered per partition before it is paused (default 5,000); it is resumed
    /// when the buffer is half empty again. The buffer holds the records between the
    /// committed position and the fetch position: waiting, in flight, and settled behind a
    /// record still in flight.
    pub max_buffered_per_partition: usize,
    /// Bytes (payloads, keys and headers) buffered per partition before it is paused
    /// (default 1 MiB), whichever of the two limits comes first; resumed at half. With the
    /// record limit this bounds the consumer's memory for any message size.
    ///
    /// A paused partition drops what librdkafka prefetched for it, and its next fetch can
    /// wait up to `fetch.wait.max.ms` behind a fetch already at the broker, so the buffer's
    /// lower half must last that long at the handlers' rate: small buffers stall fast
    /// handlers (BENCHMARKS.md measures it).
    pub max_buffered_bytes_per_partition: usize,
    /// How long a revoke waits for in-flight records of the revoked partitions to settle
    /// (default 10s). Settlements arriving later are dropped; the new owner redelivers and
    /// the inbox deduplicates. The wait runs inside the poll, so it must stay under half of
    /// `max.poll.interval.ms` when that is set ([`KafkaConfig::validate`] checks).
    pub revoke_timeout: Duration,
    /// Longest wait for a retry or dead-letter copy's delivery report (default 30s).
    pub produce_timeout: Duration,
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
        }
    }

    /// Reads the configuration from the process environment; see [`KafkaConfig::from_vars`].
    pub fn from_env() -> Result<Self, Error> {
        Self::from_vars(std::env::vars())
    }

    /// Reads the configuration from `NAME=value` pairs:
    ///
    /// | variable | field |
    /// | --- | --- |
    /// | `KAFKA_BROKERS` (required) | `brokers` |
    /// | `KAFKA_GROUP_ID` (required) | `group_id` |
    /// | `KAFKA_TOPICS` (required, comma-separated) | `topics` |
    /// | `KAFKA_ORDER` = `partition` \| `key` | `order` |
    /// | `KAFKA_RETRY_MODE` = `retry-topic` \| `blocking` | `retry` |
    /// | `KAFKA_RETRY_TOPIC_SUFFIX`, `KAFKA_DLQ_TOPIC_SUFFIX` | the suffixes |
    /// | `KAFKA_MESSAGE_ID_HEADER` | `message_id_header` |
    /// | `KAFKA_OFFSET_MESSAGE_IDS` = `true` \| `false` | `offset_message_ids` |
    /// | `KAFKA_COMMIT` = `manual` \| `auto-store` | `commit` |
    /// | `KAFKA_COMMIT_INTERVAL_MS`, `KAFKA_REVOKE_TIMEOUT_MS`, `KAFKA_PRODUCE_TIMEOUT_MS` | durations |
    /// | `KAFKA_MAX_BUFFERED_PER_PARTITION` | `max_buffered_per_partition` |
    /// | `KAFKA_MAX_BUFFERED_BYTES_PER_PARTITION` | `max_buffered_bytes_per_partition` |
    /// | `KAFKA_PROPERTY_<NAME>` | `properties` |
    /// | `KAFKA_CONSUMER_PROPERTY_<NAME>` | `consumer_properties` |
    /// | `KAFKA_PRODUCER_PROPERTY_<NAME>` | `producer_properties` |
    ///
    /// In a property variable the name is lower-cased and `_` becomes `.`:
    /// `KAFKA_PROPERTY_SASL_PASSWORD` sets `sasl.password`. A malformed value fails naming the
    /// variable. The result is not yet validated: see [`KafkaConfig::validate`].
    pub fn from_vars<K, V>(vars: impl IntoIterator<Item = (K, V)>) -> Result<Self, Error>
    where
        K: AsRef<str>,
        V: Into<String>,
    {
        let vars: BTreeMap<String, String> = vars
            .into_iter()
            .map(|(k, v)| (k.as_ref().to_owned(), v.into()))
            .filter(|(k, _)| k.starts_with("KAFKA_"))
            .collect();
        let required = |name: &str| {
            vars.get(name)
                .filter(|v| !v.trim().is_empty())
                .cloned()
                .ok_or_else(|| Error::config(name, "is not set"))
        };
        let topics = required("KAFKA_TOPICS")?
            .split(',')
            .map(str::trim)
            .filter(|t| !t.is_empty())
            .map(str::to_owned)
            .collect::<Vec<_>>();
        let mut c = KafkaConfig::new(
            required("KAFKA_BROKERS")?,
            required("KAFKA_GROUP_ID")?,
            topics,
        );
        for (name, value) in &vars {
            let value = value.as_str();
            match name.as_str() {
                "KAFKA_BROKERS" | "KAFKA_GROUP_ID" | "KAFKA_TOPICS" => {}
                "KAFKA_ORDER" => {
                    c.order = match value {
                        "partition" => ProcessingOrder::Partition,
                        "key" => ProcessingOrder::Key,
                        _ => return Err(Error::config(name, "must be `partition` or `key`")),
                    }
                }
                "KAFKA_RETRY_MODE" => {
                    c.retry = match value {
                        "retry-topic" => RetryMode::RetryTopic,
                        "blocking" => RetryMode::Blocking,
                        _ => {
                            return Err(Error::config(name, "must be `retry-topic` or `blocking`"))
                        }
                    }
                }
                "KAFKA_COMMIT" => {
                    c.commit = match value {
                        "manual" => CommitMode::Manual,
                        "auto-store" => CommitMode::AutoStore,
                        _ => return Err(Error::config(name, "must be `manual` or `auto-store`")),
                    }
                }
                "KAFKA_RETRY_TOPIC_SUFFIX" => c.retry_topic_suffix = value.to_owned(),
                "KAFKA_DLQ_TOPIC_SUFFIX" => c.dead_letter_topic_suffix = value.to_owned(),
                "KAFKA_MESSAGE_ID_HEADER" => c.message_id_header = value.to_owned(),
                "KAFKA_OFFSET_MESSAGE_IDS" => {
                    c.offset_message_ids = value
                        .parse()
                        .map_err(|_| Error::config(name, "must be `true` or `false`"))?
                }
                "KAFKA_COMMIT_INTERVAL_MS" => c.commit_interval = millis(name, value)?,
                "KAFKA_REVOKE_TIMEOUT_MS" => c.revoke_timeout = millis(name, value)?,
                "KAFKA_PRODUCE_TIMEOUT_MS" => c.produce_timeout = millis(name, value)?,
                "KAFKA_MAX_BUFFERED_PER_PARTITION" => {
                    c.max_buffered_per_partition = value
                        .parse()
                        .map_err(|_| Error::config(name, "must be a whole number"))?
                }
                "KAFKA_MAX_BUFFERED_BYTES_PER_PARTITION" => {
                    c.max_buffered_bytes_per_partition = value
                        .parse()
                        .map_err(|_| Error::config(name, "must be a whole number"))?
                }
                _ => {
                    let (target, suffix) =
                        if let Some(s) = name.strip_prefix("KAFKA_CONSUMER_PROPERTY_") {
                            (&mut c.consumer_properties, s)
                        } else if let Some(s) = name.strip_prefix("KAFKA_PRODUCER_PROPERTY_") {
                            (&mut c.producer_properties, s)
                        } else if let Some(s) = name.strip_prefix("KAFKA_PROPERTY_") {
                            (&mut c.properties, s)
                        } else {
                            // Other KAFKA_* variables belong to other programs.
                            continue;
                        };
                    if suffix.is_empty() {
                        return Err(Error::config(name, "names no property"));
                    }
                    target.set(suffix.to_ascii_lowercase().replace('_', "."), value);
                }
            }
        }
        Ok(c)
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

    /// Checks every field; the first bad one is reported by name. Client properties are
    /// checked by librdkafka itself, one at a time, with sensitive values redacted from the
    /// reason.
    pub fn validate(&self) -> Result<(), Error> {
        validate_brokers(&self.brokers)?;
        validate_group(&self.group_id)?;
        if self.topics.is_empty() {
            return Err(Error::config("topics", "at least one topic is required"));
        }
        for t in &self.topics {
            validate_topic("topics", t)?;
            if t.ends_with(&self.retry_topic_suffix) || t.ends_with(&self.dead_letter_topic_suffix)
            {
                return Err(Error::config(
                    "topics",
                    format!("{t:?} is a retry or dead-letter topic; list the original topic"),
                ));
            }
            validate_topic("retry_topic_suffix", &self.retry_topic(t))?;
            validate_topic("dead_letter_topic_suffix", &self.dead_letter_topic(t))?;
        }
        if self.retry_topic_suffix.is_empty() {
            return Err(Error::config("retry_topic_suffix", "must not be empty"));
        }
        if self.dead_letter_topic_suffix.is_empty() {
            return Err(Error::config(
                "dead_letter_topic_suffix",
                "must not be empty",
            ));
        }
        if self.retry_topic_suffix == self.dead_letter_topic_suffix {
            return Err(Error::config(
                "dead_letter_topic_suffix",
                "must differ from retry_topic_suffix",
            ));
        }
        if self.message_id_header.trim().is_empty() {
            return Err(Error::config("message_id_header", "must not be empty"));
        }
        if self.commit_interval.is_zero() {
            return Err(Error::config(
                "commit_interval",
                "must be greater than zero",
            ));
        }
        if self.revoke_timeout.is_zero() {
            return Err(Error::config("revoke_timeout", "must be greater than zero"));
        }
        // The revoke callback runs inside the poll: waiting there longer than
        // `max.poll.interval.ms` makes librdkafka leave the group, and it holds up the
        // whole group's rebalance meanwhile.
        let max_poll = [
            ("consumer_properties", &self.consumer_properties),
            ("properties", &self.properties),
        ]
        .into_iter()
        .find_map(|(field, props)| {
            let ms = props
                .get("max.poll.interval.ms")?
                .trim()
                .parse::<u64>()
                .ok();
            Some((field, ms))
        });
        if let Some((field, Some(max_poll_ms))) = max_poll {
            if self.revoke_timeout.as_millis() >= u128::from(max_poll_ms) / 2 {
                return Err(Error::config(
                    "revoke_timeout",
                    format!(
                        "must be less than half of max.poll.interval.ms ({max_poll_ms} ms, \
                         from {field}): the revoke wait runs inside the poll"
                    ),
                ));
            }
        }
        if self.produce_timeout.is_zero() {
            return Err(Error::config(
                "produce_timeout",
                "must be greater than zero",
            ));
        }
        if self.max_buffered_per_partition == 0 {
            return Err(Error::config(
                "max_buffered_per_partition",
                "must be at least 1",
            ));
        }
        if self.max_buffered_bytes_per_partition == 0 {
            return Err(Error::config(
                "max_buffered_bytes_per_partition",
                "must be at least 1",
            ));
        }
        for (field, props) in [
            ("properties", &self.properties),
            ("consumer_properties", &self.consumer_properties),
            ("producer_properties", &self.producer_properties),
        ] {
            validate_properties(field, props)?;
        }
        Ok(())
    }

    /// The consumer's librdkafka configuration.
    pub(crate) fn consumer_client_config(&self) -> ClientConfig {
        let mut c = ClientConfig::new();
        c.set("bootstrap.servers", &self.brokers)
            .set("group.id", &self.group_id)
            .set("auto.offset.reset", "earliest")
            .set("enable.partition.eof", "false");
        // librdkafka drops what it prefetched for a partition the transport pauses (a full
        // buffer), so the resume fetches again; that fetch waits behind the one already at the
        // broker, which holds it up to this long when it asks only for partitions without new
        // records (a retry topic, a drained partition). librdkafka's default, 500 ms, stalls a
        // backlogged partition that long at every resume (the bench: 4,800 msg/s against
        // 18,000-21,000 with 100 ms). An idle consumer sends 10 fetches a second instead of 2.
        c.set("fetch.wait.max.ms", FETCH_WAIT_MAX_MS);
        self.properties.apply(&mut c);
        self.consumer_properties.apply(&mut c);
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
pub const COPY_MAX_BYTES: usize = consumer_core::DEFAULT_MAX_PAYLOAD_BYTES + COPY_HEADER_ROOM;

/// Room for the key and headers in [`COPY_MAX_BYTES`].
pub const COPY_HEADER_ROOM: usize = 64 * 1024;

fn millis(name: &str, value: &str) -> Result<Duration, Error> {
    value
        .parse::<u64>()
        .map(Duration::from_millis)
        .map_err(|_| Error::config(name, "must be a whole number of milliseconds"))
}

pub(crate) fn validate_brokers(brokers: &str) -> Result<(), Error> {
    if brokers.trim().is_empty() {
        return Err(Error::config(
            "brokers",
            "at least one host:port is required",
        ));
    }
    for b in brokers.split(',').map(str::trim) {
        // librdkafka takes credentials only as properties; an entry with user info is a
        // credential pasted in the wrong place, and is never quoted back.
        if b.contains('@') {
            return Err(Error::config(
                "brokers",
                "an entry holds user info (`…@host`): give credentials as `sasl.username` and \
                 `sasl.password` properties, not in the broker list",
            ));
        }
        // Accept an optional scheme prefix as librdkafka does (e.g. `PLAINTEXT://host:9092`).
        let hostport = b.rsplit("://").next().unwrap_or(b);
        let ok = hostport.rsplit_once(':').is_some_and(|(host, port)| {
            !host.is_empty() && port.parse::<u16>().is_ok_and(|p| p > 0)
        });
        if !ok {
            return Err(Error::config(
                "brokers",
                format!("{b:?} is not host:port (comma-separate several brokers)"),
            ));
        }
    }
    Ok(())
}

fn validate_group(group: &str) -> Result<(), Error> {
    if group.trim().is_empty() {
        return Err(Error::config("group_id", "must not be empty"));
    }
    if group.len() > 255 || group.chars().any(char::is_control) {
        return Err(Error::config(
            "group_id",
            "must be at most 255 characters without control characters",
        ));
    }
    Ok(())
}

/// Kafka's own rule: 1..=249 of `[a-zA-Z0-9._-]`, not `.` or `..`.
pub(crate) fn validate_topic(field: &str, topic: &str) -> Result<(), Error> {
    let ok = !topic.is_empty()
        && topic.len() <= MAX_TOPIC_LEN
        && topic != "."
        && topic != ".."
        && topic
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-'));
    if ok {
        Ok(())
    } else {
        Err(Error::config(
            field,
            format!(
                "{topic:?} is not a valid topic name (1 to {MAX_TOPIC_LEN} of a-z A-Z 0-9 . _ -)"
            ),
        ))
    }
}

pub(crate) fn validate_properties(field: &str, props: &ClientProperties) -> Result<(), Error> {
    for (name, value) in props.iter() {
        let field = format!("{field}.{name}");
        if let Some((_, why)) = RESERVED.iter().find(|(r, _)| *r == name) {
            return Err(Error::config(
                field,
                format!("is managed by the transport: {why}"),
            ));
        }
        let mut one = ClientConfig::new();
        one.set(name, value);
        if let Err(e) = one.create_native_config() {
            return Err(Error::config(field, redacted_reason(name, value, &e)));
        }
    }
    Ok(())
}

/// librdkafka's configuration errors quote the value; a credential must not reach a log.
pub(crate) fn redacted_reason(name: &str, value: &str, e: &KafkaError) -> String {
    let text = match e {
        KafkaError::ClientConfig(_, desc, _, _) => desc.clone(),
        other => other.to_string(),
    };
    if ClientProperties::is_sensitive(name) && !value.is_empty() {
        text.replace(value, "<redacted>")
    } else {
        text
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn valid() -> KafkaConfig {
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

    fn field_of(c: &KafkaConfig) -> String {
        match c.validate() {
            Err(Error::Config { field, .. }) => field,
            other => panic!("expected a config error, got {other:?}"),
        }
    }

    #[test]
    fn revoke_timeout_stays_under_half_the_poll_interval() {
        let mut c = valid();
        c.consumer_properties.set("max.poll.interval.ms", "7000");
        assert_eq!(field_of(&c), "revoke_timeout");
        c.revoke_timeout = Duration::from_millis(3000);
        c.validate().unwrap();
        let mut c = valid();
        c.properties.set("max.poll.interval.ms", "6000");
        assert_eq!(field_of(&c), "revoke_timeout");
    }

    #[test]
    fn bad_values_name_their_field() {
        let mut c = valid();
        c.brokers = "localhost".into();
        assert_eq!(field_of(&c), "brokers");
        let mut c = valid();
        c.topics = vec!["bad topic".into()];
        assert_eq!(field_of(&c), "topics");
        let mut c = valid();
        c.topics = vec![];
        assert_eq!(field_of(&c), "topics");
        let mut c = valid();
        c.topics = vec!["orders.dlq".into()];
        assert_eq!(field_of(&c), "topics");
        let mut c = valid();
        c.group_id = " ".into();
        assert_eq!(field_of(&c), "group_id");
        let mut c = valid();
        c.message_id_header = String::new();
        assert_eq!(field_of(&c), "message_id_header");
        let mut c = valid();
        c.max_buffered_per_partition = 0;
        assert_eq!(field_of(&c), "max_buffered_per_partition");
        let mut c = valid();
        c.max_buffered_bytes_per_partition = 0;
        assert_eq!(field_of(&c), "max_buffered_bytes_per_partition");
        let mut c = valid();
        c.properties.set("no.such.property", "1");
        assert_eq!(field_of(&c), "properties.no.such.property");
        let mut c = valid();
        c.consumer_properties.set("enable.auto.commit", "true");
        assert_eq!(field_of(&c), "consumer_properties.enable.auto.commit");
        let mut c = valid();
        c.producer_properties.set("enable.idempotence", "false");
        assert_eq!(field_of(&c), "producer_properties.enable.idempotence");
    }

    #[test]
    fn credentials_never_appear_in_debug_or_errors() {
        let mut c = valid();
        c.properties
            .set("security.protocol", "SASL_SSL")
            .set("sasl.username", "svc")
            .set("sasl.password", "hunter2-secret")
            .set("ssl.key.password", "pem-pass");
        let shown = format!("{c:?}");
        assert!(
            !shown.contains("hunter2") && !shown.contains("pem-pass"),
            "{shown}"
        );
        assert!(
            shown.contains("SASL_SSL") && shown.contains("svc"),
            "{shown}"
        );

        // librdkafka accepts the credential; a rejected sensitive value is redacted.
        let mut c = valid();
        c.properties.set("sasl.password", "hunter2");
        c.validate().unwrap();
        let e = KafkaError::ClientConfig(
            rdkafka::types::RDKafkaConfRes::RD_KAFKA_CONF_INVALID,
            "Invalid value \"hunter2\" for configuration property \"sasl.password\"".into(),
            "sasl.password".into(),
            "hunter2".into(),
        );
        let reason = redacted_reason("sasl.password", "hunter2", &e);
        assert!(!reason.contains("hunter2"), "{reason}");
    }

    /// `sasl.password` values with the characters that end a URL's parts, raw and
    /// percent-escaped: never in `Debug`, `Display` or an error, wherever they are put.
    #[test]
    fn credentials_never_appear_in_url_errors_or_display() {
        for password in ["s3c/ret", "s3c?r#et", "s3c@ret", "s3c:ret", "s3c%2Fr%40et"] {
            let mut c = valid();
            c.properties
                .set("security.protocol", "SASL_SSL")
                .set("sasl.mechanism", "PLAIN")
                .set("sasl.username", "svc")
                .set("sasl.password", password);
            c.producer_properties.set("sasl.password", password);
            c.validate().unwrap();
            let shown = format!("{c:?} {:?}", c.properties);
            assert!(!shown.contains("s3c"), "{shown}");

            // Credentials pasted into the broker list are refused without being quoted.
            for brokers in [
                format!("SASL_SSL://svc:{password}@kafka:9092"),
                format!("svc:{password}@kafka"),
                format!("kafka:9092,svc:{password}@other"),
            ] {
                let mut c = valid();
                c.brokers = brokers.clone();
                let e = c.validate().unwrap_err();
                let text = format!("{e} {e:?}");
                assert!(text.contains("brokers"), "{text}");
                assert!(
                    !text.contains("s3c") && !text.contains("svc"),
                    "{brokers}: {text}"
                );
            }

            // A credential librdkafka rejects is redacted from its message.
            let e = KafkaError::ClientConfig(
                rdkafka::types::RDKafkaConfRes::RD_KAFKA_CONF_INVALID,
                format!(
                    "Invalid value \"{password}\" for configuration property \"sasl.password\""
                ),
                "sasl.password".into(),
                password.into(),
            );
            let e = crate::producer::client_error("creating the producer", e);
            let text = format!("{e} {e:?}");
            assert!(!text.contains("s3c"), "{text}");
        }
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

    #[test]
    fn environment_maps_to_fields() {
        let c = KafkaConfig::from_vars([
            ("KAFKA_BROKERS", "127.0.0.1:9092"),
            ("KAFKA_GROUP_ID", "invoices"),
            ("KAFKA_TOPICS", "orders, payments"),
            ("KAFKA_ORDER", "key"),
            ("KAFKA_RETRY_MODE", "blocking"),
            ("KAFKA_OFFSET_MESSAGE_IDS", "true"),
            ("KAFKA_PROPERTY_SECURITY_PROTOCOL", "SASL_PLAINTEXT"),
            ("KAFKA_PROPERTY_SASL_PASSWORD", "pw"),
            ("KAFKA_CONSUMER_PROPERTY_SESSION_TIMEOUT_MS", "6000"),
            ("KAFKA_UNRELATED", "ignored"),
            ("PATH", "/bin"),
        ])
        .unwrap();
        assert_eq!(c.topics, vec!["orders", "payments"]);
        assert_eq!(c.order, ProcessingOrder::Key);
        assert_eq!(c.retry, RetryMode::Blocking);
        assert!(c.offset_message_ids);
        assert_eq!(
            c.properties.get("security.protocol"),
            Some("SASL_PLAINTEXT")
        );
        assert_eq!(c.properties.get("sasl.password"), Some("pw"));
        assert_eq!(
            c.consumer_properties.get("session.timeout.ms"),
            Some("6000")
        );
        c.validate().unwrap();

        let e = KafkaConfig::from_vars([("KAFKA_BROKERS", "b:1")]).unwrap_err();
        assert!(
            matches!(e, Error::Config { ref field, .. } if field == "KAFKA_TOPICS"),
            "{e}"
        );
        let e = KafkaConfig::from_vars([
            ("KAFKA_BROKERS", "b:1"),
            ("KAFKA_GROUP_ID", "g"),
            ("KAFKA_TOPICS", "t"),
            ("KAFKA_ORDER", "random"),
        ])
        .unwrap_err();
        assert!(
            matches!(e, Error::Config { ref field, .. } if field == "KAFKA_ORDER"),
            "{e}"
        );
    }
}
