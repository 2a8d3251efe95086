//! Long operations: a request starts one in its transaction and answers 202 with where its
//! status is; a retry gets the same 202 and id; the status route tells the caller that
//! started it how it went, and nobody else; the work is finished once, through the store's
//! operations; a request that rolled back left no operation; finished operations are purged
//! after their keep. On PostgreSQL, SQLite and PostgreSQL with the Redis fast path.

// Test code may panic: a panic is how a test fails.
#![allow(clippy::unwrap_used)]

mod common;

use std::time::Duration;

use consumer_http::{IdempotencyConfig, OperationStatus};
use serde_json::json;

use common::{on_both, App, Db, Scoping, ALICE, BOB};

async fn app(db: &Db) -> App {
    // No background purge: the purge test runs its own and counts what it deleted.
    let config = IdempotencyConfig::builder()
        .no_purge()
        .build()
        .expect("config");
    App::serve_scoped(db, config, Scoping::PerCaller).await
}

/// A 202 with `Location` and `Retry-After`, the same on a retry (a replay), and a status
/// that follows the operation from pending to succeeded; the work finds it pending once.
async fn an_operation_is_started_once_and_its_status_follows_it(db: Db) {
    let app = app(&db).await;
    let body = json!({"order_id": 7, "amount": 300});
    let first = app.post("/refunds", Some("refund-7"), &body).await;
    assert_eq!(first.status, 202, "{:?}", first.body);
    let id = first.json()["operation_id"]
        .as_str()
        .expect("an id")
        .to_owned();
    assert!(id.starts_with("op_"), "{id}");
    let location = first.header("location").expect("Location").to_owned();
    assert_eq!(location, format!("/operations/{id}"));
    assert_eq!(first.header("retry-after"), Some("1"));

    let again = app.post("/refunds", Some("refund-7"), &body).await;
    assert!(again.replayed());
    assert_eq!((again.status, &again.body), (202, &first.body));
    assert_eq!(again.header("location"), Some(location.as_str()));
    assert_eq!(app.runs(), 1);

    let pending = db.pending_operations("refund").await;
    assert_eq!(pending.len(), 1, "one operation, however often it was sent");
    assert_eq!(pending[0].id, id);
    assert_eq!(pending[0].input, body);
    assert_eq!(pending[0].status, OperationStatus::Pending);

    let status = app.get(&location, Some(ALICE)).await;
    assert_eq!(status.status, 200);
    assert_eq!(status.json()["status"], "pending");
    assert_eq!(status.json()["kind"], "refund");
    assert_eq!(status.header("retry-after"), Some("1"));

    let result = json!({"refund_id": 11});
    let day = Duration::from_secs(24 * 3600);
    assert!(db.finish_operation(&id, Ok(result.clone()), day).await);
    assert!(
        !db.finish_operation(&id, Err(json!("again")), day).await,
        "an operation is finished once"
    );
    let status = app.get(&location, Some(ALICE)).await;
    assert_eq!(status.json()["status"], "succeeded");
    assert_eq!(status.json()["result"], result);
    assert_eq!(status.header("retry-after"), None);
    assert!(db.pending_operations("refund").await.is_empty());
}

/// A failed operation says so, with the error its worker gave.
async fn a_failed_operation_shows_its_error(db: Db) {
    let app = app(&db).await;
    let first = app
        .post("/refunds", Some("refund-8"), &json!({"order_id": 8}))
        .await;
    let location = first.header("location").expect("Location").to_owned();
    let id = first.json()["operation_id"]
        .as_str()
        .expect("id")
        .to_owned();
    let error = json!({"reason": "the order was never charged"});
    let day = Duration::from_secs(24 * 3600);
    assert!(db.finish_operation(&id, Err(error.clone()), day).await);
    let status = app.get(&location, Some(ALICE)).await;
    assert_eq!(status.json()["status"], "failed");
    assert_eq!(status.json()["error"], error);
}

/// What one caller started, another cannot read: 404, as for an id that does not exist;
/// a request without a caller is 401.
async fn only_the_caller_that_started_an_operation_reads_it(db: Db) {
    let app = app(&db).await;
    let first = app
        .post("/refunds", Some("refund-9"), &json!({"order_id": 9}))
        .await;
    let location = first.header("location").expect("Location").to_owned();
    assert_eq!(app.get(&location, Some(ALICE)).await.status, 200);
    app.get(&location, Some(BOB)).await.assert_problem(404);
    app.get("/operations/op_0", Some(ALICE))
        .await
        .assert_problem(404);
    app.get(&location, None).await.assert_problem(401);
}

/// A request that started an operation and then failed (5xx) rolled the operation back
/// with its claim: nothing is pending, and the retry starts one of its own.
async fn an_operation_rolls_back_with_its_request(db: Db) {
    let app = app(&db).await;
    let failing = app
        .post(
            "/refunds",
            Some("refund-10"),
            &json!({"order_id": 10, "fail": true}),
        )
        .await;
    assert_eq!(failing.status, 502);
    assert!(db.pending_operations("refund").await.is_empty());
    assert_eq!(db.operations().await, 0);
    let retry = app
        .post("/refunds", Some("refund-11"), &json!({"order_id": 10}))
        .await;
    assert_eq!(retry.status, 202);
    assert_eq!(db.pending_operations("refund").await.len(), 1);
}

/// A finished operation is deleted by the purge once its keep has passed; a pending one
/// never is.
async fn finished_operations_are_purged_after_their_keep(db: Db) {
    let app = app(&db).await;
    for key in ["refund-12", "refund-13"] {
        let answer = app.post("/refunds", Some(key), &json!({"key": key})).await;
        assert_eq!(answer.status, 202);
    }
    let pending = db.pending_operations("refund").await;
    assert_eq!(pending.len(), 2);
    assert!(
        db.finish_operation(&pending[0].id, Ok(json!(null)), Duration::ZERO)
            .await
    );
    assert_eq!(db.purge_finished_operations().await, 1);
    assert_eq!(db.operations().await, 1, "the pending one stays");
    assert_eq!(db.pending_operations("refund").await[0].id, pending[1].id);
}

on_both!(
    an_operation_is_started_once_and_its_status_follows_it,
    a_failed_operation_shows_its_error,
    only_the_caller_that_started_an_operation_reads_it,
    an_operation_rolls_back_with_its_request,
    finished_operations_are_purged_after_their_keep,
);
