//! [`KafkaConfig::validate`]: every field checked before a client is created, the error
//! naming the first bad one, with credentials redacted from librdkafka's reasons.

use rdkafka::config::ClientConfig;
use rdkafka::error::KafkaError;

use super::properties::ClientProperties;
use super::KafkaConfig;
use crate::Error;

/// Longest Kafka topic name.
const MAX_TOPIC_LEN: usize = 249;

/// Properties the transport sets itself; passing them through would break its guarantees.
const RESERVED: &[(&str, &str)] = &[
    ("bootstrap.servers", "set `brokers` instead"),
    ("metadata.broker.list", "set `brokers` instead"),
    ("group.id", "set `group_id` instead"),
    ("group.instance.id", "set `instance_id` instead"),
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

impl KafkaConfig {
    /// Checks every field; the first bad one is reported by name. Client properties are
    /// checked by librdkafka itself, one at a time, with sensitive values redacted from the
    /// reason.
    pub fn validate(&self) -> Result<(), Error> {
        validate_brokers(&self.brokers)?;
        validate_group(&self.group_id)?;
        if let Some(id) = &self.instance_id {
            validate_instance_id(id)?;
        }
        if self.topics.is_empty() {
            return Err(Error::config(
                "kafka.topics",
                "at least one topic is required",
            ));
        }
        for t in &self.topics {
            validate_topic("kafka.topics", t)?;
            if t.ends_with(&self.retry_topic_suffix) || t.ends_with(&self.dead_letter_topic_suffix)
            {
                return Err(Error::config(
                    "kafka.topics",
                    format!("{t:?} is a retry or dead-letter topic; list the original topic"),
                ));
            }
            validate_topic("kafka.retry_topic_suffix", &self.retry_topic(t))?;
            validate_topic("kafka.dead_letter_topic_suffix", &self.dead_letter_topic(t))?;
        }
        if self.retry_topic_suffix.is_empty() {
            return Err(Error::config(
                "kafka.retry_topic_suffix",
                "must not be empty",
            ));
        }
        if self.dead_letter_topic_suffix.is_empty() {
            return Err(Error::config(
                "kafka.dead_letter_topic_suffix",
                "must not be empty",
            ));
        }
        if self.retry_topic_suffix == self.dead_letter_topic_suffix {
            return Err(Error::config(
                "kafka.dead_letter_topic_suffix",
                "must differ from retry_topic_suffix",
            ));
        }
        if self.message_id_header.trim().is_empty() {
            return Err(Error::config(
                "kafka.message_id_header",
                "must not be empty",
            ));
        }
        if self.commit_interval.is_zero() {
            return Err(Error::config(
                "kafka.commit_interval",
                "must be greater than zero",
            ));
        }
        if self.revoke_timeout.is_zero() {
            return Err(Error::config(
                "kafka.revoke_timeout",
                "must be greater than zero",
            ));
        }
        // The revoke callback runs inside the poll: waiting there longer than
        // `max.poll.interval.ms` makes librdkafka leave the group, and it holds up the
        // whole group's rebalance meanwhile.
        let max_poll = [
            ("kafka.consumer_properties", &self.consumer_properties),
            ("kafka.properties", &self.properties),
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
                    "kafka.revoke_timeout",
                    format!(
                        "must be less than half of max.poll.interval.ms ({max_poll_ms} ms, \
                         from {field}): the revoke wait runs inside the poll"
                    ),
                ));
            }
        }
        if self.produce_timeout.is_zero() {
            return Err(Error::config(
                "kafka.produce_timeout",
                "must be greater than zero",
            ));
        }
        if self.coordinator_timeout.is_zero() {
            return Err(Error::config(
                "kafka.coordinator_timeout",
                "must be greater than zero",
            ));
        }
        if self.max_buffered_per_partition == 0 {
            return Err(Error::config(
                "kafka.max_buffered_per_partition",
                "must be at least 1",
            ));
        }
        if self.max_buffered_bytes_per_partition == 0 {
            return Err(Error::config(
                "kafka.max_buffered_bytes_per_partition",
                "must be at least 1",
            ));
        }
        for (field, props) in [
            ("kafka.properties", &self.properties),
            ("kafka.consumer_properties", &self.consumer_properties),
            ("kafka.producer_properties", &self.producer_properties),
        ] {
            validate_properties(field, props)?;
        }
        Ok(())
    }
}

