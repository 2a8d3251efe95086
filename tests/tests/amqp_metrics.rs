//! RabbitMQ: a real Prometheus scrapes the real `invoice_worker` (its `METRICS_ADDR`
//! endpoint) during a run with duplicates, a key conflict and a poison job, and what it
//! scraped is what the test published: each counter, and the inbox gauges that rise while
//! the poison job's key is stuck pending and fall once it is dead-lettered.

use std::collections::HashMap;

use consumer_amqp::AmqpPublisher;
use consumer_tests::amqp::{self, amqp_url, init_tracing, repo_root, wait_for, Db, Rabbit, LONG};
use consumer_tests::common::database_url;
use consumer_tests::process::{example_binary, Process};
use consumer_tests::prometheus::{http_get, Prometheus};
use futures::{StreamExt, TryStreamExt};
use invoices::settings::Settings;
use invoices::{InvoiceJob, POISON_ORDERS};

const JOBS: i64 = 20;
const DUPLICATES: i64 = 5;

async fn publish(publisher: &AmqpPublisher, jobs: &[(String, InvoiceJob)]) {
    futures::stream::iter(jobs)
        .map(|(id, job)| publisher.publish_json("invoice", id, job))
        .buffer_unordered(16)
        .try_collect::<Vec<()>>()
        .await
        .expect("publish");
}

