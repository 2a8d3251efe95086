//! The README's promises about the runtime that no other test pins down, on the in-memory
//! broker and a SQLite inbox (the core decides them; no broker is involved):
//!
//! - a handler that outlives its `timeout` has failed an attempt: it is rolled back, counted,
//!   retried, and dead-lettered after `max_attempts`;
//! - `on_conflict = "skip"` acks a key reused with another payload without running it, where
//!   the default dead-letters it as `key_conflict`;
//! - `payload_hash = true` keys a message without template or id by `sha256:` of its
//!   canonical JSON, so a reordered payload is a duplicate; without it such a message is
//!   dead-lettered as `missing_key`;
//! - every delivery runs in a `delivery` span carrying handler, source, key, attempt and
//!   outcome.

// Test code may panic: a panic is how a test fails.
#![allow(clippy::unwrap_used)]

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use consumer_core::inbox::EntryStatus;
use consumer_core::memory::{MemoryBroker, Message};
use consumer_core::retry::NoJitter;
use consumer_core::{
    handler, Context, DeadLetterReason, Error, Handler, HandlerError, Inbox, Worker, WorkerConfig,
};
use consumer_scenarios::env::{self as common, SqliteEnv, DEADLINE};
use serde::Deserialize;
use serde_json::json;
use sha2::{Digest, Sha256};
use sqlx::Sqlite;
use tracing::field::{Field, Visit};
use tracing::span::{Attributes, Id, Record};
use tracing_subscriber::layer::{Context as LayerContext, Layer, SubscriberExt};
use tracing_subscriber::registry::LookupSpan;

/// A job: an id, and how long to stall on its first attempts.
#[derive(Debug, Deserialize)]
struct Job {
    id: String,
    /// Sleep this long on every attempt up to `stall_until` (past the handler's timeout).
    #[serde(default)]
    stall_ms: u64,
    #[serde(default)]
    stall_until: u32,
    /// Fail (transiently) while the attempt number is at most this.
    #[serde(default)]
    fail_times: u32,
}

/// Writes a ledger row first, then stalls or fails as the job says: a timed-out or failed
/// attempt must leave no row behind.
async fn record(ctx: &mut Context<'_, Sqlite>, job: &Job) -> Result<(), HandlerError> {
    let attempt = i32::try_from(ctx.attempt()).unwrap_or(i32::MAX);
    sqlx::query("INSERT INTO ledger (job_id, attempt) VALUES (?1, ?2)")
        .bind(&job.id)
        .bind(attempt)
        .execute(ctx.db())
        .await?;
    if ctx.attempt() <= job.stall_until {
        tokio::time::sleep(Duration::from_millis(job.stall_ms)).await;
    }
    if ctx.attempt() <= job.fail_times {
        return Err(HandlerError::transient(format!(
            "job {} fails on attempt {}",
            job.id,
            ctx.attempt()
        )));
    }
    Ok(())
}

#[handler(
    name = "timed",
    max_attempts = 3,
    backoff = "5ms..20ms",
    timeout = "150ms"
)]
async fn timed(ctx: &mut Context<'_, Sqlite>, job: Job) -> Result<(), HandlerError> {
    record(ctx, &job).await
}

#[handler(name = "skipping", on_conflict = "skip")]
async fn skipping(ctx: &mut Context<'_, Sqlite>, job: Job) -> Result<(), HandlerError> {
    record(ctx, &job).await
}

#[handler(name = "strict")]
async fn strict(ctx: &mut Context<'_, Sqlite>, job: Job) -> Result<(), HandlerError> {
    record(ctx, &job).await
}

#[handler(name = "hashed", payload_hash = true)]
async fn hashed(ctx: &mut Context<'_, Sqlite>, job: Job) -> Result<(), HandlerError> {
    record(ctx, &job).await
}

#[handler(name = "span_probe", max_attempts = 3, backoff = "5ms..20ms")]
async fn span_probe(ctx: &mut Context<'_, Sqlite>, job: Job) -> Result<(), HandlerError> {
    record(ctx, &job).await
}

fn config() -> WorkerConfig {
    WorkerConfig::default()
        .with_concurrency(1)
        .with_retention_interval(None)
        .with_jitter(Arc::new(NoJitter))
}

fn with_id(id: &str, body: serde_json::Value) -> Message {
    Message::json(id, &body)
}

/// A message with no id and exactly these payload bytes.
fn anonymous(payload: &str) -> Message {
    Message {
        id: None,
        payload: Bytes::from(payload.to_owned()),
        headers: BTreeMap::new(),
        published_at: None,
    }
}

