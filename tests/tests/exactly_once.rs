//! The runtime's exactly-once guarantees, against real PostgreSQL (a fresh schema per test,
//! several independent pools standing in for several worker processes) and SQLite.
//!
//! Each scenario is written once, generic over the backend, and instantiated for both, each
//! with one transaction per delivery and in batched mode.

// Test code may panic: a panic is how a test fails.
#![allow(clippy::unwrap_used)]

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use consumer_core::fault::{CrashAlways, CrashOnce, FaultAction, FaultPoint};
use consumer_core::memory::{MemoryBroker, Message};
use consumer_core::{
    handler, Backend, BatchConfig, BatchContext, Context, DeadLetterReason, EntryStatus, Error,
    FlagGuard, Handler, HandlerError, Inbox, InboxConfig, LogPosition, NoJitter, Origin,
    StatsSnapshot, Transition, Worker, WorkerConfig,
};
use consumer_tests::common::{self, run_until, wait_until, PgEnv, SqliteEnv, DEADLINE};
use futures::future::BoxFuture;
use futures::StreamExt;
use serde::Deserialize;
use serde_json::json;
use sqlx::{Postgres, Sqlite};

/// A test job. Its fields script the handler's behaviour, so handlers stay stateless.
#[derive(Debug, Deserialize)]
struct Job {
    id: String,
    /// Fail (transiently) while the attempt number is at most this.
    #[serde(default)]
    fail_times: u32,
    #[serde(default)]
    panic: bool,
    #[serde(default)]
    permanent: bool,
    /// Hold the transaction open this long, so concurrent deliveries overlap.
    #[serde(default)]
    sleep_ms: u64,
    /// Also run the guards for this order.
    #[serde(default)]
    order_id: Option<i64>,
}

impl Job {
    fn behave(&self, attempt: u32) -> Result<(), HandlerError> {
        if self.panic {
            panic!("job {} always panics", self.id);
        }
        if self.permanent {
            return Err(HandlerError::permanent(format!(
                "job {} is invalid",
                self.id
            )));
        }
        if attempt <= self.fail_times {
            return Err(HandlerError::transient(format!(
                "transient failure on attempt {attempt}"
            )));
        }
        Ok(())
    }
}

/// One handler per backend: identical but for the placeholder syntax.
macro_rules! record_handler {
    ($name:ident, $db:ty, $insert:literal) => {
        #[handler(name = "record", max_attempts = 3, backoff = "5ms..20ms")]
        async fn $name(ctx: &mut Context<'_, $db>, job: Job) -> Result<(), HandlerError> {
            job.behave(ctx.attempt())?;
            tokio::time::sleep(Duration::from_millis(job.sleep_ms)).await;
            let attempt = i32::try_from(ctx.attempt()).unwrap_or(i32::MAX);
            sqlx::query($insert)
                .bind(&job.id)
                .bind(attempt)
                .execute(ctx.db())
                .await?;
            if let Some(order) = job.order_id {
                // Two different jobs for one order: the flag and the transition are won once.
                let moved = Transition::new("orders", "status", "id")?
                    .apply(ctx, order, "created", "invoiced")
                    .await?;
                if FlagGuard::new("orders", "invoice_sent", "id")?
                    .set(ctx, order)
                    .await?
                {
                    assert!(moved, "the flag and the transition are won by the same job");
                    sqlx::query($insert)
                        .bind(format!("email-{order}"))
                        .bind(attempt)
                        .execute(ctx.db())
                        .await?;
                }
            }
            Ok(())
        }
    };
}

record_handler!(
    record_pg,
    Postgres,
    "INSERT INTO ledger (job_id, attempt) VALUES ($1, $2)"
);
record_handler!(
    record_sqlite,
    Sqlite,
    "INSERT INTO ledger (job_id, attempt) VALUES (?1, ?2)"
);

/// The same handler with a batch function, which writes a batch's ledger rows with one
/// statement. Jobs that use the guards make it fail, so the batch reruns one by one through
/// the handler; a failing, panicking or sleeping job fails, panics or sleeps the batch.
macro_rules! bulk_handler {
    ($name:ident, $single:ident, $batch:literal, $db:ty) => {
        #[handler(name = "record", max_attempts = 3, backoff = "5ms..20ms", batch = $batch)]
        async fn $name(ctx: &mut Context<'_, $db>, job: Job) -> Result<(), HandlerError> {
            $single::call(ctx, job).await
        }
    };
}

bulk_handler!(bulk_pg, record_pg, "record_pg_batch", Postgres);
bulk_handler!(bulk_sqlite, record_sqlite, "record_sqlite_batch", Sqlite);

/// Batch function calls per queue (the location of the deliveries' source), so a test can
/// tell that its batches went through the batch function.
static BATCH_CALLS: std::sync::Mutex<Vec<String>> = std::sync::Mutex::new(Vec::new());

/// The ledger rows of a batch, after each job's scripted behaviour.
fn ledger_rows<DB: Backend>(
    ctx: &BatchContext<'_, DB>,
    jobs: &[Job],
) -> Result<(Vec<String>, Vec<i32>), HandlerError> {
    if jobs.iter().any(|j| j.order_id.is_some()) {
        return Err(HandlerError::transient("jobs with guards run one by one"));
    }
    let mut rows = (Vec::new(), Vec::new());
    for (i, job) in jobs.iter().enumerate() {
        job.behave(ctx.attempt(i))?;
        rows.0.push(job.id.clone());
        rows.1
            .push(i32::try_from(ctx.attempt(i)).unwrap_or(i32::MAX));
    }
    BATCH_CALLS
        .lock()
        .unwrap()
        .push(ctx.delivery(0).source.location.clone());
    Ok(rows)
}

async fn sleep_for(jobs: &[Job]) {
    let ms = jobs.iter().map(|j| j.sleep_ms).max().unwrap_or(0);
    tokio::time::sleep(Duration::from_millis(ms)).await;
}

async fn record_pg_batch(
    ctx: &mut BatchContext<'_, Postgres>,
    jobs: Vec<Job>,
) -> Result<(), HandlerError> {
    let (ids, attempts) = ledger_rows(ctx, &jobs)?;
    sleep_for(&jobs).await;
    sqlx::query(
        "INSERT INTO ledger (job_id, attempt) SELECT * FROM unnest($1::text[], $2::int4[])",
    )
    .bind(ids)
    .bind(attempts)
    .execute(ctx.db())
    .await?;
    Ok(())
}

