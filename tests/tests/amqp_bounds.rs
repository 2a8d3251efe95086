//! Bounds on RabbitMQ: at most `WorkerConfig::concurrency` handlers run at once, and the
//! broker holds at most `AmqpConfig::prefetch` deliveries unacknowledged for the consumer.

use consumer_amqp::AmqpPublisher;
use consumer_core::Worker;
use consumer_tests::amqp::{
    self, config, init_tracing, rabbitmq_sh, wait_for, worker_config, Rabbit, Running, LONG,
};
use consumer_tests::common::PgEnv;
use consumer_tests::gauge::{gated, Lane};
use serde_json::json;

const JOBS: u32 = 40;
const CONCURRENCY: usize = 3;
const PREFETCH: u16 = 5;

/// `messages_unacknowledged` of `queue`, as `rabbitmqctl list_queues` reports it.
async fn unacknowledged(queue: &str) -> u32 {
    let out = rabbitmq_sh(&[
        "ctl",
        "list_queues",
        "name",
        "messages_unacknowledged",
        "-q",
        "--no-table-headers",
    ])
    .await;
    out.lines()
        .filter_map(|l| l.split_once('\t'))
        .find(|(name, _)| name.trim() == queue)
        .and_then(|(_, n)| n.trim().parse().ok())
        .unwrap_or_else(|| panic!("no line for {queue} in:\n{out}"))
}

// Test code: it may unwrap and print.
#[allow(clippy::unwrap_used, clippy::print_stdout)]
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn handlers_stay_within_concurrency_and_unacked_within_prefetch() {
    init_tracing();
    let env = PgEnv::new().await;
    let queue = amqp::unique_name("bounds");
    let lane = Lane::get(&queue);
    let mut cfg = config(&queue);
    cfg.prefetch = PREFETCH;

    let publisher = AmqpPublisher::connect(cfg.clone()).await.unwrap();
    for i in 0..JOBS {
        let id = format!("job-{i}");
        publisher
            .publish_json(
                &queue,
                &id,
                &json!({"id": id, "lane": queue, "work_ms": 20}),
            )
            .await
            .unwrap();
    }
    publisher.close().await;
    assert_eq!(Rabbit::ready(&queue).await, JOBS);

    let worker = Worker::with_config(env.inbox().await, gated, worker_config(CONCURRENCY)).unwrap();
    let running = Running::start(worker, cfg.clone()).await;

    // Gate closed: nothing completes, so nothing is acked. The broker hands out `PREFETCH`
    // deliveries and no more; the worker runs `CONCURRENCY` of them and holds the rest.
    wait_for(
        "the prefetch window handed out and the handlers busy",
        LONG,
        || async {
            lane.running() == CONCURRENCY
                && Rabbit::ready(&queue).await <= JOBS - u32::from(PREFETCH)
        },
    )
    .await;
    assert_eq!(
        Rabbit::ready(&queue).await,
        JOBS - u32::from(PREFETCH),
        "the broker sent more than the prefetch ahead of acks"
    );
    let unacked = unacknowledged(&queue).await;
    assert_eq!(
        unacked,
        u32::from(PREFETCH),
        "rabbitmqctl: unacknowledged deliveries"
    );
    assert_eq!(
        lane.max(),
        CONCURRENCY,
        "handlers running while the gate is closed"
    );
    assert_eq!(running.worker.snapshot().completed, 0);

    // Open: the queue drains with runs overlapping; never more than `CONCURRENCY` at once.
    lane.open();
    wait_for("every job committed and the queue empty", LONG, || async {
        running.worker.snapshot().completed == u64::from(JOBS) && Rabbit::ready(&queue).await == 0
    })
    .await;
    let stats = running.stop().await;
    println!("max handlers at once: {}; {stats:?}", lane.max());
    assert_eq!(
        lane.max(),
        CONCURRENCY,
        "most handlers ever running at once"
    );
    assert_eq!(lane.runs(), u64::from(JOBS), "each job ran once");
    let inbox = env.inbox().await;
    let rows: i64 = sqlx::query_scalar("SELECT count(DISTINCT job_id) FROM ledger")
        .fetch_one(inbox.pool())
        .await
        .unwrap();
    assert_eq!(rows, i64::from(JOBS));
    Rabbit::delete_topology(&cfg).await;
}
