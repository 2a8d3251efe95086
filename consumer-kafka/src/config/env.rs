//! [`KafkaConfig::from_env`]: the configuration from `KAFKA_*` environment variables.

use std::collections::BTreeMap;
use std::time::Duration;

use super::{CommitMode, KafkaConfig, ProcessingOrder, RetryMode};
use crate::Error;

impl KafkaConfig {
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
    /// | `KAFKA_COMMIT_INTERVAL_MS`, `KAFKA_REVOKE_TIMEOUT_MS`, `KAFKA_PRODUCE_TIMEOUT_MS`, `KAFKA_COORDINATOR_TIMEOUT_MS` | durations |
    /// | `KAFKA_MAX_BUFFERED_PER_PARTITION` | `max_buffered_per_partition` |
    /// | `KAFKA_MAX_BUFFERED_BYTES_PER_PARTITION` | `max_buffered_bytes_per_partition` |
    /// | `KAFKA_INSTANCE_ID` | `instance_id` (static membership) |
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
                "KAFKA_INSTANCE_ID" => c.instance_id = Some(value.to_owned()),
                "KAFKA_OFFSET_MESSAGE_IDS" => {
                    c.offset_message_ids = value
                        .parse()
                        .map_err(|_| Error::config(name, "must be `true` or `false`"))?
                }
                "KAFKA_COMMIT_INTERVAL_MS" => c.commit_interval = millis(name, value)?,
                "KAFKA_REVOKE_TIMEOUT_MS" => c.revoke_timeout = millis(name, value)?,
                "KAFKA_PRODUCE_TIMEOUT_MS" => c.produce_timeout = millis(name, value)?,
                "KAFKA_COORDINATOR_TIMEOUT_MS" => c.coordinator_timeout = millis(name, value)?,
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
}

fn millis(name: &str, value: &str) -> Result<Duration, Error> {
    value
        .parse::<u64>()
        .map(Duration::from_millis)
        .map_err(|_| Error::config(name, "must be a whole number of milliseconds"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn environment_maps_to_fields() {
        let c = KafkaConfig::from_vars([
            ("KAFKA_BROKERS", "127.0.0.1:9092"),
            ("KAFKA_GROUP_ID", "invoices"),
            ("KAFKA_TOPICS", "orders, payments"),
            ("KAFKA_ORDER", "key"),
            ("KAFKA_RETRY_MODE", "blocking"),
            ("KAFKA_OFFSET_MESSAGE_IDS", "true"),
            ("KAFKA_INSTANCE_ID", "invoices-0"),
            ("KAFKA_PROPERTY_SECURITY_PROTOCOL", "SASL_PLAINTEXT"),
            ("KAFKA_PROPERTY_SASL_PASSWORD", "pw"),
            ("KAFKA_CONSUMER_PROPERTY_SESSION_TIMEOUT_MS", "6000"),
            ("KAFKA_COORDINATOR_TIMEOUT_MS", "20000"),
            ("KAFKA_UNRELATED", "ignored"),
            ("PATH", "/bin"),
        ])
        .unwrap();
        assert_eq!(c.topics, vec!["orders", "payments"]);
        assert_eq!(c.coordinator_timeout, std::time::Duration::from_secs(20));
        assert_eq!(c.order, ProcessingOrder::Key);
        assert_eq!(c.retry, RetryMode::Blocking);
        assert!(c.offset_message_ids);
        assert_eq!(c.instance_id.as_deref(), Some("invoices-0"));
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