async fn record_sqlite_batch(
    ctx: &mut BatchContext<'_, Sqlite>,
    jobs: Vec<Job>,
) -> Result<(), HandlerError> {
    let (ids, attempts) = ledger_rows(ctx, &jobs)?;
    sleep_for(&jobs).await;
    let rows: Vec<(String, i32)> = ids.into_iter().zip(attempts).collect();
    sqlx::query(
        "INSERT INTO ledger (job_id, attempt) \
         SELECT value ->> '$[0]', value ->> '$[1]' FROM json_each(?1)",
    )
    .bind(serde_json::to_string(&rows).map_err(HandlerError::permanent)?)
    .execute(ctx.db())
    .await?;
    Ok(())
}

/// What a scenario needs from a backend.
struct Harness<DB: Backend, H> {
    handler: H,
    /// Batched mode, or one transaction per delivery.
    batch: Option<BatchConfig>,
    /// An inbox as a separate worker process would have it (PostgreSQL: its own pool;
    /// SQLite, one process only: the same inbox).
    new_inbox: Box<dyn Fn() -> BoxFuture<'static, Inbox<DB>> + Send + Sync>,
    /// An inbox on the same table with key locks of its own (as a second deployment whose
    /// locks this one does not see), its table spelled another way where the backend allows
    /// (PostgreSQL: unqualified, resolved through the search path), and a copy grace of its
    /// own.
    other_inbox: Box<dyn Fn(Duration) -> BoxFuture<'static, Inbox<DB>> + Send + Sync>,
    /// `SELECT count(*) FROM ledger WHERE job_id = ?`.
    ledger: fn(Inbox<DB>, String) -> BoxFuture<'static, i64>,
    /// `SELECT status FROM orders WHERE id = ?`, inserting the order first if `create`.
    order: fn(Inbox<DB>, i64, bool) -> BoxFuture<'static, String>,
}

async fn pg_harness(batch: Option<BatchConfig>) -> Harness<Postgres, record_pg> {
    pg_harness_with(record_pg, batch).await
}

async fn pg_bulk_harness(batch: Option<BatchConfig>) -> Harness<Postgres, bulk_pg> {
    pg_harness_with(bulk_pg, batch).await
}

async fn pg_harness_with<H>(handler: H, batch: Option<BatchConfig>) -> Harness<Postgres, H> {
    let env = Arc::new(PgEnv::new().await);
    Harness {
        handler,
        batch,
        new_inbox: Box::new({
            let env = env.clone();
            move || {
                let env = env.clone();
                Box::pin(async move { env.inbox().await })
            }
        }),
        other_inbox: Box::new(move |grace| {
            let env = env.clone();
            Box::pin(async move {
                env.inbox_with(InboxConfig::table("consumer_inbox").with_copy_grace(grace))
                    .await
            })
        }),
        ledger: |inbox, id| {
            Box::pin(async move {
                sqlx::query_scalar("SELECT count(*) FROM ledger WHERE job_id = $1")
                    .bind(id)
                    .fetch_one(inbox.pool())
                    .await
                    .expect("count ledger")
            })
        },
        order: |inbox, id, create| {
            Box::pin(async move {
                if create {
                    sqlx::query("INSERT INTO orders (id) VALUES ($1)")
                        .bind(id)
                        .execute(inbox.pool())
                        .await
                        .expect("insert order");
                }
                sqlx::query_scalar("SELECT status FROM orders WHERE id = $1")
                    .bind(id)
                    .fetch_one(inbox.pool())
                    .await
                    .expect("order status")
            })
        },
    }
}

async fn sqlite_harness(batch: Option<BatchConfig>) -> Harness<Sqlite, record_sqlite> {
    sqlite_harness_with(record_sqlite, batch).await
}

async fn sqlite_bulk_harness(batch: Option<BatchConfig>) -> Harness<Sqlite, bulk_sqlite> {
    sqlite_harness_with(bulk_sqlite, batch).await
}

async fn sqlite_harness_with<H>(handler: H, batch: Option<BatchConfig>) -> Harness<Sqlite, H> {
    let env = Arc::new(SqliteEnv::new().await);
    Harness {
        handler,
        batch,
        new_inbox: Box::new({
            let env = env.clone();
            move || {
                let env = env.clone();
                Box::pin(async move { env.inbox.clone() })
            }
        }),
        other_inbox: Box::new(move |grace| {
            let env = env.clone();
            Box::pin(async move {
                let config = InboxConfig::default().with_copy_grace(grace);
                Inbox::new(env.inbox.pool().clone(), config).await.unwrap()
            })
        }),
        ledger: |inbox, id| {
            Box::pin(async move {
                sqlx::query_scalar("SELECT count(*) FROM ledger WHERE job_id = ?1")
                    .bind(id)
                    .fetch_one(inbox.pool())
                    .await
                    .expect("count ledger")
            })
        },
        order: |inbox, id, create| {
            Box::pin(async move {
                if create {
                    sqlx::query("INSERT INTO orders (id) VALUES (?1)")
                        .bind(id)
                        .execute(inbox.pool())
                        .await
                        .expect("insert order");
                }
                sqlx::query_scalar("SELECT status FROM orders WHERE id = ?1")
                    .bind(id)
                    .fetch_one(inbox.pool())
                    .await
                    .expect("order status")
            })
        },
    }
}

impl<DB: Backend, H> Harness<DB, H> {
    fn config(&self) -> WorkerConfig {
        WorkerConfig::default()
            .with_concurrency(4)
            .with_retention_interval(None)
            .with_jitter(Arc::new(NoJitter))
            .with_batch(self.batch)
    }
}

fn msg(id: &str, body: serde_json::Value) -> Message {
    Message::json(id, &body)
}

/// Runs one worker on `queue` until the queue is drained (or the worker crashes).
async fn run_until_drained<DB: Backend, H: Handler<DB>>(
    worker: &Worker<DB, H>,
    broker: &MemoryBroker,
    queue: &str,
) -> Result<(), Error> {
    tokio::time::timeout(
        DEADLINE,
        worker.run(broker.consume(queue), broker.drained(queue)),
    )
    .await
    .expect("worker did not drain the queue in time")
}

/// A log for [`run_log_until_drained`]: its name, and the offset of each message id.
struct Log {
    name: Arc<str>,
    offsets: HashMap<String, i64>,
}

impl Log {
    fn new(ids: &[&str]) -> Log {
        Log {
            name: Arc::from(common::unique("group/topic/0")),
            offsets: ids
                .iter()
                .zip(0..)
                .map(|(id, o)| (id.to_string(), o))
                .collect(),
        }
    }
}

