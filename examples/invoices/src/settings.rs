//! Settings from the environment.
//!
//! | variable | default | meaning |
//! | --- | --- | --- |
//! | `TRANSPORT` | `amqp` | the broker (see [`crate::transport`]) |
//! | `AMQP_URL` | required for `amqp` | e.g. `amqp://user:pass@localhost:5672/%2f`; several comma-separated (a cluster's nodes: `consumer_amqp::AmqpConfig::with_addresses`) |
//! | `AMQP_ORIGIN_SECRET` | unset | signs the origin of the retry and dead-letter copies (`consumer_amqp::OriginSecret`, at least 16 bytes, e.g. `openssl rand -hex 32`); the same for every worker and for `consumer dlq replay` |
//! | `KAFKA_BROKERS` | required for `kafka` | e.g. `127.0.0.1:9092` |
//! | `KAFKA_PARTITIONS` | `4` | partitions of the jobs topic when it is created (Kafka) |
//! | other `KAFKA_*` | | passed to `consumer_kafka::KafkaConfig::from_vars`, e.g. `KAFKA_CONSUMER_PROPERTY_MAX_POLL_INTERVAL_MS` |
//! | `DATABASE_URL` | required | PostgreSQL, e.g. `postgres://user:pass@localhost/db` |
//! | `DB_SCHEMA` | `public` | schema of the tables and the inbox |
//! | `INVOICE_QUEUE` | `invoices` | the queue `send_invoice` consumes jobs from (Kafka: its consumer group) |
//! | `EMAIL_QUEUE` | `emails` | the queue `send_email` consumes events from (Kafka: its consumer group) |
//! | `EXCHANGE` | `invoice_jobs` | fanout exchange the jobs are published to (Kafka: the topic) |
//! | `EVENTS` | `invoice_ready` | fanout exchange the relay publishes the `invoice_ready` events to (Kafka: the topic) |
//! | `QUEUE_TYPE` | `classic` | `classic` or `quorum` |
//! | `CONCURRENCY` | `8` | deliveries processed at once |
//! | `PREFETCH` | `32` | deliveries the broker sends ahead |
//! | `WORK_MS` | `0` | simulated work per job, in milliseconds |
//! | `SLOW_JOB_MS` | `0` | extra sleep on slow jobs (order ids ending in 37), chaos suite |
//! | `BATCH_SIZE` | `0` (off) | batched mode: up to this many deliveries per transaction (`consumer_core::BatchConfig`) |
//! | `BATCH_WAIT_MS` | `5` | batched mode: how long to wait for more deliveries after the first |
//! | `METRICS_ADDR` | unset (off) | serve `/metrics` (Prometheus), `/healthz` and `/readyz` on this address, e.g. `0.0.0.0:9100` ([`crate::ops`]) |
//! | `INBOX_GAUGE_MS` | `30000` | how often the inbox gauges are read (`consumer_core::WorkerConfig::inbox_gauge_interval`; `0`: never) |
//! | `STATS_INTERVAL_MS` | `0` (off) | write this process's counters to `worker_stats` this often and at shutdown |
//! | `CONSUMER_FAULTS`, `CONSUMER_FAULT_SEED` | unset (off) | fault points that abort the process (`consumer_core::fault`), chaos suite |
//! | `CONSUMER_BROKEN_ACK_BEFORE_COMMIT` | unset | **test-only, never in production**: `1` acks every delivery before its handler runs, to prove the chaos suite can fail |

use std::time::Duration;

use anyhow::{bail, Context as _};
use consumer_amqp::{OriginSecret, QueueType, RedactedUrl, ORIGIN_SECRET_VAR};
use consumer_core::BatchConfig;

use crate::transport::TransportKind;

