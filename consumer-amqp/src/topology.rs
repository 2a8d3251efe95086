//! The queues, exchange and bindings declared from an [`AmqpConfig`], and the retry buckets.

use std::time::Duration;

use lapin::options::{ExchangeDeclareOptions, QueueBindOptions, QueueDeclareOptions};
use lapin::types::{AMQPValue, FieldTable, LongString, ShortString};
use lapin::Channel;

use crate::config::{AmqpConfig, ExchangeType, QueueType};
use crate::origin::OriginSecret;
use crate::Error;

/// One retry queue: copies wait `delay` in `queue`, then a worker returns them to the work
/// queue (see `retry_queue`).
#[derive(Debug, Clone)]
pub(crate) struct RetryBucket {
    pub(crate) delay: Duration,
    pub(crate) queue: String,
}

/// The names and arguments of everything declared for one work queue.
#[derive(Debug, Clone)]
pub(crate) struct Topology {
    pub(crate) queue: String,
    pub(crate) dead_letter_queue: String,
    /// `amqp:<queue>`: names the consumers that read this queue's retry copies (see
    /// `Acknowledger::copy_scope`).
    pub(crate) copy_scope: String,
    /// Signs the origin of this queue's copies and checks it on the retry copies that come
    /// back; `None`: no copy is taken for the framework's own.
    pub(crate) origin_secret: Option<OriginSecret>,
    /// The longest a delivery is held unacked while the broker refuses its retry copy:
    /// half the broker's consumer timeout, so the hold never has the channel closed.
    pub(crate) max_hold: std::time::Duration,
    queue_type: QueueType,
    exchange: String,
    exchange_type: ExchangeType,
    binding_keys: Vec<String>,
    /// Sorted by delay, shortest first; never empty (validated).
    retry: Vec<RetryBucket>,
}

impl Topology {
    /// The topology of a validated `config`.
    pub(crate) fn new(config: &AmqpConfig) -> Self {
        let mut delays = config.retry_delays.clone();
        delays.sort();
        let binding_keys = if config.binding_keys.is_empty() {
            vec![config.queue.clone()]
        } else {
            config.binding_keys.clone()
        };
        Topology {
            queue: config.queue.clone(),
            dead_letter_queue: config.dead_letter_queue_name(),
            copy_scope: format!("amqp:{}", config.queue),
            origin_secret: config.origin_secret.clone(),
            max_hold: config.broker_consumer_timeout / 2,
            queue_type: config.queue_type,
            exchange: config.exchange.clone(),
            exchange_type: config.exchange_type,
            binding_keys,
            retry: delays
                .into_iter()
                .map(|delay| RetryBucket {
                    delay,
                    queue: config.retry_queue_name(delay),
                })
                .collect(),
        }
    }

    /// The bucket for a retry after `delay`: the shortest one at least as long, else the
    /// longest (a delay is never shortened, and stretched by at most one bucket).
    pub(crate) fn retry_bucket(&self, delay: Duration) -> &RetryBucket {
        self.retry
            .iter()
            .find(|b| b.delay >= delay)
            .or_else(|| self.retry.last())
            .unwrap_or_else(|| unreachable!("validated: at least one retry delay"))
    }

    /// The retry queues, shortest delay first.
    pub(crate) fn retry_buckets(&self) -> &[RetryBucket] {
        &self.retry
    }

    /// Declares everything (idempotent; it is re-run after each reconnect).
    pub(crate) async fn declare(&self, channel: &Channel) -> Result<(), Error> {
        let durable = QueueDeclareOptions::durable();

        // The dead-letter queue first: the others point at it.
        let args = self.base_arguments();
        declare_queue(channel, &self.dead_letter_queue, durable, args).await?;

        for bucket in &self.retry {
            // Always a quorum queue, whatever the work queue's type: replicated, so a copy
            // whose original was acked survives its node. No TTL and no dead-lettering: the
            // copies go back through the workers (`retry_queue`), with publisher confirms,
            // not through the broker's dead-lettering, which a leader change can stall for
            // minutes (RabbitMQ 3.10 left copies stranded in the retry queue after the node
            // holding its leader was killed).
            let mut args = FieldTable::default();
            args.insert("x-queue-type".into(), string("quorum"));
            args.insert("x-overflow".into(), string("reject-publish"));
            declare_queue(channel, &bucket.queue, durable, args).await?;
        }

        // Whatever the broker itself drops from the work queue (a quorum queue's delivery
        // limit, an expired per-message TTL) lands in the dead-letter queue, not nowhere.
        let mut args = self.base_arguments();
        args.insert("x-dead-letter-exchange".into(), string(""));
        args.insert(
            "x-dead-letter-routing-key".into(),
            string(&self.dead_letter_queue),
        );
        declare_queue(channel, &self.queue, durable, args).await?;

        if !self.exchange.is_empty() {
            // `amq.*` exchanges exist already and may not be declared.
            if !self.exchange.starts_with("amq.") {
                channel
                    .exchange_declare(
                        short(&self.exchange),
                        self.exchange_type.lapin(),
                        ExchangeDeclareOptions {
                            durable: true,
                            ..ExchangeDeclareOptions::default()
                        },
                        FieldTable::default(),
                    )
                    .await
                    .map_err(|e| Error::Topology {
                        what: format!("exchange {:?}", self.exchange),
                        source: e.into(),
                    })?;
            }
            for key in &self.binding_keys {
                channel
                    .queue_bind(
                        short(&self.queue),
                        short(&self.exchange),
                        short(key),
                        QueueBindOptions::default(),
                        FieldTable::default(),
                    )
                    .await
                    .map_err(|e| Error::Topology {
                        what: format!(
                            "binding of queue {:?} to exchange {:?} with key {key:?}",
                            self.queue, self.exchange
                        ),
                        source: e.into(),
                    })?;
            }
        }
        Ok(())
    }

    fn base_arguments(&self) -> FieldTable {
        let mut args = FieldTable::default();
        // Classic is the default; leaving the argument out keeps queues declared by other
        // tools (without it) equivalent.
        if self.queue_type == QueueType::Quorum {
            args.insert("x-queue-type".into(), string("quorum"));
        }
        args
    }
}

async fn declare_queue(
    channel: &Channel,
    name: &str,
    options: QueueDeclareOptions,
    args: FieldTable,
) -> Result<(), Error> {
    channel
        .queue_declare(short(name), options, args)
        .await
        .map(drop)
        .map_err(|e| Error::Topology {
            what: format!("queue {name:?}"),
            source: e.into(),
        })
}

fn string(s: &str) -> AMQPValue {
    AMQPValue::LongString(LongString::from(s))
}

/// A validated name (at most 255 bytes) as a short string.
pub(crate) fn short(s: &str) -> ShortString {
    ShortString::try_new(s).unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn delays_round_up_to_a_bucket_and_cap_at_the_longest() {
        let mut c = AmqpConfig::new("amqp://h", "q");
        c.retry_delays = vec![Duration::from_secs(5), Duration::from_secs(1)];
        let t = Topology::new(&c);
        let pick = |ms| t.retry_bucket(Duration::from_millis(ms)).queue.clone();
        assert_eq!(pick(0), "q.delayed.1000");
        assert_eq!(pick(1000), "q.delayed.1000");
        assert_eq!(pick(1001), "q.delayed.5000");
        assert_eq!(pick(60_000), "q.delayed.5000");
        assert_eq!(t.dead_letter_queue, "q.dlq");
    }
}