/// [`run_until_drained`], with the queue's deliveries made to look as a Kafka partition's
/// records do: a position (epoch 1, the offset `log` gives the message id), never flagged
/// redelivered (a log is read again after a crash, not redelivered), and no transport
/// freshness. Only the log mark can make them fresh.
async fn run_log_until_drained<DB: Backend, H: Handler<DB>>(
    worker: &Worker<DB, H>,
    broker: &MemoryBroker,
    queue: &str,
    log: &Log,
) -> Result<(), Error> {
    let name = log.name.clone();
    let offsets = log.offsets.clone();
    let records = broker.consume(queue).map(move |item| {
        item.map(|mut incoming| {
            let d = &mut incoming.delivery;
            d.redelivered = false;
            d.origin = d.message_id.as_ref().and_then(|id| offsets.get(id)).map_or(
                Origin::Unknown,
                |&offset| {
                    Origin::Log(LogPosition {
                        log: name.clone(),
                        epoch: 1,
                        offset,
                    })
                },
            );
            incoming
        })
    });
    tokio::time::timeout(DEADLINE, worker.run(records, broker.drained(queue)))
        .await
        .expect("worker did not drain the log in time")
}

fn sum(a: StatsSnapshot, b: StatsSnapshot) -> StatsSnapshot {
    StatsSnapshot {
        received: a.received + b.received,
        handler_runs: a.handler_runs + b.handler_runs,
        completed: a.completed + b.completed,
        duplicates: a.duplicates + b.duplicates,
        retries: a.retries + b.retries,
        dead_lettered: a.dead_lettered + b.dead_lettered,
        quarantined: a.quarantined + b.quarantined,
        ..StatsSnapshot::default()
    }
}

async fn same_key_over_four_workers<DB: Backend, H: Handler<DB> + Clone>(h: Harness<DB, H>) {
    let broker = MemoryBroker::new();
    let queue = common::unique("q");
    for _ in 0..100 {
        broker.publish(
            &queue,
            msg("job-1", json!({"id": "job-1", "sleep_ms": 300})),
        );
    }
    let mut runs = Vec::new();
    for _ in 0..4 {
        let worker =
            Worker::with_config((h.new_inbox)().await, h.handler.clone(), h.config()).unwrap();
        let broker = broker.clone();
        let queue = queue.clone();
        runs.push(tokio::spawn(async move {
            run_until_drained(&worker, &broker, &queue).await.unwrap();
            worker.snapshot()
        }));
    }
    let mut total = StatsSnapshot::default();
    for r in runs {
        total = sum(total, r.await.unwrap());
    }
    let inbox = (h.new_inbox)().await;
    assert_eq!(total.received, 100);
    assert_eq!(total.handler_runs, 1, "{total:?}");
    assert_eq!(total.duplicates, 99, "{total:?}");
    assert_eq!((h.ledger)(inbox, "job-1".into()).await, 1);
}

async fn crash_after_commit_is_skipped_on_redelivery<DB: Backend, H: Handler<DB> + Clone>(
    h: Harness<DB, H>,
) {
    let broker = MemoryBroker::new();
    let queue = common::unique("q");
    broker.publish(&queue, msg("a", json!({"id": "a"})));
    let crash = Arc::new(CrashOnce::new(
        FaultAction::StopWorker,
        [(FaultPoint::AfterCommit, "a".to_owned())],
    ));
    let inbox = (h.new_inbox)().await;
    let cfg = h.config().with_faults(crash.clone());
    let first = Worker::with_config(inbox.clone(), h.handler.clone(), cfg.clone()).unwrap();
    let r = run_until_drained(&first, &broker, &queue).await;
    assert!(matches!(r, Err(Error::Crashed("after_commit"))), "{r:?}");
    assert_eq!(
        broker.depth(&queue).ready,
        1,
        "the unacked delivery is back"
    );

    let second = Worker::with_config(inbox.clone(), h.handler.clone(), cfg).unwrap();
    run_until_drained(&second, &broker, &queue).await.unwrap();
    let s = second.snapshot();
    assert_eq!((s.handler_runs, s.duplicates), (0, 1), "{s:?}");
    assert_eq!((h.ledger)(inbox, "a".into()).await, 1);
}

async fn crash_before_commit_gives_one_effect<DB: Backend, H: Handler<DB> + Clone>(
    h: Harness<DB, H>,
) {
    let broker = MemoryBroker::new();
    let queue = common::unique("q");
    broker.publish(&queue, msg("b", json!({"id": "b"})));
    let crash = Arc::new(CrashOnce::new(
        FaultAction::StopWorker,
        [(FaultPoint::BeforeCommit, "b".to_owned())],
    ));
    let inbox = (h.new_inbox)().await;
    let cfg = h.config().with_faults(crash);
    let first = Worker::with_config(inbox.clone(), h.handler.clone(), cfg.clone()).unwrap();
    let r = run_until_drained(&first, &broker, &queue).await;
    assert!(matches!(r, Err(Error::Crashed("before_commit"))), "{r:?}");
    assert_eq!(
        (h.ledger)(inbox.clone(), "b".into()).await,
        0,
        "rolled back"
    );

    // A new process: the crashed one's connection (and its key lock) are gone.
    let second = Worker::with_config((h.new_inbox)().await, h.handler.clone(), cfg).unwrap();
    run_until_drained(&second, &broker, &queue).await.unwrap();
    assert_eq!(second.snapshot().handler_runs, 1);
    assert_eq!((h.ledger)(inbox.clone(), "b".into()).await, 1);
    let entry = inbox.entry("record", "b").await.unwrap().unwrap();
    assert_eq!(entry.status, EntryStatus::Completed);
    // The crashed attempt was a fresh delivery: it left no row, so the redelivery, which is
    // counted, is attempt 1.
    assert_eq!(entry.attempts, 1, "the crashed fresh attempt left nothing");
}

async fn key_reused_with_other_payload_is_a_conflict<DB: Backend, H: Handler<DB> + Clone>(
    h: Harness<DB, H>,
) {
    let broker = MemoryBroker::new();
    let queue = common::unique("q");
    broker.publish(&queue, msg("c", json!({"id": "c"})));
    broker.publish(
        &queue,
        msg("c", json!({"id": "c", "order_id": null, "fail_times": 0})),
    );
    broker.publish(&queue, msg("c", json!({"id": "c-other"})));
    let inbox = (h.new_inbox)().await;
    let w = Worker::with_config(
        inbox.clone(),
        h.handler.clone(),
        h.config().with_concurrency(1),
    )
    .unwrap();
    run_until_drained(&w, &broker, &queue).await.unwrap();
    let dead = broker.dead_letters(&queue);
    assert_eq!(dead.len(), 2, "{dead:?}");
    assert!(dead
        .iter()
        .all(|d| d.dead_letter.reason == DeadLetterReason::KeyConflict));
    assert_eq!(w.snapshot().handler_runs, 1);
    assert_eq!((h.ledger)(inbox, "c".into()).await, 1);
}

async fn panicking_handler_is_dead_lettered_after_max_attempts<
    DB: Backend,
    H: Handler<DB> + Clone,
