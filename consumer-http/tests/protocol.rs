//! The layer to the letter of the Idempotency-Key draft (`draft-ietf-httpapi-idempotency-key-header`):
//! the key's forms. Every scenario runs on PostgreSQL, SQLite, and PostgreSQL with the Redis
//! fast path.

// A scenario's setup failing is the test failing.
#![allow(clippy::unwrap_used)]

mod common;

use common::{App, Db};
use consumer_http::IdempotencyConfig;
use serde_json::json;

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

common::on_both!(a_quoted_key_and_its_bare_form_are_one_key);
