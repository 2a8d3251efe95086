//! Configuration: the broker URL, the queue and its topology, prefetch, retries, reconnection.

use std::fmt;
use std::str::FromStr;
use std::time::Duration;

use crate::Error;

/// The longest queue name accepted. AMQP allows 255 bytes; the retry and dead-letter queues
/// derive their names by appending a suffix (`.retry.<ms>`, `.dlq`), which needs room.
pub const MAX_QUEUE_NAME_LEN: usize = 200;

/// The longest value of `x-message-ttl` RabbitMQ accepts (2³² − 1 ms, about 49 days).
const MAX_TTL_MS: u128 = u32::MAX as u128;

/// A broker URL that can only be displayed without its credentials.
///
/// `Display` and `Debug` print `amqp://***@host:5672/vhost?query`: the user name and
/// password are replaced, whatever they contain. Every log line and error of this crate
/// shows URLs through this type.
#[derive(Clone, PartialEq, Eq)]
pub struct RedactedUrl(String);

impl RedactedUrl {
    /// Wraps `url`; it is only ever shown redacted.
    pub fn new(url: impl Into<String>) -> Self {
        RedactedUrl(url.into())
    }

    /// The URL with its credentials, for connecting. Never log it.
    pub fn expose(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for RedactedUrl {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&redact(&self.0))
    }
}

impl fmt::Debug for RedactedUrl {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "RedactedUrl({:?})", redact(&self.0))
    }
}

/// `scheme://user:pass@host/...` → `scheme://***@host/...`. Anything that does not look
/// like a URL with an authority is hidden entirely rather than guessed at.
///
/// The user info ends at the *last* `@` of the URL. RFC 3986 lets the user info hold `/`,
/// `?`, `#` and `@` only percent-escaped, but passwords are often pasted raw: taking the
/// host part to end at the first `/`, `?` or `#` would print the tail of such a password.
/// An `@` in the path or query (rare in broker and database URLs) then hides everything up
/// to it too: the redaction may hide more than the credentials, never less.
fn redact(url: &str) -> String {
    let Some((scheme, rest)) = url.split_once("://") else {
        return "<redacted url>".to_owned();
    };
    if scheme.is_empty()
        || !scheme
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '+' | '-' | '.'))
    {
        return "<redacted url>".to_owned();
    }
    match rest.rfind('@') {
        Some(at) => format!("{scheme}://***@{}", &rest[at + 1..]),
        None => format!("{scheme}://{rest}"),
    }
}

/// The queue type, chosen by the user: RabbitMQ cannot change it on an existing queue.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum QueueType {
    /// A classic queue (the default): one node, lowest latency.
    #[default]
    Classic,
    /// A quorum queue: replicated (Raft), the recommended type for durable work queues on a
    /// cluster. (The retry queues are quorum queues with either choice; see the crate docs.)
    Quorum,
}

impl QueueType {
    /// `classic` or `quorum`, as in `x-queue-type`.
    pub fn as_str(self) -> &'static str {
        match self {
            QueueType::Classic => "classic",
            QueueType::Quorum => "quorum",
        }
    }
}

impl FromStr for QueueType {
    type Err = Error;

    fn from_str(s: &str) -> Result<Self, Error> {
        match s.trim().to_ascii_lowercase().as_str() {
            "classic" => Ok(QueueType::Classic),
            "quorum" => Ok(QueueType::Quorum),
            other => Err(Error::config(
                "amqp.queue_type",
                format!("{other:?} is not a queue type: use `classic` or `quorum`"),
            )),
        }
    }
}

/// The type of the exchange the queue is bound to, when one is configured.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ExchangeType {
    /// Routes on an exact routing key (the default).
    #[default]
    Direct,
    /// Routes every message to every bound queue.
    Fanout,
    /// Routes on routing key patterns (`*`, `#`).
    Topic,
}

impl ExchangeType {
    pub(crate) fn lapin(self) -> lapin::ExchangeKind {
        match self {
            ExchangeType::Direct => lapin::ExchangeKind::Direct,
            ExchangeType::Fanout => lapin::ExchangeKind::Fanout,
            ExchangeType::Topic => lapin::ExchangeKind::Topic,
        }
    }
}

impl FromStr for ExchangeType {
    type Err = Error;

    fn from_str(s: &str) -> Result<Self, Error> {
        match s.trim().to_ascii_lowercase().as_str() {
            "direct" => Ok(ExchangeType::Direct),
            "fanout" => Ok(ExchangeType::Fanout),
            "topic" => Ok(ExchangeType::Topic),
            other => Err(Error::config(
                "amqp.exchange_type",
                format!("{other:?} is not an exchange type: use `direct`, `fanout` or `topic`"),
            )),
        }
    }
}

