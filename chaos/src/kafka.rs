//! Kafka: the run's topics (jobs and events, one consumer group per handler), publishing,
//! consumer lag, and reading the dead-letter topics back.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::Duration;

use anyhow::Context as _;
use consumer_kafka::{headers, KafkaConfig, KafkaPublisher};
use invoices::Part;
use rdkafka::admin::{AdminClient, AdminOptions, AlterConfig, ResourceSpecifier};
use rdkafka::client::DefaultClientContext;
use rdkafka::config::ClientConfig;
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::error::KafkaError;
use rdkafka::message::{Headers, Message};
use rdkafka::{Offset, TopicPartitionList};

use crate::cluster;
use crate::workload::{label, Outgoing};
use crate::{DeadSeen, Names};

/// The suite's own producer's `message.max.bytes`: large enough to write the several-MiB
/// bad input. The workers keep their default, so they meet that input as a user's would
/// (it is dead-lettered as a reference, `copy_too_large`).
const PUBLISHER_MAX_MESSAGE_BYTES: &str = "16777216";
/// The workers' `max.poll.interval.ms`: librdkafka wants it at least `session.timeout.ms`.
const MAX_POLL_INTERVAL_MS: u64 = 7_000;
/// How long a revoke waits for records in flight before it gives them up.
const REVOKE_TIMEOUT_MS: u64 = 500;

/// Where every partition of a run's topics starts: they are created for the run and nothing
/// is deleted from them.
const LOG_START: i64 = 0;

/// The Kafka side of a run.
pub(crate) struct Kafka {
    scripts: PathBuf,
    brokers: String,
    /// On the three-node cluster (`KAFKA_CLUSTER_BROKERS`): topics replicated three times,
    /// and a "restart" kills a node.
    cluster: bool,
    /// The jobs topic.
    topic: String,
    /// Per handler: its topic's configuration (topic and group).
    configs: Vec<(Part, KafkaConfig)>,
    publisher: KafkaPublisher,
}

impl Kafka {
    pub(crate) async fn connect(
        names: &Names,
        scripts: PathBuf,
        cluster: bool,
    ) -> anyhow::Result<Self> {
        let (var, start) = if cluster {
            ("KAFKA_CLUSTER_BROKERS", "scripts/kafka.sh cluster 3")
        } else {
            ("KAFKA_BROKERS", "scripts/servers.sh env")
        };
        let brokers = std::env::var(var)
            .with_context(|| format!("{var} is not set: eval \"$({start})\" first"))?;
        let replication = if cluster { 3 } else { 1 };
        let settings = names.settings(&[
            ("TRANSPORT", "kafka".to_owned()),
            ("KAFKA_BROKERS", brokers.clone()),
        ])?;
        let mut configs = Vec::new();
        for part in [Part::Invoices, Part::Emails] {
            let config = invoices::transport::kafka_config(&settings, part)?;
            consumer_kafka::create_topics(&config, settings.kafka_partitions, replication).await?;
            raise_record_limit(&brokers, &config.topics).await?;
            configs.push((part, config));
        }
        let mut publishing = configs[0].1.clone();
        publishing
            .producer_properties
            .set("message.max.bytes", PUBLISHER_MAX_MESSAGE_BYTES);
        let publisher = KafkaPublisher::new(&publishing)?;
        Ok(Kafka {
            scripts,
            brokers,
            cluster,
            topic: names.exchange.clone(),
            configs,
            publisher,
        })
    }

