//! How the poll thread's librdkafka consumer is made: created from the configuration and
//! subscribed, at start and again after another member took its instance id (see
//! `poll::Fences`) or its group's coordinator stayed out of reach (see `coordinator`).

use std::sync::Arc;
use std::time::Duration;

use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::ClientConfig;

use super::coordinator::CoordinatorWatch;
use super::partitions::Shared;
use super::rebalance::ConsumerCtx;
use crate::config::KafkaConfig;
use crate::{producer, Error};

/// What a new librdkafka consumer is made of.
pub(super) struct Client {
    config: ClientConfig,
    topics: Vec<String>,
    coordinator_timeout: Duration,
}

impl Client {
    /// The consumers of `config` (validated).
    pub(super) fn new(config: &KafkaConfig) -> Self {
        Client {
            config: config.consumer_client_config(),
            topics: config.subscribed_topics(),
            coordinator_timeout: config.coordinator_timeout,
        }
    }

    /// The topics a consumer subscribes to.
    pub(super) fn topics(&self) -> &[String] {
        &self.topics
    }

    /// A new librdkafka consumer, subscribed; its callbacks act on `shared`.
    pub(super) fn open(&self, shared: &Arc<Shared>) -> Result<BaseConsumer<ConsumerCtx>, Error> {
        let consumer: BaseConsumer<ConsumerCtx> = self
            .config
            .create_with_context(ConsumerCtx {
                shared: shared.clone(),
                coordinator: CoordinatorWatch::new(self.coordinator_timeout),
            })
            .map_err(|e| producer::client_error("creating the consumer", e))?;
        let names: Vec<&str> = self.topics.iter().map(String::as_str).collect();
        consumer
            .subscribe(&names)
            .map_err(|e| producer::client_error("subscribing", e))?;
        Ok(consumer)
    }
}
