//! The one place that knows which broker the binaries use. Everything else sees a
//! [`BoxTransport`] (any stream of deliveries) and a [`JobPublisher`].
//!
//! To add a broker: a [`TransportKind`] variant, its arm in [`consumer`] and in
//! [`JobPublisher`], and its settings in [`crate::settings`].

use std::str::FromStr;

use anyhow::{bail, Context as _};
use consumer_amqp::{AmqpConfig, AmqpConsumer, AmqpPublisher, ExchangeType};
use consumer_core::{Incoming, TransportError};
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
}

impl FromStr for TransportKind {
    type Err = anyhow::Error;

    fn from_str(s: &str) -> anyhow::Result<Self> {
        match s.trim().to_ascii_lowercase().as_str() {
            "amqp" | "rabbitmq" => Ok(TransportKind::Amqp),
            other => bail!("TRANSPORT={other:?} is not supported: use `amqp`"),
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
    }
}

/// Publishes invoice jobs, each once, to every worker's queue.
#[derive(Debug)]
pub enum JobPublisher {
    /// Through RabbitMQ's fanout exchange.
    Amqp(AmqpPublisher),
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
        }
    }

    /// Publishes `job` under its message id and waits for the broker's confirm.
    pub async fn publish(&self, job: &InvoiceJob) -> anyhow::Result<()> {
        match self {
            JobPublisher::Amqp(p) => Ok(p.publish_json("invoice", &job.message_id(), job).await?),
        }
    }

    /// Closes the connection.
    pub async fn close(&self) {
        match self {
            JobPublisher::Amqp(p) => p.close().await,
        }
    }
}