>(
    h: Harness<DB, H>,
) {
    let broker = MemoryBroker::new();
    let queue = common::unique("q");
    broker.publish(&queue, msg("p", json!({"id": "p", "panic": true})));
    broker.publish(&queue, msg("ok", json!({"id": "ok"})));
    let inbox = (h.new_inbox)().await;
    let w = Worker::with_config(inbox.clone(), h.handler.clone(), h.config()).unwrap();
    run_until_drained(&w, &broker, &queue).await.unwrap();
    let s = w.snapshot();
    assert_eq!(s.panics, 3, "{s:?}");
    assert_eq!(s.retries, 2, "{s:?}");
    let dead = broker.dead_letters(&queue);
    assert_eq!(dead.len(), 1, "only the panicking job: {dead:?}");
    let d = &dead[0].dead_letter;
    assert_eq!(d.reason, DeadLetterReason::MaxAttemptsExceeded);
    assert_eq!(
        (d.handler.as_str(), d.key.as_deref(), d.attempts),
        ("record", Some("p"), 3)
    );
    assert!(
        d.error.contains("panicked") && d.error.contains("always panics"),
        "{}",
        d.error
    );
    assert_eq!(d.source.transport, "memory");
    assert_eq!((h.ledger)(inbox.clone(), "ok".into()).await, 1);
    let entry = inbox.entry("record", "p").await.unwrap().unwrap();
    assert_eq!(entry.status, EntryStatus::Dead);
}

async fn crash_loop_is_quarantined<DB: Backend, H: Handler<DB> + Clone>(h: Harness<DB, H>) {
    crash_loop(h, None).await;
}

/// On a log, no delivery says it was handed out before: only the log mark, raised before the
/// first run, makes the restarted worker count the crashed record's attempts.
async fn crash_loop_over_a_log_is_quarantined<DB: Backend, H: Handler<DB> + Clone>(
    h: Harness<DB, H>,
) {
    crash_loop(h, Some(Log::new(&["k"]))).await;
}

async fn crash_loop<DB: Backend, H: Handler<DB> + Clone>(h: Harness<DB, H>, log: Option<Log>) {
    let broker = MemoryBroker::new();
    let queue = common::unique("q");
    broker.publish(&queue, msg("k", json!({"id": "k"})));
    let cfg = h.config().with_faults(Arc::new(CrashAlways {
        point: FaultPoint::BeforeCommit,
        key: "k".to_owned(),
        action: FaultAction::StopWorker,
    }));
    let mut crashes = 0;
    let mut runs = 0;
    loop {
        // Every restart is a new "process": new pool, new in-process state.
        let w = Worker::with_config((h.new_inbox)().await, h.handler.clone(), cfg.clone()).unwrap();
        let r = match &log {
            None => run_until_drained(&w, &broker, &queue).await,
            Some(log) => run_log_until_drained(&w, &broker, &queue, log).await,
        };
        runs += w.snapshot().handler_runs;
        match r {
            Err(Error::Crashed(_)) => crashes += 1,
            Ok(()) => break,
            Err(e) => panic!("{e}"),
        }
        assert!(
            crashes <= 4,
            "the message loops instead of being quarantined"
        );
    }
    // max_attempts is 3. The first delivery is fresh, so its crash is not counted (there
    // was nothing to count it in: its claim rolled back); the three redeliveries are, and
    // the fourth finds the attempts used up without an outcome.
    assert_eq!((crashes, runs), (4, 4));
    let dead = broker.dead_letters(&queue);
    assert_eq!(dead.len(), 1);
    assert_eq!(dead[0].dead_letter.reason, DeadLetterReason::Quarantined);
    assert_eq!(dead[0].dead_letter.attempts, 3);
    assert_eq!((h.ledger)((h.new_inbox)().await, "k".into()).await, 0);
}

/// A log's records take the fresh path once the log mark is raised past them; a new
/// process reading the log again does not trust what lies below the mark it finds.
async fn log_records_are_proven_fresh<DB: Backend, H: Handler<DB> + Clone>(h: Harness<DB, H>) {
    let ids: Vec<String> = (0..12).map(|i| format!("l{i}")).collect();
    let log = Log::new(&ids.iter().map(String::as_str).collect::<Vec<_>>());
    let broker = MemoryBroker::new();
    let queue = common::unique("q");
    for id in &ids[..10] {
        broker.publish(&queue, msg(id, json!({ "id": id })));
    }
    let inbox = (h.new_inbox)().await;
    let first = Worker::with_config(inbox.clone(), h.handler.clone(), h.config()).unwrap();
    run_log_until_drained(&first, &broker, &queue, &log)
        .await
        .unwrap();
    let s = first.snapshot();
    assert_eq!((s.completed, s.fresh_completed), (10, 10), "{s:?}");
    let mark = inbox.log_mark("record", &log.name).await.unwrap();
    assert!(
        mark.is_some_and(|m| m >= 10),
        "raised past every record run: {mark:?}"
    );
    assert_eq!(inbox.log_mark("record", "another log").await.unwrap(), None);

    // A second process reads the log again from offset 8 (its commit was lost), then reads
    // a new record: both below the mark the first process left, so both are counted.
    for id in &ids[8..11] {
        broker.publish(&queue, msg(id, json!({ "id": id })));
    }
    let second = Worker::with_config((h.new_inbox)().await, h.handler.clone(), h.config()).unwrap();
    run_log_until_drained(&second, &broker, &queue, &log)
        .await
        .unwrap();
    let s = second.snapshot();
    assert_eq!(
        (s.duplicates, s.completed, s.fresh_completed),
        (2, 1, 0),
        "{s:?}"
    );
    let entry = inbox.entry("record", "l10").await.unwrap().unwrap();
    assert_eq!((entry.status, entry.attempts), (EntryStatus::Completed, 1));
    for id in &ids[..11] {
        assert_eq!((h.ledger)(inbox.clone(), id.clone()).await, 1, "{id}");
    }
}

