//! For the Kafka tests: the broker started by `scripts/kafka.sh`, a topic and group
//! per test (created with the admin client), a test handler that records its effects in
//! PostgreSQL, a worker running in a task, and independent reads of committed offsets and
//! topics through plain rdkafka clients (not through the transport under test).

use std::collections::HashMap;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use consumer_core::retry::NoJitter;
use consumer_core::stats::StatsSnapshot;
use consumer_core::{handler, Context, Handler, HandlerError, Worker, WorkerConfig};
use consumer_kafka::{ClientProperties, KafkaConfig, KafkaConsumer, KafkaObserver, KafkaPublisher};
use futures::StreamExt;
use rdkafka::admin::{AdminClient, AdminOptions, AlterConfig, ResourceSpecifier};
use rdkafka::client::DefaultClientContext;
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::message::{Headers, Message, OwnedMessage};
use rdkafka::{ClientConfig, Offset, TopicPartitionList};
use serde::Deserialize;
use sqlx::Postgres;
use tokio::sync::oneshot;
use tokio::task::JoinHandle;

/// Logs to the test's output, as in [`crate::common::init_tracing`].
pub use crate::common::init_tracing;
/// Waits for a condition, as in [`crate::common::wait_for`].
pub use crate::common::wait_for;
use crate::common::{database_url, unique, PgEnv};

/// The broker address printed by `scripts/kafka.sh env`.
pub fn brokers() -> String {
    std::env::var("KAFKA_BROKERS").expect(
        "KAFKA_BROKERS is not set: start the broker with `eval \"$(scripts/kafka.sh env)\"` \
         (and PostgreSQL with `eval \"$(scripts/postgres.sh env)\"`)",
    )
}

/// The consumer group protocol a test's members use.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GroupProtocol {
    /// The classic protocol: the members assign the partitions (librdkafka's default).
    Classic,
    /// KIP-848's consumer protocol: the broker assigns them, incrementally.
    Consumer,
}

/// The group protocol of this run: `KAFKA_GROUP_PROTOCOL=consumer` (KIP-848) or `classic`
/// (the default).
pub fn group_protocol() -> GroupProtocol {
    match std::env::var("KAFKA_GROUP_PROTOCOL").as_deref() {
        Ok("consumer") => GroupProtocol::Consumer,
        Ok("classic") | Err(_) => GroupProtocol::Classic,
        Ok(other) => panic!("KAFKA_GROUP_PROTOCOL={other}: use classic or consumer"),
    }
}

/// Sets a topic-level configuration (e.g. `max.message.bytes`) of `topic` on the broker.
pub async fn set_topic_config(topic: &str, name: &str, value: &str) {
    let admin: AdminClient<DefaultClientContext> =
        plain_client(None).create().expect("admin client");
    let change = AlterConfig::new(ResourceSpecifier::Topic(topic)).set(name, value);
    let options = AdminOptions::new().operation_timeout(Some(Duration::from_secs(30)));
    let results = admin
        .alter_configs([&change], &options)
        .await
        .expect("alter the topic's configuration");
    for r in results {
        r.unwrap_or_else(|e| panic!("setting {name}={value} on {topic}: {e:?}"));
    }
}

/// A test job; its fields script the handler.
#[derive(Debug, Deserialize)]
pub struct Job {
    /// The job's id, recorded in `effects`.
    pub id: String,
    /// Fail (transiently) while the attempt number is at most this.
    #[serde(default)]
    pub fail_times: u32,
    /// Fail permanently (a poison message).
    #[serde(default)]
    pub permanent: bool,
    /// Sleep this long inside the transaction.
    #[serde(default)]
    pub sleep_ms: u64,
    /// Sleep this long when the delivery is fresh, its first hand-out ever (a slow record a
    /// crash interrupts: the next process finds it below the log mark, not fresh).
    #[serde(default)]
    pub fresh_sleep_ms: u64,
}

