//! Validation of an [`AmqpConfig`]: every field checked at startup, the error naming it.

use std::time::Duration;

use super::{AmqpConfig, MAX_QUEUE_NAME_LEN};
use crate::redacted_url::RedactedUrl;
use crate::Error;

/// The longest retry delay accepted (2³² − 1 ms, about 49 days): a bound on nonsense, not
/// a limit of the mechanism (a copy due later than the longest hold waits again).
const MAX_DELAY_MS: u128 = u32::MAX as u128;

impl AmqpConfig {
    /// Checks every field; the error names the first bad one (`amqp.<field>`).
    pub fn validate(&self) -> Result<(), Error> {
        validate_url("amqp.url", self.url.expose())?;
        for (i, url) in self.failover_urls.iter().enumerate() {
            validate_url("amqp.failover_urls", url.expose())?;
            if self.addresses().take(i + 1).any(|earlier| earlier == url) {
                return Err(Error::config(
                    "amqp.failover_urls",
                    format!("{url} is listed twice"),
                ));
            }
        }
        validate_queue_name("amqp.queue", &self.queue)?;
        if let Some(dlq) = &self.dead_letter_queue {
            validate_queue_name("amqp.dead_letter_queue", dlq)?;
            if dlq == &self.queue {
                return Err(Error::config(
                    "amqp.dead_letter_queue",
                    "must differ from the work queue",
                ));
            }
        }
        if !self.exchange.is_empty() {
            validate_name("amqp.exchange", &self.exchange, 255)?;
        } else if !self.binding_keys.is_empty() {
            return Err(Error::config(
                "amqp.binding_keys",
                "binding keys need an exchange (`amqp.exchange` is empty: the default exchange routes by queue name)",
            ));
        }
        for key in &self.binding_keys {
            if key.len() > 255 || key.chars().any(char::is_control) {
                return Err(Error::config(
                    "amqp.binding_keys",
                    format!("{key:?} must be at most 255 bytes without control characters"),
                ));
            }
        }
        if self.prefetch == 0 {
            return Err(Error::config(
                "amqp.prefetch",
                "must be at least 1 (0 would let the broker push the whole queue into memory)",
            ));
        }
        if self.consumer_tag.len() > 255 || self.consumer_tag.chars().any(char::is_control) {
            return Err(Error::config(
                "amqp.consumer_tag",
                "must be at most 255 bytes without control characters",
            ));
        }
        if self.retry_delays.is_empty() {
            return Err(Error::config(
                "amqp.retry_delays",
                "needs at least one delay (retries would have nowhere to wait)",
            ));
        }
        let mut seen = Vec::new();
        for d in &self.retry_delays {
            let ms = d.as_millis();
            if ms == 0 || ms > MAX_DELAY_MS || d.subsec_nanos() % 1_000_000 != 0 {
                return Err(Error::config(
                    "amqp.retry_delays",
                    format!("{d:?} must be a whole number of milliseconds between 1ms and {MAX_DELAY_MS}ms"),
                ));
            }
            if seen.contains(&ms) {
                return Err(Error::config(
                    "amqp.retry_delays",
                    format!("{d:?} is listed twice"),
                ));
            }
            seen.push(ms);
        }
        positive("amqp.connect_timeout", self.connect_timeout)?;
        positive("amqp.reconnect_min", self.reconnect_min)?;
        positive("amqp.publish_timeout", self.publish_timeout)?;
        positive("amqp.confirm_timeout", self.confirm_timeout)?;
        positive("amqp.broker_consumer_timeout", self.broker_consumer_timeout)?;
        if self.reconnect_max < self.reconnect_min {
            return Err(Error::config(
                "amqp.reconnect_max",
                format!(
                    "{:?} is smaller than reconnect_min {:?}",
                    self.reconnect_max, self.reconnect_min
                ),
            ));
        }
        if let Some(name) = &self.connection_name {
            if name.len() > 255 || name.chars().any(char::is_control) {
                return Err(Error::config(
                    "amqp.connection_name",
                    "must be at most 255 bytes without control characters",
                ));
            }
        }
        Ok(())
    }
}

fn positive(field: &'static str, d: Duration) -> Result<(), Error> {
    if d.is_zero() {
        return Err(Error::config(field, "must be greater than zero"));
    }
    Ok(())
}

