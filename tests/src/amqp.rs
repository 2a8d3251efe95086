//! For the RabbitMQ tests: the broker started by `scripts/rabbitmq.sh`, names and a
//! PostgreSQL schema unique to each test, workers running in tasks, and independent reads of
//! queues through plain lapin clients (not through the transport under test).
//!
//! The chaos test closes every connection of the broker and restarts it, which other tests
//! may see when they run at the same time (e.g. under a parallel runner). So every function
//! here that talks to the broker retries over connection loss, the transport under test
//! reconnects by itself, and the waits are long enough to ride out a restart.

use std::collections::BTreeMap;
use std::future::Future;
use std::path::{Path, PathBuf};
use std::str::FromStr;
use std::time::Duration;

use consumer_amqp::{AmqpConfig, AmqpConsumer, ConsumerHealth, OriginSecret};
use consumer_core::retry::NoJitter;
use consumer_core::{Error, Handler, Inbox, InboxConfig, Worker, WorkerConfig};
use invoices::provider::EmailProvider;
use lapin::options::{
    BasicAckOptions, BasicGetOptions, ExchangeDeleteOptions, QueueDeclareOptions,
    QueueDeleteOptions,
};
use lapin::types::{AMQPValue, FieldTable};
use lapin::{Connection, ConnectionProperties};
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::{PgPool, Postgres};
use tokio::sync::oneshot;
use tokio::task::JoinHandle;

/// Logs to the test's output, as in [`crate::common::init_tracing`].
pub use crate::common::init_tracing;
/// Waits for a condition, as in [`crate::common::wait_for`].
pub use crate::common::wait_for;
use crate::common::{database_url, unique};

/// Long enough for a broker restart in the middle of any wait.
pub const LONG: Duration = Duration::from_secs(120);

/// The broker URL printed by `scripts/rabbitmq.sh env`.
pub fn amqp_url() -> String {
    std::env::var("AMQP_URL").expect(
        "AMQP_URL is not set: start RabbitMQ with `eval \"$(scripts/rabbitmq.sh env)\"` \
         (and PostgreSQL with `eval \"$(scripts/postgres.sh env)\"`), or run `scripts/test.sh`",
    )
}

/// A name for a queue or exchange, unique to this test and run (`[a-z0-9_]`).
pub fn unique_name(prefix: &str) -> String {
    unique(prefix)
}

/// The origin secret of every test configuration ([`config`]): what the `consumer`
/// command is given as `AMQP_ORIGIN_SECRET` to verify the tests' dead letters.
pub const ORIGIN_SECRET: &str = "consumer-tests-origin-secret-0123456789";

/// A test configuration: short retry delays, quick reconnection, publishes that outlast a
/// broker restart, copies signed with [`ORIGIN_SECRET`].
pub fn config(queue: &str) -> AmqpConfig {
    config_at(&amqp_url(), queue)
}

/// [`config`] on the comma-separated broker `addresses` (see
/// [`AmqpConfig::with_addresses`]), e.g. the nodes of the test cluster.
pub fn config_at(addresses: &str, queue: &str) -> AmqpConfig {
    let mut c = AmqpConfig::with_addresses(addresses, queue);
    c.origin_secret = Some(OriginSecret::new(ORIGIN_SECRET).expect("a valid origin secret"));
    c.retry_delays = vec![Duration::from_millis(200), Duration::from_secs(1)];
    c.reconnect_min = Duration::from_millis(50);
    c.reconnect_max = Duration::from_secs(1);
    c.startup_timeout = LONG;
    c.publish_timeout = LONG;
    c.prefetch = 16;
    c.connection_name = Some(format!("test {queue}"));
    c
}

/// Worker settings for tests: no jitter (delays are the backoff's ceilings), no purge task.
pub fn worker_config(concurrency: usize) -> WorkerConfig {
    WorkerConfig::default()
        .with_concurrency(concurrency)
        .with_retention_interval(None)
        .with_jitter(std::sync::Arc::new(NoJitter))
}

/// A PostgreSQL schema of its own with the invoice example's tables, its inbox, and the
/// email provider stand-in installed for it.
pub struct Db {
    /// The schema's name, unique to the test.
    pub schema: String,
    /// A pool on the schema.
    pub pool: PgPool,
}

impl Db {
    /// Creates the schema with the example's tables and installs the provider stand-in.
    pub async fn new() -> Db {
        let schema = unique("amqp");
        let pool = Self::pool_for(&schema, 20).await;
        invoices::schema::migrate(&pool, &schema)
            .await
            .expect("create the example's tables");
        EmailProvider::install(&schema, pool.clone()).expect("install the provider stand-in");
        Db { schema, pool }
    }

    /// A pool on `schema`, as a separate worker process would have it.
    pub async fn pool_for(schema: &str, size: u32) -> PgPool {
        let options = PgConnectOptions::from_str(&database_url())
            .expect("DATABASE_URL")
            .options([("search_path", schema)]);
        PgPoolOptions::new()
            .max_connections(size)
            .acquire_timeout(Duration::from_secs(60))
            .connect_with(options)
            .await
            .expect("connect to PostgreSQL")
    }

