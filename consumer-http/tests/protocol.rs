//! The layer to the letter of the Idempotency-Key draft (`draft-ietf-httpapi-idempotency-key-header`):
//! the key's forms, the key format the service declares, problem answers that point at the
//! published policy, and a retry not corrected after a 400 or 422 answered the same. Every
//! scenario runs on PostgreSQL, SQLite, and PostgreSQL with the Redis fast path.

// A scenario's setup failing is the test failing.
#![allow(clippy::unwrap_used)]

mod common;

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use common::{Answer, App, Db, POLICY_PATH};
use consumer_http::{IdempotencyConfig, KeyFormat};
use serde_json::json;

const POLICY: &str = POLICY_PATH;
const UUID_KEY: &str = "8e03978e-40d5-43e8-bc93-6894a57f9324";

/// A layer that declares UUID keys and publishes its policy at [`POLICY`], answering 409 at
/// once while a key runs.
async fn declared(db: &Db) -> App {
    let config = IdempotencyConfig::builder()
        .key_format(KeyFormat::uuid())
        .policy_url(POLICY)
        .wait(Duration::ZERO)
        .build()
        .unwrap();
    App::serve(db, config).await
}

/// `answer` is a problem of `status` whose type is the policy's section `fragment`, with a
/// `Link` to the policy.
fn assert_points_at_policy(answer: &Answer, status: u16, fragment: &str) {
    answer.assert_problem(status);
    assert_eq!(
        answer.json()["type"],
        json!(format!("{POLICY}#{fragment}")),
        "{answer:?}"
    );
    assert_eq!(
        answer.header("link"),
        Some(format!("<{POLICY}>; rel=\"describedby\"").as_str()),
        "{answer:?}"
    );
}

/// A key of another format than the declared one is 400, typed `#invalid-key`, and so is a
/// missing key; each sent again unchanged gets the same answer, byte for byte, and runs
/// nothing. A key of the format runs.
async fn a_key_not_of_the_declared_format_is_refused_the_same_each_time(db: Db) {
    let app = declared(&db).await;
    let body = json!({"amount": 5});
    let first = app.post("/payments", Some("order-7"), &body).await;
    assert_points_at_policy(&first, 400, "invalid-key");
    assert!(
        first.json()["detail"].as_str().unwrap().contains("UUID"),
        "{first:?}"
    );
    let again = app.post("/payments", Some("order-7"), &body).await;
    assert_eq!((again.status, &again.body), (first.status, &first.body));
    let missing = app.post("/payments", None, &body).await;
    assert_points_at_policy(&missing, 400, "invalid-key");
    assert_eq!(app.runs(), 0);
    let quoted = format!("\"{UUID_KEY}\"");
    assert_eq!(
        app.post("/payments", Some(&quoted), &body).await.status,
        201
    );
    assert_eq!(db.effects().await, 1);
}

/// The key reused with another body is 422, typed `#key-reused`, and stays so however often
/// it is sent unchanged; a request still running is 409, typed `#in-progress`, with
/// `Retry-After`.
async fn answers_about_a_key_point_at_the_published_policy(db: Db) {
    let app = Arc::new(declared(&db).await);
    let body = json!({"amount": 5});
    app.handlers.hold_next.store(true, Ordering::SeqCst);
    let first = tokio::spawn({
        let (app, body) = (app.clone(), body.clone());
        async move { app.post("/payments", Some(UUID_KEY), &body).await }
    });
    app.wait_held(1).await;
    let busy = app.post("/payments", Some(UUID_KEY), &body).await;
    assert_points_at_policy(&busy, 409, "in-progress");
    assert!(busy.header("retry-after").is_some(), "{busy:?}");
    app.open_gate();
    assert_eq!(first.await.unwrap().status, 201);

    let other = json!({"amount": 6});
    let reused = app.post("/payments", Some(UUID_KEY), &other).await;
    assert_points_at_policy(&reused, 422, "key-reused");
    let again = app.post("/payments", Some(UUID_KEY), &other).await;
    assert_eq!((again.status, &again.body), (reused.status, &reused.body));
    assert_eq!(app.runs(), 1);
}

