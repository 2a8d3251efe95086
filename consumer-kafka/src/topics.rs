//! [`create_topics`]: a configuration's topics, with their retry and dead-letter topics.

use std::time::Duration;

use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
use rdkafka::error::KafkaError;
use rdkafka::types::RDKafkaErrorCode;

use crate::config::validate::{validate_brokers, validate_properties, validate_topic};
use crate::producer::{client_error, LogContext};
use crate::{Error, KafkaConfig, RetryMode};

/// Creates the topics of `config`, and their retry (in [`RetryMode::RetryTopic`]) and
/// dead-letter topics, with `partitions` partitions and `replication` replicas each. Topics
/// that exist already are left as they are.
pub async fn create_topics(
    config: &KafkaConfig,
    partitions: i32,
    replication: i32,
) -> Result<(), Error> {
    validate_brokers(&config.brokers)?;
    validate_properties("properties", &config.properties)?;
    if partitions < 1 {
        return Err(Error::config("partitions", "must be at least 1"));
    }
    if replication < 1 {
        return Err(Error::config("replication", "must be at least 1"));
    }
    let mut names = Vec::new();
    for t in &config.topics {
        validate_topic("topics", t)?;
        names.push(t.clone());
        if config.retry == RetryMode::RetryTopic {
            names.push(config.retry_topic(t));
        }
        names.push(config.dead_letter_topic(t));
    }
    let admin: AdminClient<LogContext> = config
        .admin_client_config()
        .create_with_context(LogContext)
        .map_err(|e| client_error("creating the admin client", e))?;
    let specs: Vec<NewTopic<'_>> = names
        .iter()
        .map(|n| NewTopic::new(n, partitions, TopicReplication::Fixed(replication)))
        .collect();
    let options = AdminOptions::new().operation_timeout(Some(Duration::from_secs(30)));
    let results = admin
        .create_topics(specs.iter(), &options)
        .await
        .map_err(|e| client_error("creating topics", e))?;
    for r in results {
        match r {
            Ok(_) | Err((_, RDKafkaErrorCode::TopicAlreadyExists)) => {}
            Err((topic, code)) => {
                return Err(Error::client(
                    format!("creating topic {topic:?}"),
                    KafkaError::AdminOp(code),
                ))
            }
        }
    }
    Ok(())
}
