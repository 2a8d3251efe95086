//! The Redis fast path against a real Redis (`REDIS_URL`) and PostgreSQL (`DATABASE_URL`):
//! what it answers without the database, and that the database alone answers the same when
//! Redis is unreachable or silent. Each test has its own schema and key prefix. The
//! scenarios of `idempotency.rs` also run with the fast path (`postgres_redis`).

#![cfg(feature = "redis")]
// A scenario's setup failing is the test failing.
#![allow(clippy::unwrap_used)]

mod common;

use std::collections::BTreeMap;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex, Once};
use std::time::Duration;

use common::{redis_url, unique, wait_until, App, Db};
use consumer_http::{IdempotencyConfig, RedisFastPath};
use metrics::{Counter, Gauge, Histogram, Key, KeyName, Metadata, SharedString, Unit};
use serde_json::json;

/// The layer's configuration of these tests: no purge, and gauges an hour apart, so that
/// once the layer's background task has read the table for its first gauges
/// ([`start_housekeeping`]) it takes no connection while a test counts the ones its
/// requests take.
fn config() -> consumer_http::IdempotencyConfigBuilder {
    IdempotencyConfig::builder()
        .no_purge()
        .gauge_interval(Duration::from_secs(3600))
}

/// How many times the layers of this test binary have read each table for their gauges
/// (one connection from the pool each time), by the table's label.
static GAUGE_READS: Mutex<BTreeMap<String, u64>> = Mutex::new(BTreeMap::new());

/// The reads of `table` for the gauges so far.
fn gauge_reads(table: &str) -> u64 {
    GAUGE_READS.lock().unwrap().get(table).copied().unwrap_or(0)
}

/// This binary's metrics recorder: counts in [`GAUGE_READS`] each
/// `consumer_http_records{status="completed"}` a layer sets (once per read of its table,
/// after the read), and drops every other metric.
struct CountsGaugeReads;

/// The gauge of one table's completed records, as [`CountsGaugeReads`] hands it out.
struct TableRead(String);

impl metrics::GaugeFn for TableRead {
    fn increment(&self, _: f64) {}
    fn decrement(&self, _: f64) {}
    fn set(&self, _: f64) {
        *GAUGE_READS
            .lock()
            .unwrap()
            .entry(self.0.clone())
            .or_default() += 1;
    }
}

impl metrics::Recorder for CountsGaugeReads {
    fn describe_counter(&self, _: KeyName, _: Option<Unit>, _: SharedString) {}
    fn describe_gauge(&self, _: KeyName, _: Option<Unit>, _: SharedString) {}
    fn describe_histogram(&self, _: KeyName, _: Option<Unit>, _: SharedString) {}
    fn register_counter(&self, _: &Key, _: &Metadata<'_>) -> Counter {
        Counter::noop()
    }
    fn register_gauge(&self, key: &Key, _: &Metadata<'_>) -> Gauge {
        let label = |name: &str| key.labels().find(|l| l.key() == name).map(|l| l.value());
        match (key.name(), label("status"), label("table")) {
            ("consumer_http_records", Some("completed"), Some(table)) => {
                Gauge::from_arc(Arc::new(TableRead(table.to_owned())))
            }
            _ => Gauge::noop(),
        }
    }
    fn register_histogram(&self, _: &Key, _: &Metadata<'_>) -> Histogram {
        Histogram::noop()
    }
}

/// Starts the background task of `app`'s layer, which no request has reached yet, with a
/// request that reads nothing (no key: 400), and waits until the task's first read of
/// `db`'s table for the gauges is done: from then on (no purge, the next read an hour
/// away) every connection taken from the pool is a request's.
async fn start_housekeeping(app: &App, db: &Db) {
    static RECORDER: Once = Once::new();
    RECORDER.call_once(|| {
        metrics::set_global_recorder(CountsGaugeReads).expect("the only recorder of this binary");
    });
    let table = db.table();
    let before = gauge_reads(&table);
    app.post("/payments", None, &json!({}))
        .await
        .assert_problem(400);
    wait_until(
        "the layer's first read of its table for the gauges",
        || async { gauge_reads(&table) > before },
    )
    .await;
}

/// A fast path with a prefix of its own, and that prefix. Its calls may take 5 s, not the
/// default 100 ms: a call that runs out pauses the fast path and sends its requests to the
/// database, which these tests count, and on a loaded machine the first lookup of 100
/// concurrent requests (which also connects) has taken longer than 100 ms.
fn fast_path() -> (RedisFastPath, String) {
    let prefix = unique("http");
    let fast = RedisFastPath::builder(redis_url())
        .timeout(Duration::from_secs(5))
        .key_prefix(&prefix)
        .build()
        .unwrap();
    (fast, prefix)
}