/// The address in the worker's "serving /metrics" log line.
async fn metrics_address(worker: &Process) -> String {
    let mut address = None;
    wait_for("the worker's metrics address in its log", LONG, || {
        let log = worker.log();
        address = log
            .lines()
            .find(|l| l.contains("serving /metrics"))
            .and_then(|l| l.split("bound=").nth(1))
            .and_then(|rest| rest.split_whitespace().next())
            .map(str::to_owned);
        let found = address.is_some();
        async move { found }
    })
    .await;
    address.expect("found")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn prometheus_scrapes_what_the_worker_did() {
    init_tracing();
    let prometheus = Prometheus::from_env();
    tokio::task::spawn_blocking(|| example_binary("invoice_worker"))
        .await
        .unwrap();
    let db = Db::new().await;
    let queue = amqp::unique_name("metrics");
    let vars: HashMap<&'static str, String> = HashMap::from([
        ("AMQP_URL", amqp_url()),
        ("DATABASE_URL", database_url()),
        ("DB_SCHEMA", db.schema.clone()),
        ("INVOICE_QUEUE", queue.clone()),
        ("EMAIL_QUEUE", format!("{queue}_emails")),
        ("EVENTS", format!("{queue}_ready")),
        ("EXCHANGE", amqp::unique_name("jobs")),
        ("METRICS_ADDR", "127.0.0.1:0".to_owned()),
        ("INBOX_GAUGE_MS", "200".to_owned()),
    ]);
    let settings = Settings::from_lookup(|k| vars.get(k).cloned()).unwrap();
    let cfg = invoices::transport::amqp_config(&settings, invoices::Part::Invoices).unwrap();
    let jobs: Vec<InvoiceJob> = (1..=JOBS).map(InvoiceJob::sample).collect();
    invoices::schema::place_orders(&db.pool, &jobs)
        .await
        .unwrap();

    let logs = std::env::temp_dir().join(&queue);
    std::fs::create_dir_all(&logs).unwrap();
    let worker = Process::spawn("invoice_worker", &vars, logs.join("worker.log"));
    let address = metrics_address(&worker).await;
    let _target = prometheus.scrape(&queue, &address);
    let series = |name: &str, labels: &str| format!("{name}{{test=\"{queue}\"{labels}}}");
    let delivered = |outcome: &str| {
        series(
            "consumer_deliveries_total",
            &format!(",outcome=\"{outcome}\""),
        )
    };
    let dead = |reason: &str| {
        series(
            "consumer_deliveries_total",
            &format!(",outcome=\"dead_lettered\",reason=\"{reason}\""),
        )
    };
    // Equal to `want` in Prometheus (scraped, not only counted in the process).
    let scraped = |query: String, want: f64| {
        let prometheus = &prometheus;
        async move {
            wait_for(&format!("{query} = {want} in Prometheus"), LONG, || async {
                prometheus.value(&query).await == Some(want)
            })
            .await;
        }
    };
    wait_for("the worker ready", LONG, || async {
        http_get(&address, "/readyz").await.0 == 200
    })
    .await;
    assert_eq!(http_get(&address, "/healthz").await.0, 200);

    let publisher = AmqpPublisher::connect(cfg.clone()).await.unwrap();
    let originals: Vec<(String, InvoiceJob)> =
        jobs.iter().map(|j| (j.message_id(), j.clone())).collect();
    publish(&publisher, &originals).await;
    // Every original first: a republished copy is then a duplicate, and the conflicting
    // job the second payload under its key.
    scraped(delivered("completed"), JOBS as f64).await;
    let mut conflicting = jobs[0].clone();
    conflicting.amount += 1;
    let poison = InvoiceJob::sample(POISON_ORDERS.start + 1);
    let mut second: Vec<(String, InvoiceJob)> = originals[..DUPLICATES as usize].to_vec();
    second.push(("conflict-1".to_owned(), conflicting));
    second.push((poison.message_id(), poison));
    publish(&publisher, &second).await;
    publisher.close().await;

    scraped(delivered("duplicate"), DUPLICATES as f64).await;
    scraped(dead("key_conflict"), 1.0).await;
    scraped(series("consumer_conflicts_total", ""), 1.0).await;
    // The poison job: nine retries, then dead after its tenth attempt (send_invoice's
    // max_attempts = 10).
    scraped(dead("max_attempts_exceeded"), 1.0).await;
    scraped(delivered("retried"), 9.0).await;
    scraped(delivered("completed"), JOBS as f64).await;
    scraped(
        series("consumer_received_total", ""),
        (JOBS + DUPLICATES + 2 + 9) as f64,
    )
    .await;
    // While it was retried its key was pending, and its age grew between attempts (at
    // least 1 s: RabbitMQ's shortest retry delay); now it is dead, and nothing is pending.
    let pending = series("consumer_inbox_keys", ",status=\"pending\"");
    let stalest = series("consumer_inbox_stalest_pending_seconds", "");
    let peak = |q: &str| format!("max_over_time({q}[10m])");
    let peak_pending = prometheus.value(&peak(&pending)).await;
    assert!(
        peak_pending >= Some(1.0),
        "pending peaked at {peak_pending:?}"
    );
    let peak_age = prometheus.value(&peak(&stalest)).await;
    assert!(
        peak_age >= Some(1.0),
        "the stalest pending age peaked at {peak_age:?}"
    );
    scraped(pending, 0.0).await;
    scraped(stalest, 0.0).await;
    scraped(series("consumer_inbox_keys", ",status=\"dead\""), 1.0).await;
    scraped(
        series("consumer_inbox_keys", ",status=\"completed\""),
        JOBS as f64,
    )
    .await;
    // The handler ran once per original job and ten times for the poison one.
    scraped(
        series("consumer_handler_duration_seconds_count", ""),
        (JOBS + 10) as f64,
    )
    .await;

    // The worker's own text, as the README shows it.
    let (status, text) = http_get(&address, "/metrics").await;
    assert_eq!(status, 200);
    for line in [
        "consumer_deliveries_total{handler=\"send_invoice\",outcome=\"completed\"} 20",
        "consumer_deliveries_total{handler=\"send_invoice\",outcome=\"duplicate\"} 5",
        "consumer_deliveries_total{handler=\"send_invoice\",outcome=\"dead_lettered\",reason=\"key_conflict\"} 1",
    ] {
        assert!(text.lines().any(|l| l == line), "{line} not in:\n{text}");
    }

    // Every query of the Grafana dashboard is one Prometheus accepts, and the panels on
    // what this run did have data.
    let dashboard = repo_root().join("monitoring/grafana/consumer.json");
    let dashboard: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&dashboard).unwrap()).unwrap();
    let mut with_data = Vec::new();
    for panel in dashboard["panels"].as_array().expect("panels") {
        for target in panel["targets"].as_array().expect("targets") {
            let expr = target["expr"].as_str().expect("expr");
            let expr = expr.replace("$handler", "send_invoice");
            if prometheus.value(&expr).await.is_some() {
                with_data.push(panel["title"].as_str().unwrap_or_default().to_owned());
            }
        }
    }
    for title in [
        "Deliveries by outcome",
        "Handler duration",
        "Inbox keys by status",
    ] {
        assert!(
            with_data.iter().any(|t| t == title),
            "{title}: {with_data:?}"
        );
    }

    worker.sigterm();
    let (status, log) = worker.exit().await;
    assert!(status.success(), "{status}\n{log}");
    assert_eq!(
        db.count("SELECT count(*) FROM invoices").await,
        JOBS,
        "one invoice per order"
    );
    let _ = std::fs::remove_dir_all(&logs);
    Rabbit::delete_topology(&cfg).await;
}