/// Records one effect per run in `effects`, in commit order (`seq`).
#[handler(
    name = "kafka_record",
    max_attempts = 3,
    backoff = "300ms..600ms",
    timeout = "120s"
)]
pub async fn kafka_record(ctx: &mut Context<'_, Postgres>, job: Job) -> Result<(), HandlerError> {
    if job.permanent {
        return Err(HandlerError::permanent(format!("job {} is poison", job.id)));
    }
    if ctx.attempt() <= job.fail_times {
        return Err(HandlerError::transient(format!(
            "job {} fails on attempt {}",
            job.id,
            ctx.attempt()
        )));
    }
    let sleep = job.sleep_ms + if ctx.fresh() { job.fresh_sleep_ms } else { 0 };
    tokio::time::sleep(Duration::from_millis(sleep)).await;
    let attempt = i32::try_from(ctx.attempt()).unwrap_or(i32::MAX);
    sqlx::query("INSERT INTO effects (job_id, attempt) VALUES ($1, $2)")
        .bind(&job.id)
        .bind(attempt)
        .execute(ctx.db())
        .await?;
    Ok(())
}

/// A topic (with its retry and dead-letter topics), a group and a PostgreSQL schema, all
/// unique to the test.
pub struct KafkaEnv {
    /// The main topic.
    pub topic: String,
    /// The consumer group.
    pub group: String,
    /// The main topic's partitions.
    pub partitions: i32,
    /// The group's PostgreSQL schema, with its `effects` table.
    pub pg: Arc<PgEnv>,
}

impl KafkaEnv {
    /// Creates the topics (named after `prefix`, with `partitions` each), the group's schema
    /// and its `effects` table.
    pub async fn new(prefix: &str, partitions: i32) -> KafkaEnv {
        init_tracing();
        let env = KafkaEnv {
            topic: unique(prefix),
            group: unique("group"),
            partitions,
            pg: Arc::new(PgEnv::new().await),
        };
        consumer_kafka::create_topics(&env.config(), partitions, 1)
            .await
            .expect("create topics");
        env.create_effects_table().await;
        env
    }

    /// Another consumer group (with its own schema) on the same topic.
    pub async fn sharing_topic(&self) -> KafkaEnv {
        let env = KafkaEnv {
            topic: self.topic.clone(),
            group: unique("group"),
            partitions: self.partitions,
            pg: Arc::new(PgEnv::new().await),
        };
        env.create_effects_table().await;
        env
    }

    async fn create_effects_table(&self) {
        let pool = sqlx::PgPool::connect(&database_url())
            .await
            .expect("connect to PostgreSQL");
        sqlx::raw_sql(&format!(
            "CREATE TABLE \"{}\".effects (seq BIGSERIAL PRIMARY KEY, job_id TEXT NOT NULL, attempt INTEGER NOT NULL)",
            self.pg.schema
        ))
        .execute(&pool)
        .await
        .expect("create effects table");
        pool.close().await;
    }

    /// The transport configuration for this test: the group protocol of
    /// [`group_protocol`], a short session timeout (classic; the consumer protocol's is the
    /// broker's), frequent commits, a consumer replaced after 15 s without its coordinator.
    pub fn config(&self) -> KafkaConfig {
        let mut c = KafkaConfig::new(brokers(), self.group.clone(), [self.topic.clone()]);
        c.consumer_properties
            .set("fetch.wait.max.ms", "100")
            .set("topic.metadata.refresh.interval.ms", "2000");
        match group_protocol() {
            GroupProtocol::Classic => {
                c.consumer_properties
                    .set("session.timeout.ms", "6000")
                    .set("heartbeat.interval.ms", "500");
            }
            GroupProtocol::Consumer => {
                c.consumer_properties.set("group.protocol", "consumer");
            }
        }
        if let Ok(debug) = std::env::var("KAFKA_TEST_DEBUG") {
            // librdkafka's own debug contexts, e.g. `cgrp` (logged with RUST_LOG=librdkafka=debug).
            c.consumer_properties.set("debug", debug);
        }
        c.commit_interval = Duration::from_millis(100);
        c.produce_timeout = Duration::from_secs(20);
        // A few sessions (6 s): a consumer librdkafka left without its coordinator after a
        // broker restart is replaced well within a test's waits.
        c.coordinator_timeout = Duration::from_secs(15);
        c
    }

    /// A publisher on the broker.
    pub fn publisher(&self) -> KafkaPublisher {
        let mut props = ClientProperties::new();
        if let Ok(debug) = std::env::var("KAFKA_TEST_PRODUCER_DEBUG") {
            // librdkafka's own debug contexts for the test's producer, e.g. `msg,topic`.
            props.set("debug", debug);
        }
        KafkaPublisher::connect(&brokers(), &props).expect("publisher")
    }