fn validate_url(field: &'static str, url: &str) -> Result<(), Error> {
    const SHAPE: &str = "expected amqp://user:password@host:port/vhost or amqps://…";
    let scheme = url.split_once("://").map(|(s, _)| s);
    if !matches!(scheme, Some("amqp" | "amqps")) {
        return Err(Error::config(
            field,
            format!("{} is not an AMQP URL: {SHAPE}", RedactedUrl::new(url)),
        ));
    }
    if let Err(e) = url.parse::<lapin::uri::AMQPUri>() {
        // The parser's message may quote any part of the URL (a port that is really the
        // start of a password holding a raw `/`, say): it is shown only for a URL without
        // user info, and never when it quotes an `@`.
        let detail = if url.contains('@') || e.contains('@') {
            String::new()
        } else {
            format!(" ({e})")
        };
        return Err(Error::config(
            field,
            format!(
                "{} is not a valid AMQP URL{detail}: {SHAPE}",
                RedactedUrl::new(url)
            ),
        ));
    }
    Ok(())
}

/// Queue names: `[A-Za-z0-9_.:-]`, not starting with the reserved `amq.` prefix.
fn validate_queue_name(field: &'static str, name: &str) -> Result<(), Error> {
    validate_name(field, name, MAX_QUEUE_NAME_LEN)?;
    if name.starts_with("amq.") {
        return Err(Error::config(
            field,
            format!("{name:?} starts with `amq.`, which RabbitMQ reserves"),
        ));
    }
    Ok(())
}