async fn retries_then_succeeds<DB: Backend, H: Handler<DB> + Clone>(h: Harness<DB, H>) {
    let broker = MemoryBroker::new();
    let queue = common::unique("q");
    broker.publish(&queue, msg("r", json!({"id": "r", "fail_times": 2})));
    broker.publish(
        &queue,
        msg("perm", json!({"id": "perm", "permanent": true})),
    );
    broker.publish(
        &queue,
        Message {
            id: Some("bad".into()),
            payload: "{not json".into(),
            ..Message::default()
        },
    );
    broker.publish(&queue, msg("wrong", json!({"no_id_field": 1})));
    broker.publish(
        &queue,
        msg(
            "huge",
            json!({"id": "huge", "pad": "x".repeat(2 * 1024 * 1024)}),
        ),
    );
    let inbox = (h.new_inbox)().await;
    let w = Worker::with_config(inbox.clone(), h.handler.clone(), h.config()).unwrap();
    run_until_drained(&w, &broker, &queue).await.unwrap();
    let s = w.snapshot();
    assert_eq!(
        (s.handler_runs - s.batch_reruns, s.retries),
        (4, 2),
        "{s:?}"
    );
    assert_eq!((h.ledger)(inbox, "r".into()).await, 1);
    let mut reasons: Vec<_> = broker
        .dead_letters(&queue)
        .iter()
        .map(|d| {
            (
                d.message.id.clone().unwrap_or_default(),
                d.dead_letter.reason,
                d.dead_letter.attempts,
            )
        })
        .collect();
    reasons.sort_by(|a, b| a.0.cmp(&b.0));
    assert_eq!(
        reasons,
        vec![
            ("bad".to_owned(), DeadLetterReason::Undecodable, 0),
            ("huge".to_owned(), DeadLetterReason::PayloadTooLarge, 0),
            ("perm".to_owned(), DeadLetterReason::PermanentError, 1),
            ("wrong".to_owned(), DeadLetterReason::Undecodable, 0),
        ]
    );
}

/// A delivery whose attempt failed and whose retry copy is with the broker may come back: a
/// Kafka record replayed after a rebalance, a RabbitMQ delivery whose ack was lost. It is
/// superseded by the copy: acked without running and without counting an attempt, so the
/// message keeps its backoff and its attempt budget. The copy then runs as attempt 2.
async fn replay_of_a_retried_delivery_is_superseded<DB: Backend, H: Handler<DB> + Clone>(
    h: Harness<DB, H>,
) {
    let broker = MemoryBroker::new();
    let queue = common::unique("q");
    let inbox = (h.new_inbox)().await;
    let w = Worker::with_config(inbox.clone(), h.handler.clone(), h.config()).unwrap();
    // The retry copies (attempt 2) are held back until the replays have been seen; the
    // replays come as redeliveries (not fresh), as a log's or a lost ack's do.
    let held = Arc::new(std::sync::Mutex::new(Vec::new()));
    let replaying = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let (release, released) = futures::channel::mpsc::unbounded();
    let deliveries = broker.consume(&queue).filter_map({
        let (held, replaying) = (held.clone(), replaying.clone());
        move |item| {
            let item = match item {
                Ok(incoming) if incoming.delivery.attempt >= 2 => {
                    held.lock().unwrap().push(incoming);
                    None
                }
                Ok(mut incoming) if replaying.load(std::sync::atomic::Ordering::SeqCst) => {
                    incoming.delivery.origin = Origin::Unknown;
                    incoming.delivery.redelivered = true;
                    Some(Ok(incoming))
                }
                other => Some(other),
            };
            futures::future::ready(item)
        }
    });
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let running = tokio::spawn({
        let w = w.clone();
        let deliveries = futures::stream::select(deliveries, released);
        async move {
            w.run(deliveries, async {
                let _ = stopped.await;
            })
            .await
        }
    });
    let ids = ["s1", "s2"];
    let publish_all = || {
        for id in ids {
            broker.publish(&queue, msg(id, json!({"id": id, "fail_times": 1})));
        }
    };
    let entries = || {
        let inbox = inbox.clone();
        async move {
            let mut entries = Vec::new();
            for id in ids {
                entries.push(inbox.entry("record", id).await.unwrap());
            }
            entries
        }
    };

    publish_all();
    wait_until("both retry copies held, and recorded in the inbox", || {
        let copies = held.lock().unwrap().len();
        let entries = entries();
        async move {
            let recorded = entries
                .await
                .iter()
                .all(|e| e.as_ref().is_some_and(|e| e.retried_to == 2));
            copies == 2 && recorded
        }
    })
    .await;
    replaying.store(true, std::sync::atomic::Ordering::SeqCst);
    publish_all();
    wait_until("both replays superseded", || {
        let superseded = w.snapshot().superseded;
        async move { superseded == 2 }
    })
    .await;
    let s = w.snapshot();
    assert_eq!(s.handler_runs - s.batch_reruns, 2, "{s:?}");
    for entry in entries().await {
        let entry = entry.unwrap();
        assert_eq!((entry.status, entry.attempts), (EntryStatus::Pending, 1));
    }

    for copy in held.lock().unwrap().drain(..) {
        release.unbounded_send(Ok(copy)).unwrap();
    }
    wait_until("both copies completed", || {
        let completed = w.snapshot().completed;
        async move { completed == 2 }
    })
    .await;
    for id in ids {
        assert_eq!((h.ledger)(inbox.clone(), id.into()).await, 1, "{id}");
        let entry = inbox.entry("record", id).await.unwrap().unwrap();
        assert_eq!((entry.status, entry.attempts), (EntryStatus::Completed, 2));
    }
    stop.send(()).unwrap();
    running.await.unwrap().unwrap();
    assert!(broker.dead_letters(&queue).is_empty());
}

/// A delivery can carry a higher attempt number than the inbox has counted (its earlier
/// attempts were retried after database errors, which count nothing). Its retry copy is
/// numbered above it (4, not the count's 2), so copies are numbered upward along the
/// message's line and a copy is never below a recorded older one; the message then
/// completes.
async fn a_delivery_numbered_ahead_of_the_count_is_retried<DB: Backend, H: Handler<DB> + Clone>(
    h: Harness<DB, H>,
) {
    let broker = MemoryBroker::new();
    let queue = common::unique("q");
    let inbox = (h.new_inbox)().await;
    let w = Worker::with_config(inbox.clone(), h.handler.clone(), h.config()).unwrap();
    broker.publish(
        &queue,
        msg("ahead", json!({"id": "ahead", "fail_times": 1})),
    );
    // The published message arrives as the third copy of a message the inbox never saw.
    let numbers = Arc::new(std::sync::Mutex::new(Vec::new()));
    let deliveries = broker.consume(&queue).map({
        let numbers = numbers.clone();
        move |item| {
            item.map(|mut incoming| {
                let d = &mut incoming.delivery;
                if d.attempt == 1 {
                    (d.attempt, d.origin, d.redelivered) = (3, Origin::Unknown, true);
                }
                numbers.lock().unwrap().push(d.attempt);
                incoming
            })
        }
    });
    tokio::time::timeout(DEADLINE, w.run(deliveries, broker.drained(&queue)))
        .await
        .expect("worker did not drain the queue in time")
        .unwrap();
    let s = w.snapshot();
    assert_eq!((s.retries, s.superseded, s.completed), (1, 0, 1), "{s:?}");
    assert_eq!(*numbers.lock().unwrap(), vec![3, 4]);
    assert_eq!((h.ledger)(inbox.clone(), "ahead".into()).await, 1);
    let entry = inbox.entry("record", "ahead").await.unwrap().unwrap();
    assert_eq!((entry.status, entry.attempts), (EntryStatus::Completed, 2));
}

