//! [`create_topics`]: a configuration's topics, with their retry and dead-letter topics.

use std::time::{Duration, Instant};

use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
use rdkafka::error::KafkaError;
use rdkafka::types::RDKafkaErrorCode;

use crate::config::validate::{validate_brokers, validate_properties, validate_topic};
use crate::producer::{client_error, LogContext};
use crate::{Error, KafkaConfig, RetryMode};

/// Creates the topics of `config`, and their retry (in [`RetryMode::RetryTopic`]) and
/// dead-letter topics, with `partitions` partitions and `replication` replicas each. Topics
/// that exist already are left as they are. A creation that times out or finds no broker or
/// controller (a cluster losing a node) is tried again, with backoff, for up to 90 s; a
/// refusal (bad replication factor, no authorisation) fails at once.
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
    // A cluster losing a node (its controller, a leader) answers with timeouts for a
    // while: the creation is tried again, topics already made being left as they are.
    let deadline = Instant::now() + CREATE_PATIENCE;
    let mut delay = Duration::from_millis(500);
    loop {
        let failed = match admin.create_topics(specs.iter(), &options).await {
            Err(e) => (client_error("creating topics", e), true),
            Ok(results) => {
                let failed = results.into_iter().find_map(|r| match r {
                    Ok(_) | Err((_, RDKafkaErrorCode::TopicAlreadyExists)) => None,
                    Err((topic, code)) => Some((
                        Error::client(
                            format!("creating topic {topic:?}"),
                            KafkaError::AdminOp(code),
                        ),
                        is_transient(code),
                    )),
                });
                match failed {
                    None => return Ok(()),
                    Some(f) => f,
                }
            }
        };
        let (e, transient) = failed;
        if !transient || Instant::now() + delay >= deadline {
            return Err(e);
        }
        tracing::warn!(error = %e, retry_in = ?delay, "creating topics failed; trying again");
        tokio::time::sleep(delay).await;
        delay = (delay * 2).min(Duration::from_secs(5));
    }
}

/// How long [`create_topics`] tries again after timeouts and unavailable brokers.
const CREATE_PATIENCE: Duration = Duration::from_secs(90);

/// Whether a topic's creation failed for a reason that passes (a broker or controller
/// unavailable, a timeout), not because of what was asked.
fn is_transient(code: RDKafkaErrorCode) -> bool {
    matches!(
        code,
        RDKafkaErrorCode::RequestTimedOut
            | RDKafkaErrorCode::OperationTimedOut
            | RDKafkaErrorCode::NotController
            | RDKafkaErrorCode::BrokerNotAvailable
            | RDKafkaErrorCode::LeaderNotAvailable
            | RDKafkaErrorCode::NetworkException
            | RDKafkaErrorCode::BrokerTransportFailure
            | RDKafkaErrorCode::AllBrokersDown
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn timeouts_and_unavailable_brokers_are_tried_again_bad_requests_are_not() {
        assert!(is_transient(RDKafkaErrorCode::OperationTimedOut));
        assert!(is_transient(RDKafkaErrorCode::NotController));
        assert!(!is_transient(RDKafkaErrorCode::InvalidReplicationFactor));
        assert!(!is_transient(RDKafkaErrorCode::TopicAuthorizationFailed));
    }
}
