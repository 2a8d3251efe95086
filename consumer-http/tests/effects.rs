//! What a handler behind the layer gets for its effects outside the database: a stable key
//! to hand a provider (`IdempotentTx::idempotency_key`). Every scenario runs on PostgreSQL,
//! SQLite, and PostgreSQL with the Redis fast path.

// A scenario's setup failing is the test failing.
#![allow(clippy::unwrap_used)]

mod common;

use std::sync::atomic::Ordering;

use common::{App, Db, BOB};
use consumer_http::IdempotencyConfig;
use serde_json::json;

/// A run rolled back (502) and its retry get the same effect key, so a provider sees one
/// request; another key, or the same key from another caller, gets another.
async fn a_handler_gets_the_same_effect_key_on_every_run_of_its_request(db: Db) {
    let app = App::serve(&db, IdempotencyConfig::builder().build().unwrap()).await;
    let body = json!({});
    app.handlers.fail_next.store(true, Ordering::SeqCst);
    assert_eq!(app.post("/flaky", Some("k1"), &body).await.status, 502);
    assert_eq!(app.post("/flaky", Some("k1"), &body).await.status, 201);
    assert_eq!(app.post("/flaky", Some("k2"), &body).await.status, 201);
    let bob = app
        .send(
            "/flaky",
            Some("k1"),
            body.to_string(),
            &[("authorization", BOB)],
        )
        .await;
    assert_eq!(bob.status, 201);
    let keys = app.handlers.effect_keys.lock().unwrap().clone();
    assert_eq!(keys.len(), 4, "{keys:?}");
    assert!(
        keys[0].starts_with("ik-") && keys[0].len() == 3 + 64,
        "{}",
        keys[0]
    );
    assert_eq!(keys[0], keys[1], "the retry's key");
    assert_ne!(keys[0], keys[2], "another key's");
    assert_ne!(keys[0], keys[3], "another caller's");
}

common::on_both!(a_handler_gets_the_same_effect_key_on_every_run_of_its_request);