async fn guards_are_won_once<DB: Backend, H: Handler<DB> + Clone>(h: Harness<DB, H>) {
    let broker = MemoryBroker::new();
    let queue = common::unique("q");
    let inbox = (h.new_inbox)().await;
    assert_eq!((h.order)(inbox.clone(), 7, true).await, "created");
    // Two different jobs (different keys, both run) touching the same order.
    broker.publish(&queue, msg("g1", json!({"id": "g1", "order_id": 7})));
    broker.publish(&queue, msg("g2", json!({"id": "g2", "order_id": 7})));
    let w = Worker::with_config(inbox.clone(), h.handler.clone(), h.config()).unwrap();
    run_until_drained(&w, &broker, &queue).await.unwrap();
    assert_eq!(w.snapshot().completed, 2);
    assert_eq!((h.ledger)(inbox.clone(), "email-7".into()).await, 1);
    assert_eq!((h.order)(inbox, 7, false).await, "invoiced");
}

async fn expired_rows_are_purged<DB: Backend, H: Handler<DB> + Clone>(h: Harness<DB, H>) {
    let broker = MemoryBroker::new();
    let queue = common::unique("q");
    for i in 0..5 {
        broker.publish(
            &queue,
            msg(&format!("e{i}"), json!({"id": format!("e{i}")})),
        );
    }
    let inbox = (h.new_inbox)().await;
    let w = Worker::with_config(
        inbox.clone(),
        h.handler.clone(),
        h.config()
            .with_retention(Duration::from_millis(1))
            .with_retention_interval(Some(Duration::from_millis(50)))
            .with_retention_batch(2),
    )
    .unwrap();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let run = {
        let w = w.clone();
        let broker = broker.clone();
        let queue = queue.clone();
        tokio::spawn(async move {
            w.run(broker.consume(&queue), async {
                let _ = stopped.await;
            })
            .await
        })
    };
    // First every job must have run (an entry that was never written is not a purged one).
    wait_until("all five jobs to complete", || {
        let done = w.snapshot().completed == 5;
        async move { done }
    })
    .await;
    wait_until("the background task to purge every expired row", || {
        let inbox = inbox.clone();
        async move {
            let mut left = 0;
            for i in 0..5 {
                left += usize::from(
                    inbox
                        .entry("record", &format!("e{i}"))
                        .await
                        .unwrap()
                        .is_some(),
                );
            }
            left == 0
        }
    })
    .await;
    stop.send(()).unwrap();
    run.await.unwrap().unwrap();
    assert_eq!(w.snapshot().completed, 5);
}

/// Batches big enough to hold several of a scenario's messages at once.
const BATCHED: Option<BatchConfig> = Some(BatchConfig::new(16, Duration::from_millis(20)));

async fn many_distinct_jobs_each_once<DB: Backend, H: Handler<DB> + Clone>(h: Harness<DB, H>) {
    let broker = MemoryBroker::new();
    let queue = common::unique("q");
    for i in 0..60 {
        let fail_times = u32::from(i % 20 == 0);
        broker.publish(
            &queue,
            msg(
                &format!("m{i}"),
                json!({"id": format!("m{i}"), "fail_times": fail_times}),
            ),
        );
    }
    // Redelivered copies of a few, as a broker would after a lost ack.
    for i in 0..6 {
        broker.publish(
            &queue,
            msg(
                &format!("m{i}"),
                json!({"id": format!("m{i}"), "fail_times": u32::from(i % 20 == 0)}),
            ),
        );
    }
    let inbox = (h.new_inbox)().await;
    let w = Worker::with_config(inbox.clone(), h.handler.clone(), h.config()).unwrap();
    run_until_drained(&w, &broker, &queue).await.unwrap();
    let s = w.snapshot();
    assert_eq!(s.completed, 60, "{s:?}");
    assert_eq!(s.retries, 3, "{s:?}");
    for i in 0..60 {
        assert_eq!((h.ledger)(inbox.clone(), format!("m{i}")).await, 1, "m{i}");
    }
    if h.batch.is_some() {
        assert!(
            s.batches > 0 && s.batches < 60,
            "batched mode batched nothing: {s:?}"
        );
    } else {
        assert_eq!(s.batches, 0);
    }
    let calls = BATCH_CALLS
        .lock()
        .unwrap()
        .iter()
        .filter(|q| **q == queue)
        .count();
    if h.batch.is_some() && h.handler.handles_batches() {
        assert!(calls > 0, "the batch function was never called: {s:?}");
    } else {
        assert_eq!(calls, 0, "a batch function outside batched mode");
    }
}

/// Holds back the retry copies (attempt 2 and up) of `deliveries` in `held`, and hands on
/// the rest as redeliveries (not fresh), as a log's replay or a lost ack's redelivery comes.
fn holding_copies(
    deliveries: consumer_core::memory::MemoryConsumer,
    held: Arc<std::sync::Mutex<Vec<consumer_core::Incoming>>>,
) -> impl consumer_core::Transport {
    deliveries.filter_map(move |item| {
        let item = match item {
            Ok(incoming) if incoming.delivery.attempt >= 2 => {
                held.lock().unwrap().push(incoming);
                None
            }
            Ok(mut incoming) => {
                incoming.delivery.origin = Origin::Unknown;
                incoming.delivery.redelivered = true;
                Some(Ok(incoming))
            }
            other => Some(other),
        };
        futures::future::ready(item)
    })
}

/// Finding: a retry copy that will never be consumed must not supersede the message. The
/// copy of a failed attempt is left with a broker that is then replaced (as a retry queue
/// deleted, a retry topic no longer read, or another consumer group would leave it); the
/// producer publishes the job again, to the new broker. That delivery comes through other
/// consumers than the copy's, so it runs, and the job's effect happens once.
async fn a_copy_that_can_no_longer_arrive_does_not_supersede<
    DB: Backend,
    H: Handler<DB> + Clone,
