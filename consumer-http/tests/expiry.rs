//! Expired records: a key runs again after its TTL, and its record is deleted by the
//! store's purge and by the layer's own. Every scenario runs on PostgreSQL, SQLite, and
//! PostgreSQL with the Redis fast path.

// A scenario's setup failing is the test failing.
#![allow(clippy::unwrap_used)]

mod common;

use std::time::Duration;

use common::{wait_until, App, Db};
use consumer_http::IdempotencyConfig;
use serde_json::json;

/// A record whose TTL passed is deleted by the layer's own purge, with nothing scheduled by
/// the application (which records the purge statement takes:
/// `an_expired_key_runs_again_and_is_purged`).
async fn the_layer_purges_expired_records_itself(db: Db) {
    let short = IdempotencyConfig::builder()
        .lease(Duration::from_millis(1))
        .ttl(Duration::from_millis(100))
        .purge_interval(Duration::from_millis(50))
        .build()
        .unwrap();
    let app = App::serve(&db, short).await;
    assert_eq!(
        app.post("/flaky", Some("gone"), &json!({})).await.status,
        201
    );
    wait_until("the expired record purged", || async {
        db.records().await == 0
    })
    .await;
    // Its writes stay: only the record goes.
    assert_eq!(db.effects().await, 1);
}

/// After its TTL a key runs again, and the expired records are purged.
async fn an_expired_key_runs_again_and_is_purged(db: Db) {
    let ttl = Duration::from_secs(2);
    // The store's purge, run by the test: the layer's own is off.
    let config = IdempotencyConfig::builder()
        .lease(ttl)
        .ttl(ttl)
        .no_purge()
        .build()
        .unwrap();
    let app = App::serve(&db, config).await;
    let body = json!({"amount": 1});
    assert_eq!(app.post("/payments", Some("t"), &body).await.status, 201);
    wait_until("the key to run again after its TTL", || async {
        !app.post("/payments", Some("t"), &body).await.replayed()
    })
    .await;
    assert_eq!(app.runs(), 2);
    assert_eq!(db.effects().await, 2);
    wait_until("the expired record to be purged", || async {
        db.purge_expired().await == 1
    })
    .await;
    assert_eq!(db.records().await, 0);
}

common::on_both!(
    the_layer_purges_expired_records_itself,
    an_expired_key_runs_again_and_is_purged,
);