    pub(crate) fn worker_env(&self) -> Vec<(String, String)> {
        [
            ("TRANSPORT", "kafka".to_owned()),
            ("KAFKA_BROKERS", self.brokers.clone()),
            (
                "KAFKA_CONSUMER_PROPERTY_SESSION_TIMEOUT_MS",
                "6000".to_owned(),
            ),
            (
                "KAFKA_CONSUMER_PROPERTY_HEARTBEAT_INTERVAL_MS",
                "2000".to_owned(),
            ),
            // A revoke waits at most this long for in-flight records (a slow job is
            // not waited for: the new owner redelivers it), so a rebalance is not held up.
            ("KAFKA_REVOKE_TIMEOUT_MS", REVOKE_TIMEOUT_MS.to_string()),
            (
                "KAFKA_CONSUMER_PROPERTY_MAX_POLL_INTERVAL_MS",
                MAX_POLL_INTERVAL_MS.to_string(),
            ),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_owned(), v))
        .collect()
    }

    /// Restarts the broker after a SIGKILL (same port, same data; not a graceful stop:
    /// CHAOS.md says why); on the cluster, kills the node leading
    /// the jobs topic's partition 0 (any node if that cannot be read) and starts it again.
    pub(crate) async fn restart(&self) -> anyhow::Result<()> {
        let script = self.scripts.join("kafka.sh");
        if self.cluster {
            // The leader is read once the turn is ours: another run's fault may move it.
            let _turn = cluster::node_fault_turn(&script).await?;
            let node = cluster::kafka_leader(&self.brokers, &self.topic)
                .await
                .unwrap_or(1);
            return cluster::kill_and_restart(&script, node).await;
        }
        crate::script(&script, &["restart", "kill"]).await
    }

    pub(crate) async fn publish(&self, m: &Outgoing) -> anyhow::Result<()> {
        let key = m.label();
        self.publisher
            .publish(
                &self.topic,
                Some(key.as_bytes()),
                m.message_id.as_deref(),
                &m.payload,
                &[],
            )
            .await?;
        Ok(())
    }

    fn client(&self, group: &str) -> ClientConfig {
        let mut c = ClientConfig::new();
        c.set("bootstrap.servers", &self.brokers)
            .set("group.id", group)
            .set("enable.auto.commit", "false")
            .set("log_level", "3");
        c
    }

    /// Consumer lag of each group over its topic and that topic's retry topic: high
    /// watermark minus committed offset, per partition. `None` if the broker cannot say
    /// right now.
    pub(crate) async fn backlog(&self) -> Option<u64> {
        let groups: Vec<(ClientConfig, [String; 2])> = self
            .configs
            .iter()
            .map(|(_, c)| {
                let topic = &c.topics[0];
                (
                    self.client(&c.group_id),
                    [topic.clone(), c.retry_topic(topic)],
                )
            })
            .collect();
        tokio::task::spawn_blocking(move || {
            let timeout = Duration::from_secs(10);
            let mut total = 0u64;
            for (client, topics) in groups {
                let consumer: BaseConsumer = client.create().ok()?;
                let mut tpl = TopicPartitionList::new();
                for topic in &topics {
                    let md = consumer.fetch_metadata(Some(topic), timeout).ok()?;
                    for t in md.topics() {
                        for p in t.partitions() {
                            tpl.add_partition(topic, p.id());
                        }
                    }
                }
                let committed = consumer.committed_offsets(tpl, timeout).ok()?;
                for e in committed.elements() {
                    let (_, high) = consumer
                        .fetch_watermarks(e.topic(), e.partition(), timeout)
                        .ok()?;
                    let from = match e.offset() {
                        Offset::Offset(o) => o,
                        _ => LOG_START,
                    };
                    total += u64::try_from(high - from).unwrap_or(0);
                }
            }
            Some(total)
        })
        .await
        .ok()
        .flatten()
    }

    /// Reads both dead-letter topics (`x-handler` says whose), each partition from
    /// [`LOG_START`] until the fetch says it is at the end.
    pub(crate) async fn dead_letters(&self) -> anyhow::Result<Vec<DeadSeen>> {
        let mut out = Vec::new();
        for (_, config) in &self.configs {
            out.extend(self.dead_letters_of(config).await?);
        }
        Ok(out)
    }

    async fn dead_letters_of(&self, config: &KafkaConfig) -> anyhow::Result<Vec<DeadSeen>> {
        let topic = config.dead_letter_topic(&config.topics[0]);
        let mut client = self.client(&format!("{topic}_reader"));
        client
            .set("auto.offset.reset", "earliest")
            .set("enable.partition.eof", "true");
        let id_header = config.message_id_header.clone();
        tokio::task::spawn_blocking(move || {
            let timeout = Duration::from_secs(10);
            let consumer: BaseConsumer = client.create()?;
            let md = consumer.fetch_metadata(Some(&topic), timeout)?;
            let mut tpl = TopicPartitionList::new();
            let mut pending = std::collections::BTreeSet::new();
            for t in md.topics() {
                for p in t.partitions() {
                    pending.insert(p.id());
                    tpl.add_partition_offset(&topic, p.id(), Offset::Offset(LOG_START))?;
                }
            }
            consumer.assign(&tpl)?;
            let mut out = Vec::new();
            let deadline = std::time::Instant::now() + Duration::from_secs(120);
            while !pending.is_empty() {
                anyhow::ensure!(
                    std::time::Instant::now() < deadline,
                    "reading {topic}: partitions {pending:?} not read to their end in 120s"
                );
                let m = match consumer.poll(Duration::from_millis(500)) {
                    None => continue,
                    Some(Err(KafkaError::PartitionEOF(p))) => {
                        pending.remove(&p);
                        continue;
                    }
                    Some(m) => m?,
                };
                let mut hs: BTreeMap<String, String> = BTreeMap::new();
                if let Some(headers) = m.headers() {
                    for h in headers.iter() {
                        if let Some(v) = h.value {
                            hs.insert(h.key.to_owned(), String::from_utf8_lossy(v).into_owned());
                        }
                    }
                }
                let handler = hs.get(headers::HANDLER).map(String::as_str);
                let Some(part) = [Part::Invoices, Part::Emails]
                    .into_iter()
                    .find(|p| Some(p.handler()) == handler)
                else {
                    anyhow::bail!("dead letter with handler {handler:?}");
                };
                out.push(DeadSeen {
                    part,
                    label: label(
                        hs.get(&id_header).map(String::as_str),
                        m.payload().unwrap_or_default(),
                    ),
                    reason: hs.get(headers::DEAD_LETTER_REASON).cloned(),
                });
            }
            Ok(out)
        })
        .await?
    }

    /// Deletes the run's topics (best effort: the broker keeps them in memory anyway).
    pub(crate) async fn cleanup(&self) -> anyhow::Result<()> {
        let admin: AdminClient<DefaultClientContext> = self.client("unused").create()?;
        let topics: Vec<String> = self
            .configs
            .iter()
            .flat_map(|(_, c)| {
                let topic = &c.topics[0];
                [
                    topic.clone(),
                    c.retry_topic(topic),
                    c.dead_letter_topic(topic),
                ]
            })
            .collect();
        let names: Vec<&str> = topics.iter().map(String::as_str).collect();
        let _ = admin.delete_topics(&names, &AdminOptions::new()).await;
        Ok(())
    }
}

/// Lets the run's main topics take the suite's bad input of several MiB (the broker's
/// default, `message.max.bytes`, is 1 MiB), as a user who accepts such records would; the
/// retry and dead-letter topics keep the default, so the workers' copies meet it.
async fn raise_record_limit(brokers: &str, topics: &[String]) -> anyhow::Result<()> {
    let admin: AdminClient<DefaultClientContext> = ClientConfig::new()
        .set("bootstrap.servers", brokers)
        .create()
        .context("admin client")?;
    let changes: Vec<AlterConfig<'_>> = topics
        .iter()
        .map(|t| {
            AlterConfig::new(ResourceSpecifier::Topic(t))
                .set("max.message.bytes", PUBLISHER_MAX_MESSAGE_BYTES)
        })
        .collect();
    let options = AdminOptions::new().operation_timeout(Some(Duration::from_secs(30)));
    for r in admin.alter_configs(changes.iter(), &options).await? {
        r.map_err(|(what, e)| anyhow::anyhow!("raising max.message.bytes of {what:?}: {e}"))?;
    }
    Ok(())
}