>(
    h: Harness<DB, H>,
) {
    let queue = common::unique("q");
    let inbox = (h.new_inbox)().await;
    let body = json!({"id": "gone", "fail_times": 1});
    let first = MemoryBroker::new();
    let held = Arc::new(std::sync::Mutex::new(Vec::new()));
    let w1 = Worker::with_config(inbox.clone(), h.handler.clone(), h.config()).unwrap();
    first.publish(&queue, msg("gone", body.clone()));
    run_until(
        &w1,
        holding_copies(first.consume(&queue), held.clone()),
        "the first attempt failed, its copy held and recorded",
        || {
            let (inbox, held) = (inbox.clone(), held.clone());
            async move {
                let entry = inbox.entry("record", "gone").await.unwrap();
                entry.is_some_and(|e| e.retried_to == 2) && held.lock().unwrap().len() == 1
            }
        },
    )
    .await;
    let entry = inbox.entry("record", "gone").await.unwrap().unwrap();
    assert_eq!(
        entry.last_error.as_deref(),
        Some("transient failure on attempt 1"),
        "a pending key's error names no dead-letter reason: {entry:?}"
    );
    // The stuck key is visible to an operator.
    let counts = inbox.counts("record").await.unwrap();
    assert_eq!((counts.pending, counts.completed), (1, 0), "{counts:?}");
    assert!(counts.stalest_pending.is_some(), "{counts:?}");

    let second = MemoryBroker::new();
    second.publish(&queue, msg("gone", body));
    let w2 = Worker::with_config(inbox.clone(), h.handler.clone(), h.config()).unwrap();
    run_until_drained(&w2, &second, &queue).await.unwrap();
    let s = w2.snapshot();
    assert_eq!((s.superseded, s.completed), (0, 1), "{s:?}");
    assert_eq!((h.ledger)(inbox.clone(), "gone".to_owned()).await, 1);
    let entry = inbox.entry("record", "gone").await.unwrap().unwrap();
    assert_eq!(
        (entry.status, entry.attempts),
        (EntryStatus::Completed, 2),
        "{entry:?}"
    );
    let counts = inbox.counts("record").await.unwrap();
    assert_eq!((counts.pending, counts.completed), (0, 1), "{counts:?}");
    assert_eq!(counts.stalest_pending, None, "{counts:?}");
}

/// Finding: a copy that is overdue by more than the inbox's grace period is taken as lost
/// (a retry topic past its retention, say): a later delivery of the message through the same
/// consumers runs instead of being superseded.
async fn an_overdue_copy_does_not_supersede<DB: Backend, H: Handler<DB> + Clone>(
    h: Harness<DB, H>,
) {
    let broker = MemoryBroker::new();
    let queue = common::unique("q");
    let inbox = (h.other_inbox)(Duration::ZERO).await;
    let body = json!({"id": "late", "fail_times": 1});
    let held = Arc::new(std::sync::Mutex::new(Vec::new()));
    let w = Worker::with_config(inbox.clone(), h.handler.clone(), h.config()).unwrap();
    broker.publish(&queue, msg("late", body.clone()));
    run_until(
        &w,
        holding_copies(broker.consume(&queue), held.clone()),
        "the copy held, recorded, and overdue",
        || {
            let (inbox, held) = (inbox.clone(), held.clone());
            async move {
                let entry = inbox.entry("record", "late").await.unwrap();
                let overdue = entry.is_some_and(|e| {
                    e.retried_to == 2 && e.copy_due_in_ms.is_some_and(|due| due < 0)
                });
                overdue && held.lock().unwrap().len() == 1
            }
        },
    )
    .await;
    // The held copy is never delivered: it was lost. The job comes again.
    broker.publish(&queue, msg("late", body));
    run_until(
        &w,
        holding_copies(broker.consume(&queue), held.clone()),
        "the job's effect",
        || {
            let (inbox, ledger) = (inbox.clone(), h.ledger);
            async move { ledger(inbox, "late".to_owned()).await == 1 }
        },
    )
    .await;
    let s = w.snapshot();
    assert_eq!((s.superseded, s.completed), (0, 1), "{s:?}");
}

/// Finding: completion has a status guard. Two inboxes on one table whose key locks do not
/// see each other (PostgreSQL: the table spelled `"schema"."consumer_inbox"` and, through
/// the search path, `consumer_inbox`; SQLite: two inboxes on one file) are each handed a
/// redelivery of one key, and their handlers overlap. The key's effect is committed once;
/// the other delivery is settled as a duplicate.
async fn two_inboxes_that_share_no_locks_complete_a_key_once<
    DB: Backend,
    H: Handler<DB> + Clone,
>(
    h: Harness<DB, H>,
) {
    let broker = MemoryBroker::new();
    let (qa, qb) = (common::unique("qa"), common::unique("qb"));
    let inbox_a = (h.new_inbox)().await;
    let inbox_b = (h.other_inbox)(Duration::from_secs(300)).await;
    let body = json!({"id": "both", "sleep_ms": 500});
    broker.publish(&qa, msg("both", body.clone()));
    broker.publish(&qb, msg("both", body));
    let wa = Worker::with_config(inbox_a.clone(), h.handler.clone(), h.config()).unwrap();
    let wb = Worker::with_config(inbox_b, h.handler.clone(), h.config()).unwrap();
    let held = Arc::new(std::sync::Mutex::new(Vec::new()));
    let settled = |w: &Worker<DB, H>| {
        let s = w.snapshot();
        s.completed + s.duplicates
    };
    let (a, b) = tokio::join!(
        run_until(
            &wa,
            holding_copies(broker.consume(&qa), held.clone()),
            "a settled",
            || {
                let n = settled(&wa);
                async move { n == 1 }
            }
        ),
        run_until(
            &wb,
            holding_copies(broker.consume(&qb), held.clone()),
            "b settled",
            || {
                let n = settled(&wb);
                async move { n == 1 }
            }
        ),
    );
    let ((), ()) = (a, b);
    assert_eq!((h.ledger)(inbox_a.clone(), "both".to_owned()).await, 1);
    let (sa, sb) = (wa.snapshot(), wb.snapshot());
    assert_eq!(sa.completed + sb.completed, 1, "{sa:?} {sb:?}");
    assert_eq!(sa.duplicates + sb.duplicates, 1, "{sa:?} {sb:?}");
}

