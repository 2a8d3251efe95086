//! RabbitMQ: 1,000 invoice jobs plus 10% republished duplicates (same message
//! id) through a fanout exchange to the invoice and email workers of the example, on a real
//! RabbitMQ and PostgreSQL, give exactly 1,000 invoices and 1,000 provider calls.

use std::time::{Duration, Instant};

use consumer_amqp::{AmqpPublisher, ExchangeType, QueueType};
use consumer_core::{BatchConfig, Worker};
use consumer_tests::amqp::{
    self, config, init_tracing, wait_for, worker_config, Db, Rabbit, Running, LONG,
};
use futures::{StreamExt, TryStreamExt};
use invoices::{send_email, send_invoice, InvoiceJob};

const JOBS: i64 = 1000;
const DUPLICATES: i64 = 100;
/// Jobs published before the invoice worker starts, so their emails must retry.
const EARLY: usize = 10;

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn thousand_jobs_with_duplicates_give_thousand_invoices_and_provider_calls() {
    thousand_jobs(None).await;
}

/// The same in batched mode: batches mix completions, duplicates and retries (an email
/// before its invoice), so their deliveries are acked both in coalesced `multiple` frames
/// and alone, around retry copies still being published.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn thousand_jobs_with_duplicates_in_batches_give_thousand_invoices_and_provider_calls() {
    thousand_jobs(Some(BatchConfig::default())).await;
}

// The body of both tests above, so test code: it may unwrap and print.
#[allow(clippy::unwrap_used, clippy::print_stdout)]
async fn thousand_jobs(batch: Option<BatchConfig>) {
    init_tracing();
    let db = Db::new().await;
    let exchange = amqp::unique_name("jobs");
    let mut invoice_config = config(&amqp::unique_name("invoices"));
    invoice_config.exchange = exchange.clone();
    invoice_config.exchange_type = ExchangeType::Fanout;
    // Both queue types: the invoices on a classic queue, the emails (which retry until
    // their invoice exists) on a quorum queue (retry queues are quorum queues for both).
    invoice_config.queue_type = QueueType::Classic;
    invoice_config.retry_delays = vec![Duration::from_secs(1), Duration::from_secs(2)];
    let mut email_config = invoice_config.clone();
    email_config.queue = amqp::unique_name("emails");
    email_config.queue_type = QueueType::Quorum;

    let jobs: Vec<InvoiceJob> = (1..=JOBS).map(InvoiceJob::sample).collect();
    invoices::schema::place_orders(&db.pool, &jobs)
        .await
        .expect("place the orders");

    let worker_config = || worker_config(8).with_batch(batch);
    // The emails retry until their invoice exists; more attempts than the default so none
    // runs out while the invoice worker works through a loaded machine's backlog.
    let email_worker = Worker::with_config(
        db.inbox(20).await,
        send_email,
        worker_config().with_max_attempts(30),
    )
    .unwrap();
    let emailing = Running::start(email_worker, email_config.clone()).await;

    // Declaring both queues before publishing, so each gets every job.
    let publisher = AmqpPublisher::connect(invoice_config.clone())
        .await
        .unwrap();
    publisher.declare(&email_config).await.unwrap();
    let start = Instant::now();
    // The first jobs go out while only the email worker runs, so their emails find no
    // invoice and go through the quorum retry queues for certain (not by a race).
    let (early, rest) = jobs.split_at(EARLY);
    publish(&publisher, early.iter())
        .await
        .expect("publish and confirm the early jobs");
    wait_for("an email to be sent to a retry queue", LONG, || async {
        emailing.worker.snapshot().retries > 0
    })
    .await;
    let invoice_worker =
        Worker::with_config(db.inbox(20).await, send_invoice, worker_config()).unwrap();
    let invoicing = Running::start(invoice_worker, invoice_config.clone()).await;
    let republished = jobs.iter().filter(|j| j.order_id % 10 == 0);
    publish(&publisher, rest.iter().chain(republished))
        .await
        .expect("publish and confirm every job");
    let published_in = start.elapsed();
    publisher.close().await;

    wait_for("1,000 invoices and 1,000 provider calls", LONG, || async {
        db.count("SELECT count(*) FROM invoices").await >= JOBS
            && db.count("SELECT count(*) FROM provider_calls").await >= JOBS
    })
    .await;
    let effects_in = start.elapsed();
    // Every delivery settled: each job once, each duplicate once (more only if the broker
    // redelivered after a reconnect), nothing left waiting in a retry queue. A duplicate of
    // an email waiting in a retry queue is superseded by that copy rather than skipped.
    wait_for("every delivery to be settled", LONG, || async {
        let i = invoicing.worker.snapshot();
        let e = emailing.worker.snapshot();
        i.completed + i.duplicates >= (JOBS + DUPLICATES) as u64
            && e.completed + e.duplicates + e.superseded >= (JOBS + DUPLICATES) as u64
            && Rabbit::ready(&invoice_config.queue).await == 0
            && Rabbit::ready(&email_config.queue).await == 0
    })
    .await;
    let invoice_stats = invoicing.stop().await;
    let email_stats = emailing.stop().await;

    let invoices = db.count("SELECT count(*) FROM invoices").await;
    let invoiced_orders = db
        .count("SELECT count(DISTINCT order_id) FROM invoices")
        .await;
    let calls = db.count("SELECT count(*) FROM provider_calls").await;
    let distinct_keys = db
        .count("SELECT count(DISTINCT idempotency_key) FROM provider_calls")
        .await;
    let flagged = db
        .count("SELECT count(*) FROM orders WHERE invoice_sent AND email_sent")
        .await;
    println!(
        "published {} messages in {published_in:?}; all effects after {effects_in:?}; \
         invoice worker {invoice_stats:?}; email worker {email_stats:?}",
        JOBS + DUPLICATES
    );
    assert_eq!((invoices, invoiced_orders), (JOBS, JOBS));
    assert_eq!((calls, distinct_keys), (JOBS, JOBS));
    assert_eq!(flagged, JOBS);
    assert_eq!(invoice_stats.completed, JOBS as u64, "{invoice_stats:?}");
    assert_eq!(email_stats.completed, JOBS as u64, "{email_stats:?}");
    assert!(invoice_stats.duplicates >= DUPLICATES as u64);
    assert_eq!(invoice_stats.dead_lettered + email_stats.dead_lettered, 0);
    assert!(email_stats.retries > 0, "the quorum retry queues were used");
    for c in [&invoice_config, &email_config] {
        assert_eq!(Rabbit::ready(&c.queue).await, 0, "{} drained", c.queue);
        assert_eq!(Rabbit::ready(&c.dead_letter_queue_name()).await, 0);
        for d in &c.retry_delays {
            assert_eq!(Rabbit::ready(&c.retry_queue_name(*d)).await, 0);
        }
    }
    Rabbit::delete_topology(&invoice_config).await;
    Rabbit::delete_topology(&email_config).await;
}

/// Publishes `jobs` with up to 64 confirms outstanding.
async fn publish<'a>(
    publisher: &AmqpPublisher,
    jobs: impl Iterator<Item = &'a InvoiceJob>,
) -> Result<(), consumer_amqp::Error> {
    futures::stream::iter(jobs)
        .map(|job| async move {
            publisher
                .publish_json("invoice", &job.message_id(), job)
                .await
        })
        .buffer_unordered(64)
        .try_collect::<()>()
        .await
}
