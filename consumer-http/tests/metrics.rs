//! The layer's counts through the `metrics` facade, read from a recorder installed for this
//! test process (so in a binary of its own): each way of answering a request with a key is
//! counted once, under its outcome, and every decision on a key is timed.

// A scenario's setup failing is the test failing.
#![allow(clippy::unwrap_used)]

mod common;

use common::{App, Db};
use consumer_http::IdempotencyConfig;
use metrics_util::debugging::{DebugValue, DebuggingRecorder};
use serde_json::json;

#[tokio::test]
async fn each_answer_is_counted_under_its_outcome() {
    let recorder = DebuggingRecorder::new();
    let snapshotter = recorder.snapshotter();
    recorder
        .install()
        .expect("the only recorder of this process");

    let db = Db::sqlite().await;
    let app = App::serve(&db, IdempotencyConfig::builder().build().unwrap()).await;
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
                .any(|l| l.key() == "outcome" && l.value() == name);
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
}
