//! RabbitMQ: SIGTERM in the middle of a stream stops the real `invoice_worker`
//! binary gracefully: the jobs in flight finish and are acked, the rest stays in the queue,
//! and after a restart every job has run exactly once.
//!
//! "Finish" is checked in the database, not inferred from counts (a job dropped mid-flight
//! rolls back and is redelivered, which counts cannot tell from a job that never started):
//! the worker's connections carry an `application_name`, the test reads the ids of the
//! handler transactions they have open when it sends SIGTERM, and after the process exited
//! PostgreSQL must report every one of them committed.
//!
//! The binary is built by [`consumer_tests::process::example_binary`].

use std::collections::HashMap;
use std::time::Duration;

use consumer_amqp::AmqpPublisher;
use consumer_tests::amqp::{self, amqp_url, init_tracing, wait_for, Db, Rabbit, LONG};
use consumer_tests::common::database_url;
use consumer_tests::process::{example_binary, Process};
use futures::{StreamExt, TryStreamExt};
use invoices::settings::Settings;
use invoices::InvoiceJob;
use sqlx::PgPool;

const JOBS: i64 = 300;

/// `DATABASE_URL` with `application_name` set, so the worker's connections can be told
/// from every other test's.
fn named_database_url(application: &str) -> String {
    let url = database_url();
    let sep = if url.contains('?') { '&' } else { '?' };
    format!("{url}{sep}application_name={application}")
}

/// The transaction ids (as `xid8` text) of the transactions with writes that connections
/// named `application` have open now. `pg_stat_activity` shows a 32-bit `xid`; the epoch is
/// taken from the current snapshot (an id far above the snapshot's, more than half the
/// `xid` space, belongs to the previous epoch; one just above it was assigned after the
/// snapshot was taken).
async fn open_transactions(pool: &PgPool, application: &str) -> Vec<String> {
    sqlx::query_scalar(
        "WITH cur AS (SELECT pg_snapshot_xmax(pg_current_snapshot())::text::bigint AS xmax)
         SELECT (CASE WHEN f.x > cur.xmax + 2147483648 THEN f.x - 4294967296 ELSE f.x END)::text
         FROM cur, LATERAL (
             SELECT ((cur.xmax >> 32) << 32) + a.backend_xid::text::bigint AS x
             FROM pg_stat_activity a
             WHERE a.application_name = $1 AND a.backend_xid IS NOT NULL
         ) f",
    )
    .bind(application)
    .fetch_all(pool)
    .await
    .expect("read pg_stat_activity")
}

