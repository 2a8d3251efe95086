//! Unit tests of the pipeline on an SQLite inbox and the in-memory broker: no server.
//! The decisions of each stage have their own tests in [`super::attempt`] and
//! [`super::claim`]; these run the stages together.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::future::BoxFuture;
use serde::Deserialize;
use serde_json::json;
use sqlx::Sqlite;

use crate::delivery::{Acknowledger, Incoming, Settlement};
use crate::error::TransportError;
use crate::memory::{MemoryBroker, Message};
use crate::stats::StatsSnapshot;
use crate::{
    BatchConfig, BatchContext, Context, DeadLetterReason, Handler, HandlerError, HandlerOptions,
    Inbox, Worker, WorkerConfig,
};

/// A job: `fail` transient failures before it succeeds, or a permanent failure.
#[derive(Debug, Deserialize)]
struct Job {
    id: String,
    #[serde(default)]
    fail: u32,
    #[serde(default)]
    permanent: bool,
}

/// A handler that records every run (the key and the attempt it ran as) and writes one
/// effect row per success; with `batches`, it also has a batch function.
#[derive(Clone, Default)]
struct Recorder {
    runs: Arc<Mutex<Vec<(String, u32)>>>,
    batch_calls: Arc<AtomicUsize>,
    batches: bool,
}

impl Recorder {
    fn runs_of(&self, key: &str) -> Vec<u32> {
        let runs = self.runs.lock().expect("runs");
        runs.iter()
            .filter(|(k, _)| k == key)
            .map(|(_, n)| *n)
            .collect()
    }

    fn outcome(job: &Job, attempt: u32) -> Result<(), HandlerError> {
        if job.permanent {
            return Err(HandlerError::permanent("refused for good"));
        }
        if attempt <= job.fail {
            return Err(HandlerError::transient("not yet"));
        }
        Ok(())
    }
}

impl Handler<Sqlite> for Recorder {
    type Message = Job;

    fn options(&self) -> HandlerOptions {
        HandlerOptions::new("unit").backoff(Duration::from_millis(1), Duration::from_millis(1))
    }

    fn handle<'a, 'c>(
        &'a self,
        ctx: &'a mut Context<'c, Sqlite>,
        job: Job,
    ) -> BoxFuture<'a, Result<(), HandlerError>>
    where
        'c: 'a,
    {
        Box::pin(async move {
            let attempt = ctx.attempt();
            self.runs
                .lock()
                .expect("runs")
                .push((ctx.key().to_owned(), attempt));
            Recorder::outcome(&job, attempt)?;
            sqlx::query("INSERT INTO effects (id) VALUES (?)")
                .bind(&job.id)
                .execute(ctx.db())
                .await?;
            Ok(())
        })
    }

    fn handles_batches(&self) -> bool {
        self.batches
    }

    fn handle_batch<'a, 'c>(
        &'a self,
        ctx: &'a mut BatchContext<'c, Sqlite>,
        jobs: Vec<Job>,
    ) -> BoxFuture<'a, Result<(), HandlerError>>
    where
        'c: 'a,
    {
        Box::pin(async move {
            self.batch_calls.fetch_add(1, Ordering::Relaxed);
            for (i, job) in jobs.iter().enumerate() {
                Recorder::outcome(job, ctx.attempt(i))?;
            }
            for job in &jobs {
                sqlx::query("INSERT INTO effects (id) VALUES (?)")
                    .bind(&job.id)
                    .execute(ctx.db())
                    .await?;
            }
            Ok(())
        })
    }
}

/// An SQLite inbox in a fresh temporary directory, with the handler's effects table.
async fn inbox() -> (Inbox<Sqlite>, tempfile::TempDir) {
    let dir = tempfile::tempdir().expect("temporary directory");
    let inbox = Inbox::open_sqlite(dir.path().join("inbox.db"))
        .await
        .expect("open the inbox");
    sqlx::query("CREATE TABLE effects (id TEXT PRIMARY KEY)")
        .execute(inbox.pool())
        .await
        .expect("create the effects table");
    (inbox, dir)
}

async fn effects(inbox: &Inbox<Sqlite>) -> Vec<String> {
    sqlx::query_scalar("SELECT id FROM effects ORDER BY id")
        .fetch_all(inbox.pool())
        .await
        .expect("read the effects")
}

fn config(batch: Option<BatchConfig>) -> WorkerConfig {
    WorkerConfig::default()
        .with_concurrency(2)
        .with_retention_interval(None)
        .with_batch(batch)
}