/// The keys under `prefix` in Redis.
async fn redis_keys(prefix: &str) -> Vec<String> {
    let client = redis::Client::open(redis_url()).unwrap();
    let mut conn = client.get_multiplexed_async_connection().await.unwrap();
    let mut keys: Vec<String> = redis::cmd("KEYS")
        .arg(format!("{prefix}:*"))
        .query_async(&mut conn)
        .await
        .unwrap();
    keys.sort();
    keys
}

/// After a completed request its answer is in Redis (and its lease gone, and its key holds
/// no trace of the caller but a hash), and a replay and
/// a request with another body under the key are answered without taking a connection
/// from the database's pool: the same bytes, and 422.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_replay_and_a_422_are_answered_from_redis() {
    let (fast, prefix) = fast_path();
    let db = Db::postgres().await.with_redis(fast);
    let app = App::serve(&db, config().build().unwrap()).await;
    start_housekeeping(&app, &db).await;
    let body = json!({"amount": 3});
    let first = app.post("/payments", Some("r"), &body).await;
    assert_eq!(first.status, 201);
    let keys = redis_keys(&prefix).await;
    assert_eq!(keys.len(), 1, "{keys:?}");
    assert!(
        keys[0].starts_with(&format!("{prefix}:answer:")),
        "{keys:?}"
    );
    // Scoped by the caller's hash: neither its name nor its credential is in the key.
    assert!(
        !keys[0].contains("alice") && !keys[0].contains("token"),
        "{keys:?}"
    );

    let before = db.acquires();
    let replay = app.post("/payments", Some("r"), &body).await;
    assert!(replay.replayed(), "{replay:?}");
    assert_eq!(replay.body, first.body);
    assert_eq!(replay.header("location"), first.header("location"));
    let other = app
        .post("/payments", Some("r"), &json!({"amount": 4}))
        .await;
    other.assert_problem(422);
    assert_eq!(db.acquires(), before, "the database was asked");
    assert_eq!(app.runs(), 1);
    assert_eq!(db.effects().await, 1);
}

/// An answer the database holds but Redis does not (stored while Redis was not in front)
/// is replayed from the database once, cached, and then replayed from Redis.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_answer_only_the_database_holds_is_cached_on_its_first_replay() {
    let db = Db::postgres().await;
    let body = json!({"amount": 8});
    let without = App::serve(&db, config().build().unwrap()).await;
    start_housekeeping(&without, &db).await;
    let first = without.post("/payments", Some("b"), &body).await;
    assert_eq!(first.status, 201);
    let (fast, prefix) = fast_path();
    let db = db.with_redis(fast);
    let app = App::serve(&db, config().build().unwrap()).await;
    start_housekeeping(&app, &db).await;
    assert!(redis_keys(&prefix).await.is_empty());
    let before = db.acquires();
    let from_db = app.post("/payments", Some("b"), &body).await;
    assert!(from_db.replayed());
    assert!(
        db.acquires() > before,
        "the first replay comes from the database"
    );
    assert_eq!(redis_keys(&prefix).await.len(), 1);
    let before = db.acquires();
    let from_redis = app.post("/payments", Some("b"), &body).await;
    assert!(from_redis.replayed());
    assert_eq!(from_redis.body, first.body);
    assert_eq!(db.acquires(), before, "the second replay comes from Redis");
}

/// 100 concurrent requests with one key: one run; the others wait on the Redis lease, not
/// on the database (a handful of connections taken in all, where polling the database
/// takes at least one per waiting request), and are answered the first answer byte for byte.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_duplicates_wait_on_the_lease_not_on_the_database() {
    let (fast, _) = fast_path();
    let db = Db::postgres().await.with_redis(fast);
    let app =
        Arc::new(App::serve(&db, config().wait(Duration::from_secs(30)).build().unwrap()).await);
    start_housekeeping(&app, &db).await;
    app.handlers.hold_next.store(true, Ordering::SeqCst);
    let body = json!({"amount": 100});
    let before = db.acquires();
    let requests: Vec<_> = (0..100)
        .map(|_| {
            let (app, body) = (app.clone(), body.clone());
            tokio::spawn(async move { app.post("/payments", Some("c"), &body).await })
        })
        .collect();
    app.wait_held(1).await;
    app.open_gate();
    let mut answers = Vec::new();
    for r in requests {
        answers.push(r.await.unwrap());
    }
    let taken = db.acquires() - before;
    assert_eq!(app.runs(), 1);
    let first: Vec<_> = answers.iter().filter(|a| !a.replayed()).collect();
    assert_eq!(first.len(), 1, "{answers:?}");
    let first = first[0];
    assert_eq!(first.status, 201);
    for a in &answers {
        assert_eq!(a.status, 201, "{a:?}");
        assert_eq!(a.body, first.body);
        assert_eq!(a.header("location"), first.header("location"));
    }
    // The run: its read, its claim, its transaction.
    assert!(
        taken <= 5,
        "{taken} connections taken for one run and 99 waits"
    );
    assert_eq!(db.effects().await, 1);
}