/// Everything the consumer and the publisher need to know about the broker and the queue.
///
/// Build it with [`AmqpConfig::new`] and adjust the public fields; [`AmqpConfig::validate`]
/// (called by [`crate::AmqpConsumer::connect`] and [`crate::AmqpPublisher::connect`]) rejects
/// a bad value at startup, naming the field.
///
/// The topology declared from it (all durable, re-declared after every reconnect):
///
/// - the work queue `queue`, of type `queue_type`;
/// - `<queue>.retry.<ms>` for each of `retry_delays`: a quorum queue (whatever
///   `queue_type` is) with TTL `<ms>`, dead-lettering back to the work queue through the
///   default exchange, at least once;
/// - the dead-letter queue (`dead_letter_queue`, default `<queue>.dlq`);
/// - when `exchange` is set: that exchange (unless it is a predeclared `amq.*` one) and one
///   binding of the work queue per entry of `binding_keys` (default: the queue's name).
#[derive(Clone)]
pub struct AmqpConfig {
    /// `amqp://user:pass@host:5672/vhost` or `amqps://…`. Shown only redacted.
    pub url: RedactedUrl,
    /// The work queue.
    pub queue: String,
    /// Classic (default) or quorum; applies to the work and dead-letter queues (the retry
    /// queues are always quorum queues: see the crate docs).
    pub queue_type: QueueType,
    /// An exchange to bind the queue to; empty (the default) publishes through the default
    /// exchange, where the routing key is the queue's name.
    pub exchange: String,
    /// The exchange's type, when `exchange` is set (default direct).
    pub exchange_type: ExchangeType,
    /// Binding keys of the queue on `exchange` (default: the queue's name).
    pub binding_keys: Vec<String>,
    /// Deliveries the broker sends ahead of acks (`basic.qos`), at least 1 (default 32).
    /// Keep it at least the worker's concurrency, or workers sit idle.
    pub prefetch: u16,
    /// The consumer tag; empty (the default) lets the broker choose one.
    pub consumer_tag: String,
    /// The retry delays available as queues. A retry after `d` goes to the smallest delay
    /// `>= d` (the largest if none is): never earlier than asked, at most one bucket later.
    /// Default 1s, 5s, 15s, 60s, 300s.
    pub retry_delays: Vec<Duration>,
    /// The dead-letter queue; `None` (the default) means `<queue>.dlq`.
    pub dead_letter_queue: Option<String>,
    /// Longest wait for one connection attempt, handshake included (default 10s).
    pub connect_timeout: Duration,
    /// How long the first connection is retried (while the broker is still starting) before
    /// `connect` fails (default 30s). Authentication and declaration errors fail at once.
    pub startup_timeout: Duration,
    /// First delay between reconnection attempts, doubled up to `reconnect_max`
    /// (default 100ms).
    pub reconnect_min: Duration,
    /// Longest delay between reconnection attempts (default 5s).
    pub reconnect_max: Duration,
    /// How long [`crate::AmqpPublisher::publish`] keeps retrying over connection failures
    /// (default 30s).
    pub publish_timeout: Duration,
    /// Longest wait for the broker's confirm of one publish: a retry or dead-letter copy,
    /// or one try of [`crate::AmqpPublisher::publish`] (default 30s). A confirm that does
    /// not come in time is a transient publish error: the copy's original is returned to
    /// its queue and the connection replaced, as for a lost connection, since the copy may
    /// or may not have arrived (the inbox deduplicates either way).
    pub confirm_timeout: Duration,
    /// A connection name shown in the management UI; `None` uses `consumer-amqp`.
    pub connection_name: Option<String>,
}

impl fmt::Debug for AmqpConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("AmqpConfig")
            .field("url", &self.url)
            .field("queue", &self.queue)
            .field("queue_type", &self.queue_type)
            .field("exchange", &self.exchange)
            .field("exchange_type", &self.exchange_type)
            .field("binding_keys", &self.binding_keys)
            .field("prefetch", &self.prefetch)
            .field("consumer_tag", &self.consumer_tag)
            .field("retry_delays", &self.retry_delays)
            .field("dead_letter_queue", &self.dead_letter_queue)
            .field("connect_timeout", &self.connect_timeout)
            .field("startup_timeout", &self.startup_timeout)
            .field("reconnect_min", &self.reconnect_min)
            .field("reconnect_max", &self.reconnect_max)
            .field("publish_timeout", &self.publish_timeout)
            .field("confirm_timeout", &self.confirm_timeout)
            .field("connection_name", &self.connection_name)
            .finish()
    }
}