    /// `(job_id, attempt)` of every effect, in commit order.
    pub async fn effects(&self) -> Vec<(String, i32)> {
        let inbox = self.pg.inbox().await;
        let rows = sqlx::query_as("SELECT job_id, attempt FROM effects ORDER BY seq")
            .fetch_all(inbox.pool())
            .await
            .expect("read effects");
        inbox.pool().close().await;
        rows
    }

    /// Asserts that each of `n` jobs took effect, none more than once.
    pub async fn assert_each_job_once(&self, n: usize) {
        let mut per_job: HashMap<String, usize> = HashMap::new();
        for (job, _) in self.effects().await {
            *per_job.entry(job).or_default() += 1;
        }
        let twice: Vec<_> = per_job.iter().filter(|(_, &k)| k > 1).collect();
        assert!(
            twice.is_empty(),
            "jobs with more than one effect: {twice:?}"
        );
        assert_eq!(per_job.len(), n, "every job took effect");
    }

    /// How many effects were recorded.
    pub async fn effect_count(&self) -> i64 {
        let inbox = self.pg.inbox().await;
        let n = sqlx::query_scalar("SELECT count(*) FROM effects")
            .fetch_one(inbox.pool())
            .await
            .expect("count effects");
        inbox.pool().close().await;
        n
    }

    /// The group's committed offsets of the main topic, read by an independent client
    /// (`None`: nothing committed).
    pub async fn committed(&self) -> Vec<Option<i64>> {
        committed_offsets(&self.group, &self.topic, self.partitions).await
    }

    /// Every record below `ends` (per partition, as [`publish_all`] returns them) is
    /// committed by the group.
    pub async fn committed_up_to(&self, ends: &[i64]) -> bool {
        let committed = self.committed().await;
        ends.iter()
            .zip(committed)
            .all(|(end, c)| *end == 0 || c.is_some_and(|c| c >= *end))
    }
}

/// Worker settings for tests: no jitter (delays are the backoff's ceilings), no purge task.
pub fn worker_config(concurrency: usize) -> WorkerConfig {
    WorkerConfig::default()
        .with_concurrency(concurrency)
        .with_retention_interval(None)
        .with_jitter(Arc::new(NoJitter))
}

fn plain_client(group: Option<&str>) -> ClientConfig {
    let mut c = ClientConfig::new();
    c.set("bootstrap.servers", brokers())
        .set("enable.auto.commit", "false")
        .set("enable.partition.eof", "false");
    if let Some(g) = group {
        c.set("group.id", g);
    }
    c
}

/// The offsets `group` committed on each partition of `topic`, read by an independent client
/// (`None`: nothing committed).
pub async fn committed_offsets(group: &str, topic: &str, partitions: i32) -> Vec<Option<i64>> {
    let (group, topic) = (group.to_owned(), topic.to_owned());
    tokio::task::spawn_blocking(move || {
        let c: BaseConsumer = plain_client(Some(&group)).create().expect("offsets client");
        let mut tpl = TopicPartitionList::new();
        for p in 0..partitions {
            tpl.add_partition(&topic, p);
        }
        let got = c
            .committed_offsets(tpl, Duration::from_secs(15))
            .expect("committed offsets");
        (0..partitions)
            .map(|p| {
                match got
                    .find_partition(&topic, p)
                    .map(|e| e.offset())
                    .unwrap_or(Offset::Invalid)
                {
                    Offset::Offset(n) => Some(n),
                    _ => None,
                }
            })
            .collect()
    })
    .await
    .expect("offsets task")
}

/// Reads every record of `topic` (all partitions from offset 0) until `expect` arrived or
/// `limit` passed, with a throwaway client.
///
/// A test topic is fresh and nothing is deleted from it, so its log starts at offset 0.
pub async fn read_topic(
    topic: &str,
    partitions: i32,
    expect: usize,
    limit: Duration,
) -> Vec<OwnedMessage> {
    let topic = topic.to_owned();
    tokio::task::spawn_blocking(move || {
        let c: BaseConsumer = plain_client(Some(&unique("reader")))
            .create()
            .expect("reader client");
        let mut tpl = TopicPartitionList::new();
        for p in 0..partitions {
            tpl.add_partition_offset(&topic, p, Offset::Offset(0))
                .expect("tpl");
        }
        c.assign(&tpl).expect("assign");
        let start = std::time::Instant::now();
        let mut out = Vec::new();
        while out.len() < expect && start.elapsed() < limit {
            if let Some(m) = c.poll(Duration::from_millis(100)) {
                out.push(m.expect("read record").detach());
            }
        }
        out
    })
    .await
    .expect("reader task")
}

