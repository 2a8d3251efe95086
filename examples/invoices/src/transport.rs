//! The one place that knows which broker the binaries use. Everything else sees a
//! [`BoxTransport`] (any stream of deliveries), a [`JobPublisher`] and an
//! [`EventPublisher`] (the outbox relay's).
//!
//! Two flows, each with its own exchange (Kafka: topic) and queue (Kafka: consumer group):
//! the jobs (`EXCHANGE` → `INVOICE_QUEUE`, for `send_invoice`) and the `invoice_ready`
//! events (`EVENTS` → `EMAIL_QUEUE`, for `send_email`); [`Part`] names which.
//!
//! To add a broker: a [`TransportKind`] variant, its arm in [`consumer`], [`JobPublisher`]
//! and [`EventPublisher`], and its settings in [`crate::settings`].

use std::collections::BTreeMap;
use std::str::FromStr;

use anyhow::{bail, Context as _};
use consumer_amqp::{AmqpConfig, AmqpConsumer, AmqpPublisher, ExchangeType};
use consumer_core::transport::{Incoming, TransportError};
use consumer_core::{OutboxMessage, PublishError, Publisher};
use consumer_kafka::{KafkaConfig, KafkaConsumer, KafkaPublisher};
use futures::future::BoxFuture;
use futures::stream::BoxStream;
use futures::FutureExt;
use futures::StreamExt;

use crate::handlers::INVOICE_READY;
use crate::settings::Settings;
use crate::{InvoiceJob, Part};

/// Which broker (`TRANSPORT`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TransportKind {
    /// RabbitMQ, through `consumer-amqp` (`TRANSPORT=amqp`, the default).
    Amqp,
    /// Kafka, through `consumer-kafka` (`TRANSPORT=kafka`): the jobs topic is `EXCHANGE`,
    /// and each worker binary is its own consumer group (`QUEUE`), so each gets every job.
    Kafka,
}

impl FromStr for TransportKind {
    type Err = anyhow::Error;

    fn from_str(s: &str) -> anyhow::Result<Self> {
        match s.trim().to_ascii_lowercase().as_str() {
            "amqp" | "rabbitmq" => Ok(TransportKind::Amqp),
            "kafka" => Ok(TransportKind::Kafka),
            other => bail!("TRANSPORT={other:?} is not supported: use `amqp` or `kafka`"),
        }
    }
}

/// A transport whatever the broker: what [`consumer_core::Worker::run`] consumes.
pub type BoxTransport = BoxStream<'static, Result<Incoming, TransportError>>;

/// The exchange (Kafka: topic) and the queue (Kafka: group) of `part`'s flow.
pub fn flow(settings: &Settings, part: Part) -> (&str, &str) {
    match part {
        Part::Invoices => (&settings.exchange, &settings.invoice_queue),
        Part::Emails => (&settings.events, &settings.email_queue),
    }
}

/// The RabbitMQ configuration of `part`'s queue: bound to its fanout exchange.
pub fn amqp_config(settings: &Settings, part: Part) -> anyhow::Result<AmqpConfig> {
    let url = settings.amqp_url.as_ref().context("AMQP_URL is not set")?;
    let (exchange, queue) = flow(settings, part);
    // One address, or several comma-separated (the nodes of a cluster).
    let mut config = AmqpConfig::with_addresses(url.expose(), queue);
    config.exchange = exchange.to_owned();
    config.exchange_type = ExchangeType::Fanout;
    config.queue_type = settings.queue_type;
    config.prefetch = settings.prefetch;
    config.connection_name = Some(format!("invoices {queue}"));
    config.origin_secret = settings.amqp_origin_secret.clone();
    config.validate()?;
    Ok(config)
}

/// The Kafka configuration of `part`'s consumer group on its topic. Every other `KAFKA_*`
/// variable of the process is passed to [`KafkaConfig::from_vars`] (e.g.
/// `KAFKA_CONSUMER_PROPERTY_MAX_POLL_INTERVAL_MS=7000`).
pub fn kafka_config(settings: &Settings, part: Part) -> anyhow::Result<KafkaConfig> {
    let (topic, group) = flow(settings, part);
    let brokers = settings
        .kafka_brokers
        .as_ref()
        .context("KAFKA_BROKERS is not set")?;
    let mut vars: BTreeMap<String, String> = std::env::vars()
        .filter(|(k, _)| k.starts_with("KAFKA_"))
        .collect();
    vars.insert("KAFKA_BROKERS".to_owned(), brokers.clone());
    vars.insert("KAFKA_GROUP_ID".to_owned(), group.to_owned());
    vars.insert("KAFKA_TOPICS".to_owned(), topic.to_owned());
    let config = KafkaConfig::from_vars(vars)?;
    config.validate()?;
    Ok(config)
}

/// Completes once a dropped transport has closed its connection (its last acks are in).
pub type Closed = BoxFuture<'static, ()>;