/// Publishes `jobs` (id, body) on a fresh queue and runs a worker until the queue is drained.
async fn run(
    handler: &Recorder,
    inbox: &Inbox<Sqlite>,
    batch: Option<BatchConfig>,
    jobs: &[(&str, serde_json::Value)],
) -> (StatsSnapshot, MemoryBroker) {
    let broker = published(jobs);
    let worker = Worker::with_config(inbox.clone(), handler.clone(), config(batch)).unwrap();
    drain(&worker, &broker).await;
    (worker.snapshot(), broker)
}

/// A broker with `jobs` (id, body) on the queue `q`.
fn published(jobs: &[(&str, serde_json::Value)]) -> MemoryBroker {
    let broker = MemoryBroker::new();
    for (id, body) in jobs {
        broker.publish("q", Message::json(*id, body));
    }
    broker
}

/// Runs `worker` on the queue `q` of `broker` until it is drained.
async fn drain(worker: &Worker<Sqlite, Recorder>, broker: &MemoryBroker) {
    tokio::time::timeout(
        Duration::from_secs(30),
        worker.run(broker.consume("q"), broker.drained("q")),
    )
    .await
    .expect("the queue drains in time")
    .expect("the worker runs");
}

const BATCH: BatchConfig = BatchConfig::new(8, Duration::from_millis(200));

#[tokio::test]
async fn a_failed_member_reruns_the_batch_one_by_one_and_the_rest_complete_once() {
    for batches in [false, true] {
        let (inbox, _dir) = inbox().await;
        let handler = Recorder {
            batches,
            ..Recorder::default()
        };
        let jobs = [
            ("a", json!({"id": "a"})),
            ("b", json!({"id": "b", "permanent": true})),
            ("c", json!({"id": "c"})),
        ];
        let (stats, broker) = run(&handler, &inbox, Some(BATCH), &jobs).await;
        assert_eq!(
            effects(&inbox).await,
            ["a", "c"],
            "batch function: {batches}"
        );
        assert_eq!(stats.completed, 2, "{stats:?}");
        assert_eq!(stats.dead_lettered, 1, "{stats:?}");
        assert!(
            stats.batch_reruns > 0,
            "the batch ran again one by one: {stats:?}"
        );
        let dead = broker.dead_letters("q");
        assert_eq!(dead.len(), 1);
        assert_eq!(dead[0].dead_letter.reason, DeadLetterReason::PermanentError);
        // Each key ran alone once after the failed batch, as attempt 1 (a fresh delivery:
        // the rolled-back batch counted nothing).
        for key in ["a", "b", "c"] {
            let alone: Vec<u32> = handler.runs_of(key);
            assert_eq!(alone.last(), Some(&1), "{key}: {alone:?}");
        }
    }
}

#[tokio::test]
async fn a_batch_of_one_runs_the_per_message_handler() {
    let (inbox, _dir) = inbox().await;
    let handler = Recorder {
        batches: true,
        ..Recorder::default()
    };
    let (stats, _) = run(&handler, &inbox, None, &[("a", json!({"id": "a"}))]).await;
    assert_eq!(stats.completed, 1);
    assert_eq!(handler.batch_calls.load(Ordering::Relaxed), 0);
    assert_eq!(handler.runs_of("a"), [1]);
}

/// A broker slow to take settlements: each tells `arrived` it is there, waits until the test
/// opens `gate`, then goes to the in-memory broker's own acknowledger.
struct Held {
    inner: Box<dyn Acknowledger>,
    arrived: Arc<tokio::sync::Semaphore>,
    gate: Arc<tokio::sync::Semaphore>,
}

impl Acknowledger for Held {
    fn settle(
        self: Box<Self>,
        settlement: Settlement,
    ) -> BoxFuture<'static, Result<(), TransportError>> {
        Box::pin(async move {
            self.arrived.add_permits(1);
            let _open = self.gate.acquire().await;
            self.inner.settle(settlement).await
        })
    }
}

#[tokio::test]
async fn a_delivery_waiting_for_its_settlement_leaves_its_slot_to_the_next() {
    let (inbox, _dir) = inbox().await;
    let handler = Recorder::default();
    let broker = published(&[("a", json!({"id": "a"})), ("b", json!({"id": "b"}))]);
    let arrived = Arc::new(tokio::sync::Semaphore::new(0));
    let gate = Arc::new(tokio::sync::Semaphore::new(0));
    let held = {
        let (arrived, gate) = (arrived.clone(), gate.clone());
        futures::TryStreamExt::map_ok(broker.consume("q"), move |i: Incoming| Incoming {
            delivery: i.delivery,
            acker: Box::new(Held {
                inner: i.acker,
                arrived: arrived.clone(),
                gate: gate.clone(),
            }),
        })
    };
    let worker = Worker::with_config(
        inbox.clone(),
        handler.clone(),
        config(None).with_concurrency(1),
    )
    .unwrap();
    let running = tokio::spawn(async move { worker.run(held, broker.drained("q")).await });
    // One slot: b runs, and reaches its own settlement, while a, committed, still waits for
    // the broker to take its ack.
    let both = tokio::time::timeout(Duration::from_secs(10), arrived.acquire_many(2)).await;
    assert!(both.is_ok(), "b settles while a's settlement is held");
    assert_eq!(handler.runs_of("b"), [1]);
    assert_eq!(handler.runs_of("a"), [1]);
    gate.add_permits(1);
    tokio::time::timeout(Duration::from_secs(30), running)
        .await
        .expect("the worker ends in time")
        .expect("the worker's task")
        .expect("the worker runs");
    assert_eq!(effects(&inbox).await, ["a", "b"]);
}