/// Finding: dead is not forever. A dead key released through the inbox runs again when its
/// dead letter is replayed; before the release, a replay is dead-lettered again.
async fn a_released_dead_key_runs_again<DB: Backend, H: Handler<DB> + Clone>(h: Harness<DB, H>) {
    let broker = MemoryBroker::new();
    let queue = common::unique("q");
    let inbox = (h.new_inbox)().await;
    let body = json!({"id": "dead", "fail_times": 1});
    let one_attempt = h.config().with_max_attempts(1);
    let w1 = Worker::with_config(inbox.clone(), h.handler.clone(), one_attempt).unwrap();
    broker.publish(&queue, msg("dead", body.clone()));
    run_until_drained(&w1, &broker, &queue).await.unwrap();
    let entry = inbox.entry("record", "dead").await.unwrap().unwrap();
    assert_eq!(entry.status, EntryStatus::Dead, "{entry:?}");
    assert!(!inbox.release("record", "missing").await.unwrap());

    // The cause is fixed (three attempts now), but the key is still dead: the replay is
    // dead-lettered again, with the recorded reason.
    let w2 = Worker::with_config(inbox.clone(), h.handler.clone(), h.config()).unwrap();
    broker.publish(&queue, msg("dead", body.clone()));
    run_until_drained(&w2, &broker, &queue).await.unwrap();
    let dead = broker.dead_letters(&queue);
    assert_eq!(dead.len(), 2);
    assert_eq!(
        dead[1].dead_letter.reason,
        DeadLetterReason::MaxAttemptsExceeded
    );
    assert_eq!((h.ledger)(inbox.clone(), "dead".to_owned()).await, 0);

    assert!(inbox.release("record", "dead").await.unwrap());
    assert!(inbox.entry("record", "dead").await.unwrap().is_none());
    broker.publish(&queue, msg("dead", body));
    run_until_drained(&w2, &broker, &queue).await.unwrap();
    assert_eq!(broker.dead_letters(&queue).len(), 2);
    assert_eq!((h.ledger)(inbox.clone(), "dead".to_owned()).await, 1);
    let entry = inbox.entry("record", "dead").await.unwrap().unwrap();
    assert_eq!(entry.status, EntryStatus::Completed, "{entry:?}");
}

/// Finding: dead rows expire after the handler's retention, like completed ones.
async fn dead_rows_expire_after_retention<DB: Backend, H: Handler<DB> + Clone>(h: Harness<DB, H>) {
    let broker = MemoryBroker::new();
    let queue = common::unique("q");
    let inbox = (h.new_inbox)().await;
    let config = h.config().with_retention(Duration::from_millis(1));
    let w = Worker::with_config(inbox.clone(), h.handler.clone(), config).unwrap();
    broker.publish(
        &queue,
        msg("poison", json!({"id": "poison", "permanent": true})),
    );
    run_until_drained(&w, &broker, &queue).await.unwrap();
    let entry = inbox.entry("record", "poison").await.unwrap().unwrap();
    assert_eq!(entry.status, EntryStatus::Dead, "{entry:?}");
    wait_until("the dead row purged", || {
        let inbox = inbox.clone();
        async move {
            inbox.purge_expired(100).await.unwrap();
            inbox.entry("record", "poison").await.unwrap().is_none()
        }
    })
    .await;
}

/// Finding: an attempt number at `u32::MAX` (a producer's or a corrupted header) does not
/// overflow the numbering of the retry copies: the message is retried and dead-lettered
/// after its attempts like any other.
async fn an_attempt_number_at_u32_max_is_bounded<DB: Backend, H: Handler<DB> + Clone>(
    h: Harness<DB, H>,
) {
    let broker = MemoryBroker::new();
    let queue = common::unique("q");
    let inbox = (h.new_inbox)().await;
    let w = Worker::with_config(inbox.clone(), h.handler.clone(), h.config()).unwrap();
    broker.publish(&queue, msg("max", json!({"id": "max", "fail_times": 10})));
    let deliveries = broker.consume(&queue).map(|item| {
        item.map(|mut incoming| {
            if incoming.delivery.attempt == 1 {
                incoming.delivery.attempt = u32::MAX;
                incoming.delivery.origin = Origin::Unknown;
            }
            incoming
        })
    });
    run_until(&w, deliveries, "the message dead-lettered", || {
        let n = broker.dead_letters(&queue).len();
        async move { n == 1 }
    })
    .await;
    let dead = broker.dead_letters(&queue);
    assert_eq!(
        (dead[0].dead_letter.reason, dead[0].dead_letter.attempts),
        (DeadLetterReason::MaxAttemptsExceeded, 3)
    );
}

macro_rules! scenarios {
    ($backend:ident, $harness:ident, $batch:expr) => {
        mod $backend {
            use super::*;

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn same_key_over_four_workers_runs_once() {
                same_key_over_four_workers($harness($batch).await).await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn crash_between_commit_and_ack_is_skipped() {
                crash_after_commit_is_skipped_on_redelivery($harness($batch).await).await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn crash_before_commit_gives_exactly_one_effect() {
                crash_before_commit_gives_one_effect($harness($batch).await).await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn key_conflict_is_dead_lettered() {
                key_reused_with_other_payload_is_a_conflict($harness($batch).await).await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn panic_every_time_ends_dead_lettered() {
                panicking_handler_is_dead_lettered_after_max_attempts($harness($batch).await).await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn crash_every_time_is_quarantined() {
                crash_loop_is_quarantined($harness($batch).await).await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn crash_every_time_on_a_log_is_quarantined() {
                crash_loop_over_a_log_is_quarantined($harness($batch).await).await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn log_records_run_fresh_below_the_mark_only_once() {
                log_records_are_proven_fresh($harness($batch).await).await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn transient_failures_retry_permanent_and_undecodable_do_not() {
                retries_then_succeeds($harness($batch).await).await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn a_replay_of_a_retried_delivery_is_superseded_by_its_copy() {
                replay_of_a_retried_delivery_is_superseded($harness($batch).await).await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn a_delivery_numbered_ahead_of_the_count_is_retried_not_superseded() {
                a_delivery_numbered_ahead_of_the_count_is_retried($harness($batch).await).await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn flag_and_transition_guards_win_once() {
                guards_are_won_once($harness($batch).await).await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn many_distinct_jobs_with_failures_and_duplicates_each_once() {
                many_distinct_jobs_each_once($harness($batch).await).await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn a_copy_that_can_no_longer_arrive_does_not_supersede() {
                super::a_copy_that_can_no_longer_arrive_does_not_supersede($harness($batch).await)
                    .await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn an_overdue_copy_does_not_supersede() {
                super::an_overdue_copy_does_not_supersede($harness($batch).await).await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn two_inboxes_that_share_no_locks_complete_a_key_once() {
                super::two_inboxes_that_share_no_locks_complete_a_key_once($harness($batch).await)
                    .await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn a_released_dead_key_runs_again() {
                super::a_released_dead_key_runs_again($harness($batch).await).await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn dead_rows_expire_after_retention() {
                super::dead_rows_expire_after_retention($harness($batch).await).await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn an_attempt_number_at_u32_max_is_bounded() {
                super::an_attempt_number_at_u32_max_is_bounded($harness($batch).await).await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn expired_inbox_rows_are_cleaned_up() {
                expired_rows_are_purged($harness($batch).await).await;
            }
        }
    };
}

scenarios!(postgres, pg_harness, None);
scenarios!(sqlite, sqlite_harness, None);
scenarios!(postgres_batched, pg_harness, BATCHED);
scenarios!(sqlite_batched, sqlite_harness, BATCHED);
scenarios!(postgres_batch_function, pg_bulk_harness, BATCHED);
scenarios!(sqlite_batch_function, sqlite_bulk_harness, BATCHED);
