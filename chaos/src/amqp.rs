//! RabbitMQ: the run's exchanges (jobs, events) and queues, publishing, queue depth, broker
//! restarts, and reading the dead-letter queues back.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::Duration;

use anyhow::Context as _;
use consumer_amqp::{headers, AmqpConfig, AmqpPublisher, ORIGIN_SECRET_VAR};
use invoices::Part;
use lapin::options::{BasicAckOptions, BasicGetOptions, ExchangeDeleteOptions, QueueDeleteOptions};
use lapin::types::AMQPValue;
use lapin::{Connection, ConnectionProperties};

use crate::cluster;
use crate::workload::{label, Outgoing};
use crate::{DeadSeen, Names};

/// The RabbitMQ side of a run.
pub(crate) struct Amqp {
    /// One address, or the cluster's, comma-separated.
    url: String,
    /// On the three-node cluster (`AMQP_CLUSTER_URLS`): quorum queues, and a "restart"
    /// kills a node.
    cluster: bool,
    /// The run's own origin secret, shared by its workers and its publisher's settings.
    origin_secret: String,
    scripts: PathBuf,
    prefix: String,
    exchanges: [String; 2],
    configs: Vec<(Part, AmqpConfig)>,
    publisher: AmqpPublisher,
}

impl Amqp {
    pub(crate) async fn connect(
        names: &Names,
        scripts: PathBuf,
        cluster: bool,
    ) -> anyhow::Result<Self> {
        let (var, start) = if cluster {
            ("AMQP_CLUSTER_URLS", "scripts/rabbitmq.sh cluster 3")
        } else {
            ("AMQP_URL", "scripts/servers.sh env")
        };
        let url = std::env::var(var)
            .with_context(|| format!("{var} is not set: eval \"$({start})\" first"))?;
        // A secret of the run's own (its prefix is unique); a deployment uses a random one.
        let origin_secret = format!("chaos-origin-secret-{}", names.prefix);
        let settings = names.settings(&[
            ("TRANSPORT", "amqp".to_owned()),
            ("AMQP_URL", url.clone()),
            (ORIGIN_SECRET_VAR, origin_secret.clone()),
            ("QUEUE_TYPE", queue_type(cluster).to_owned()),
        ])?;
        let mut configs = Vec::new();
        for part in [Part::Invoices, Part::Emails] {
            let mut config = invoices::transport::amqp_config(&settings, part)?;
            // Publishes wait out a broker restart instead of failing.
            config.publish_timeout = Duration::from_secs(120);
            config.startup_timeout = Duration::from_secs(120);
            config.connection_name = Some(format!("chaos publisher {}", names.prefix));
            configs.push((part, config));
        }
        // Both queues exist before any worker starts (the relays declare the email queue
        // too).
        let publisher = AmqpPublisher::connect(configs[0].1.clone()).await?;
        publisher.declare(&configs[1].1).await?;
        Ok(Amqp {
            url,
            cluster,
            origin_secret,
            scripts,
            prefix: names.prefix.clone(),
            exchanges: [names.exchange.clone(), names.events.clone()],
            configs,
            publisher,
        })
    }

    pub(crate) fn worker_env(&self) -> Vec<(String, String)> {
        vec![
            ("TRANSPORT".to_owned(), "amqp".to_owned()),
            ("AMQP_URL".to_owned(), self.url.clone()),
            (ORIGIN_SECRET_VAR.to_owned(), self.origin_secret.clone()),
            ("QUEUE_TYPE".to_owned(), queue_type(self.cluster).to_owned()),
        ]
    }

    pub(crate) async fn publish(&self, m: &Outgoing) -> anyhow::Result<()> {
        let id = m.message_id.as_deref().unwrap_or("");
        self.publisher
            .publish("invoice", id, &m.payload, &BTreeMap::new())
            .await?;
        Ok(())
    }

    /// Messages in the run's work and retry queues, ready or unacked; `None` if the broker
    /// cannot say right now.
    pub(crate) async fn backlog(&self) -> Option<u64> {
        let out = self
            .ctl(&[
                "list_queues",
                "name",
                "messages",
                "-q",
                "--no-table-headers",
            ])
            .await?;
        let mut total = 0;
        for line in String::from_utf8_lossy(&out.stdout).lines() {
            let mut parts = line.split_whitespace();
            let (Some(name), Some(n)) = (parts.next(), parts.next()) else {
                continue;
            };
            if name.starts_with(&self.prefix) && !name.ends_with(".dlq") {
                total += n.parse::<u64>().ok()?;
            }
        }
        Some(total)
    }

