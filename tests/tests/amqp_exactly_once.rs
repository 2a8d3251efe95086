//! RabbitMQ: 1,000 invoice jobs plus 10% republished duplicates (same message id) to the
//! example's invoice handler, whose `invoice_ready` events the outbox's relay publishes to
//! the email handler, all in one `App` as the `invoices` binary runs them, on a real RabbitMQ
//! and PostgreSQL, give exactly 1,000 invoices and 1,000 provider calls.

use std::time::Instant;

use consumer_amqp::{AmqpConsumer, AmqpPublisher, ExchangeType, QueueType};
use consumer_core::{App, BatchConfig};
use consumer_tests::amqp::{self, config, init_tracing, wait_for, worker_config, Db, Rabbit, LONG};
use futures::{StreamExt, TryStreamExt};
use invoices::transport::EventPublisher;
use invoices::{send_email, send_invoice, InvoiceJob};

const JOBS: i64 = 1000;
const DUPLICATES: i64 = 100;

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn thousand_jobs_with_duplicates_give_thousand_invoices_and_provider_calls() {
    thousand_jobs(None).await;
}

/// The same in batched mode: each batch's events are written to the outbox in the batch's
/// transaction, and their deliveries are acked in coalesced `multiple` frames.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn thousand_jobs_with_duplicates_in_batches_give_thousand_invoices_and_provider_calls() {
    thousand_jobs(Some(BatchConfig::default())).await;
}

// The body of both tests above, so test code: it may unwrap and print.
#[allow(clippy::unwrap_used, clippy::print_stdout)]
async fn thousand_jobs(batch: Option<BatchConfig>) {
    init_tracing();
    let db = Db::new().await;
    let mut invoice_config = config(&amqp::unique_name("invoices"));
    invoice_config.exchange = amqp::unique_name("jobs");
    invoice_config.exchange_type = ExchangeType::Fanout;
    invoice_config.queue_type = QueueType::Classic;
    // Both queue types: the jobs on a classic queue, the events on a quorum queue.
    let mut email_config = invoice_config.clone();
    email_config.exchange = amqp::unique_name("ready");
    email_config.queue = amqp::unique_name("emails");
    email_config.queue_type = QueueType::Quorum;

    let jobs: Vec<InvoiceJob> = (1..=JOBS).map(InvoiceJob::sample).collect();
    invoices::schema::place_orders(&db.pool, &jobs)
        .await
        .expect("place the orders");

    let worker_config = || worker_config(8).with_batch(batch);
    // The relay's publisher declares the email queue and binds it to the events exchange.
    let events = EventPublisher::Amqp(AmqpPublisher::connect(email_config.clone()).await.unwrap());
    let inbox = db.inbox(20).await;
    let outbox = inbox.outbox();
    let invoice_consumer = AmqpConsumer::connect(invoice_config.clone()).await.unwrap();
    let email_consumer = AmqpConsumer::connect(email_config.clone()).await.unwrap();
    let app = App::new(inbox)
        .handler_with(send_invoice, invoice_consumer, worker_config())
        .handler_with(send_email, email_consumer, worker_config())
        .relay(events);
    let health = app.health();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let running = tokio::spawn(app.run(async {
        let _ = stopped.await;
    }));

    let publisher = AmqpPublisher::connect(invoice_config.clone())
        .await
        .unwrap();
    let start = Instant::now();
    let republished = jobs.iter().filter(|j| j.order_id % 10 == 0);
    publish(&publisher, jobs.iter().chain(republished))
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
    // Every delivery settled (each job once, each duplicate once, more only if the broker
    // redelivered after a reconnect), every event published, nothing left in a queue.
    let stats = |name: &str| health.handler(name).unwrap().stats;
    wait_for("every delivery to be settled", LONG, || async {
        let i = stats("send_invoice");
        let e = stats("send_email");
        i.completed + i.duplicates >= (JOBS + DUPLICATES) as u64
            && e.completed + e.duplicates >= JOBS as u64
            && outbox.stats().await.is_ok_and(|s| s.pending == 0)
            && Rabbit::ready(&invoice_config.queue).await == 0
            && Rabbit::ready(&email_config.queue).await == 0
    })
    .await;
    stop.send(()).unwrap();
    tokio::time::timeout(LONG, running)
        .await
        .expect("the app stops")
        .unwrap()
        .expect("the app ends without error");
    let invoice_stats = stats("send_invoice");
    let email_stats = stats("send_email");

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
    let events_written = db.count("SELECT count(*) FROM consumer_inbox_outbox").await;
    println!(
        "published {} messages in {published_in:?}; all effects after {effects_in:?}; \
         invoice handler {invoice_stats:?}; email handler {email_stats:?}",
        JOBS + DUPLICATES
    );
    assert_eq!((invoices, invoiced_orders), (JOBS, JOBS));
    assert_eq!((calls, distinct_keys), (JOBS, JOBS));
    assert_eq!(flagged, JOBS);
    assert_eq!(events_written, JOBS, "one invoice_ready event per invoice");
    assert_eq!(invoice_stats.completed, JOBS as u64, "{invoice_stats:?}");
    assert_eq!(email_stats.completed, JOBS as u64, "{email_stats:?}");
    assert!(invoice_stats.duplicates >= DUPLICATES as u64);
    assert_eq!(invoice_stats.dead_lettered + email_stats.dead_lettered, 0);
    assert_eq!(
        invoice_stats.retries + email_stats.retries,
        0,
        "no email waits for its invoice"
    );
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
