//! RabbitMQ: the broker closes every connection (`rabbitmqctl
//! close_all_connections`) and later restarts (`scripts/rabbitmq.sh restart`), both while a
//! worker is busy with 1,000 invoice jobs: the worker reconnects by itself and every job's
//! effect happens exactly once.
//!
//! Both disruptions hit the whole (shared) broker, so they live in this one test, one after
//! the other; other RabbitMQ tests tolerate them (see `amqp_support`).

use std::time::{Duration, Instant};

use consumer_amqp::AmqpPublisher;
use consumer_core::{handler, Context, HandlerError, Worker};
use consumer_tests::amqp::{
    self, config, init_tracing, rabbitmq_sh, wait_for, worker_config, Db, Rabbit, Running, LONG,
};
use futures::{StreamExt, TryStreamExt};
use invoices::InvoiceJob;
use sqlx::Postgres;

const JOBS: i64 = 1000;

/// The example's `send_invoice`, slowed down so that the disruptions land mid-stream.
#[handler(
    name = "send_invoice",
    key = "invoice-{order_id}",
    max_attempts = 10,
    backoff = "200ms..1s"
)]
async fn slow_send_invoice(
    ctx: &mut Context<'_, Postgres>,
    job: InvoiceJob,
) -> Result<(), HandlerError> {
    tokio::time::sleep(Duration::from_millis(25)).await;
    invoices::send_invoice::call(ctx, job).await
}

async fn publish(publisher: &AmqpPublisher, queue: &str, jobs: &[InvoiceJob]) {
    futures::stream::iter(jobs)
        .map(|job| async move { publisher.publish_json(queue, &job.message_id(), job).await })
        .buffer_unordered(64)
        .try_collect::<Vec<()>>()
        .await
        .expect("publish and confirm");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn connections_closed_and_broker_restarted_midstream_every_job_runs_once() {
    init_tracing();
    let db = Db::new().await;
    let cfg = config(&amqp::unique_name("chaos"));
    let jobs: Vec<InvoiceJob> = (1..=JOBS).map(InvoiceJob::sample).collect();
    invoices::schema::place_orders(&db.pool, &jobs)
        .await
        .expect("place the orders");
    let publisher = AmqpPublisher::connect(cfg.clone()).await.unwrap();
    publish(&publisher, &cfg.queue, &jobs).await;

    let worker =
        Worker::with_config(db.inbox(20).await, slow_send_invoice, worker_config(4)).unwrap();
    let running = Running::start(worker, cfg.clone()).await;
    let invoices = || db.count("SELECT count(*) FROM invoices");

    // 1. The broker closes every connection.
    wait_for("the first 100 invoices", LONG, || async {
        invoices().await >= 100
    })
    .await;
    let t = Instant::now();
    rabbitmq_sh(&["ctl", "close_all_connections", "chaos test"]).await;
    let closed_at = invoices().await;
    wait_for("the consumer to reconnect", LONG, || async {
        running.health.sessions() >= 2 && running.health.is_connected()
    })
    .await;
    let reconnected_in = t.elapsed();
    // `close_all_connections` is a CLI call that can take seconds on a loaded machine, and
    // the worker goes on meanwhile: progress is 50 more invoices, or all of them.
    wait_for("progress after reconnecting", LONG, || async {
        invoices().await >= (closed_at + 50).min(JOBS)
    })
    .await;

    // 2. The broker restarts.
    let before_restart = invoices().await;
    let t = Instant::now();
    rabbitmq_sh(&["restart"]).await;
    let restart_took = t.elapsed();
    let after_restart = invoices().await;
    wait_for(
        "the consumer to reconnect after the restart",
        LONG,
        || async { running.health.sessions() >= 3 && running.health.is_connected() },
    )
    .await;
    let resumed_in = t.elapsed();

    // 3. 10% of the jobs published again, through the same publisher: it reconnects by
    // itself (its connection died twice).
    let republished: Vec<InvoiceJob> = jobs
        .iter()
        .filter(|j| j.order_id % 10 == 0)
        .cloned()
        .collect();
    publish(&publisher, &cfg.queue, &republished).await;
    publisher.close().await;

    wait_for("all 1,000 invoices", LONG, || async {
        invoices().await >= JOBS
    })
    .await;
    wait_for("every delivery to be settled", LONG, || async {
        let s = running.worker.snapshot();
        s.completed + s.duplicates >= (JOBS as u64) + republished.len() as u64
            && Rabbit::ready(&cfg.queue).await == 0
    })
    .await;
    let sessions = running.health.sessions();
    let stale = running.health.stale_deliveries_dropped();
    let stats = running.stop().await;

    println!(
        "closed all connections at {closed_at} invoices, reconnected in {reconnected_in:?}; \
         restart at {before_restart} invoices took {restart_took:?} ({after_restart} after it), \
         consuming again {resumed_in:?} after it began; {sessions} sessions, {stale} stale \
         deliveries dropped; {stats:?}"
    );
    assert!(
        before_restart < JOBS && after_restart < JOBS,
        "the restart happened mid-stream"
    );
    assert!(sessions >= 3, "reconnected after each disruption");
    assert_eq!(invoices().await, JOBS);
    assert_eq!(
        db.count("SELECT count(DISTINCT order_id) FROM invoices")
            .await,
        JOBS
    );
    assert_eq!(
        db.count("SELECT count(*) FROM orders WHERE invoice_sent")
            .await,
        JOBS
    );
    assert_eq!(
        stats.completed, JOBS as u64,
        "each job committed once: {stats:?}"
    );
    assert_eq!(
        db.count("SELECT count(*) FROM consumer_inbox WHERE status <> 'completed'")
            .await,
        0
    );
    assert_eq!(stats.dead_lettered, 0, "{stats:?}");
    Rabbit::delete_topology(&cfg).await;
}