/// Runs one worker on `queue` until the queue is drained.
async fn drain<H: Handler<Sqlite>>(
    worker: &Worker<Sqlite, H>,
    broker: &MemoryBroker,
    queue: &str,
) -> Result<(), Error> {
    tokio::time::timeout(
        DEADLINE,
        worker.run(broker.consume(queue), broker.drained(queue)),
    )
    .await
    .expect("the worker did not drain the queue in time")
}

/// `(job_id, attempt)` of every committed ledger row, in insertion order.
async fn ledger(inbox: &Inbox<Sqlite>) -> Vec<(String, i64)> {
    sqlx::query_as("SELECT job_id, attempt FROM ledger ORDER BY rowid")
        .fetch_all(inbox.pool())
        .await
        .unwrap()
}

#[tokio::test]
async fn a_timed_out_attempt_is_counted_retried_then_dead_lettered() {
    let env = SqliteEnv::new().await;
    let broker = MemoryBroker::new();
    let queue = common::unique("timeout");
    // Stalls past the 150ms timeout on every attempt.
    broker.publish(
        &queue,
        with_id(
            "slow",
            json!({"id": "slow", "stall_ms": 10_000, "stall_until": 99}),
        ),
    );
    // Stalls on its first attempt only: the timeout fails that attempt, the retry completes.
    broker.publish(
        &queue,
        with_id(
            "once",
            json!({"id": "once", "stall_ms": 10_000, "stall_until": 1}),
        ),
    );
    let w = Worker::with_config(env.inbox.clone(), timed, config()).unwrap();
    drain(&w, &broker, &queue).await.unwrap();

    let s = w.snapshot();
    assert_eq!(s.timeouts, 4, "three of `slow`, one of `once`: {s:?}");
    assert_eq!(s.handler_runs, 5, "{s:?}");
    assert_eq!(s.retries, 3, "two of `slow`, one of `once`: {s:?}");
    assert_eq!((s.completed, s.dead_lettered), (1, 1), "{s:?}");

    let dead = broker.dead_letters(&queue);
    assert_eq!(dead.len(), 1, "{dead:?}");
    let d = &dead[0].dead_letter;
    assert_eq!(d.reason, DeadLetterReason::MaxAttemptsExceeded);
    assert_eq!((d.key.as_deref(), d.attempts), (Some("slow"), 3));
    assert!(d.error.contains("timed out"), "{}", d.error);

    let slow = env.inbox.entry("timed", "slow").await.unwrap().unwrap();
    assert_eq!((slow.status, slow.attempts), (EntryStatus::Dead, 3));
    let once = env.inbox.entry("timed", "once").await.unwrap().unwrap();
    assert_eq!((once.status, once.attempts), (EntryStatus::Completed, 2));
    // Each timed-out attempt was rolled back: only the completed retry left its row.
    assert_eq!(ledger(&env.inbox).await, [("once".to_owned(), 2)]);
}

/// The same key (the message id) twice, with two payloads.
fn conflicting(broker: &MemoryBroker, queue: &str) {
    broker.publish(queue, with_id("c", json!({"id": "c"})));
    broker.publish(queue, with_id("c", json!({"id": "c-other"})));
}

#[tokio::test]
async fn on_conflict_skip_acks_a_reused_key_without_running_it() {
    let env = SqliteEnv::new().await;
    let broker = MemoryBroker::new();
    let queue = common::unique("skip");
    conflicting(&broker, &queue);
    let w = Worker::with_config(env.inbox.clone(), skipping, config()).unwrap();
    drain(&w, &broker, &queue).await.unwrap();

    let s = w.snapshot();
    assert_eq!((s.handler_runs, s.completed), (1, 1), "{s:?}");
    assert_eq!(s.dead_lettered, 0, "{s:?}");
    assert!(s.conflicts >= 1, "the conflict is counted: {s:?}");
    assert!(broker.dead_letters(&queue).is_empty());
    assert!(broker.depth(&queue).is_drained(), "the conflict was acked");
    assert_eq!(ledger(&env.inbox).await, [("c".to_owned(), 1)]);
    let entry = env.inbox.entry("skipping", "c").await.unwrap().unwrap();
    assert_eq!(
        entry.status,
        EntryStatus::Completed,
        "the first payload's run stands"
    );
}