    /// A new inbox in this schema (its own pool, as another process would have).
    pub async fn inbox(&self, pool_size: u32) -> Inbox<Postgres> {
        let pool = Self::pool_for(&self.schema, pool_size).await;
        Inbox::new(pool, InboxConfig::in_schema(self.schema.clone()))
            .await
            .expect("inbox")
    }

    /// `SELECT count(*) …` or any query returning one BIGINT.
    pub async fn count(&self, sql: &str) -> i64 {
        sqlx::query_scalar(sql)
            .fetch_one(&self.pool)
            .await
            .unwrap_or_else(|e| panic!("{sql}: {e}"))
    }
}

/// A worker consuming in a task until stopped.
pub struct Running<H: Handler<Postgres>> {
    /// The running worker, for its stats and inbox.
    pub worker: Worker<Postgres, H>,
    /// The consumer's connection state.
    pub health: ConsumerHealth,
    stop: oneshot::Sender<()>,
    task: JoinHandle<Result<(), Error>>,
}

impl<H: Handler<Postgres>> Running<H> {
    /// Connects a consumer for `config` and runs `worker` on it.
    pub async fn start(worker: Worker<Postgres, H>, config: AmqpConfig) -> Self {
        let consumer = AmqpConsumer::connect(config)
            .await
            .expect("connect the consumer");
        let health = consumer.health();
        let (stop, stopped) = oneshot::channel::<()>();
        let task = {
            let worker = worker.clone();
            tokio::spawn(async move {
                worker
                    .run(consumer, async {
                        let _ = stopped.await;
                    })
                    .await
            })
        };
        Running {
            worker,
            health,
            stop,
            task,
        }
    }

    /// Stops it gracefully and waits until its connection is closed.
    pub async fn stop(self) -> consumer_core::stats::StatsSnapshot {
        let _ = self.stop.send(());
        tokio::time::timeout(LONG, self.task)
            .await
            .expect("the worker stops")
            .expect("the worker task")
            .expect("the worker ends without error");
        tokio::time::timeout(Duration::from_secs(10), self.health.closed())
            .await
            .expect("the consumer closes its connection");
        self.worker.snapshot()
    }
}

/// A message read back from a queue.
#[derive(Debug, Clone)]
pub struct Got {
    /// The message body.
    pub body: Vec<u8>,
    /// The `message_id` property.
    pub message_id: Option<String>,
    /// The `content_type` property.
    pub content_type: Option<String>,
    /// The `correlation_id` property.
    pub correlation_id: Option<String>,
    /// The headers, each value as text.
    pub headers: BTreeMap<String, String>,
}

/// Independent access to the broker through plain lapin, retried over connection loss.
pub struct Rabbit;