/// A header of a record as text.
pub fn header(m: &OwnedMessage, name: &str) -> Option<String> {
    m.headers()?
        .iter()
        .find(|h| h.key == name)
        .and_then(|h| h.value.map(|v| String::from_utf8_lossy(v).into_owned()))
}

/// Publishes jobs `(key, id, payload)` in order, with up to 64 awaiting their report.
/// Returns one past the last offset written to each partition (the end offsets).
///
/// The ends come from the delivery reports, so no second request can race a later write.
pub async fn publish_all(
    publisher: &KafkaPublisher,
    topic: &str,
    partitions: i32,
    jobs: Vec<(String, String, serde_json::Value)>,
) -> Vec<i64> {
    let written = futures::stream::iter(jobs)
        .map(|(key, id, body)| {
            let publisher = publisher.clone();
            let topic = topic.to_owned();
            async move {
                publisher
                    .publish(
                        &topic,
                        Some(key.as_bytes()),
                        Some(&id),
                        body.to_string().as_bytes(),
                        &[],
                    )
                    .await
                    .expect("publish")
            }
        })
        .buffered(64)
        .collect::<Vec<_>>()
        .await;
    let mut ends = vec![0; usize::try_from(partitions).expect("partitions")];
    for w in written {
        let p = usize::try_from(w.partition).expect("partition");
        ends[p] = ends[p].max(w.offset + 1);
    }
    ends
}

/// A worker running over a Kafka consumer in a task.
pub struct Running<H: Handler<Postgres> = kafka_record> {
    /// The running worker, for its stats and inbox.
    pub worker: Worker<Postgres, H>,
    /// The consumer's offset and assignment events.
    pub observer: KafkaObserver,
    stop: Option<oneshot::Sender<()>>,
    task: JoinHandle<Result<(), consumer_core::Error>>,
    closed: std::pin::Pin<Box<dyn Future<Output = ()> + Send>>,
}

impl Running {
    /// Runs [`kafka_record`] over a consumer for `config`, on the inbox of `env`.
    pub async fn start(env: &KafkaEnv, config: KafkaConfig, worker: WorkerConfig) -> Running {
        Running::start_handler(env, kafka_record, config, worker).await
    }
}

impl<H: Handler<Postgres>> Running<H> {
    /// [`Running::start`] with another handler.
    pub async fn start_handler(
        env: &KafkaEnv,
        handler: H,
        config: KafkaConfig,
        worker: WorkerConfig,
    ) -> Running<H> {
        let worker = Worker::with_config(env.pg.inbox().await, handler, worker).expect("worker");
        let transport = KafkaConsumer::new(config).expect("consumer");
        let observer = transport.observer();
        let closed = Box::pin(transport.closed());
        let (stop, stopped) = oneshot::channel::<()>();
        let task = {
            let worker = worker.clone();
            tokio::spawn(async move {
                worker
                    .run(transport, async {
                        let _ = stopped.await;
                    })
                    .await
            })
        };
        Running {
            worker,
            observer,
            stop: Some(stop),
            task,
            closed,
        }
    }

    /// The worker's counters so far.
    pub fn stats(&self) -> StatsSnapshot {
        self.worker.snapshot()
    }

    /// Graceful: in-flight deliveries finish and settle, offsets are committed, the member
    /// leaves the group.
    pub async fn stop(mut self) -> StatsSnapshot {
        if let Some(s) = self.stop.take() {
            let _ = s.send(());
        }
        tokio::time::timeout(Duration::from_secs(60), &mut self.task)
            .await
            .expect("worker stopped in time")
            .expect("worker task")
            .expect("worker run");
        tokio::time::timeout(Duration::from_secs(60), self.closed)
            .await
            .expect("consumer closed in time");
        self.worker.snapshot()
    }

    /// A crash in the process: the worker is dropped mid-flight, nothing in flight settles.
    /// Returns once the consumer has left the group.
    pub async fn kill(self) -> StatsSnapshot {
        self.task.abort();
        let _ = self.task.await;
        // The aborted handlers' connections are closed with their locks, as in a dead
        // process; the pool is closed too.
        self.worker.inbox().pool().close().await;
        tokio::time::timeout(Duration::from_secs(60), self.closed)
            .await
            .expect("consumer closed in time");
        self.worker.snapshot()
    }
}