pub(crate) fn validate_brokers(brokers: &str) -> Result<(), Error> {
    if brokers.trim().is_empty() {
        return Err(Error::config(
            "kafka.brokers",
            "at least one host:port is required",
        ));
    }
    for b in brokers.split(',').map(str::trim) {
        // librdkafka takes credentials only as properties; an entry with user info is a
        // credential pasted in the wrong place, and is never quoted back.
        if b.contains('@') {
            return Err(Error::config(
                "kafka.brokers",
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
                "kafka.brokers",
                format!("{b:?} is not host:port (comma-separate several brokers)"),
            ));
        }
    }
    Ok(())
}

fn validate_group(group: &str) -> Result<(), Error> {
    if group.trim().is_empty() {
        return Err(Error::config("kafka.group_id", "must not be empty"));
    }
    if group.len() > 255 || group.chars().any(char::is_control) {
        return Err(Error::config(
            "kafka.group_id",
            "must be at most 255 characters without control characters",
        ));
    }
    Ok(())
}

/// A static member's name: a stable, printable name, like a group's.
fn validate_instance_id(id: &str) -> Result<(), Error> {
    if id.trim().is_empty() || id.trim() != id {
        return Err(Error::config(
            "kafka.instance_id",
            "must not be empty nor start or end with whitespace",
        ));
    }
    if id.len() > 249 || id.chars().any(char::is_control) {
        return Err(Error::config(
            "kafka.instance_id",
            "must be at most 249 characters without control characters",
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
    use std::time::Duration;

    use super::*;
    use crate::config::tests::valid;

    fn field_of(c: &KafkaConfig) -> String {
        match c.validate() {
            Err(Error::Config { field, .. }) => field,
            other => panic!("expected a config error, got {other:?}"),
        }
    }

    #[test]
    fn a_zero_coordinator_timeout_is_refused() {
        let mut c = valid();
        c.coordinator_timeout = Duration::ZERO;
        assert_eq!(field_of(&c), "kafka.coordinator_timeout");
    }

    #[test]
    fn revoke_timeout_stays_under_half_the_poll_interval() {
        let mut c = valid();
        c.consumer_properties.set("max.poll.interval.ms", "7000");
        assert_eq!(field_of(&c), "kafka.revoke_timeout");
        c.revoke_timeout = Duration::from_millis(3000);
        c.validate().unwrap();
        let mut c = valid();
        c.properties.set("max.poll.interval.ms", "6000");
        assert_eq!(field_of(&c), "kafka.revoke_timeout");
    }

    #[test]
    fn bad_values_name_their_field() {
        let mut c = valid();
        c.brokers = "localhost".into();
        assert_eq!(field_of(&c), "kafka.brokers");
        let mut c = valid();
        c.topics = vec!["bad topic".into()];
        assert_eq!(field_of(&c), "kafka.topics");
        let mut c = valid();
        c.topics = vec![];
        assert_eq!(field_of(&c), "kafka.topics");
        let mut c = valid();
        c.topics = vec!["orders.dlq".into()];
        assert_eq!(field_of(&c), "kafka.topics");
        let mut c = valid();
        c.group_id = " ".into();
        assert_eq!(field_of(&c), "kafka.group_id");
        let mut c = valid();
        c.instance_id = Some(" worker-1".into());
        assert_eq!(field_of(&c), "kafka.instance_id");
        let mut c = valid();
        c.consumer_properties.set("group.instance.id", "worker-1");
        assert_eq!(field_of(&c), "kafka.consumer_properties.group.instance.id");
        let mut c = valid();
        c.message_id_header = String::new();
        assert_eq!(field_of(&c), "kafka.message_id_header");
        let mut c = valid();
        c.max_buffered_per_partition = 0;
        assert_eq!(field_of(&c), "kafka.max_buffered_per_partition");
        let mut c = valid();
        c.max_buffered_bytes_per_partition = 0;
        assert_eq!(field_of(&c), "kafka.max_buffered_bytes_per_partition");
        let mut c = valid();
        c.properties.set("no.such.property", "1");
        assert_eq!(field_of(&c), "kafka.properties.no.such.property");
        let mut c = valid();
        c.consumer_properties.set("enable.auto.commit", "true");
        assert_eq!(field_of(&c), "kafka.consumer_properties.enable.auto.commit");
        let mut c = valid();
        c.producer_properties.set("enable.idempotence", "false");
        assert_eq!(field_of(&c), "kafka.producer_properties.enable.idempotence");
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
                assert!(text.contains("kafka.brokers"), "{text}");
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
}