#[tokio::test]
async fn a_skipped_conflict_is_counted_once() {
    let env = SqliteEnv::new().await;
    let broker = MemoryBroker::new();
    let queue = common::unique("skip_count");
    conflicting(&broker, &queue);
    let w = Worker::with_config(env.inbox.clone(), skipping, config()).unwrap();
    drain(&w, &broker, &queue).await.unwrap();
    let s = w.snapshot();
    assert_eq!(s.conflicts, 1, "one conflicting delivery: {s:?}");
}

#[tokio::test]
async fn on_conflict_by_default_dead_letters_key_conflict() {
    let env = SqliteEnv::new().await;
    let broker = MemoryBroker::new();
    let queue = common::unique("strict");
    conflicting(&broker, &queue);
    let w = Worker::with_config(env.inbox.clone(), strict, config()).unwrap();
    drain(&w, &broker, &queue).await.unwrap();

    let s = w.snapshot();
    assert_eq!(
        (s.handler_runs, s.conflicts, s.dead_lettered),
        (1, 1, 1),
        "{s:?}"
    );
    let dead = broker.dead_letters(&queue);
    assert_eq!(dead.len(), 1, "{dead:?}");
    assert_eq!(dead[0].dead_letter.reason, DeadLetterReason::KeyConflict);
    assert_eq!(dead[0].dead_letter.key.as_deref(), Some("c"));
    assert_eq!(
        dead[0].message.payload,
        json!({"id": "c-other"}).to_string()
    );
    assert_eq!(ledger(&env.inbox).await, [("c".to_owned(), 1)]);
}

