//! RabbitMQ cluster: a worker whose node is killed (SIGKILL) mid-stream fails over to
//! another node of the cluster and finishes, every job taking effect exactly once and every
//! message acked; the publisher that was connected to the same node publishes the last
//! jobs through another one. Poison jobs, retried through the retry queues while the node
//! dies, still end in the dead-letter queue, each once. Needs the cluster of
//! `scripts/rabbitmq.sh cluster 3` (AMQP_CLUSTER_URLS).

use std::time::Instant;

use consumer_amqp::{AmqpPublisher, QueueType};
use consumer_core::Worker;
use consumer_tests::amqp::{self, init_tracing, wait_for, worker_config, Db, Running, LONG};
use consumer_tests::amqp_cluster::{cluster_config, kill_node, node_of, ready_in_cluster};
use futures::{StreamExt, TryStreamExt};
use invoices::{send_invoice, InvoiceJob};

const JOBS: i64 = 1000;
/// Published after the kill, through the publisher connected before it.
const LATE: i64 = 100;
/// Poison jobs among the first published: failing every attempt, their retry copies are
/// being written when the node dies.
const POISON: i64 = 20;

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
#[allow(clippy::unwrap_used, clippy::print_stdout)]
async fn killing_the_node_of_a_worker_mid_stream_fails_over_without_loss_or_duplicate() {
    init_tracing();
    let db = Db::new().await;
    let mut config = cluster_config(&amqp::unique_name("cluster_jobs"));
    // Replicated on the three nodes: the queue outlives any one of them.
    config.queue_type = QueueType::Quorum;
    let poison = (1..=POISON).map(|i| InvoiceJob::sample(invoices::POISON_ORDERS.start + i));
    let jobs: Vec<InvoiceJob> = poison
        .chain((1..=JOBS + LATE).map(InvoiceJob::sample))
        .collect();
    let (early, late) = jobs.split_at((POISON + JOBS) as usize);
    invoices::schema::place_orders(&db.pool, &jobs)
        .await
        .expect("place the orders");

    // Everything queued first, so the kill lands while the worker is busy.
    // Connected to the first address, node 1, as the worker will be.
    let publisher = AmqpPublisher::connect(config.clone()).await.unwrap();
    publish(&publisher, &config.queue, early).await;

    let worker = Worker::with_config(
        db.inbox(20).await,
        send_invoice,
        worker_config(8).with_max_attempts(4),
    )
    .unwrap();
    let running = Running::start(worker, config.clone()).await;
    let health = running.health.clone();
    wait_for("the first invoices", LONG, || async {
        db.count("SELECT count(*) FROM invoices").await >= JOBS / 10
    })
    .await;
    let first = health.address().expect("connected");
    let killed = node_of(&config, &first);
    let started = Instant::now();
    let down = kill_node(killed).await;
    let done_at_kill = db.count("SELECT count(*) FROM invoices").await;
    let dead_at_kill = running.worker.snapshot().dead_lettered;
    assert!(
        dead_at_kill < POISON as u64,
        "every poison job was dead-lettered before node {killed} was killed: no copy crosses the kill"
    );
    assert!(
        done_at_kill < JOBS,
        "every job was done before node {killed} was killed: the test proves nothing; raise JOBS"
    );
    println!(
        "killed node {killed} ({first}) with {done_at_kill} of {JOBS} invoices done, \
         {dead_at_kill} of {POISON} poison jobs dead-lettered"
    );
    publish(&publisher, &config.queue, late).await;
    publisher.close().await;

    wait_for("the worker to connect to another node", LONG, || async {
        health.is_connected() && health.address().is_some_and(|a| a != first)
    })
    .await;
    let second = health.address().unwrap();
    println!(
        "reconnected to node {} ({second}) after {:?}",
        node_of(&config, &second),
        started.elapsed()
    );
    wait_for("every invoice, every delivery settled", LONG, || async {
        let s = running.worker.snapshot();
        db.count("SELECT count(*) FROM invoices").await >= JOBS + LATE
            && s.completed + s.duplicates >= (JOBS + LATE) as u64
            && s.dead_lettered >= POISON as u64
            && ready_in_cluster(&config).await == 0
    })
    .await;
    let finished_in = started.elapsed();
    let health_after = running.health.clone();
    let stats = running.stop().await;
    down.restart().await;

    let invoices = db.count("SELECT count(*) FROM invoices").await;
    let orders = db
        .count("SELECT count(DISTINCT order_id) FROM invoices")
        .await;
    println!(
        "all done {finished_in:?} after the kill; sessions {}, stale deliveries dropped {}; {stats:?}",
        health_after.sessions(),
        health_after.stale_deliveries_dropped()
    );
    let all = JOBS + LATE;
    assert_eq!((invoices, orders), (all, all), "each job exactly once");
    assert_eq!(stats.completed, all as u64, "{stats:?}");
    assert_eq!(stats.dead_lettered, POISON as u64, "{stats:?}");
    let mut dead_letters = config.clone();
    dead_letters.queue = config.dead_letter_queue_name();
    assert_eq!(
        ready_in_cluster(&dead_letters).await,
        POISON as u32,
        "each poison job dead-lettered once"
    );
    assert!(health_after.sessions() >= 2, "the worker reconnected");
    assert_eq!(ready_in_cluster(&config).await, 0, "every message acked");
}

/// Publishes `jobs` to `queue` with up to 64 confirms outstanding.
async fn publish(publisher: &AmqpPublisher, queue: &str, jobs: &[InvoiceJob]) {
    futures::stream::iter(jobs)
        .map(|job| async move { publisher.publish_json(queue, &job.message_id(), job).await })
        .buffer_unordered(64)
        .try_collect::<()>()
        .await
        .expect("publish and confirm every job");
}
