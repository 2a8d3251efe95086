//! What the layer does on its own besides answering: it deletes expired records. Every
//! scenario runs on PostgreSQL, SQLite, and PostgreSQL with the Redis fast path.

// A scenario's setup failing is the test failing.
#![allow(clippy::unwrap_used)]

mod common;

use std::time::Duration;

use common::{wait_until, App, Db};
use consumer_http::IdempotencyConfig;
use serde_json::json;

/// A record whose TTL passed is deleted by the layer's own purge, with nothing scheduled by
/// the application (which records the purge statement takes: `idempotency.rs`,
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

common::on_both!(the_layer_purges_expired_records_itself);