/// A worker's or publisher's settings.
#[derive(Debug, Clone)]
pub struct Settings {
    /// Which broker.
    pub transport: TransportKind,
    /// The RabbitMQ URL (shown redacted).
    pub amqp_url: Option<RedactedUrl>,
    /// Signs the origin of the RabbitMQ copies (never shown).
    pub amqp_origin_secret: Option<OriginSecret>,
    /// The Kafka bootstrap brokers.
    pub kafka_brokers: Option<String>,
    /// Partitions of the jobs topic, when it is created (Kafka).
    pub kafka_partitions: i32,
    /// The PostgreSQL URL (shown redacted).
    pub database_url: RedactedUrl,
    /// Schema of the tables and the inbox.
    pub schema: String,
    /// The queue of the invoice jobs (Kafka: the invoice handler's group).
    pub invoice_queue: String,
    /// The queue of the `invoice_ready` events (Kafka: the email handler's group).
    pub email_queue: String,
    /// The exchange jobs are published to (Kafka: the jobs topic).
    pub exchange: String,
    /// The exchange the relay publishes the events to (Kafka: the events topic).
    pub events: String,
    /// Classic or quorum queues.
    pub queue_type: QueueType,
    /// Deliveries processed at once.
    pub concurrency: usize,
    /// Deliveries the broker sends ahead.
    pub prefetch: u16,
    /// Simulated work per job.
    pub work: Duration,
    /// Extra sleep on slow jobs (0: off).
    pub slow_job: Duration,
    /// Batched mode (`None`: one transaction per delivery).
    pub batch: Option<BatchConfig>,
    /// Where to serve the metrics and health endpoints (`None`: nowhere).
    pub metrics_addr: Option<std::net::SocketAddr>,
    /// How often the inbox gauges are read (`None`: never).
    pub inbox_gauge_interval: Option<Duration>,
    /// How often to write this process's counters to `worker_stats` (`None`: never).
    pub stats_interval: Option<Duration>,
    /// DELIBERATELY BROKEN, test-only: ack before the handler runs. Never in production.
    pub broken_ack_before_commit: bool,
}

impl Settings {
    /// Reads the process environment.
    pub fn from_env() -> anyhow::Result<Self> {
        Self::from_lookup(|name| std::env::var(name).ok())
    }