fn validate_name(field: &'static str, name: &str, max: usize) -> Result<(), Error> {
    if name.is_empty()
        || !name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '_' | '.' | ':' | '-'))
    {
        return Err(Error::config(
            field,
            format!("{name:?} must be non-empty ASCII letters, digits, `_`, `.`, `:` or `-`"),
        ));
    }
    if name.len() > max {
        return Err(Error::config(
            field,
            format!("{name:?} is longer than {max} bytes"),
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::{ExchangeType, QueueType};

    const URL: &str = "amqp://app:s3cret@rabbit.internal:5672/%2f";

    fn field_of(e: Error) -> &'static str {
        match e {
            Error::Config { field, .. } => field,
            other => panic!("not a config error: {other}"),
        }
    }

    /// Passwords with the characters that end a URL's parts (`/ ? # @ :`), raw or
    /// percent-escaped, for AMQP and PostgreSQL URLs.
    #[test]
    fn credentials_never_appear_in_url_errors_or_display() {
        let passwords = [
            "s3c/ret",
            "s3c?ret",
            "s3c#ret",
            "s3c@ret",
            "s3c:ret",
            "s3c/r?e#t@x:y",
            "s3c%2Fret",
            "s3c%40ret",
            "s3c%23r%3Fet",
        ];
        for password in passwords {
            for (url, host) in [
                (
                    format!("amqp://app:{password}@rabbit:5672/%2f"),
                    "rabbit:5672/%2f",
                ),
                (
                    format!("amqps://app:{password}@rabbit/v?heartbeat=5"),
                    "rabbit/v?heartbeat=5",
                ),
                (
                    format!("postgres://app:{password}@db:5432/orders"),
                    "db:5432/orders",
                ),
                (
                    format!("postgresql://app:{password}@db/orders?sslmode=require"),
                    "db/orders?sslmode=require",
                ),
            ] {
                let r = RedactedUrl::new(url.as_str());
                let (shown, debug) = (r.to_string(), format!("{r:?}"));
                for text in [&shown, &debug] {
                    assert!(
                        !text.contains("s3c") && !text.contains("ret") && !text.contains("app"),
                        "{url} shown as {text}"
                    );
                }
                assert!(
                    shown.ends_with(&format!("***@{host}")),
                    "{url} shown as {shown}"
                );
                assert_eq!(r.expose(), url);
                if url.starts_with("amqp") {
                    // Valid or not, an AMQP URL's error names the field and only the
                    // redacted URL.
                    let errors = [
                        AmqpConfig::new(url.as_str(), "q").validate().err(),
                        AmqpConfig::new(url.replace(":5672", ":99999"), "q")
                            .validate()
                            .err(),
                        AmqpConfig::new(url.replace("amqp", "http"), "q")
                            .validate()
                            .err(),
                    ];
                    for e in errors.into_iter().flatten() {
                        let text = format!("{e} {e:?}");
                        assert!(text.contains("amqp.url"), "{text}");
                        assert!(
                            !text.contains("s3c") && !text.contains("ret") && !text.contains("app"),
                            "{url}: {text}"
                        );
                    }
                }
            }
        }
    }

    #[test]
    fn each_bad_field_is_named() {
        let base = || AmqpConfig::new(URL, "orders");
        let cases: Vec<(&str, AmqpConfig)> = vec![
            ("amqp.url", AmqpConfig::new("http://u:p@h/", "orders")),
            ("amqp.url", AmqpConfig::new("", "orders")),
            (
                "amqp.failover_urls",
                AmqpConfig::with_addresses(&format!("{URL},http://u:p@h/"), "orders"),
            ),
            (
                "amqp.failover_urls",
                AmqpConfig::with_addresses(&format!("{URL},"), "orders"),
            ),
            (
                "amqp.failover_urls",
                AmqpConfig::with_addresses(&format!("{URL},{URL}"), "orders"),
            ),
            (
                "amqp.url",
                AmqpConfig::new("amqp://u:p@h:notaport/", "orders"),
            ),
            ("amqp.queue", AmqpConfig::new(URL, "")),
            ("amqp.queue", AmqpConfig::new(URL, "has space")),
            ("amqp.queue", AmqpConfig::new(URL, "amq.reserved")),
            ("amqp.queue", AmqpConfig::new(URL, "q".repeat(201))),
            (
                "amqp.prefetch",
                AmqpConfig {
                    prefetch: 0,
                    ..base()
                },
            ),
            (
                "amqp.dead_letter_queue",
                AmqpConfig {
                    dead_letter_queue: Some("orders".into()),
                    ..base()
                },
            ),
            (
                "amqp.dead_letter_queue",
                AmqpConfig {
                    dead_letter_queue: Some("bad/name".into()),
                    ..base()
                },
            ),
            (
                "amqp.exchange",
                AmqpConfig {
                    exchange: "x y".into(),
                    ..base()
                },
            ),
            (
                "amqp.binding_keys",
                AmqpConfig {
                    binding_keys: vec!["k".into()],
                    ..base()
                },
            ),
            (
                "amqp.consumer_tag",
                AmqpConfig {
                    consumer_tag: "t\n".into(),
                    ..base()
                },
            ),
            (
                "amqp.retry_delays",
                AmqpConfig {
                    retry_delays: vec![],
                    ..base()
                },
            ),
            (
                "amqp.retry_delays",
                AmqpConfig {
                    retry_delays: vec![Duration::ZERO],
                    ..base()
                },
            ),
            (
                "amqp.retry_delays",
                AmqpConfig {
                    retry_delays: vec![Duration::from_micros(1500)],
                    ..base()
                },
            ),
            (
                "amqp.retry_delays",
                AmqpConfig {
                    retry_delays: vec![Duration::from_secs(1), Duration::from_millis(1000)],
                    ..base()
                },
            ),
            (
                "amqp.retry_delays",
                AmqpConfig {
                    retry_delays: vec![Duration::from_secs(60 * 24 * 3600)],
                    ..base()
                },
            ),
            (
                "amqp.reconnect_max",
                AmqpConfig {
                    reconnect_max: Duration::from_millis(1),
                    ..base()
                },
            ),
            (
                "amqp.connect_timeout",
                AmqpConfig {
                    connect_timeout: Duration::ZERO,
                    ..base()
                },
            ),
        ];
        for (field, config) in cases {
            let e = config.validate().unwrap_err();
            assert!(!e.to_string().contains("s3cret"), "{e}");
            assert_eq!(field_of(e), field, "{config:?}");
        }
    }

    #[test]
    fn url_errors_never_show_the_password() {
        for url in [
            "http://app:s3cret@h/",
            "amqp://app:s3cret@h:99999/",
            "amqp://app:s3cret@/",
            "amqp://app:s3cret@h/?heartbeat=x",
        ] {
            let e = AmqpConfig::new(url, "q").validate().unwrap_err();
            let text = e.to_string();
            assert!(text.contains("amqp.url"), "{text}");
            assert!(!text.contains("s3cret") && !text.contains("app"), "{text}");
        }
    }

    #[test]
    fn parses_queue_and_exchange_types() {
        assert_eq!("Quorum".parse::<QueueType>().unwrap(), QueueType::Quorum);
        assert_eq!("classic".parse::<QueueType>().unwrap(), QueueType::Classic);
        assert_eq!(
            field_of("stream".parse::<QueueType>().unwrap_err()),
            "amqp.queue_type"
        );
        assert_eq!(
            "fanout".parse::<ExchangeType>().unwrap(),
            ExchangeType::Fanout
        );
        assert_eq!(
            field_of("x".parse::<ExchangeType>().unwrap_err()),
            "amqp.exchange_type"
        );
    }

    #[test]
    fn core_error_keeps_the_field() {
        let e: consumer_core::Error = AmqpConfig {
            prefetch: 0,
            ..AmqpConfig::new(URL, "q")
        }
        .validate()
        .unwrap_err()
        .into();
        assert!(
            matches!(
                e,
                consumer_core::Error::Config {
                    field: "amqp.prefetch",
                    ..
                }
            ),
            "{e}"
        );
    }
}
