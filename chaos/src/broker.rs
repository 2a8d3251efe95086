//! The broker under test and the run's names: the schema, exchanges or topics, and queues or
//! groups every worker and reader is given; [`Broker`] dispatches to the RabbitMQ
//! (`amqp`) or Kafka (`kafka`) side.

use invoices::Part;

use crate::{amqp, kafka, workload};

/// The run's names: schema, exchanges or topics, queues or groups.
#[derive(Debug, Clone)]
pub(crate) struct Names {
    pub(crate) prefix: String,
    pub(crate) schema: String,
    /// Where the jobs are published.
    pub(crate) exchange: String,
    /// Where the relay publishes the `invoice_ready` events.
    pub(crate) events: String,
}

impl Names {
    /// Names unique to this run (its seed, the clock and the process id).
    pub(crate) fn new(seed: u64) -> Self {
        let t = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_millis() % 100_000_000)
            .unwrap_or(0);
        let prefix = format!("chaos_{seed}_{t}_{}", std::process::id());
        Names {
            schema: prefix.clone(),
            exchange: format!("{prefix}_jobs"),
            events: format!("{prefix}_ready"),
            prefix,
        }
    }

    /// The queue (RabbitMQ) or consumer group (Kafka) of a handler.
    pub(crate) fn queue(&self, part: Part) -> String {
        match part {
            Part::Invoices => format!("{}_invoices", self.prefix),
            Part::Emails => format!("{}_emails", self.prefix),
        }
    }

    /// The settings every worker process gets for these names (and a broker's own
    /// variables), as the example reads them.
    pub(crate) fn settings(
        &self,
        vars: &[(&str, String)],
    ) -> anyhow::Result<invoices::settings::Settings> {
        let mut all: std::collections::BTreeMap<&str, String> = self.vars().into_iter().collect();
        all.insert("DATABASE_URL", "postgres://unused".to_owned());
        all.extend(vars.iter().cloned());
        invoices::settings::Settings::from_lookup(|k| all.get(k).cloned())
    }

    /// The example's variables naming the run's exchanges (topics) and queues (groups).
    pub(crate) fn vars(&self) -> Vec<(&'static str, String)> {
        vec![
            ("EXCHANGE", self.exchange.clone()),
            ("EVENTS", self.events.clone()),
            ("INVOICE_QUEUE", self.queue(Part::Invoices)),
            ("EMAIL_QUEUE", self.queue(Part::Emails)),
        ]
    }
}

/// A message found in a dead-letter destination.
#[derive(Debug, Clone)]
pub(crate) struct DeadSeen {
    /// Whose dead letter it is.
    pub(crate) part: Part,
    pub(crate) label: String,
    pub(crate) reason: Option<String>,
}

/// The broker under test.
pub(crate) enum Broker {
    Amqp(amqp::Amqp),
    Kafka(kafka::Kafka),
}

impl Broker {
    pub(crate) fn worker_env(&self) -> Vec<(String, String)> {
        match self {
            Broker::Amqp(b) => b.worker_env(),
            Broker::Kafka(b) => b.worker_env(),
        }
    }

    pub(crate) async fn publish(&self, m: &workload::Outgoing) -> anyhow::Result<()> {
        match self {
            Broker::Amqp(b) => b.publish(m).await,
            Broker::Kafka(b) => b.publish(m).await,
        }
    }

    pub(crate) async fn backlog(&self) -> Option<u64> {
        match self {
            Broker::Amqp(b) => b.backlog().await,
            Broker::Kafka(b) => b.backlog().await,
        }
    }

    pub(crate) async fn restart(&self) -> anyhow::Result<()> {
        match self {
            Broker::Amqp(b) => b.restart().await,
            Broker::Kafka(b) => b.restart().await,
        }
    }

    pub(crate) async fn dead_letters(&self) -> anyhow::Result<Vec<DeadSeen>> {
        match self {
            Broker::Amqp(b) => b.dead_letters().await,
            Broker::Kafka(b) => b.dead_letters().await,
        }
    }

    pub(crate) async fn cleanup(&self) -> anyhow::Result<()> {
        match self {
            Broker::Amqp(b) => b.cleanup().await,
            Broker::Kafka(b) => b.cleanup().await,
        }
    }
}