/// The policy document the layer writes for the service to publish says what its
/// configuration keeps (format, expiry, scope, the answers) and has a section for each
/// problem type.
async fn the_published_policy_is_the_configurations(db: Db) {
    let app = declared(&db).await;
    let page = app
        .client
        .get(format!("{}{POLICY_PATH}", app.base))
        .send()
        .await
        .unwrap();
    assert_eq!(page.status(), 200);
    let text = page.text().await.unwrap();
    for expected in [
        "a UUID",
        "kept for 1d",
        "authenticated caller",
        "POST, PATCH",
        "id=\"invalid-key\"",
        "id=\"in-progress\"",
        "id=\"key-reused\"",
    ] {
        assert!(
            text.contains(expected),
            "{expected:?} missing from:\n{text}"
        );
    }
}

/// Configured so, a retry that finds its key's request running gets 202 with `Retry-After`
/// instead of 409, and every answer to a request with a key carries the key back as sent.
async fn in_progress_can_be_202_and_the_key_echoed(db: Db) {
    let config = IdempotencyConfig::builder()
        .accepted_while_in_progress()
        .echo_key()
        .wait(Duration::ZERO)
        .build()
        .unwrap();
    let app = Arc::new(App::serve(&db, config).await);
    let body = json!({"amount": 5});
    app.handlers.hold_next.store(true, Ordering::SeqCst);
    let first = tokio::spawn({
        let (app, body) = (app.clone(), body.clone());
        async move { app.post("/payments", Some("\"e-1\""), &body).await }
    });
    app.wait_held(1).await;
    let busy = app.post("/payments", Some("e-1"), &body).await;
    assert_eq!(busy.status, 202, "{busy:?}");
    assert!(busy.header("retry-after").is_some(), "{busy:?}");
    assert_eq!(busy.header("idempotency-key"), Some("e-1"));
    app.open_gate();
    let first = first.await.unwrap();
    assert_eq!(first.status, 201);
    assert_eq!(first.header("idempotency-key"), Some("\"e-1\""));
    let replay = app.post("/payments", Some("e-1"), &body).await;
    assert!(replay.replayed());
    assert_eq!(replay.header("idempotency-key"), Some("e-1"));
    assert_eq!(app.runs(), 1);
}

/// Without a published policy the problems are typed `about:blank` and carry no `Link`.
async fn without_a_policy_problems_are_about_blank(db: Db) {
    let app = App::serve(&db, IdempotencyConfig::builder().build().unwrap()).await;
    let missing = app.post("/payments", None, &json!({})).await;
    missing.assert_problem(400);
    assert_eq!(missing.json()["type"], json!("about:blank"));
    assert_eq!(missing.header("link"), None);
}

/// The key as a Structured Field string (`"k"`, as the draft writes it) and in the bare
/// form (`k`) are one key: whichever comes first runs, the other is its replay; a quoted
/// value that is not a string is a 400 that runs nothing.
async fn a_quoted_key_and_its_bare_form_are_one_key(db: Db) {
    let app = App::serve(&db, IdempotencyConfig::builder().build().unwrap()).await;
    let body = json!({"amount": 5});
    let first = app.post("/payments", Some(r#""order-7""#), &body).await;
    assert_eq!((first.status, first.replayed()), (201, false));
    let bare = app.post("/payments", Some("order-7"), &body).await;
    assert!(bare.replayed(), "{bare:?}");
    assert_eq!(bare.body, first.body);
    let with_parameter = app.post("/payments", Some(r#""order-7";v=2"#), &body).await;
    assert!(with_parameter.replayed(), "{with_parameter:?}");

    let bare_first = app.post("/payments", Some("order-8"), &body).await;
    assert_eq!((bare_first.status, bare_first.replayed()), (201, false));
    let quoted = app.post("/payments", Some(r#""order-8""#), &body).await;
    assert!(quoted.replayed(), "{quoted:?}");

    app.post("/payments", Some(r#""order-9"#), &body)
        .await
        .assert_problem(400);
    assert_eq!(app.runs(), 2);
    assert_eq!(db.effects().await, 2);
}

common::on_both!(
    a_quoted_key_and_its_bare_form_are_one_key,
    a_key_not_of_the_declared_format_is_refused_the_same_each_time,
    answers_about_a_key_point_at_the_published_policy,
    without_a_policy_problems_are_about_blank,
    the_published_policy_is_the_configurations,
    in_progress_can_be_202_and_the_key_echoed,
);
