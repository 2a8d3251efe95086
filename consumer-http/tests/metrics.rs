//! The layer's counts through the `metrics` facade, read from a recorder installed for this
//! test process (so in a binary of its own): each way of answering a request with a key is
//! counted once, under its route and outcome, every decision on a key is timed, and the
//! gauges count the records and the age of the oldest request in progress.

// A scenario's setup failing is the test failing.
#![allow(clippy::unwrap_used)]

mod common;

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use common::{wait_until, App, Db};
use consumer_http::IdempotencyConfig;
use metrics_util::debugging::{DebugValue, DebuggingRecorder, Snapshotter};
use serde_json::json;

/// The value of the gauge `name` whose labels include every one of `labels`.
fn gauge(snapshotter: &Snapshotter, name: &str, labels: &[(&str, &str)]) -> Option<f64> {
    snapshotter
        .snapshot()
        .into_vec()
        .into_iter()
        .find_map(|(key, _, _, value)| {
            let key = key.key();
            let labelled = labels
                .iter()
                .all(|(k, v)| key.labels().any(|l| l.key() == *k && l.value() == *v));
            match value {
                DebugValue::Gauge(g) if key.name() == name && labelled => Some(g.into_inner()),
                _ => None,
            }
        })
}

#[tokio::test]
async fn each_answer_is_counted_under_its_route_and_outcome_and_the_gauges_follow() {
    let recorder = DebuggingRecorder::new();
    let snapshotter = recorder.snapshotter();
    recorder
        .install()
        .expect("the only recorder of this process");

    let db = Db::sqlite().await;
    let config = IdempotencyConfig::builder()
        .gauge_interval(Duration::from_millis(20))
        .wait(Duration::ZERO)
        .build()
        .unwrap();
    let app = Arc::new(App::serve(&db, config).await);
    let body = json!({"amount": 5});
    assert_eq!(app.post("/payments", Some("m-1"), &body).await.status, 201);
    assert!(app.post("/payments", Some("m-1"), &body).await.replayed());
    let other = json!({"amount": 6});
    app.post("/payments", Some("m-1"), &other)
        .await
        .assert_problem(422);
    app.post("/payments", None, &body).await.assert_problem(400);
    app.send(
        "/payments",
        Some("m-2"),
        body.to_string(),
        &[("authorization", "")],
    )
    .await
    .assert_problem(401);

    let snapshot = snapshotter.snapshot().into_vec();
    let outcome = |name: &str| {
        snapshot.iter().find_map(|(key, _, _, value)| {
            let key = key.key();
            let labelled = key
                .labels()
                .any(|l| l.key() == "outcome" && l.value() == name)
                && key
                    .labels()
                    .any(|l| l.key() == "route" && l.value() == "POST /payments");
            match value {
                DebugValue::Counter(n)
                    if key.name() == "consumer_http_requests_total" && labelled =>
                {
                    Some(*n)
                }
                _ => None,
            }
        })
    };
    assert_eq!(outcome("completed"), Some(1), "{snapshot:?}");
    assert_eq!(outcome("replayed"), Some(1));
    assert_eq!(outcome("mismatch"), Some(1));
    assert_eq!(outcome("invalid_key"), Some(1));
    assert_eq!(outcome("no_caller"), Some(1));
    assert_eq!(outcome("in_progress"), None, "nothing was in progress");
    let decisions = snapshot.iter().find_map(|(key, _, _, value)| match value {
        DebugValue::Histogram(v) if key.key().name() == "consumer_http_store_seconds" => {
            Some(v.len())
        }
        _ => None,
    });
    assert_eq!(
        decisions,
        Some(3),
        "the three requests with a key were decided"
    );

    // The gauges: one completed record ("m-1"); a request held running makes the oldest
    // request in progress older than zero, and its end makes it zero again.
    wait_until("the records gauge", || async {
        gauge(
            &snapshotter,
            "consumer_http_records",
            &[("status", "completed")],
        ) == Some(1.0)
    })
    .await;
    app.handlers.hold_next.store(true, Ordering::SeqCst);
    let running = tokio::spawn({
        let app = app.clone();
        async move {
            app.post("/payments", Some("m-3"), &json!({"amount": 7}))
                .await
        }
    });
    app.wait_held(1).await;
    wait_until("a request in progress in the gauge", || async {
        gauge(
            &snapshotter,
            "consumer_http_oldest_in_progress_seconds",
            &[],
        )
        .is_some_and(|age| age > 0.0)
    })
    .await;
    app.open_gate();
    assert_eq!(running.await.unwrap().status, 201);
    wait_until("no request in progress in the gauge", || async {
        gauge(
            &snapshotter,
            "consumer_http_oldest_in_progress_seconds",
            &[],
        ) == Some(0.0)
    })
    .await;
}
