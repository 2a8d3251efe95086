//! The one place that knows which broker the binaries use. Everything else sees a
//! [`BoxTransport`] (any stream of deliveries) and a [`JobPublisher`].
//!
//! To add a broker: a [`TransportKind`] variant, its arm in [`consumer`] and in
//! [`JobPublisher`], and its settings in [`crate::settings`].

use std::collections::BTreeMap;
use std::str::FromStr;

use anyhow::{bail, Context as _};
use consumer_amqp::{AmqpConfig, AmqpConsumer, AmqpPublisher, ExchangeType};
use consumer_core::{Incoming, TransportError};
use consumer_kafka::{KafkaConfig, KafkaConsumer, KafkaPublisher};
use futures::future::BoxFuture;
use futures::stream::BoxStream;
use futures::FutureExt;
use futures::StreamExt;

use crate::settings::Settings;
use crate::InvoiceJob;

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

/// The RabbitMQ configuration of `queue`: bound to the fanout exchange the jobs go to.
pub fn amqp_config(settings: &Settings, queue: &str) -> anyhow::Result<AmqpConfig> {
    let url = settings.amqp_url.as_ref().context("AMQP_URL is not set")?;
    let mut config = AmqpConfig::new(url.expose(), queue);
    config.exchange = settings.exchange.clone();
    config.exchange_type = ExchangeType::Fanout;
    config.queue_type = settings.queue_type;
    config.prefetch = settings.prefetch;
    config.connection_name = Some(format!("invoices {queue}"));
    config.validate()?;
    Ok(config)
}

/// The Kafka configuration of consumer group `group` on the jobs topic (`EXCHANGE`). Every
/// other `KAFKA_*` variable of the process is passed to [`KafkaConfig::from_vars`] (e.g.
/// `KAFKA_CONSUMER_PROPERTY_MAX_POLL_INTERVAL_MS=7000`); retry copies carry the group, so
/// the groups share the retry and dead-letter topics.
pub fn kafka_config(settings: &Settings, group: &str) -> anyhow::Result<KafkaConfig> {
    let brokers = settings
        .kafka_brokers
        .as_ref()
        .context("KAFKA_BROKERS is not set")?;
    let mut vars: BTreeMap<String, String> = std::env::vars()
        .filter(|(k, _)| k.starts_with("KAFKA_"))
        .collect();
    vars.insert("KAFKA_BROKERS".to_owned(), brokers.clone());
    vars.insert("KAFKA_GROUP_ID".to_owned(), group.to_owned());
    vars.insert("KAFKA_TOPICS".to_owned(), settings.exchange.clone());
    let config = KafkaConfig::from_vars(vars)?;
    config.validate()?;
    Ok(config)
}

/// Completes once a dropped transport has closed its connection (its last acks are in).
pub type Closed = BoxFuture<'static, ()>;

/// Connects the consumer of `settings.queue`.
pub async fn consumer(settings: &Settings) -> anyhow::Result<(BoxTransport, Closed)> {
    match settings.transport {
        TransportKind::Amqp => {
            let config = amqp_config(settings, &settings.queue)?;
            let consumer = AmqpConsumer::connect(config).await?;
            let health = consumer.health();
            let closed = async move { health.closed().await }.boxed();
            Ok((consumer.boxed(), closed))
        }
        TransportKind::Kafka => {
            let config = kafka_config(settings, &settings.queue)?;
            consumer_kafka::create_topics(&config, settings.kafka_partitions, 1).await?;
            let consumer = KafkaConsumer::new(config)?;
            let closed = consumer.closed().boxed();
            Ok((consumer.boxed(), closed))
        }
    }
}

/// Publishes invoice jobs, each once, to every worker's queue.
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
    /// Connects and makes sure each of `queues` exists and receives the jobs, so none is
    /// published before its queue is there.
    pub async fn connect(settings: &Settings, queues: &[String]) -> anyhow::Result<Self> {
        let Some((first, rest)) = queues.split_first() else {
            bail!("no queue to publish to");
        };
        match settings.transport {
            TransportKind::Amqp => {
                let publisher = AmqpPublisher::connect(amqp_config(settings, first)?).await?;
                for queue in rest {
                    publisher.declare(&amqp_config(settings, queue)?).await?;
                }
                Ok(JobPublisher::Amqp(publisher))
            }
            TransportKind::Kafka => {
                // One topic for every group: creating it is all "declaring" means here.
                let config = kafka_config(settings, first)?;
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