/// `pg_xact_status` of a transaction id from [`open_transactions`]: `committed`,
/// `aborted` or `in progress`.
async fn transaction_status(pool: &PgPool, xid: &str) -> String {
    sqlx::query_scalar::<_, Option<String>>("SELECT pg_xact_status($1::text::xid8)")
        .bind(xid)
        .fetch_one(pool)
        .await
        .expect("pg_xact_status")
        .unwrap_or_else(|| format!("unknown (transaction {xid} is too old)"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn sigterm_midstream_finishes_in_flight_jobs_and_loses_nothing() {
    init_tracing();
    let binary = tokio::task::spawn_blocking(|| example_binary("invoice_worker"))
        .await
        .unwrap();
    let db = Db::new().await;
    let queue = amqp::unique_name("sigterm");
    let vars: HashMap<&'static str, String> = HashMap::from([
        ("AMQP_URL", amqp_url()),
        ("DATABASE_URL", named_database_url(&queue)),
        ("DB_SCHEMA", db.schema.clone()),
        ("INVOICE_QUEUE", queue.clone()),
        ("EMAIL_QUEUE", format!("{queue}_emails")),
        ("EVENTS", format!("{queue}_ready")),
        ("EXCHANGE", amqp::unique_name("jobs")),
        ("CONCURRENCY", "4".to_owned()),
        ("PREFETCH", "8".to_owned()),
        // Long enough that SIGTERM lands while handler transactions are open.
        ("WORK_MS", "150".to_owned()),
    ]);
    // The worker's own settings give the publisher the same topology.
    let settings = Settings::from_lookup(|k| vars.get(k).cloned()).unwrap();
    let cfg = invoices::transport::amqp_config(&settings, invoices::Part::Invoices).unwrap();

    let jobs: Vec<InvoiceJob> = (1..=JOBS).map(InvoiceJob::sample).collect();
    invoices::schema::place_orders(&db.pool, &jobs)
        .await
        .unwrap();
    let publisher = AmqpPublisher::connect(cfg.clone()).await.unwrap();
    futures::stream::iter(&jobs)
        .map(|job| {
            let publisher = &publisher;
            async move {
                publisher
                    .publish_json("invoice", &job.message_id(), job)
                    .await
            }
        })
        .buffer_unordered(64)
        .try_collect::<Vec<()>>()
        .await
        .unwrap();
    publisher.close().await;

    let logs = std::env::temp_dir().join(&queue);
    std::fs::create_dir_all(&logs).unwrap();
    let invoices = || db.count("SELECT count(*) FROM invoices");

    // Run 1: SIGTERM once some jobs are done.
    let first = Process::spawn("invoice_worker", &vars, logs.join("first.log"));
    wait_for("the first 40 invoices", LONG, || async {
        invoices().await >= 40
    })
    .await;
    // Handler transactions under way (each has written its inbox row): in flight.
    let start = tokio::time::Instant::now();
    let in_flight = loop {
        let open = open_transactions(&db.pool, &queue).await;
        if !open.is_empty() {
            break open;
        }
        assert!(
            start.elapsed() < LONG,
            "no handler transaction open in {LONG:?}"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    };
    first.sigterm();
    let (status, log) = first.exit().await;
    assert!(status.success(), "{status}\n{log}");
    for xid in &in_flight {
        assert_eq!(
            transaction_status(&db.pool, xid).await,
            "committed",
            "transaction {xid}, open at SIGTERM, finished before the worker exited"
        );
    }
    println!(
        "{} handler transactions in flight at SIGTERM all committed",
        in_flight.len()
    );
    assert!(log.contains("SIGTERM: finishing in-flight jobs"), "{log}");
    assert!(log.contains("consumer dropped"), "{log}");
    // A broker restart by a parallel test during this run would make the broker forget
    // acks sent just before it (the inbox then skips those jobs): only the effects are
    // checked then.
    let undisturbed = !log.contains("connection lost");
    let done = invoices().await;
    let unfinished = db
        .count("SELECT count(*) FROM consumer_inbox WHERE status <> 'completed'")
        .await;
    let ready = i64::from(Rabbit::ready(&queue).await);
    println!("SIGTERM after {done} of {JOBS} invoices; {ready} messages back in the queue");
    assert!(done < JOBS, "stopped mid-stream");
    assert_eq!(
        unfinished, 0,
        "every job that started has finished and committed"
    );
    if undisturbed {
        assert_eq!(
            ready,
            JOBS - done,
            "every finished job was acked, every other one is back in the queue"
        );
    }

    // Run 2: the rest, each exactly once.
    let second = Process::spawn("invoice_worker", &vars, logs.join("second.log"));
    wait_for("all invoices and an empty queue", LONG, || async {
        invoices().await >= JOBS && Rabbit::ready(&queue).await == 0
    })
    .await;
    second.sigterm();
    let (status, log) = second.exit().await;
    assert!(status.success(), "{status}\n{log}");
    let stopped = log
        .lines()
        .find(|l| l.contains("handler stopped"))
        .unwrap_or_else(|| panic!("no `handler stopped` line:\n{log}"));
    println!("second run: {stopped}");
    assert!(
        stopped.contains(&format!("completed={}", JOBS - done)),
        "{stopped}"
    );
    if undisturbed && !log.contains("connection lost") {
        assert!(
            stopped.contains("duplicates=0"),
            "nothing ran twice: {stopped}"
        );
    }

    assert_eq!(invoices().await, JOBS);
    assert_eq!(
        db.count("SELECT count(DISTINCT order_id) FROM invoices")
            .await,
        JOBS
    );
    assert_eq!(
        db.count("SELECT max(attempts)::BIGINT FROM consumer_inbox")
            .await,
        1,
        "no job was attempted twice"
    );
    drop(binary);
    let _ = std::fs::remove_dir_all(&logs);
    Rabbit::delete_topology(&cfg).await;
}

/// SIGTERM while the worker is still starting (here: waiting for a database that does not
/// answer) ends it cleanly, with exit status 0, instead of killing it with the signal's
/// default action: the worker listens for the signal from its first step, not from the
/// moment it begins consuming.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_while_starting_exits_cleanly() {
    init_tracing();
    tokio::task::spawn_blocking(|| example_binary("invoice_worker"))
        .await
        .unwrap();
    let queue = amqp::unique_name("sigterm_start");
    // Nothing listens on port 1: the worker keeps retrying the database (for up to a
    // minute) and is still starting when the signal comes.
    let vars: HashMap<&'static str, String> = HashMap::from([
        ("AMQP_URL", amqp_url()),
        (
            "DATABASE_URL",
            "postgres://consumer@127.0.0.1:1/consumer".to_owned(),
        ),
        ("INVOICE_QUEUE", queue.clone()),
        ("EMAIL_QUEUE", format!("{queue}_emails")),
        ("EVENTS", format!("{queue}_ready")),
        ("EXCHANGE", amqp::unique_name("jobs")),
    ]);
    let logs = std::env::temp_dir().join(&queue);
    std::fs::create_dir_all(&logs).unwrap();
    let worker = Process::spawn("invoice_worker", &vars, logs.join("worker.log"));
    wait_for(
        "the worker to be waiting for the database",
        LONG,
        || async { worker.log().contains("database not reachable yet") },
    )
    .await;
    worker.sigterm();
    let (status, log) = worker.exit().await;
    assert!(
        status.success(),
        "SIGTERM while starting must end the worker cleanly, got {status}:\n{log}"
    );
    assert!(log.contains("stopped while starting"), "{log}");
}
