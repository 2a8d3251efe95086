//! RabbitMQ's `consumer_timeout` (delivery acknowledgement timeout): a handler that outlasts
//! it gets its channel closed by the broker; the consumer reconnects, the broker redelivers,
//! and the job takes effect exactly once. A worker whose handler timeout is not below the
//! configured `broker_consumer_timeout` is refused at startup.
//!
//! The broker's timeout is lowered to 2 s (checked every second) on node 1 of the cluster of
//! `scripts/rabbitmq.sh cluster 3` for the first test, through `rabbitmqctl eval`, and put
//! back when it ends: it applies to channels opened meanwhile.

use std::collections::HashSet;
use std::sync::Mutex;
use std::time::Duration;

use consumer_amqp::{AmqpConfig, AmqpConsumer, AmqpPublisher, Error as AmqpError};
use consumer_core::{handler, Context, HandlerError, Worker};
use consumer_tests::amqp::{
    self, config_at, init_tracing, wait_for, worker_config, Db, Running, LONG,
};
use consumer_tests::amqp_cluster::{cluster_urls, node_ctl, ready_in_cluster};
use serde::{Deserialize, Serialize};
use sqlx::Postgres;

#[derive(Debug, Serialize, Deserialize)]
struct Job {
    id: String,
}

/// The jobs whose first run slept past the broker's timeout.
static SLEPT: Mutex<Option<HashSet<String>>> = Mutex::new(None);

/// How long the first run of each job takes: twice the broker's timeout below.
const SLOW: Duration = Duration::from_secs(4);

#[handler(name = "slow_once")]
async fn slow_once(ctx: &mut Context<'_, Postgres>, job: Job) -> Result<(), HandlerError> {
    let first = SLEPT
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .get_or_insert_with(HashSet::new)
        .insert(job.id.clone());
    if first {
        tokio::time::sleep(SLOW).await;
    }
    sqlx::query("INSERT INTO slow_effects (job_id) VALUES ($1)")
        .bind(&job.id)
        .execute(ctx.db())
        .await?;
    Ok(())
}

/// Sets `rabbit`'s application variable `key` on cluster node 1; returns its value before.
async fn set_broker_env(key: &str, value: &str) -> String {
    let before = node_ctl(
        1,
        &["eval", &format!("application:get_env(rabbit, {key}).")],
    )
    .await;
    node_ctl(
        1,
        &[
            "eval",
            &format!("application:set_env(rabbit, {key}, {value})."),
        ],
    )
    .await;
    // `{ok,1800000}`
    before
        .trim()
        .trim_start_matches("{ok,")
        .trim_end_matches('}')
        .to_owned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
#[allow(clippy::unwrap_used, clippy::print_stdout)]
async fn a_handler_outlasting_the_broker_consumer_timeout_gets_its_channel_closed_and_the_job_runs_once(
) {
    init_tracing();
    let db = Db::new().await;
    sqlx::query("CREATE TABLE slow_effects (job_id TEXT NOT NULL)")
        .execute(&db.pool)
        .await
        .unwrap();
    let node1 = cluster_urls().split(',').next().unwrap().trim().to_owned();
    // The configuration does not know the broker's lowered timeout (the default, 30 min),
    // as when an operator lowered it without telling the workers.
    let config = config_at(&node1, &amqp::unique_name("slow"));
    let timeout_before = set_broker_env("consumer_timeout", "2000").await;
    let tick_before = set_broker_env("channel_tick_interval", "1000").await;
    let outcome = tokio::spawn(run_slow_jobs(db, config)).await;
    set_broker_env("consumer_timeout", &timeout_before).await;
    set_broker_env("channel_tick_interval", &tick_before).await;
    if let Err(e) = outcome {
        std::panic::resume_unwind(e.into_panic());
    }
}

#[allow(clippy::unwrap_used, clippy::print_stdout)]
async fn run_slow_jobs(db: Db, config: AmqpConfig) {
    const JOBS: usize = 3;
    let worker = Worker::with_config(db.inbox(10).await, slow_once, worker_config(4)).unwrap();
    let running = Running::start(worker, config.clone()).await;
    let publisher = AmqpPublisher::connect(config.clone()).await.unwrap();
    for i in 0..JOBS {
        let id = format!("{}-{i}", config.queue);
        publisher
            .publish_json(&config.queue, &id, &Job { id: id.clone() })
            .await
            .unwrap();
    }
    publisher.close().await;
    let health = running.health.clone();
    wait_for(
        "every job's effect and every delivery acked",
        LONG,
        || async {
            let s = running.worker.snapshot();
            db.count("SELECT count(*) FROM slow_effects").await >= JOBS as i64
                && s.completed + s.duplicates >= JOBS as u64
                && ready_in_cluster(&config).await == 0
        },
    )
    .await;
    let stats = running.stop().await;
    let effects = db.count("SELECT count(*) FROM slow_effects").await;
    let distinct = db
        .count("SELECT count(DISTINCT job_id) FROM slow_effects")
        .await;
    println!(
        "sessions {} (the broker closed the channel under the slow handler), {stats:?}",
        health.sessions()
    );
    assert!(
        health.sessions() >= 2,
        "the broker closed the channel and the consumer reconnected"
    );
    assert_eq!(
        (effects, distinct),
        (JOBS as i64, JOBS as i64),
        "each job once"
    );
    assert_eq!(stats.completed, JOBS as u64, "{stats:?}");
    assert!(
        stats.duplicates >= 1,
        "a redelivery was recognised: {stats:?}"
    );
    assert_eq!(ready_in_cluster(&config).await, 0, "every message acked");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_whose_handler_timeout_is_not_below_the_broker_consumer_timeout_is_refused() {
    init_tracing();
    let db = Db::new().await;
    let mut config = config_at(&cluster_urls(), &amqp::unique_name("refused"));
    // The handler's timeout is 30 s (the default).
    config.broker_consumer_timeout = Duration::from_secs(30);
    let worker = Worker::with_config(db.inbox(2).await, slow_once, worker_config(1)).unwrap();
    match AmqpConsumer::connect_for(config.clone(), &worker).await {
        Err(AmqpError::Config { field, reason }) => {
            assert_eq!(field, "amqp.broker_consumer_timeout", "{reason}");
        }
        other => panic!("expected a refusal, got {:?}", other.map(|_| ())),
    }
    config.broker_consumer_timeout = Duration::from_secs(31);
    let consumer = AmqpConsumer::connect_for(config, &worker)
        .await
        .expect("a handler timeout below the broker's is accepted");
    drop(consumer);
}