#[tokio::test]
async fn the_pipeline_gives_each_emptied_batch_buffer_back_to_the_intake() {
    let (inbox, _dir) = inbox().await;
    let handler = Recorder::default();
    let ids: Vec<String> = (0..40).map(|i| format!("j{i:02}")).collect();
    let jobs: Vec<(&str, serde_json::Value)> = ids
        .iter()
        .map(|id| (id.as_str(), json!({ "id": id })))
        .collect();
    let broker = published(&jobs);
    let worker = Worker::with_config(inbox.clone(), handler, config(Some(BATCH))).unwrap();
    drain(&worker, &broker).await;
    assert_eq!(worker.snapshot().completed, 40);
    // Five batches or more ran, two at most at once: the buffers came back (none dropped
    // with its batch), no more than two are kept, and each still has a batch's room.
    let kept = worker.inner.spare_batches.capacities();
    assert!(
        (1..=2).contains(&kept.len()),
        "buffers kept after the run: {kept:?}"
    );
    assert!(kept.iter().all(|&c| c >= BATCH.max_messages), "{kept:?}");
}

#[tokio::test]
async fn a_retried_job_runs_as_the_next_attempt_each_time() {
    for batch in [None, Some(BATCH)] {
        let (inbox, _dir) = inbox().await;
        let handler = Recorder::default();
        let jobs = [("a", json!({"id": "a", "fail": 2}))];
        let (stats, _) = run(&handler, &inbox, batch, &jobs).await;
        assert_eq!(effects(&inbox).await, ["a"]);
        assert_eq!(handler.runs_of("a"), [1, 2, 3], "{batch:?}");
        assert_eq!((stats.retries, stats.completed), (2, 1), "{stats:?}");
        let entry = inbox.entry("unit", "a").await.unwrap().expect("a row");
        assert_eq!(entry.attempts, 3);
    }
}

#[tokio::test]
async fn a_key_twice_in_one_batch_runs_once() {
    let (inbox, _dir) = inbox().await;
    let handler = Recorder::default();
    let jobs = [("a", json!({"id": "a"})), ("a", json!({"id": "a"}))];
    let (stats, _) = run(&handler, &inbox, Some(BATCH), &jobs).await;
    assert_eq!(effects(&inbox).await, ["a"]);
    assert_eq!((stats.completed, stats.duplicates), (1, 1), "{stats:?}");
    assert_eq!(handler.runs_of("a"), [1]);
}

#[tokio::test]
async fn a_message_that_cannot_run_is_dead_lettered_once_with_its_reason() {
    let (inbox, _dir) = inbox().await;
    let handler = Recorder::default();
    let broker = MemoryBroker::new();
    broker.publish(
        "q",
        Message {
            id: Some("x".into()),
            payload: bytes::Bytes::from_static(b"{not json"),
            ..Message::default()
        },
    );
    broker.publish("q", Message::json("", &json!({"id": "no key"})));
    let worker = Worker::with_config(inbox.clone(), handler.clone(), config(Some(BATCH))).unwrap();
    tokio::time::timeout(
        Duration::from_secs(30),
        worker.run(broker.consume("q"), broker.drained("q")),
    )
    .await
    .expect("drains")
    .expect("runs");
    let mut reasons: Vec<_> = broker
        .dead_letters("q")
        .into_iter()
        .map(|d| d.dead_letter.reason)
        .collect();
    reasons.sort_by_key(|r| r.as_str());
    assert_eq!(
        reasons,
        [DeadLetterReason::MissingKey, DeadLetterReason::Undecodable]
    );
    assert!(handler.runs.lock().unwrap().is_empty());
}