/// Connects the consumer of `part`'s queue.
pub async fn consumer(settings: &Settings, part: Part) -> anyhow::Result<(BoxTransport, Closed)> {
    match settings.transport {
        TransportKind::Amqp => {
            let config = amqp_config(settings, part)?;
            let consumer = AmqpConsumer::connect(config).await?;
            let health = consumer.health();
            let closed = async move { health.closed().await }.boxed();
            Ok((consumer.boxed(), closed))
        }
        TransportKind::Kafka => {
            let config = kafka_config(settings, part)?;
            consumer_kafka::create_topics(&config, settings.kafka_partitions, 1).await?;
            let consumer = KafkaConsumer::new(config)?;
            let closed = consumer.closed().boxed();
            Ok((consumer.boxed(), closed))
        }
    }
}

/// Publishes invoice jobs, each once, to the jobs exchange (Kafka: topic).
#[derive(Debug)]
pub enum JobPublisher {
    /// Through RabbitMQ's fanout exchange.
    Amqp(AmqpPublisher),
    /// To the Kafka jobs topic, keyed by order id.
    Kafka {
        /// The producer.
        publisher: KafkaPublisher,
        /// The jobs topic.
        topic: String,
    },
}

impl JobPublisher {
    /// Connects and makes sure the invoice queue exists and receives the jobs, so none is
    /// published before it is there.
    pub async fn connect(settings: &Settings) -> anyhow::Result<Self> {
        match settings.transport {
            TransportKind::Amqp => {
                let config = amqp_config(settings, Part::Invoices)?;
                Ok(JobPublisher::Amqp(AmqpPublisher::connect(config).await?))
            }
            TransportKind::Kafka => {
                // Creating the topic is all "declaring" means here.
                let config = kafka_config(settings, Part::Invoices)?;
                consumer_kafka::create_topics(&config, settings.kafka_partitions, 1).await?;
                Ok(JobPublisher::Kafka {
                    publisher: KafkaPublisher::new(&config)?,
                    topic: settings.exchange.clone(),
                })
            }
        }
    }

    /// Publishes `job` under its message id and waits for the broker's confirm.
    pub async fn publish(&self, job: &InvoiceJob) -> anyhow::Result<()> {
        match self {
            JobPublisher::Amqp(p) => Ok(p.publish_json("invoice", &job.message_id(), job).await?),
            JobPublisher::Kafka { publisher, topic } => {
                let payload = serde_json::to_vec(job)?;
                let key = job.order_id.to_string();
                publisher
                    .publish(
                        topic,
                        Some(key.as_bytes()),
                        Some(&job.message_id()),
                        &payload,
                        &[],
                    )
                    .await?;
                Ok(())
            }
        }
    }

    /// Closes the connection.
    pub async fn close(&self) {
        match self {
            JobPublisher::Amqp(p) => p.close().await,
            JobPublisher::Kafka { .. } => {}
        }
    }
}

/// The outbox relay's publisher: sends the [`INVOICE_READY`] events to the events exchange
/// (RabbitMQ, confirmed and mandatory) or topic (Kafka, idempotent producer, keyed by order
/// id). Any other destination is refused (the relay logs it and keeps the row).
#[derive(Debug)]
pub enum EventPublisher {
    /// To the fanout exchange `EVENTS`, bound to the email queue.
    Amqp(AmqpPublisher),
    /// To the topic `EVENTS`.
    Kafka {
        /// The producer.
        publisher: KafkaPublisher,
        /// The events topic.
        topic: String,
    },
}

impl EventPublisher {
    /// Connects, and makes sure the email queue exists and is bound to the events exchange
    /// (Kafka: the events topic exists), so no event is published where nobody would get
    /// it.
    pub async fn connect(settings: &Settings) -> anyhow::Result<Self> {
        match settings.transport {
            TransportKind::Amqp => {
                let mut config = amqp_config(settings, Part::Emails)?;
                config.connection_name = Some("invoices relay".to_owned());
                Ok(EventPublisher::Amqp(AmqpPublisher::connect(config).await?))
            }
            TransportKind::Kafka => {
                let config = kafka_config(settings, Part::Emails)?;
                consumer_kafka::create_topics(&config, settings.kafka_partitions, 1).await?;
                Ok(EventPublisher::Kafka {
                    publisher: KafkaPublisher::new(&config)?,
                    topic: settings.events.clone(),
                })
            }
        }
    }
}

impl Publisher for EventPublisher {
    fn publish<'a>(
        &'a self,
        message: &'a OutboxMessage,
    ) -> BoxFuture<'a, Result<(), PublishError>> {
        if message.destination != INVOICE_READY {
            let refused = PublishError::refused(format!(
                "no route for outbox destination {:?} (this service publishes {INVOICE_READY:?})",
                message.destination
            ));
            return async move { Err(refused) }.boxed();
        }
        match self {
            EventPublisher::Amqp(p) => Publisher::publish(p, message),
            EventPublisher::Kafka { publisher, topic } => async move {
                let mut message = message.clone();
                message.destination.clone_from(topic);
                Publisher::publish(publisher, &message).await
            }
            .boxed(),
        }
    }
}