    /// Restarts the broker; on the cluster, kills the node leading the jobs queue (any node
    /// if that cannot be read) and starts it again.
    pub(crate) async fn restart(&self) -> anyhow::Result<()> {
        let script = self.scripts.join("rabbitmq.sh");
        if self.cluster {
            // The leader is read once the turn is ours: another run's fault may move it.
            let _turn = cluster::node_fault_turn(&script).await?;
            let queue = &self.configs[0].1.queue;
            let node = cluster::rabbitmq_leader(&script, queue).await.unwrap_or(1);
            return cluster::kill_and_restart(&script, node).await;
        }
        crate::script(&script, &["restart"]).await
    }

    /// `rabbitmqctl ARGS` through `scripts/rabbitmq.sh` (on the cluster, against the first
    /// node that answers); `None` if none does.
    async fn ctl(&self, args: &[&str]) -> Option<std::process::Output> {
        let script = self.scripts.join("rabbitmq.sh");
        let nodes: Vec<Vec<String>> = if self.cluster {
            (1..=cluster::NODES)
                .map(|i| vec!["node".to_owned(), "ctl".to_owned(), i.to_string()])
                .collect()
        } else {
            vec![vec!["ctl".to_owned()]]
        };
        for node in nodes {
            let out = tokio::process::Command::new(&script)
                .args(&node)
                .args(args)
                .output()
                .await
                .ok()?;
            if out.status.success() {
                return Some(out);
            }
        }
        None
    }

    /// A connection to the first address that answers.
    async fn connection(&self) -> anyhow::Result<Connection> {
        let mut last = None;
        for url in self.url.split(',').map(str::trim) {
            match Connection::connect(url, ConnectionProperties::default()).await {
                Ok(conn) => return Ok(conn),
                Err(e) => last = Some(e),
            }
        }
        Err(last.map_or_else(|| anyhow::anyhow!("no AMQP address"), Into::into))
    }

    /// Takes every message from both dead-letter queues (the jobs' and the events').
    pub(crate) async fn dead_letters(&self) -> anyhow::Result<Vec<DeadSeen>> {
        let conn = self.connection().await?;
        let channel = conn.create_channel().await?;
        let mut out = Vec::new();
        for (part, config) in &self.configs {
            let queue = config.dead_letter_queue_name();
            while let Some(m) = channel
                .basic_get(queue.as_str().into(), BasicGetOptions::default())
                .await?
            {
                let p = &m.delivery.properties;
                let id = p.message_id().as_ref().map(|s| s.to_string());
                let reason = p.headers().as_ref().and_then(|h| {
                    h.inner()
                        .iter()
                        .find(|(k, _)| k.as_str() == headers::DEAD_LETTER_REASON)
                        .map(|(_, v)| match v {
                            AMQPValue::LongString(s) => s.to_string(),
                            AMQPValue::ShortString(s) => s.to_string(),
                            other => format!("{other:?}"),
                        })
                });
                out.push(DeadSeen {
                    part: *part,
                    label: label(id.as_deref(), &m.delivery.data),
                    reason,
                });
                m.delivery.ack(BasicAckOptions::default()).await?;
            }
        }
        let _ = conn.close(200, "ok".into()).await;
        Ok(out)
    }

    /// Deletes the run's queues and exchanges.
    pub(crate) async fn cleanup(&self) -> anyhow::Result<()> {
        self.publisher.close().await;
        let conn = self.connection().await?;
        let channel = conn.create_channel().await?;
        for (_, config) in &self.configs {
            let mut queues = vec![config.queue.clone(), config.dead_letter_queue_name()];
            queues.extend(
                config
                    .retry_delays
                    .iter()
                    .map(|d| config.retry_queue_name(*d)),
            );
            for q in queues {
                channel
                    .queue_delete(q.as_str().into(), QueueDeleteOptions::default())
                    .await?;
            }
        }
        for exchange in &self.exchanges {
            channel
                .exchange_delete(exchange.as_str().into(), ExchangeDeleteOptions::default())
                .await?;
        }
        let _ = conn.close(200, "ok".into()).await;
        Ok(())
    }
}

/// The run's queue type: quorum on the cluster (replicated, so a node's loss loses
/// nothing), the example's default elsewhere.
fn queue_type(cluster: bool) -> &'static str {
    if cluster {
        "quorum"
    } else {
        "classic"
    }
}