/// A 5xx gives the lease back with the key: the retry runs at once, and its answer is then
/// replayed from Redis.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_5xx_releases_the_lease() {
    let (fast, prefix) = fast_path();
    let db = Db::postgres().await.with_redis(fast);
    let app = App::serve(&db, config().wait(Duration::ZERO).build().unwrap()).await;
    start_housekeeping(&app, &db).await;
    app.handlers.fail_next.store(true, Ordering::SeqCst);
    assert_eq!(app.post("/flaky", Some("f"), &json!({})).await.status, 502);
    assert!(redis_keys(&prefix).await.is_empty());
    let retried = app.post("/flaky", Some("f"), &json!({})).await;
    assert_eq!(retried.status, 201, "{retried:?}");
    let before = db.acquires();
    let again = app.post("/flaky", Some("f"), &json!({})).await;
    assert!(again.replayed());
    assert_eq!(again.body, retried.body);
    assert_eq!(db.acquires(), before);
    assert_eq!(db.effects().await, 1);
}

/// What the layer answers through the database alone, Redis being of no use: a run, a
/// replay, a 422, a 5xx released and run again.
async fn the_database_answers_alone(db: Db) {
    let app = App::serve(&db, config().build().unwrap()).await;
    let body = json!({"amount": 1});
    let first = app.post("/payments", Some("d"), &body).await;
    assert_eq!(first.status, 201, "{first:?}");
    let replay = app.post("/payments", Some("d"), &body).await;
    assert!(replay.replayed(), "{replay:?}");
    assert_eq!(replay.body, first.body);
    app.post("/payments", Some("d"), &json!({"amount": 2}))
        .await
        .assert_problem(422);
    app.handlers.fail_next.store(true, Ordering::SeqCst);
    assert_eq!(app.post("/flaky", Some("f"), &json!({})).await.status, 502);
    assert_eq!(app.post("/flaky", Some("f"), &json!({})).await.status, 201);
    assert_eq!(app.runs(), 3);
    assert_eq!(db.effects().await, 2);
}

/// Redis refuses connections (nothing listens on the port): the database answers.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn with_redis_unreachable_the_database_answers() {
    // A port that was free a moment ago: bound, then let go.
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let fast = RedisFastPath::builder(format!("redis://user:s3cret@127.0.0.1:{port}"))
        .key_prefix(unique("http"))
        .build()
        .unwrap();
    assert!(!format!("{fast:?}").contains("s3cret"), "{fast:?}");
    the_database_answers_alone(Db::postgres().await.with_redis(fast)).await;
}

/// Redis accepts connections and never answers: each call times out, and the database
/// answers.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn with_redis_silent_the_database_answers() {
    let silent = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = silent.local_addr().unwrap();
    tokio::spawn(async move {
        let mut held = Vec::new();
        while let Ok((socket, _)) = silent.accept().await {
            held.push(socket);
        }
    });
    let fast = RedisFastPath::builder(format!("redis://{addr}"))
        .timeout(Duration::from_millis(50))
        .pause_after_failure(Duration::from_millis(10))
        .key_prefix(unique("http"))
        .build()
        .unwrap();
    the_database_answers_alone(Db::postgres().await.with_redis(fast)).await;
}

/// A bad URL, prefix or timeout fails the build naming the field, and the URL's password
/// is in neither the error nor the builder's `Debug`.
#[tokio::test]
async fn bad_configuration_names_the_field_without_the_password() {
    let builder = RedisFastPath::builder("http://user:s3cret@host");
    assert!(!format!("{builder:?}").contains("s3cret"));
    let err = builder.build().unwrap_err();
    let shown = format!("{err} {err:?}");
    assert!(
        shown.contains("redis.url") && !shown.contains("s3cret"),
        "{shown}"
    );
    let field = |b: consumer_http::RedisFastPathBuilder| match b.build() {
        Err(consumer_http::Error::Config { field, .. }) => field,
        other => panic!("expected a config error, got {other:?}"),
    };
    let ok = || RedisFastPath::builder("redis://127.0.0.1:1");
    assert_eq!(field(ok().key_prefix("")), "redis.key_prefix");
    assert_eq!(field(ok().timeout(Duration::ZERO)), "redis.timeout");
}
