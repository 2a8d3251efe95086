//! The payments example's HTTP metrics as a real Prometheus scrapes them (its `METRICS_ADDR`
//! endpoint, gauges every 200 ms): first requests, replays and a reused key counted by route
//! and outcome, the decisions timed by route, and the records gauged by status.

use consumer_tests::common::wait_until;
use consumer_tests::payments::Payments;
use consumer_tests::prometheus::Prometheus;
use serde_json::json;

/// The address in the example's "serving /metrics" log line.
async fn metrics_address(server: &consumer_tests::payments::Server) -> String {
    let mut address = String::new();
    wait_until("the example's metrics address in its log", || {
        address = server
            .process
            .log()
            .lines()
            .find(|l| l.contains("serving /metrics"))
            .and_then(|l| l.split("bound=").nth(1))
            .and_then(|rest| rest.split_whitespace().next())
            .map(str::to_owned)
            .unwrap_or_default();
        std::future::ready(!address.is_empty())
    })
    .await;
    address
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prometheus_scrapes_the_layers_answers_by_route_and_outcome() {
    let prometheus = Prometheus::from_env();
    let payments = Payments::new().await;
    let extra = [
        ("METRICS_ADDR", "127.0.0.1:0"),
        ("IDEMPOTENCY_GAUGE_MS", "200"),
    ];
    let server = payments.start(&extra, "metrics").await;
    let address = metrics_address(&server).await;
    let test = payments.schema().to_owned();
    let _target = prometheus.scrape(&test, &address);
    let base = &server.base;

    for order in 1..=3 {
        let first = payments
            .pay(base, &format!("pay-{order}"), order)
            .await
            .expect("an answer");
        assert_eq!(first.status, 201);
    }
    for order in 1..=2 {
        let again = payments
            .pay(base, &format!("pay-{order}"), order)
            .await
            .expect("an answer");
        assert!(again.replayed());
    }
    let reused = payments
        .post(
            &format!("{base}/payments"),
            "pay-1",
            &json!({"order_id": 1, "amount": 999}),
        )
        .await
        .expect("an answer");
    assert_eq!(reused.status, 422);
    let refund = payments
        .post(
            &format!("{base}/refunds"),
            "refund-1",
            &json!({"order_id": 1, "amount": 50}),
        )
        .await
        .expect("an answer");
    assert_eq!(refund.status, 202);

    let requests = |route: &str, outcome: &str| {
        format!(
            "consumer_http_requests_total{{test=\"{test}\",route=\"{route}\",outcome=\"{outcome}\"}}"
        )
    };
    let expected = [
        (requests("POST /payments", "completed"), 3.0),
        (requests("POST /payments", "replayed"), 2.0),
        (requests("POST /payments", "mismatch"), 1.0),
        (requests("POST /refunds", "completed"), 1.0),
        (
            format!(
                "consumer_http_store_seconds_count{{test=\"{test}\",route=\"POST /payments\"}}"
            ),
            6.0,
        ),
        (
            format!("consumer_http_records{{test=\"{test}\",status=\"completed\"}}"),
            4.0,
        ),
    ];
    wait_until("Prometheus has scraped every answer", || {
        let (prometheus, expected) = (&prometheus, &expected);
        async move {
            for (query, want) in expected {
                if prometheus.value(query).await != Some(*want) {
                    return false;
                }
            }
            true
        }
    })
    .await;
    // No series for the raw path of a request: routes are the router's templates.
    assert_eq!(
        prometheus
            .value(&format!(
                "count(consumer_http_requests_total{{test=\"{test}\",route=~\".*[0-9].*\"}})"
            ))
            .await,
        None
    );
}