/// The value of the counter `name` with `labels` (besides `handler="unit"`), if registered.
fn counter(
    snapshot: &[(
        metrics_util::CompositeKey,
        metrics_util::debugging::DebugValue,
    )],
    name: &str,
    labels: &[(&str, &str)],
) -> Option<u64> {
    snapshot.iter().find_map(|(key, value)| {
        let key = key.key();
        let mut want: Vec<(&str, &str)> = vec![("handler", "unit")];
        want.extend_from_slice(labels);
        let got: Vec<(&str, &str)> = key.labels().map(|l| (l.key(), l.value())).collect();
        let same = key.name() == name && got.len() == want.len();
        match value {
            metrics_util::debugging::DebugValue::Counter(n)
                if same && want.iter().all(|l| got.contains(l)) =>
            {
                Some(*n)
            }
            _ => None,
        }
    })
}

#[tokio::test]
async fn the_counts_are_exported_through_the_metrics_facade() {
    for batch in [None, Some(BATCH)] {
        let (inbox, _dir) = inbox().await;
        let handler = Recorder::default();
        let broker = published(&[
            ("a", json!({"id": "a"})),
            ("a", json!({"id": "a"})),
            ("p", json!({"id": "p", "permanent": true})),
            ("r", json!({"id": "r", "fail": 1})),
        ]);
        let recorder = metrics_util::debugging::DebuggingRecorder::new();
        let snapshotter = recorder.snapshotter();
        // The handles are registered when the worker is built: a recorder in scope then is
        // the one the worker feeds.
        let worker = metrics::with_local_recorder(&recorder, || {
            Worker::with_config(inbox.clone(), handler.clone(), config(batch))
        })
        .unwrap();
        drain(&worker, &broker).await;
        let snapshot: Vec<_> = snapshotter
            .snapshot()
            .into_vec()
            .into_iter()
            .map(|(key, _, _, value)| (key, value))
            .collect();
        let stats = worker.snapshot();
        let deliveries = "consumer_deliveries_total";
        let outcome = |o| counter(&snapshot, deliveries, &[("outcome", o)]);
        assert_eq!(outcome("completed"), Some(2), "{batch:?}: {snapshot:?}");
        assert_eq!(outcome("duplicate"), Some(1), "{batch:?}");
        assert_eq!(outcome("retried"), Some(1), "{batch:?}");
        let permanent = [("outcome", "dead_lettered"), ("reason", "permanent_error")];
        assert_eq!(counter(&snapshot, deliveries, &permanent), Some(1));
        let quarantined = [("outcome", "dead_lettered"), ("reason", "quarantined")];
        assert_eq!(counter(&snapshot, deliveries, &quarantined), Some(0));
        let received = counter(&snapshot, "consumer_received_total", &[]);
        assert_eq!(received, Some(stats.received), "{batch:?}");
        let runs = counter(&snapshot, "consumer_handler_runs_total", &[]);
        assert_eq!(runs, Some(stats.handler_runs), "{batch:?}");
        let durations = snapshot.iter().find_map(|(key, value)| match value {
            metrics_util::debugging::DebugValue::Histogram(v)
                if key.key().name() == "consumer_handler_duration_seconds" =>
            {
                Some(v.len())
            }
            _ => None,
        });
        assert!(durations.is_some_and(|n| n > 0), "{batch:?}: {snapshot:?}");
    }
}

#[tokio::test]
async fn an_operator_lists_the_handlers_and_purges_old_rows_by_status() {
    let (inbox, _dir) = inbox().await;
    let handler = Recorder::default();
    let jobs = [
        ("a", json!({"id": "a"})),
        ("b", json!({"id": "b"})),
        ("p", json!({"id": "p", "permanent": true})),
    ];
    run(&handler, &inbox, None, &jobs).await;
    assert_eq!(inbox.handlers().await.unwrap(), [("unit".to_owned(), 3)]);
    let (dead, completed) = (
        crate::inbox::EntryStatus::Dead,
        crate::inbox::EntryStatus::Completed,
    );
    let long = Duration::from_secs(3600);
    // Nothing is an hour old; a zero age takes every row, even one updated this millisecond.
    assert_eq!(inbox.purge_older(dead, long, true).await.unwrap(), 0);
    assert_eq!(
        inbox.purge_older(dead, Duration::ZERO, true).await.unwrap(),
        1
    );
    assert_eq!(
        inbox
            .purge_older(dead, Duration::ZERO, false)
            .await
            .unwrap(),
        1
    );
    assert!(inbox.entry("unit", "p").await.unwrap().is_none());
    assert_eq!(inbox.purge_older(completed, long, false).await.unwrap(), 0);
    assert_eq!(inbox.handlers().await.unwrap(), [("unit".to_owned(), 2)]);
    let pending = inbox
        .purge_older(crate::inbox::EntryStatus::Pending, long, false)
        .await;
    assert!(pending.unwrap_err().to_string().contains("status"));
}