#[tokio::test]
async fn payload_hash_keys_by_the_canonical_json_so_reordered_fields_are_duplicates() {
    let env = SqliteEnv::new().await;
    let broker = MemoryBroker::new();
    let queue = common::unique("hash");
    broker.publish(&queue, anonymous(r#"{"id":"a","stall_ms":0}"#));
    broker.publish(&queue, anonymous(r#"{ "stall_ms" : 0, "id" : "a" }"#));
    broker.publish(&queue, anonymous(r#"{"id":"a","stall_ms":1}"#));
    let w = Worker::with_config(env.inbox.clone(), hashed, config()).unwrap();
    drain(&w, &broker, &queue).await.unwrap();

    let s = w.snapshot();
    assert_eq!(
        (s.handler_runs, s.completed, s.duplicates),
        (2, 2, 1),
        "{s:?}"
    );
    assert_eq!((s.conflicts, s.dead_lettered), (0, 0), "{s:?}");
    // The key is `sha256:` and the hex SHA-256 of the keys sorted, no white space.
    for canonical in [r#"{"id":"a","stall_ms":0}"#, r#"{"id":"a","stall_ms":1}"#] {
        let key = format!("sha256:{}", hex::encode(Sha256::digest(canonical)));
        let entry = env.inbox.entry("hashed", &key).await.unwrap();
        assert_eq!(
            entry.map(|e| e.status),
            Some(EntryStatus::Completed),
            "{key}"
        );
    }
}

#[tokio::test]
async fn without_payload_hash_an_unkeyed_message_is_dead_lettered_missing_key() {
    let env = SqliteEnv::new().await;
    let broker = MemoryBroker::new();
    let queue = common::unique("nokey");
    broker.publish(&queue, anonymous(r#"{"id":"a"}"#));
    let w = Worker::with_config(env.inbox.clone(), strict, config()).unwrap();
    drain(&w, &broker, &queue).await.unwrap();

    let s = w.snapshot();
    assert_eq!((s.handler_runs, s.dead_lettered), (0, 1), "{s:?}");
    let dead = broker.dead_letters(&queue);
    assert_eq!(dead.len(), 1, "{dead:?}");
    let d = &dead[0].dead_letter;
    assert_eq!(
        (d.reason, d.key.as_deref()),
        (DeadLetterReason::MissingKey, None)
    );
    assert!(ledger(&env.inbox).await.is_empty());
}

/// The fields of one closed span, as the subscriber saw them.
type Fields = HashMap<&'static str, String>;

/// Records every `delivery` span's fields, at creation and as they are filled in, and keeps
/// each span's final set once it closes.
#[derive(Clone, Default)]
struct DeliverySpans {
    closed: Arc<Mutex<Vec<Fields>>>,
}

struct Recorder<'a>(&'a mut Fields);

impl Visit for Recorder<'_> {
    fn record_str(&mut self, field: &Field, value: &str) {
        self.0.insert(field.name(), value.to_owned());
    }

    fn record_u64(&mut self, field: &Field, value: u64) {
        self.0.insert(field.name(), value.to_string());
    }

    fn record_i64(&mut self, field: &Field, value: i64) {
        self.0.insert(field.name(), value.to_string());
    }

    fn record_debug(&mut self, field: &Field, value: &dyn std::fmt::Debug) {
        self.0.insert(field.name(), format!("{value:?}"));
    }
}

impl<S> Layer<S> for DeliverySpans
where
    S: tracing::Subscriber + for<'a> LookupSpan<'a>,
{
    fn on_new_span(&self, attrs: &Attributes<'_>, id: &Id, ctx: LayerContext<'_, S>) {
        if attrs.metadata().name() != "delivery" {
            return;
        }
        let mut fields = Fields::new();
        attrs.record(&mut Recorder(&mut fields));
        if let Some(span) = ctx.span(id) {
            span.extensions_mut().insert(fields);
        }
    }

    fn on_record(&self, id: &Id, values: &Record<'_>, ctx: LayerContext<'_, S>) {
        if let Some(span) = ctx.span(id) {
            if let Some(fields) = span.extensions_mut().get_mut::<Fields>() {
                values.record(&mut Recorder(fields));
            }
        }
    }

    fn on_close(&self, id: Id, ctx: LayerContext<'_, S>) {
        if let Some(span) = ctx.span(&id) {
            if let Some(fields) = span.extensions_mut().remove::<Fields>() {
                self.closed.lock().unwrap().push(fields);
            }
        }
    }
}

/// The `delivery` spans of this test binary, recorded by a global subscriber installed on
/// first use. Global, not a thread's default: a callsite first reached on another thread
/// without a subscriber would stay disabled for a thread-local one.
fn delivery_spans() -> &'static DeliverySpans {
    static SPANS: std::sync::OnceLock<DeliverySpans> = std::sync::OnceLock::new();
    SPANS.get_or_init(|| {
        let spans = DeliverySpans::default();
        tracing::subscriber::set_global_default(
            tracing_subscriber::registry().with(spans.clone().with_filter(
                tracing_subscriber::filter::filter_fn(|m| m.is_span() && m.name() == "delivery"),
            )),
        )
        .expect("no other global subscriber in this test binary");
        spans
    })
}

#[tokio::test]
async fn every_delivery_runs_in_a_span_with_handler_source_key_attempt_and_outcome() {
    let spans = delivery_spans();
    let env = SqliteEnv::new().await;
    let broker = MemoryBroker::new();
    let queue = common::unique("spans");
    broker.publish(&queue, with_id("ok", json!({"id": "ok"})));
    broker.publish(&queue, with_id("ok", json!({"id": "ok"})));
    broker.publish(
        &queue,
        with_id("flaky", json!({"id": "flaky", "fail_times": 1})),
    );
    broker.publish(&queue, anonymous("not json"));
    let w = Worker::with_config(env.inbox.clone(), span_probe, config()).unwrap();
    drain(&w, &broker, &queue).await.unwrap();

    // A span closes when its last handle is dropped; the last delivery's span has been seen
    // closing just after `run` returned, so the test waits for the five.
    let probe = || -> Vec<Fields> {
        // Other tests' deliveries run under other handler names.
        spans
            .closed
            .lock()
            .unwrap()
            .iter()
            .filter(|f| f.get("handler").map(String::as_str) == Some("span_probe"))
            .cloned()
            .collect()
    };
    common::wait_until("the five delivery spans closed", || {
        let n = probe().len();
        async move { n >= 5 }
    })
    .await;
    let closed = probe();
    assert_eq!(closed.len(), 5, "one span per delivery: {closed:?}");
    let source = format!("memory:{queue}");
    for fields in &closed {
        assert_eq!(fields.get("source"), Some(&source), "{fields:?}");
    }
    let mut seen: Vec<(Option<&str>, Option<&str>, Option<&str>)> = closed
        .iter()
        .map(|f| {
            (
                f.get("key").map(String::as_str),
                f.get("attempt").map(String::as_str),
                f.get("outcome").map(String::as_str),
            )
        })
        .collect();
    seen.sort();
    assert_eq!(
        seen,
        [
            // Undecodable: dead-lettered before a key exists or an attempt is counted.
            (None, None, Some("dead_lettered")),
            (Some("flaky"), Some("1"), Some("retry")),
            (Some("flaky"), Some("2"), Some("completed")),
            // The duplicate settles before an attempt is counted.
            (Some("ok"), None, Some("duplicate")),
            (Some("ok"), Some("1"), Some("completed")),
        ]
    );
}