impl Rabbit {
    async fn with_connection<T, F, Fut>(what: &str, mut f: F) -> T
    where
        F: FnMut(Connection) -> Fut,
        Fut: Future<Output = lapin::Result<T>>,
    {
        let start = tokio::time::Instant::now();
        loop {
            let attempt = async {
                let conn =
                    Connection::connect(&amqp_url(), ConnectionProperties::default()).await?;
                f(conn).await
            };
            match tokio::time::timeout(Duration::from_secs(15), attempt).await {
                Ok(Ok(t)) => return t,
                Ok(Err(e)) if start.elapsed() < LONG => {
                    tracing::info!(error = %e, "{what}: retrying");
                }
                Err(_) if start.elapsed() < LONG => {}
                other => panic!("{what}: {:?}", other.err()),
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }

    /// Messages ready in `queue` (a passive declare: the queue must exist).
    pub async fn ready(queue: &str) -> u32 {
        Self::with_connection("count messages", |conn| ready_on(conn, queue)).await
    }

    /// Takes every message from `queue`.
    pub async fn take_all(queue: &str) -> Vec<Got> {
        Self::with_connection("read a queue", |conn| async move {
            let channel = conn.create_channel().await?;
            let mut out = Vec::new();
            while let Some(m) = channel
                .basic_get(queue.into(), BasicGetOptions::default())
                .await?
            {
                let p = &m.delivery.properties;
                out.push(Got {
                    body: m.delivery.data.clone(),
                    message_id: p.message_id().as_ref().map(|s| s.to_string()),
                    content_type: p.content_type().as_ref().map(|s| s.to_string()),
                    correlation_id: p.correlation_id().as_ref().map(|s| s.to_string()),
                    headers: strings(p.headers().as_ref()),
                });
                m.delivery.ack(BasicAckOptions::default()).await?;
            }
            let _ = conn.close(200, "ok".into()).await;
            Ok(out)
        })
        .await
    }

    /// Publishes a request to `queue` (default exchange) with the `reply_to` and
    /// `correlation_id` properties, as an RPC client does, and waits for the confirm.
    pub async fn publish_request(
        queue: &str,
        message_id: &str,
        body: &[u8],
        reply_to: &str,
        correlation_id: &str,
    ) {
        Self::with_connection("publish a request", |conn| async move {
            let channel = conn.create_channel().await?;
            channel
                .confirm_select(lapin::options::ConfirmSelectOptions::default())
                .await?;
            let properties = lapin::BasicProperties::default()
                .with_message_id(message_id.into())
                .with_reply_to(reply_to.into())
                .with_correlation_id(correlation_id.into());
            channel
                .basic_publish(
                    "".into(),
                    queue.into(),
                    lapin::options::BasicPublishOptions::default(),
                    body,
                    properties,
                )
                .await?
                .await?;
            let _ = conn.close(200, "ok".into()).await;
            Ok(())
        })
        .await
    }

    /// Deletes one queue.
    pub async fn delete_queue(queue: &str) {
        Self::with_connection("delete a queue", |conn| async move {
            let channel = conn.create_channel().await?;
            channel
                .queue_delete(queue.into(), QueueDeleteOptions::default())
                .await?;
            let _ = conn.close(200, "ok".into()).await;
            Ok(())
        })
        .await
    }

    /// Deletes the queues of `config` (work, retry, dead-letter) and its exchange.
    pub async fn delete_topology(config: &AmqpConfig) {
        let mut queues = vec![config.queue.clone(), config.dead_letter_queue_name()];
        queues.extend(
            config
                .retry_delays
                .iter()
                .map(|d| config.retry_queue_name(*d)),
        );
        let exchange = config.exchange.clone();
        Self::with_connection("delete test queues", |conn| {
            let queues = queues.clone();
            let exchange = exchange.clone();
            async move {
                let channel = conn.create_channel().await?;
                for q in &queues {
                    channel
                        .queue_delete(q.as_str().into(), QueueDeleteOptions::default())
                        .await?;
                }
                if !exchange.is_empty() {
                    channel
                        .exchange_delete(exchange.as_str().into(), ExchangeDeleteOptions::default())
                        .await?;
                }
                let _ = conn.close(200, "ok".into()).await;
                Ok(())
            }
        })
        .await
    }
}

/// Messages ready in `queue`, through `conn` (a passive declare: the queue must exist),
/// which it then closes.
pub async fn ready_on(conn: Connection, queue: &str) -> lapin::Result<u32> {
    let channel = conn.create_channel().await?;
    let q = channel
        .queue_declare(
            queue.into(),
            QueueDeclareOptions {
                passive: true,
                ..QueueDeclareOptions::default()
            },
            FieldTable::default(),
        )
        .await?;
    let _ = conn.close(200, "ok".into()).await;
    Ok(q.message_count())
}

fn strings(table: Option<&FieldTable>) -> BTreeMap<String, String> {
    let mut out = BTreeMap::new();
    for (k, v) in table.map(|t| t.inner().iter()).into_iter().flatten() {
        let s = match v {
            AMQPValue::LongString(s) => s.to_string(),
            AMQPValue::ShortString(s) => s.to_string(),
            AMQPValue::LongLongInt(n) => n.to_string(),
            AMQPValue::LongInt(n) => n.to_string(),
            AMQPValue::ShortShortUInt(n) => n.to_string(),
            other => format!("{other:?}"),
        };
        out.insert(k.to_string(), s);
    }
    out
}

/// The repository root.
pub fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("tests/ has a parent")
        .to_path_buf()
}

/// Closes, from the broker side, the connections whose client properties mention
/// `fragment` (e.g. a queue's name in the connection name): a disruption that touches
/// nothing else on the shared broker. Returns how many were closed.
pub async fn close_connections_matching(fragment: &str) -> usize {
    let out = rabbitmq_sh(&[
        "ctl",
        "list_connections",
        "pid",
        "client_properties",
        "-q",
        "--no-table-headers",
    ])
    .await;
    let pids: Vec<String> = out
        .lines()
        .filter(|l| l.contains(fragment))
        .filter_map(|l| l.split('\t').next())
        .map(str::to_owned)
        .collect();
    for pid in &pids {
        rabbitmq_sh(&["ctl", "close_connection", pid, "test: targeted close"]).await;
    }
    pids.len()
}

/// Runs `scripts/rabbitmq.sh <args>` and returns its standard output; panics with its
/// output on failure.
pub async fn rabbitmq_sh(args: &[&str]) -> String {
    let script = repo_root().join("scripts/rabbitmq.sh");
    let owned: Vec<String> = args.iter().map(|a| (*a).to_owned()).collect();
    let out = tokio::task::spawn_blocking(move || {
        std::process::Command::new(script).args(owned).output()
    })
    .await
    .expect("join")
    .expect("run scripts/rabbitmq.sh");
    assert!(
        out.status.success(),
        "scripts/rabbitmq.sh {args:?} failed: {}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// Sets the policy `name` (priority 100, queues only) on the queues whose names match
/// `pattern`, with `definition` (JSON), through `rabbitmqctl set_policy`.
pub async fn set_queue_policy(name: &str, pattern: &str, definition: &str) {
    rabbitmq_sh(&[
        "ctl",
        "set_policy",
        "--apply-to",
        "queues",
        "--priority",
        "100",
        name,
        pattern,
        definition,
    ])
    .await;
}