    /// Reads settings through `lookup` (the environment, or a map in tests).
    pub fn from_lookup(lookup: impl Fn(&str) -> Option<String>) -> anyhow::Result<Self> {
        let get = |name: &str| lookup(name).filter(|v| !v.trim().is_empty());
        let transport: TransportKind = get("TRANSPORT").as_deref().unwrap_or("amqp").parse()?;
        let amqp_url = get("AMQP_URL").map(RedactedUrl::new);
        if transport == TransportKind::Amqp && amqp_url.is_none() {
            bail!("AMQP_URL is not set (e.g. `eval \"$(scripts/rabbitmq.sh env)\"`)");
        }
        let amqp_origin_secret = get(ORIGIN_SECRET_VAR)
            .map(OriginSecret::new)
            .transpose()
            .with_context(|| format!("{ORIGIN_SECRET_VAR} is not a usable secret"))?;
        let kafka_brokers = get("KAFKA_BROKERS");
        if transport == TransportKind::Kafka && kafka_brokers.is_none() {
            bail!("KAFKA_BROKERS is not set (e.g. `eval \"$(scripts/kafka.sh env)\"`)");
        }
        let database_url = get("DATABASE_URL")
            .map(RedactedUrl::new)
            .context("DATABASE_URL is not set (e.g. `eval \"$(scripts/postgres.sh env)\"`)")?;
        let number = |name: &str, default: u64| -> anyhow::Result<u64> {
            match get(name) {
                None => Ok(default),
                Some(v) => v
                    .trim()
                    .parse()
                    .with_context(|| format!("{name}={v:?} is not a whole number")),
            }
        };
        let concurrency = number("CONCURRENCY", 8)?;
        if concurrency == 0 {
            bail!("CONCURRENCY must be at least 1");
        }
        let prefetch =
            u16::try_from(number("PREFETCH", 32)?).context("PREFETCH must be at most 65535")?;
        let queue_type: QueueType = get("QUEUE_TYPE").as_deref().unwrap_or("classic").parse()?;
        let kafka_partitions = i32::try_from(number("KAFKA_PARTITIONS", 4)?)
            .ok()
            .filter(|p| *p > 0)
            .context("KAFKA_PARTITIONS must be between 1 and 2^31-1")?;
        let batch = match number("BATCH_SIZE", 0)? {
            0 => None,
            n => Some(BatchConfig::new(
                usize::try_from(n).context("BATCH_SIZE is too large")?,
                Duration::from_millis(number("BATCH_WAIT_MS", 5)?),
            )),
        };
        let metrics_addr = get("METRICS_ADDR")
            .map(|v| {
                v.trim().parse().with_context(|| {
                    format!("METRICS_ADDR={v:?} is not an address and port, e.g. 0.0.0.0:9100")
                })
            })
            .transpose()?;
        Ok(Settings {
            transport,
            amqp_url,
            amqp_origin_secret,
            kafka_brokers,
            kafka_partitions,
            database_url,
            schema: get("DB_SCHEMA").unwrap_or_else(|| "public".to_owned()),
            invoice_queue: get("INVOICE_QUEUE").unwrap_or_else(|| "invoices".to_owned()),
            email_queue: get("EMAIL_QUEUE").unwrap_or_else(|| "emails".to_owned()),
            exchange: get("EXCHANGE").unwrap_or_else(|| "invoice_jobs".to_owned()),
            events: get("EVENTS").unwrap_or_else(|| "invoice_ready".to_owned()),
            queue_type,
            concurrency: usize::try_from(concurrency).context("CONCURRENCY is too large")?,
            prefetch,
            work: Duration::from_millis(number("WORK_MS", 0)?),
            slow_job: Duration::from_millis(number("SLOW_JOB_MS", 0)?),
            batch,
            metrics_addr,
            inbox_gauge_interval: Some(number("INBOX_GAUGE_MS", 30_000)?)
                .filter(|ms| *ms > 0)
                .map(Duration::from_millis),
            stats_interval: Some(number("STATS_INTERVAL_MS", 0)?)
                .filter(|ms| *ms > 0)
                .map(Duration::from_millis),
            broken_ack_before_commit: match get("CONSUMER_BROKEN_ACK_BEFORE_COMMIT").as_deref() {
                None | Some("0") => false,
                Some("1") => true,
                Some(other) => bail!("CONSUMER_BROKEN_ACK_BEFORE_COMMIT={other:?}: use 0 or 1"),
            },
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn settings(vars: &[(&str, &str)]) -> anyhow::Result<Settings> {
        let map: HashMap<String, String> = vars
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect();
        Settings::from_lookup(|k| map.get(k).cloned())
    }

    const BASE: [(&str, &str); 2] = [
        ("AMQP_URL", "amqp://u:hunter2@h/%2f"),
        ("DATABASE_URL", "postgres://u:hunter2@h/db"),
    ];

    #[test]
    fn defaults_and_overrides() {
        let s = settings(&BASE).unwrap();
        assert_eq!(
            (
                s.invoice_queue.as_str(),
                s.email_queue.as_str(),
                s.events.as_str(),
                s.concurrency,
                s.prefetch
            ),
            ("invoices", "emails", "invoice_ready", 8, 32)
        );
        assert!(!format!("{s:?}").contains("hunter2"));
        assert!(s.amqp_origin_secret.is_none());
        let s = settings(&[
            BASE[0],
            BASE[1],
            ("EMAIL_QUEUE", "q"),
            ("EVENTS", "e"),
            ("CONCURRENCY", "3"),
            ("AMQP_ORIGIN_SECRET", "origin-hunter3-0123456789"),
        ])
        .unwrap();
        assert!(s.amqp_origin_secret.is_some());
        assert!(!format!("{s:?}").contains("hunter3"));
        let short = settings(&[BASE[0], BASE[1], ("AMQP_ORIGIN_SECRET", "hunter4")]);
        let shown = format!("{:#}", short.unwrap_err());
        assert!(shown.contains("AMQP_ORIGIN_SECRET") && !shown.contains("hunter4"));
        assert_eq!(
            (s.email_queue.as_str(), s.events.as_str(), s.concurrency),
            ("q", "e", 3)
        );
    }

    /// Passwords with the characters that end a URL's parts, raw and percent-escaped:
    /// the settings' `Debug` and the database connection's errors show neither.
    #[test]
    fn credentials_never_appear_in_url_errors_or_display() {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        for password in ["s3c/ret", "s3c?r#et", "s3c@ret:x", "s3c%2Fr%40et"] {
            let amqp = format!("amqp://svcuser:{password}@rabbit/%2f");
            let db = format!("postgres://svcuser:{password}@127.0.0.1:1/orders");
            let s = settings(&[("AMQP_URL", &amqp), ("DATABASE_URL", &db)]).unwrap();
            let shown = format!("{s:?}");
            assert!(
                !shown.contains("s3c") && !shown.contains("svcuser"),
                "{shown}"
            );
            if !password.contains(['/', '?', '#']) {
                // A valid URL: connecting to nothing would be retried for a minute.
                continue;
            }
            let e = runtime
                .block_on(crate::app::connect_db(&s))
                .expect_err("a raw `/`, `?` or `#` makes the URL invalid");
            let text = format!("{e:#} {e:?}");
            assert!(!text.contains("s3c") && !text.contains("svcuser"), "{text}");
        }
    }

    #[test]
    fn bad_values_are_named() {
        let e = settings(&[BASE[0], BASE[1], ("PREFETCH", "lots")]).unwrap_err();
        assert!(e.to_string().contains("PREFETCH"), "{e}");
        let e = settings(&[BASE[1]]).unwrap_err();
        assert!(e.to_string().contains("AMQP_URL"), "{e}");
        let e = settings(&[BASE[0], BASE[1], ("TRANSPORT", "carrier-pigeon")]).unwrap_err();
        assert!(e.to_string().contains("TRANSPORT"), "{e}");
    }
}