impl AmqpConfig {
    /// A configuration for `queue` on the broker at `url`, with the defaults documented on
    /// each field.
    pub fn new(url: impl Into<String>, queue: impl Into<String>) -> Self {
        AmqpConfig {
            url: RedactedUrl::new(url),
            queue: queue.into(),
            queue_type: QueueType::Classic,
            exchange: String::new(),
            exchange_type: ExchangeType::Direct,
            binding_keys: Vec::new(),
            prefetch: 32,
            consumer_tag: String::new(),
            retry_delays: [1, 5, 15, 60, 300]
                .into_iter()
                .map(Duration::from_secs)
                .collect(),
            dead_letter_queue: None,
            connect_timeout: Duration::from_secs(10),
            startup_timeout: Duration::from_secs(30),
            reconnect_min: Duration::from_millis(100),
            reconnect_max: Duration::from_secs(5),
            publish_timeout: Duration::from_secs(30),
            confirm_timeout: Duration::from_secs(30),
            connection_name: None,
        }
    }

    /// The dead-letter queue's name.
    pub fn dead_letter_queue_name(&self) -> String {
        self.dead_letter_queue
            .clone()
            .unwrap_or_else(|| format!("{}.dlq", self.queue))
    }

    /// The retry queue's name for a bucket of `delay`: `<queue>.retry.<ms>`.
    pub fn retry_queue_name(&self, delay: Duration) -> String {
        format!("{}.retry.{}", self.queue, delay.as_millis())
    }

    /// Checks every field; the error names the first bad one (`amqp.<field>`).
    pub fn validate(&self) -> Result<(), Error> {
        validate_url(self.url.expose())?;
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
            if ms == 0 || ms > MAX_TTL_MS || d.subsec_nanos() % 1_000_000 != 0 {
                return Err(Error::config(
                    "amqp.retry_delays",
                    format!("{d:?} must be a whole number of milliseconds between 1ms and {MAX_TTL_MS}ms"),
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

fn validate_url(url: &str) -> Result<(), Error> {
    const FIELD: &str = "amqp.url";
    const SHAPE: &str = "expected amqp://user:password@host:port/vhost or amqps://…";
    let scheme = url.split_once("://").map(|(s, _)| s);
    if !matches!(scheme, Some("amqp" | "amqps")) {
        return Err(Error::config(
            FIELD,
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
            FIELD,
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

    const URL: &str = "amqp://app:s3cret@rabbit.internal:5672/%2f";

    fn field_of(e: Error) -> &'static str {
        match e {
            Error::Config { field, .. } => field,
            other => panic!("not a config error: {other}"),
        }
    }

    #[test]
    fn redacts_credentials_in_every_shape() {
        let cases = [
            (URL, "amqp://***@rabbit.internal:5672/%2f"),
            ("amqps://u:p@h", "amqps://***@h"),
            (
                "amqp://user@h:1/v?heartbeat=5",
                "amqp://***@h:1/v?heartbeat=5",
            ),
            // A raw '@' in the password: everything up to the last '@' is hidden.
            ("amqp://u:p@ss@h/v", "amqp://***@h/v"),
            ("amqp://u:p%40ss@h/v", "amqp://***@h/v"),
            ("amqp://h:5672/%2f", "amqp://h:5672/%2f"),
            ("not a url u:p@h", "<redacted url>"),
            ("://u:p@h", "<redacted url>"),
        ];
        for (url, shown) in cases {
            let r = RedactedUrl::new(url);
            assert_eq!(r.to_string(), shown, "{url}");
            assert!(!format!("{r:?}").contains("s3cret"));
        }
        assert_eq!(RedactedUrl::new(URL).expose(), URL);
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
    fn debug_of_config_hides_the_password() {
        let c = AmqpConfig::new(URL, "orders");
        let shown = format!("{c:?}");
        assert!(!shown.contains("s3cret"), "{shown}");
        assert!(!shown.contains("app:"), "{shown}");
        assert!(shown.contains("rabbit.internal"), "{shown}");
    }

    #[test]
    fn defaults_are_valid() {
        let c = AmqpConfig::new(URL, "orders");
        c.validate().unwrap();
        assert_eq!(c.dead_letter_queue_name(), "orders.dlq");
        assert_eq!(
            c.retry_queue_name(Duration::from_secs(5)),
            "orders.retry.5000"
        );
    }

    #[test]
    fn each_bad_field_is_named() {
        let base = || AmqpConfig::new(URL, "orders");
        let cases: Vec<(&str, AmqpConfig)> = vec![
            ("amqp.url", AmqpConfig::new("http://u:p@h/", "orders")),
            ("amqp.url", AmqpConfig::new("", "orders")),
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
