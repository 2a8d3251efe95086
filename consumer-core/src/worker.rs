//! The runtime: takes deliveries from a transport, runs the handler exactly once per key, and
//! settles each delivery only after its outcome is durable.

use std::future::Future;
use std::panic::AssertUnwindSafe;
use std::sync::Arc;
use std::time::Duration;

use futures::future::BoxFuture;
use futures::{FutureExt, StreamExt};
use serde::Deserialize;
use serde_json::Value;
use tokio::sync::{watch, Semaphore};
use tokio::task::JoinSet;
use tracing::{field, Instrument};

use crate::delivery::{
    Acknowledger, DeadLetter, DeadLetterReason, Delivery, Incoming, Settlement, Transport,
};
use crate::fault::{FaultAction, FaultInjector, FaultPoint};
use crate::handler::{BatchContext, BatchMember, ConflictPolicy, Context, Handler, HandlerOptions};
use crate::inbox::{AttemptItem, Backend, Claim, Inbox};
use crate::key::{canonical_hash, check_key, refused_by_database, KeyTemplate};
use crate::log_marks::{Check, LogWindows};
use crate::retry::{ExponentialBackoff, Jitter};
use crate::stats::{Stats, StatsSnapshot};
use crate::{Error, ErrorKind, HandlerError, TransportError};

/// The default of [`WorkerConfig::max_payload_bytes`]: 1 MiB. Transports size what they
/// must be able to copy (a retry or dead-letter copy of any payload the worker runs) from it.
pub const DEFAULT_MAX_PAYLOAD_BYTES: usize = 1024 * 1024;

/// Runtime settings of a worker (the handler's own settings come from `#[handler]`).
#[derive(Clone)]
pub struct WorkerConfig {
    /// Deliveries processed at once (default 8).
    pub concurrency: usize,
    /// Overrides the handler's `max_attempts`.
    pub max_attempts: Option<u32>,
    /// Overrides the handler's timeout.
    pub handler_timeout: Option<Duration>,
    /// Overrides the handler's retention of completed keys.
    pub retention: Option<Duration>,
    /// How often expired inbox rows are purged (default 60s; `None` disables the task).
    pub retention_interval: Option<Duration>,
    /// Rows deleted per purge statement (default 1000).
    pub retention_batch: u32,
    /// Replaces the backoff's randomness (tests).
    pub jitter: Option<Arc<dyn Jitter>>,
    /// Fault points (chaos tests); `None` in production.
    pub faults: Option<Arc<dyn FaultInjector>>,
    /// Payloads larger than this are dead-lettered (`payload_too_large`) without being
    /// decoded (default 1 MiB).
    pub max_payload_bytes: usize,
    /// Batched mode: process up to this many deliveries in one database transaction.
    /// `None` (the default) processes one delivery per transaction.
    pub batch: Option<BatchConfig>,
    /// DELIBERATELY BROKEN, for proving the chaos suite can fail: ack every delivery before
    /// its handler runs. Never set this outside that test.
    #[doc(hidden)]
    pub broken_ack_before_commit: bool,
}

impl Default for WorkerConfig {
    fn default() -> Self {
        WorkerConfig {
            concurrency: 8,
            max_attempts: None,
            handler_timeout: None,
            retention: None,
            retention_interval: Some(Duration::from_secs(60)),
            retention_batch: 1000,
            jitter: None,
            faults: None,
            max_payload_bytes: DEFAULT_MAX_PAYLOAD_BYTES,
            batch: None,
            broken_ack_before_commit: false,
        }
    }
}

impl std::fmt::Debug for WorkerConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WorkerConfig")
            .field("concurrency", &self.concurrency)
            .field("max_attempts", &self.max_attempts)
            .field("handler_timeout", &self.handler_timeout)
            .field("retention", &self.retention)
            .field("retention_interval", &self.retention_interval)
            .field("retention_batch", &self.retention_batch)
            .field("faults", &self.faults.is_some())
            .field("max_payload_bytes", &self.max_payload_bytes)
            .field("batch", &self.batch)
            .finish_non_exhaustive()
    }
}

/// Batched mode: many deliveries, one transaction, one commit.
///
/// The keys of a batch are claimed with one statement, the handlers run in one shared
/// transaction, and the batch commits once; then every delivery is settled. If any handler
/// fails, that transaction is rolled back and the batch runs again one message per
/// transaction, so one failure never sinks or half-commits the others (and no attempt is
/// counted twice). What changes is the number of fsyncs per message, and one thing more:
///
/// - **Database effects** (written through the context) are exactly once, as in the
///   per-message mode: the rolled-back batch left nothing.
/// - **Effects outside the database** may be made once more, even with no crash: when one
///   member fails, every member that ran before it in the batch (up to `max_messages - 1`)
///   runs again alone, and repeats any external call it made. Such a call must be safe to
///   repeat: hand the provider [`Context::idempotency_key`](crate::Context::idempotency_key)
///   (the same on every run of the key), or ask the provider whether the effect exists
///   before making it. Where neither is possible, use the per-message mode.
///
/// A handler with a batch function (`#[handler(batch = "fn_name")]`, see
/// [`Handler::handle_batch`]) gets the whole batch in one call and can write its effects
/// with one statement; the one-by-one rerun after a failure uses the per-message handler.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BatchConfig {
    /// The most deliveries in one batch (at least 1).
    pub max_messages: usize,
    /// How long to wait for more deliveries after the first one arrived.
    pub max_wait: Duration,
}

impl Default for BatchConfig {
    fn default() -> Self {
        BatchConfig {
            max_messages: 64,
            max_wait: Duration::from_millis(5),
        }
    }
}

/// Adds what arrives within the batch window to `batch`; `true` if the transport ended.
async fn gather<T: Transport>(
    transport: &mut T,
    batch: &mut Vec<Incoming>,
    config: &BatchConfig,
) -> bool {
    let deadline = tokio::time::Instant::now() + config.max_wait;
    while batch.len() < config.max_messages {
        // What is ready now is taken without arming the window's timer.
        let next = match transport.next().now_or_never() {
            Some(next) => Ok(next),
            None => tokio::time::timeout_at(deadline, transport.next()).await,
        };
        match next {
            Ok(Some(Ok(incoming))) => batch.push(incoming),
            Ok(Some(Err(e))) => tracing::warn!(error = %e, "transport error while receiving"),
            Ok(None) => return true,
            Err(_) => break,
        }
    }
    false
}

/// Handler settings after validation.
#[derive(Debug)]
struct Settings {
    name: String,
    key: Option<KeyTemplate>,
    payload_hash: bool,
    max_attempts: u32,
    backoff: ExponentialBackoff,
    retention: Duration,
    timeout: Duration,
    on_conflict: ConflictPolicy,
}

impl Settings {
    fn validate(o: HandlerOptions, config: &WorkerConfig) -> Result<Self, Error> {
        if o.name.is_empty()
            || !o
                .name
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || matches!(c, '_' | '-' | '.'))
        {
            return Err(Error::config(
                "name",
                format!(
                    "{:?} must be non-empty letters, digits, `_`, `-` or `.`",
                    o.name
                ),
            ));
        }
        let max_attempts = config.max_attempts.unwrap_or(o.max_attempts);
        if max_attempts == 0 {
            return Err(Error::config("max_attempts", "must be at least 1"));
        }
        if config.batch.is_some_and(|b| b.max_messages == 0) {
            return Err(Error::config("batch.max_messages", "must be at least 1"));
        }
        if config.concurrency == 0 {
            return Err(Error::config("concurrency", "must be at least 1"));
        }
        let timeout = config.handler_timeout.unwrap_or(o.timeout);
        if timeout.is_zero() {
            return Err(Error::config("timeout", "must be greater than zero"));
        }
        let mut backoff = ExponentialBackoff::new(o.backoff.0, o.backoff.1)?;
        if let Some(j) = &config.jitter {
            backoff = backoff.with_jitter(SharedJitter(j.clone()));
        }
        Ok(Settings {
            key: o.key.as_deref().map(KeyTemplate::parse).transpose()?,
            name: o.name.into_owned(),
            payload_hash: o.payload_hash,
            max_attempts,
            backoff,
            retention: config.retention.unwrap_or(o.retention),
            timeout,
            on_conflict: o.on_conflict,
        })
    }
}

struct SharedJitter(Arc<dyn Jitter>);

impl Jitter for SharedJitter {
    fn sample(&self) -> f64 {
        self.0.sample()
    }
}

/// Runs one handler over one transport. Cheap to clone; clones share counters.
pub struct Worker<DB: Backend, H: Handler<DB>> {
    inner: Arc<Inner<DB, H>>,
}

impl<DB: Backend, H: Handler<DB>> Clone for Worker<DB, H> {
    fn clone(&self) -> Self {
        Worker {
            inner: self.inner.clone(),
        }
    }
}

struct Inner<DB: Backend, H: Handler<DB>> {
    inbox: Inbox<DB>,
    handler: H,
    settings: Settings,
    config: WorkerConfig,
    stats: Arc<Stats>,
    /// What this worker may run as fresh in the logs it reads (see [`Worker::is_fresh`]).
    logs: tokio::sync::Mutex<LogWindows>,
}

/// Applies a batch's settlements, all under way at once, and returns each outcome with its
/// result, in order. Most settle at their first poll (a Kafka ack marks an offset): those
/// are polled in place, and only the rest are joined, so a batch does not pay a task and a
/// wake-up per delivery.
async fn settle_all(settled: Vec<Settled>) -> Vec<(Outcome, Result<(), TransportError>)> {
    let mut done = Vec::with_capacity(settled.len());
    let mut waiting = Vec::new();
    for (i, (acker, settlement, outcome)) in settled.into_iter().enumerate() {
        let mut settling = acker.settle(settlement);
        match futures::poll!(settling.as_mut()) {
            std::task::Poll::Ready(result) => done.push((outcome, result)),
            std::task::Poll::Pending => {
                done.push((outcome, Ok(())));
                waiting.push(settling.map(move |result| (i, result)));
            }
        }
    }
    for (i, result) in futures::future::join_all(waiting).await {
        done[i].1 = result;
    }
    done
}

/// Settles a retry through the transport's acker, then records in the inbox that the copy
/// (carrying `attempt`, due after `delay`) is with the broker, on its way to the acker's
/// [`Acknowledger::copy_scope`] (see [`Backend::record_retry`]). If the record cannot be
/// written, a redelivery of this delivery runs once more, as it would without it.
struct RecordRetry<DB: Backend> {
    acker: Box<dyn Acknowledger>,
    inbox: Inbox<DB>,
    handler: String,
    key: String,
    attempt: u32,
    scope: String,
    delay: Duration,
}

impl<DB: Backend> Acknowledger for RecordRetry<DB> {
    fn settle(
        self: Box<Self>,
        settlement: Settlement,
    ) -> BoxFuture<'static, Result<(), TransportError>> {
        Box::pin(async move {
            let RecordRetry {
                acker,
                inbox,
                handler,
                key,
                attempt,
                scope,
                delay,
            } = *self;
            acker.settle(settlement).await?;
            if let Err(e) = inbox
                .record_retry(&handler, &key, attempt, &scope, delay)
                .await
            {
                tracing::debug!(error = %e, "could not record the retry copy in the inbox");
            }
            Ok(())
        })
    }

    fn copy_scope(&self) -> Option<&str> {
        Some(&self.scope)
    }
}

/// Whether the log mark may prove `delivery` fresh: a first delivery with a position that its
/// transport did not already call fresh (see [`Worker::is_fresh`]).
fn may_be_proven_fresh(delivery: &Delivery) -> bool {
    !delivery.fresh && delivery.position.is_some() && !delivery.redelivered && delivery.attempt == 1
}

/// A decoded message and its key.
struct Prepared<M> {
    message: M,
    key: String,
    hash: String,
}

/// A batch member that may run: its delivery, acker and decoded message.
type Pending<M> = (Delivery, Box<dyn Acknowledger>, Prepared<M>);
/// A batch member after its attempt: its key, attempt number and how the attempt ended.
type Ran = (Delivery, Box<dyn Acknowledger>, String, u32, Attempted);

/// How a counted attempt in a transaction ended.
#[derive(Debug)]
enum Attempted {
    /// The handler's writes and the key's completion committed.
    Committed,
    /// The handler failed (or its writes were refused at the commit): rolled back; a
    /// failed attempt.
    Failed(HandlerError),
    /// The key's row was no longer this attempt's at the completion (another worker
    /// completed it or counted a newer attempt on it): rolled back, and the delivery is a
    /// duplicate of the one that holds the key now.
    Overtaken,
    /// No transaction could begin: the handler did not run.
    NotBegun(sqlx::Error),
    /// The completion or the commit failed for a reason of the database's own (a
    /// failover, a lost connection): the outcome is unknown, and it is no failed attempt.
    CommitFailed(sqlx::Error),
}

impl Attempted {
    /// A failed completion or commit: the database's fault unless it refused the handler's
    /// own writes (an integrity violation found at the commit, such as a deferred
    /// constraint), which is the handler's failed attempt.
    fn commit_failed(e: sqlx::Error) -> Self {
        if refused_writes(&e) {
            Attempted::Failed(HandlerError::transient(CommitFailed(e)))
        } else {
            Attempted::CommitFailed(e)
        }
    }
}

/// Whether a failed commit refused the handler's own writes: an integrity constraint
/// violation (SQLSTATE class 23) found at the commit, such as a deferred constraint's.
fn refused_writes(e: &sqlx::Error) -> bool {
    e.as_database_error()
        .and_then(|d| d.code())
        .is_some_and(|code| code.starts_with("23"))
}
/// A batch member whose handler ran in the batch's transaction: delivery, acker, key,
/// attempt.
type Member = (Delivery, Box<dyn Acknowledger>, String, u32);
/// A settlement waiting to be applied.
type Settled = (Box<dyn Acknowledger>, Settlement, Outcome);

/// What the fresh path did with a delivery.
enum Fresh<M> {
    /// The key has a row already: the message goes to the counted path.
    Unclaimed(M),
    /// The handler ran (or the transaction could not begin, or its commit failed for the
    /// database's own reason, `Err`): `None` committed, `Some` failed and rolled back.
    Ran(Result<Option<HandlerError>, sqlx::Error>),
}

/// Why a delivery's processing stopped without settling (a simulated crash).
struct Crash(FaultPoint);

/// How one delivery ended, for the span and the counters.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Outcome {
    Completed,
    Duplicate,
    Superseded,
    ConflictSkipped,
    /// Sent back for a delayed retry. `counted`: after a failed attempt the inbox counted
    /// (not after a database error), so its copy is recorded (see [`RecordRetry`]).
    Retry {
        counted: bool,
    },
    DeadLettered,
}

impl Outcome {
    fn as_str(self) -> &'static str {
        match self {
            Outcome::Completed => "completed",
            Outcome::Duplicate => "duplicate",
            Outcome::Superseded => "superseded",
            Outcome::ConflictSkipped => "conflict_skipped",
            Outcome::Retry { .. } => "retry",
            Outcome::DeadLettered => "dead_lettered",
        }
    }
}

impl<DB: Backend, H: Handler<DB>> Worker<DB, H> {
    /// A worker with the default [`WorkerConfig`]. Fails at once, naming the option, if the
    /// handler's settings are invalid.
    pub fn new(inbox: Inbox<DB>, handler: H) -> Result<Self, Error> {
        Self::with_config(inbox, handler, WorkerConfig::default())
    }

    /// A worker with `config`. Fails at once, naming the option, on an invalid setting.
    pub fn with_config(inbox: Inbox<DB>, handler: H, config: WorkerConfig) -> Result<Self, Error> {
        let settings = Settings::validate(handler.options(), &config)?;
        Ok(Worker {
            inner: Arc::new(Inner {
                inbox,
                handler,
                settings,
                config,
                stats: Arc::new(Stats::default()),
                logs: tokio::sync::Mutex::new(LogWindows::default()),
            }),
        })
    }

    /// The live counters.
    pub fn stats(&self) -> Arc<Stats> {
        self.inner.stats.clone()
    }

    /// A copy of the counters now.
    pub fn snapshot(&self) -> StatsSnapshot {
        self.inner.stats.snapshot()
    }

    /// The handler's stable name.
    pub fn handler_name(&self) -> &str {
        &self.inner.settings.name
    }

    /// The inbox.
    pub fn inbox(&self) -> &Inbox<DB> {
        &self.inner.inbox
    }

    /// Consumes `transport` until it ends or `shutdown` completes.
    ///
    /// On shutdown it stops taking deliveries, lets those in flight finish and settle, then
    /// drops the transport and returns `Ok`. A fault point with [`FaultAction::StopWorker`]
    /// drops everything in flight unsettled, as a crash would, and returns
    /// [`Error::Crashed`].
    pub async fn run<T: Transport>(
        &self,
        mut transport: T,
        shutdown: impl Future<Output = ()> + Send,
    ) -> Result<(), Error> {
        let permits = Arc::new(Semaphore::new(self.inner.config.concurrency));
        let (crash_tx, mut crash_rx) = watch::channel(None::<FaultPoint>);
        let mut tasks = JoinSet::new();
        let retention = self.spawn_retention();
        let shutdown = shutdown.fuse();
        futures::pin_mut!(shutdown);

        let crashed = loop {
            let permit = tokio::select! {
                biased;
                _ = crash_rx.changed() => break *crash_rx.borrow(),
                _ = &mut shutdown => break None,
                p = permits.clone().acquire_owned() => match p {
                    Ok(p) => p,
                    Err(_) => break None,
                },
            };
            let next = tokio::select! {
                biased;
                _ = crash_rx.changed() => break *crash_rx.borrow(),
                _ = &mut shutdown => break None,
                next = transport.next() => next,
            };
            let mut ended = false;
            match next {
                None => break None,
                Some(Err(e)) => {
                    tracing::warn!(error = %e, "transport error while receiving");
                }
                Some(Ok(incoming)) => {
                    let batching = self.inner.config.batch.as_ref();
                    let mut batch = Vec::with_capacity(batching.map_or(1, |b| b.max_messages));
                    batch.push(incoming);
                    if let Some(b) = batching {
                        ended = gather(&mut transport, &mut batch, b).await;
                    }
                    let worker = self.clone();
                    let crash_tx = crash_tx.clone();
                    tasks.spawn(async move {
                        let done = if batch.len() == 1 {
                            let incoming = batch.pop().expect("one delivery");
                            worker.process(incoming).await
                        } else {
                            worker.process_batch(batch).await
                        };
                        if let Err(Crash(point)) = done {
                            let _ = crash_tx.send(Some(point));
                        }
                        drop(permit);
                    });
                }
            }
            if ended {
                break None;
            }
            while let Some(done) = tasks.try_join_next() {
                log_join(done);
            }
        };

        let crashed = match crashed {
            Some(point) => Some(point),
            None => {
                // Graceful: finish and settle what is in flight, unless one of them crashes.
                loop {
                    tokio::select! {
                        biased;
                        _ = crash_rx.changed() => break *crash_rx.borrow(),
                        done = tasks.join_next() => match done {
                            Some(done) => log_join(done),
                            None => break None,
                        },
                    }
                }
            }
        };
        if let Some(r) = retention {
            r.abort();
        }
        if let Some(point) = crashed {
            tasks.abort_all();
            while tasks.join_next().await.is_some() {}
            drop(transport);
            tracing::error!(fault_point = point.as_str(), "worker crashed (simulated)");
            return Err(Error::Crashed(point.as_str()));
        }
        drop(transport);
        Ok(())
    }

    fn spawn_retention(&self) -> Option<tokio::task::JoinHandle<()>> {
        let interval = self.inner.config.retention_interval?;
        let inbox = self.inner.inbox.clone();
        let batch = self.inner.config.retention_batch;
        Some(tokio::spawn(async move {
            let mut tick = tokio::time::interval(interval);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                tick.tick().await;
                match inbox.purge_expired(batch).await {
                    Ok(0) => {}
                    Ok(n) => tracing::debug!(deleted = n, "purged expired inbox rows"),
                    Err(e) => tracing::warn!(error = %e, "inbox retention purge failed"),
                }
            }
        }))
    }

    /// Processes and settles one delivery. `Err` is a simulated crash: nothing was settled.
    async fn process(&self, incoming: Incoming) -> Result<(), Crash> {
        let Incoming {
            mut delivery,
            acker,
        } = incoming;
        delivery.attempt = bounded_attempt(delivery.attempt);
        delivery.fresh = self.is_fresh(&delivery).await;
        let s = &self.inner.settings;
        let span = tracing::info_span!(
            "delivery",
            handler = %s.name,
            source = %delivery.source,
            key = field::Empty,
            attempt = field::Empty,
            outcome = field::Empty,
        );
        async move {
            let stats = &self.inner.stats;
            Stats::bump(&stats.received);
            let mut acker = Some(acker);
            if self.inner.config.broken_ack_before_commit {
                if let Some(early) = acker.take() {
                    let _ = early.settle(Settlement::Ack).await;
                }
            }
            let mut key = None;
            let scope = acker.as_deref().and_then(|a| a.copy_scope());
            let (settlement, outcome) = self.decide(&delivery, scope, &mut key).await?;
            let key = key.unwrap_or_default();
            tracing::Span::current().record("outcome", outcome.as_str());
            self.count(outcome);
            self.fault(FaultPoint::AfterCommit, &key)?;
            let Some(acker) = acker else {
                return Ok(());
            };
            let acker = self.recording_retry(acker, &key, &settlement, outcome);
            if let Err(e) = acker.settle(settlement).await {
                Stats::bump(&stats.settle_errors);
                tracing::warn!(error = %e, "settling failed; the broker will redeliver and the inbox will deduplicate");
            }
            self.fault(FaultPoint::AfterAck, &key)?;
            tracing::debug!("settled");
            Ok(())
        }
        .instrument(span)
        .await
    }

    /// Processes a batch in one transaction and settles every delivery. `Err` is a simulated
    /// crash: nothing of the batch was settled.
    async fn process_batch(&self, batch: Vec<Incoming>) -> Result<(), Crash> {
        let span = tracing::info_span!(
            "batch",
            handler = %self.inner.settings.name,
            size = batch.len(),
        );
        async move {
            let stats = &self.inner.stats;
            let mut settled: Vec<Settled> = Vec::with_capacity(batch.len());
            let mut prepared: Vec<Pending<H::Message>> = Vec::with_capacity(batch.len());
            for mut incoming in batch {
                incoming.delivery.attempt = bounded_attempt(incoming.delivery.attempt);
                match self.prepare(&incoming.delivery) {
                    Err((settlement, outcome)) => {
                        Stats::bump(&stats.received);
                        settled.push((incoming.acker, settlement, outcome));
                    }
                    Ok(p) => prepared.push((incoming.delivery, incoming.acker, p)),
                }
            }
            // A key twice in one batch: the second copy runs (and is counted as received)
            // after the batch commits, and is then seen as a duplicate.
            let repeated: Vec<bool> = {
                let mut seen = std::collections::HashSet::with_capacity(prepared.len());
                prepared
                    .iter()
                    .map(|(_, _, p)| !seen.insert(p.key.as_str()))
                    .collect()
            };
            let mut runnable: Vec<Pending<H::Message>> = Vec::with_capacity(prepared.len());
            let mut later = Vec::new();
            for ((delivery, acker, p), repeated) in prepared.into_iter().zip(repeated) {
                if repeated {
                    later.push(Incoming { delivery, acker });
                } else {
                    Stats::bump(&stats.received);
                    runnable.push((delivery, acker, p));
                }
            }
            self.mark_fresh(&mut runnable).await;
            // Only fault injection needs the keys once the deliveries have moved on.
            let batch_keys: Vec<String> = if self.inner.config.faults.is_some() {
                runnable.iter().map(|(_, _, p)| p.key.clone()).collect()
            } else {
                Vec::new()
            };
            let (fresh, counted): (Vec<_>, Vec<_>) =
                runnable.into_iter().partition(|(d, _, _)| d.fresh);
            let mut unclaimed = Vec::new();
            if !fresh.is_empty() {
                self.run_fresh_batch(fresh, &mut settled, &mut unclaimed)
                    .await?;
            }
            if !counted.is_empty() {
                self.run_batch(counted, &mut settled, &mut unclaimed)
                    .await?;
            }
            // Fresh deliveries whose keys had rows (a republished duplicate, say), and the
            // members of a statement that the inbox refused, now that this batch's locks are
            // released.
            for (delivery, acker, p) in unclaimed {
                let key = p.key.clone();
                let (settlement, outcome) = self
                    .decide_prepared(&delivery, acker.copy_scope(), p)
                    .await?;
                settled.push(self.settled(acker, &key, settlement, outcome));
            }
            // A fault point fires for the batch if it fires for any of its keys.
            for key in &batch_keys {
                self.fault(FaultPoint::AfterCommit, key)?;
            }
            for (outcome, result) in settle_all(settled).await {
                self.count(outcome);
                if let Err(e) = result {
                    Stats::bump(&stats.settle_errors);
                    tracing::warn!(error = %e, "settling failed; the broker will redeliver and the inbox will deduplicate");
                }
            }
            for key in &batch_keys {
                self.fault(FaultPoint::AfterAck, key)?;
            }
            for incoming in later {
                self.process(incoming).await?;
            }
            Ok(())
        }
        .instrument(span)
        .await
    }

    /// Claims, runs and commits the distinct-key part of a batch, pushing one settlement per
    /// delivery to `settled`, or to `alone` a member to run by itself after the batch.
    async fn run_batch(
        &self,
        runnable: Vec<Pending<H::Message>>,
        settled: &mut Vec<Settled>,
        alone: &mut Vec<Pending<H::Message>>,
    ) -> Result<(), Crash> {
        let s = &self.inner.settings;
        let names = self.inner.inbox.names();
        let keys: Vec<String> = runnable.iter().map(|(_, _, p)| p.key.clone()).collect();
        let mut lease = match self.inner.inbox.lease_many(&s.name, &keys).await {
            Ok(l) => l,
            Err(e) => {
                self.retry_all_after_db_error(&e, runnable, settled, alone);
                return Ok(());
            }
        };
        let items: Vec<AttemptItem<'_>> = runnable
            .iter()
            .map(|(d, a, p)| AttemptItem {
                key: &p.key,
                hash: &p.hash,
                attempt: d.attempt.max(1),
                scope: a.copy_scope(),
            })
            .collect();
        let (conn, lock_ids) = lease.locking();
        let claims = match DB::begin_attempts(
            conn,
            names,
            &s.name,
            &items,
            s.max_attempts,
            lock_ids,
        )
        .await
        {
            Ok(c) => c,
            Err(e) => {
                lease.release().await;
                self.retry_all_after_db_error(&e, runnable, settled, alone);
                return Ok(());
            }
        };
        let mut to_run = Vec::new();
        for ((delivery, acker, p), claim) in runnable.into_iter().zip(claims) {
            match self
                .check_claim(lease.conn(), &delivery, &p.key, claim)
                .await
            {
                Ok(attempt) => to_run.push(((delivery, acker, p), attempt)),
                Err((settlement, outcome)) => settled.push((acker, settlement, outcome)),
            }
        }
        if to_run.is_empty() {
            lease.release().await;
            return Ok(());
        }

        let mut unlocked = false;
        let (conn, held) = lease.held();
        let ran = self
            .run_in_transaction(conn, held, &mut unlocked, to_run)
            .await;
        if unlocked {
            lease.released_in_db();
        }
        let ran = match ran? {
            Ok(ran) => ran,
            Err((e, not_run)) => {
                lease.release().await;
                self.retry_all_after_db_error(&e, not_run, settled, alone);
                return Ok(());
            }
        };
        for (delivery, acker, key, attempt, attempted) in ran {
            let (settlement, outcome) = self
                .settle_attempt(lease.conn(), &delivery, &key, attempt, attempted)
                .await;
            settled.push(self.settled(acker, &key, settlement, outcome));
        }
        lease.release().await;
        Ok(())
    }

    /// The settlement of a counted attempt that ran (or tried to) in a transaction.
    async fn settle_attempt(
        &self,
        conn: &mut DB::Connection,
        delivery: &Delivery,
        key: &str,
        attempt: u32,
        attempted: Attempted,
    ) -> (Settlement, Outcome) {
        match attempted {
            Attempted::Committed => (Settlement::Ack, Outcome::Completed),
            Attempted::Failed(f) => self.fail(conn, delivery, key, attempt, &f).await,
            Attempted::Overtaken => {
                tracing::warn!(
                    key,
                    attempt,
                    "the key was completed or counted again by another worker while this attempt ran: rolled back, settled as a duplicate"
                );
                (Settlement::Ack, Outcome::Duplicate)
            }
            Attempted::NotBegun(e) => self.retry_after_db_error(delivery, &e),
            Attempted::CommitFailed(e) => {
                self.give_back(key, attempt).await;
                self.retry_after_db_error(delivery, &e)
            }
        }
    }

    /// Gives back the count of an attempt whose commit failed for the database's reason (see
    /// [`Backend::uncount_attempt`]), so that a failover cannot use up a message's attempts.
    /// If the database cannot be reached yet, the count stays: the message then has one
    /// attempt fewer, as after a crash.
    async fn give_back(&self, key: &str, attempt: u32) {
        let name = &self.inner.settings.name;
        match self.inner.inbox.uncount_attempt(name, key, attempt).await {
            Ok(given_back) => {
                tracing::debug!(
                    key,
                    attempt,
                    given_back,
                    "commit failed: attempt given back"
                )
            }
            Err(e) => {
                Stats::bump(&self.inner.stats.db_errors);
                tracing::warn!(key, attempt, error = %e, "commit failed, and its attempt could not be given back");
            }
        }
    }

    /// Runs the messages in one transaction (through the handler's batch function if it has
    /// one, else one after another), marks their keys completed and commits once. If any handler fails, the whole transaction is rolled back and each
    /// message runs again alone, in its own transaction (its attempt is not counted twice:
    /// the locks and the claim are still held). Returns each message with its failure, if
    /// any; `Err` of the inner result when no transaction could begin. The batch's completion
    /// releases the database locks `unlock` and sets `unlocked`; the one-by-one reruns keep
    /// them until the caller releases the lease.
    async fn run_in_transaction(
        &self,
        conn: &mut DB::Connection,
        unlock: &[i64],
        unlocked: &mut bool,
        to_run: Vec<(Pending<H::Message>, u32)>,
    ) -> Result<Result<Vec<Ran>, (sqlx::Error, Vec<Pending<H::Message>>)>, Crash> {
        let s = &self.inner.settings;
        let names = self.inner.inbox.names();
        let mut tx = match DB::begin_handler(&mut *conn, s.timeout).await {
            Ok(tx) => tx,
            Err(e) => {
                let not_run = to_run.into_iter().map(|(pending, _)| pending).collect();
                return Ok(Err((e, not_run)));
            }
        };
        let (items, failed, tentative_runs) = self.run_handlers(&mut tx, to_run).await?;
        if !failed {
            let keys: Vec<&str> = items.iter().map(|i| i.2.as_str()).collect();
            let attempts: Vec<u32> = items.iter().map(|i| i.3).collect();
            for key in &keys {
                self.fault(FaultPoint::BeforeCommit, key)?;
            }
            let completed = DB::complete_many(
                &mut tx,
                names,
                &s.name,
                &keys,
                &attempts,
                s.retention,
                unlock,
            )
            .await;
            let committed = match completed {
                Ok(n) if n == keys.len() as u64 => {
                    *unlocked = !unlock.is_empty();
                    Some(tx.commit().await)
                }
                Ok(_) => {
                    // A key was overtaken by another worker: its handler's writes must not
                    // commit, so the batch rolls back and each member runs alone, where
                    // the completion settles that key as a duplicate.
                    *unlocked = !unlock.is_empty();
                    self.abandon_batch(tx, tentative_runs).await;
                    None
                }
                Err(e) => {
                    drop(tx);
                    Some(Err(e))
                }
            };
            if let Some(committed) = committed {
                if committed.is_ok() {
                    Stats::bump(&self.inner.stats.batches);
                }
                // Each member gets the failure: the handler's if the database refused the
                // batch's writes, else the database's (no attempt).
                let failure = committed
                    .err()
                    .map(|e| (refused_writes(&e), format!("batch commit failed: {e}")));
                return Ok(Ok(items
                    .into_iter()
                    .map(|(d, a, k, n)| {
                        let attempted = match &failure {
                            None => Attempted::Committed,
                            Some((true, e)) => {
                                Attempted::Failed(HandlerError::transient(e.clone()))
                            }
                            Some((false, e)) => {
                                Attempted::CommitFailed(sqlx::Error::Protocol(e.clone()))
                            }
                        };
                        (d, a, k, n, attempted)
                    })
                    .collect()));
            }
        } else {
            self.abandon_batch(tx, tentative_runs).await;
        }
        // One by one. The messages were moved into the handlers: decode them again.
        let mut ran = Vec::with_capacity(items.len());
        for (delivery, acker, key, attempt) in items {
            let attempted = match self.prepare(&delivery) {
                Err(_) => {
                    Attempted::Failed(HandlerError::permanent("the payload no longer decodes"))
                }
                Ok(p) => {
                    self.run_in_own_transaction(
                        conn,
                        &[],
                        &mut false,
                        &delivery,
                        &key,
                        attempt,
                        p.message,
                    )
                    .await?
                }
            };
            ran.push((delivery, acker, key, attempt, attempted));
        }
        Ok(Ok(ran))
    }

    /// Runs a batch's handlers in the open transaction `tx`: the handler's batch function if
    /// it has one, else the handler once per message, stopping at the first failure. Returns
    /// the messages (delivery, acker, key, attempt), whether one failed (the caller rolls
    /// back and reruns them one by one) and how many runs were tentative.
    async fn run_handlers(
        &self,
        tx: &mut DB::Connection,
        to_run: Vec<(Pending<H::Message>, u32)>,
    ) -> Result<(Vec<Member>, bool, u64), Crash> {
        let s = &self.inner.settings;
        let mut items = Vec::with_capacity(to_run.len());
        let mut failed = false;
        let mut tentative_runs = 0;
        if self.inner.handler.handles_batches() {
            let mut messages = Vec::with_capacity(to_run.len());
            for ((delivery, acker, p), attempt) in to_run {
                messages.push(p.message);
                items.push((delivery, acker, p.key, attempt));
            }
            tentative_runs = items.len() as u64;
            let result = {
                let members: Vec<BatchMember<'_>> = items
                    .iter()
                    .map(|(delivery, _, key, attempt)| BatchMember {
                        key,
                        attempt: *attempt,
                        delivery,
                    })
                    .collect();
                let mut ctx = BatchContext {
                    conn: &mut *tx,
                    handler: &s.name,
                    members: &members,
                };
                self.invoke_batch(&mut ctx, messages).await
            };
            if let Err(e) = result {
                if let Some(point) = e.crash {
                    return Err(Crash(point));
                }
                tracing::debug!(error = %e, "the batch function failed: the batch runs again one by one");
                failed = true;
            }
        } else {
            for ((delivery, acker, p), attempt) in to_run {
                let Prepared { message, key, .. } = p;
                if !failed {
                    tentative_runs += 1;
                    let result = {
                        let mut ctx = self.context(&mut *tx, &key, attempt, &delivery);
                        self.invoke(&mut ctx, message, true).await
                    };
                    if let Err(e) = result {
                        if let Some(point) = e.crash {
                            return Err(Crash(point));
                        }
                        tracing::debug!(key, error = %e, "a handler failed: the batch runs again one by one");
                        failed = true;
                    }
                }
                items.push((delivery, acker, key, attempt));
            }
        }
        Ok((items, failed, tentative_runs))
    }

    /// Rolls back a batch in which a handler failed and counts its tentative runs (the
    /// messages then run again one by one).
    async fn abandon_batch(&self, tx: sqlx::Transaction<'_, DB>, tentative_runs: u64) {
        if let Err(rb) = tx.rollback().await {
            tracing::warn!(error = %rb, "batch rollback failed");
        }
        self.inner
            .stats
            .batch_reruns
            .fetch_add(tentative_runs, std::sync::atomic::Ordering::Relaxed);
    }

    /// A settlement to apply, with its acker (see [`Worker::recording_retry`]).
    fn settled(
        &self,
        acker: Box<dyn Acknowledger>,
        key: &str,
        settlement: Settlement,
        outcome: Outcome,
    ) -> Settled {
        let acker = self.recording_retry(acker, key, &settlement, outcome);
        (acker, settlement, outcome)
    }

    /// The acker to settle with: for the retry of an attempt the inbox counted, when the
    /// transport writes a copy (see [`Acknowledger::copy_scope`]), one that then
    /// records the copy's attempt number in the inbox, so that a redelivery of this
    /// delivery is known to be superseded. A retry after a database error is not recorded:
    /// the database is likely still unreachable, and waiting for it would hold the
    /// settlement back.
    fn recording_retry(
        &self,
        acker: Box<dyn Acknowledger>,
        key: &str,
        settlement: &Settlement,
        outcome: Outcome,
    ) -> Box<dyn Acknowledger> {
        let (Settlement::Retry { attempt, delay }, Outcome::Retry { counted: true }) =
            (settlement, outcome)
        else {
            return acker;
        };
        let Some(scope) = acker.copy_scope().map(str::to_owned) else {
            return acker;
        };
        Box::new(RecordRetry {
            acker,
            inbox: self.inner.inbox.clone(),
            handler: self.inner.settings.name.clone(),
            key: key.to_owned(),
            attempt: *attempt,
            scope,
            delay: *delay,
        })
    }

    fn count(&self, outcome: Outcome) {
        let stats = &self.inner.stats;
        Stats::bump(match outcome {
            Outcome::Completed => &stats.completed,
            Outcome::Duplicate => &stats.duplicates,
            Outcome::Superseded => &stats.superseded,
            Outcome::ConflictSkipped => &stats.conflicts,
            Outcome::Retry { .. } => &stats.retries,
            Outcome::DeadLettered => &stats.dead_lettered,
        });
    }

    fn fault(&self, point: FaultPoint, key: &str) -> Result<(), Crash> {
        let Some(faults) = &self.inner.config.faults else {
            return Ok(());
        };
        match faults.check(point, &self.inner.settings.name, key) {
            None => Ok(()),
            Some(FaultAction::Abort) => {
                tracing::error!(
                    fault_point = point.as_str(),
                    key,
                    "fault point: aborting the process"
                );
                std::process::abort()
            }
            Some(FaultAction::StopWorker) => Err(Crash(point)),
        }
    }

    fn dead_letter(
        &self,
        delivery: &Delivery,
        reason: DeadLetterReason,
        key: Option<&str>,
        attempts: u32,
        error: String,
    ) -> (Settlement, Outcome) {
        tracing::warn!(reason = reason.as_str(), error = %error, "dead-lettering");
        let settlement = Settlement::DeadLetter(DeadLetter {
            reason,
            handler: self.inner.settings.name.clone(),
            key: key.map(str::to_owned),
            attempts,
            error,
            source: delivery.source.clone(),
        });
        (settlement, Outcome::DeadLettered)
    }

    /// [`Worker::retry_after_db_error`] for every member of a batch that could not run. If
    /// the database refused the statement's input (see [`refused_by_database`]), the
    /// statement does not say whose key it was: the members go to `alone`, to run one by one
    /// after the batch, where only that one is dead-lettered.
    fn retry_all_after_db_error(
        &self,
        e: &sqlx::Error,
        pending: Vec<Pending<H::Message>>,
        settled: &mut Vec<Settled>,
        alone: &mut Vec<Pending<H::Message>>,
    ) {
        if refused_by_database(e).is_some() {
            tracing::warn!(error = %e, "the inbox refused a key of the batch; its members run one by one");
            alone.extend(pending);
            return;
        }
        for (delivery, acker, _) in pending {
            let (settlement, outcome) = self.retry_after_db_error(&delivery, e);
            settled.push((acker, settlement, outcome));
        }
    }

    /// A retry when the inbox itself failed: the handler did not run, so no attempt is
    /// counted; the broker's attempt number paces the backoff. A refusal of the key (see
    /// [`refused_by_database`]) would repeat on every retry: the message is dead-lettered
    /// `invalid_key` instead.
    fn retry_after_db_error(&self, delivery: &Delivery, e: &sqlx::Error) -> (Settlement, Outcome) {
        Stats::bump(&self.inner.stats.db_errors);
        if let Some(reason) = refused_by_database(e) {
            return self.dead_letter(delivery, DeadLetterReason::InvalidKey, None, 0, reason);
        }
        tracing::error!(error = %e, "inbox unavailable; delivery will be retried");
        let attempt = delivery.attempt.max(1);
        (
            Settlement::Retry {
                delay: self.inner.settings.backoff.next_delay(attempt),
                attempt: next_attempt(attempt),
            },
            Outcome::Retry { counted: false },
        )
    }

    fn derive_key(&self, delivery: &Delivery, payload: &Value) -> Result<String, String> {
        let s = &self.inner.settings;
        if let Some(template) = &s.key {
            return template
                .render(payload)
                .map_err(|e| format!("key template {:?}: {e}", template.as_str()));
        }
        if let Some(id) = delivery.message_id.as_deref().filter(|id| !id.is_empty()) {
            return Ok(id.to_owned());
        }
        if s.payload_hash {
            return Ok(format!("sha256:{}", canonical_hash(payload)));
        }
        Err("the message has no message id, the handler has no key template, and payload hashing is not allowed".to_owned())
    }

    /// Decodes the payload and derives the key; `Err` is the settlement of a message that
    /// cannot run (undecodable, no key).
    // The `Err` is a settlement, not an error: moved once, on a cold path.
    #[allow(clippy::result_large_err)]
    fn prepare(&self, delivery: &Delivery) -> Result<Prepared<H::Message>, (Settlement, Outcome)> {
        let limit = self.inner.config.max_payload_bytes;
        if delivery.payload.len() > limit {
            return Err(self.dead_letter(
                delivery,
                DeadLetterReason::PayloadTooLarge,
                delivery.message_id.as_deref(),
                0,
                format!(
                    "payload of {} bytes exceeds the limit of {limit} bytes",
                    delivery.payload.len()
                ),
            ));
        }
        // The key and hash are taken from the decoded value first, so the message can then be
        // built from the value by move (its strings are not copied again); an undecodable
        // payload is still reported as such before a missing key.
        let decoded = serde_json::from_slice::<Value>(&delivery.payload).and_then(|value| {
            let key = self.derive_key(delivery, &value);
            let hash = canonical_hash(&value);
            Ok((H::Message::deserialize(value)?, key, hash))
        });
        let (message, key, hash) = decoded.map_err(|e| {
            self.dead_letter(
                delivery,
                DeadLetterReason::Undecodable,
                delivery.message_id.as_deref(),
                0,
                e.to_string(),
            )
        })?;
        let key =
            key.map_err(|e| self.dead_letter(delivery, DeadLetterReason::MissingKey, None, 0, e))?;
        check_key(&key)
            .map_err(|e| self.dead_letter(delivery, DeadLetterReason::InvalidKey, None, 0, e))?;
        Ok(Prepared { message, key, hash })
    }

    /// Turns a claim into the attempt number to run, or the settlement of a message that must
    /// not run (duplicate, conflict, dead, quarantined).
    async fn check_claim(
        &self,
        conn: &mut DB::Connection,
        delivery: &Delivery,
        key: &str,
        claim: Claim,
    ) -> Result<u32, (Settlement, Outcome)> {
        let s = &self.inner.settings;
        match claim {
            Claim::Run { attempt } => Ok(attempt),
            Claim::Duplicate => Err((Settlement::Ack, Outcome::Duplicate)),
            Claim::Superseded { by } => {
                tracing::debug!(
                    attempt = delivery.attempt,
                    newer = by,
                    "superseded by a newer retry copy"
                );
                Err((Settlement::Ack, Outcome::Superseded))
            }
            Claim::Conflict { status } => {
                let error = format!(
                    "key {key:?} was first seen with a different payload (that one is {status:?})"
                );
                Err(match s.on_conflict {
                    // Counted here: its outcome is a dead letter. A skipped conflict is
                    // counted by its outcome (see `Worker::count`).
                    ConflictPolicy::DeadLetter => {
                        Stats::bump(&self.inner.stats.conflicts);
                        self.dead_letter(
                            delivery,
                            DeadLetterReason::KeyConflict,
                            Some(key),
                            0,
                            error,
                        )
                    }
                    ConflictPolicy::Skip => {
                        tracing::warn!(%error, "key conflict skipped by policy");
                        (Settlement::Ack, Outcome::ConflictSkipped)
                    }
                })
            }
            Claim::Dead {
                attempts,
                last_error,
            } => {
                let text = last_error.unwrap_or_default();
                let (reason, error) = split_reason(&text);
                Err(self.dead_letter(delivery, reason, Some(key), attempts, error.to_owned()))
            }
            Claim::Exhausted {
                attempts,
                last_error,
            } => {
                let error = format!(
                    "{attempts} attempts were used up without an outcome (the worker crashed); last error: {}",
                    last_error.as_deref().unwrap_or("none recorded")
                );
                self.record_failure(conn, key, Some(DeadLetterReason::Quarantined), &error)
                    .await;
                Stats::bump(&self.inner.stats.quarantined);
                Err(self.dead_letter(
                    delivery,
                    DeadLetterReason::Quarantined,
                    Some(key),
                    attempts,
                    error,
                ))
            }
        }
    }

    /// Runs the handler in `ctx`, turning a panic or a timeout into a transient failure.
    /// `tentative`: a batch's run, which is repeated alone if the batch fails, so its panics
    /// and timeouts are counted then, once.
    async fn invoke(
        &self,
        ctx: &mut Context<'_, DB>,
        message: H::Message,
        tentative: bool,
    ) -> Result<(), HandlerError> {
        let timeout = self.inner.settings.timeout;
        Stats::bump(&self.inner.stats.handler_runs);
        let run = AssertUnwindSafe(self.inner.handler.handle(ctx, message)).catch_unwind();
        match tokio::time::timeout(timeout, run).await {
            Ok(Ok(result)) => result,
            Ok(Err(panic)) => {
                if !tentative {
                    Stats::bump(&self.inner.stats.panics);
                }
                Err(HandlerError::transient(format!(
                    "handler panicked: {}",
                    panic_message(&*panic)
                )))
            }
            Err(_) => {
                if !tentative {
                    Stats::bump(&self.inner.stats.timeouts);
                }
                Err(HandlerError::transient(format!(
                    "handler timed out after {timeout:?}"
                )))
            }
        }
    }

    /// Runs the handler's batch function in `ctx`, turning a panic or a timeout (the
    /// handler's, for the whole batch) into a failure. Always tentative: a failed batch runs
    /// again one message at a time, where panics and timeouts are counted.
    async fn invoke_batch(
        &self,
        ctx: &mut BatchContext<'_, DB>,
        messages: Vec<H::Message>,
    ) -> Result<(), HandlerError> {
        let timeout = self.inner.settings.timeout;
        self.inner
            .stats
            .handler_runs
            .fetch_add(messages.len() as u64, std::sync::atomic::Ordering::Relaxed);
        let run = AssertUnwindSafe(self.inner.handler.handle_batch(ctx, messages)).catch_unwind();
        match tokio::time::timeout(timeout, run).await {
            Ok(Ok(result)) => result,
            Ok(Err(panic)) => Err(HandlerError::transient(format!(
                "batch function panicked: {}",
                panic_message(&*panic)
            ))),
            Err(_) => Err(HandlerError::transient(format!(
                "batch function timed out after {timeout:?}"
            ))),
        }
    }

    /// Records a failed attempt and decides: retry after backoff, or dead-letter.
    async fn fail(
        &self,
        conn: &mut DB::Connection,
        delivery: &Delivery,
        key: &str,
        attempt: u32,
        failure: &HandlerError,
    ) -> (Settlement, Outcome) {
        let s = &self.inner.settings;
        let error = failure.to_string();
        let reason = if failure.kind() == ErrorKind::Permanent {
            Some(DeadLetterReason::PermanentError)
        } else if attempt >= s.max_attempts {
            Some(DeadLetterReason::MaxAttemptsExceeded)
        } else {
            None
        };
        self.record_failure(conn, key, reason, &error).await;
        tracing::warn!(key, attempt, error = %error, "handler failed");
        match reason {
            Some(reason) => self.dead_letter(delivery, reason, Some(key), attempt, error),
            // The copy is numbered above this delivery as well as above the count: a
            // delivery's number can run ahead of the count (retries after database errors
            // are not counted), and the inbox may hold that number as the newest copy's
            // (`retried_to`), which must never supersede the copy written now.
            None => (
                Settlement::Retry {
                    delay: s.backoff.next_delay(attempt),
                    attempt: next_attempt(attempt.max(delivery.attempt)),
                },
                Outcome::Retry { counted: true },
            ),
        }
    }

    /// Whether `delivery` may take the fresh path: its transport says so, or it is a first
    /// delivery from a log ([`Delivery::position`]) at or past the log's mark as this process
    /// read it, the mark raised and committed past it first if need be (see
    /// [`crate::LogPosition`]). If the mark cannot be raised, the delivery is counted.
    async fn is_fresh(&self, delivery: &Delivery) -> bool {
        if !may_be_proven_fresh(delivery) {
            return delivery.fresh;
        }
        let mut logs = self.inner.logs.lock().await;
        self.is_fresh_in(&mut logs, delivery).await
    }

    /// [`Worker::is_fresh`] for each of a batch's deliveries, under one hold of the log
    /// windows (a batch from a log usually needs no database visit at all).
    async fn mark_fresh(&self, batch: &mut [Pending<H::Message>]) {
        if !batch.iter().any(|(d, _, _)| may_be_proven_fresh(d)) {
            return;
        }
        let mut logs = self.inner.logs.lock().await;
        for (delivery, _, _) in batch.iter_mut() {
            if may_be_proven_fresh(delivery) {
                delivery.fresh = self.is_fresh_in(&mut logs, delivery).await;
            }
        }
    }

    /// [`Worker::is_fresh`] of a delivery with a position, with the log windows held.
    async fn is_fresh_in(&self, logs: &mut LogWindows, delivery: &Delivery) -> bool {
        let Some(pos) = &delivery.position else {
            return false;
        };
        let to = match logs.check(pos) {
            Check::Fresh => return true,
            Check::Counted => return false,
            Check::Advance { to } => to,
        };
        let name = &self.inner.settings.name;
        match self.inner.inbox.advance_log_mark(name, &pos.log, to).await {
            Ok(before) => {
                tracing::debug!(log = %pos.log, ?before, to, "log mark raised");
                logs.advanced(pos, before, to);
                logs.check(pos) == Check::Fresh
            }
            Err(e) => {
                tracing::warn!(error = %e, log = %pos.log, "raising the log mark failed; the delivery takes the counted path");
                false
            }
        }
    }

    /// Decides how to settle `delivery`, running the handler if the key is new. `key_out`
    /// receives the key once derived (for fault points).
    async fn decide(
        &self,
        delivery: &Delivery,
        scope: Option<&str>,
        key_out: &mut Option<String>,
    ) -> Result<(Settlement, Outcome), Crash> {
        let prepared = match self.prepare(delivery) {
            Ok(p) => p,
            Err(settled) => return Ok(settled),
        };
        tracing::Span::current().record("key", prepared.key.as_str());
        *key_out = Some(prepared.key.clone());
        self.decide_prepared(delivery, scope, prepared).await
    }

    /// [`Worker::decide`] once the message is decoded and keyed: a fresh delivery claims its
    /// key in the handler's transaction; anything else, or a fresh delivery whose key has a
    /// row already, counts its attempt first. `scope`: the delivery's
    /// [`Acknowledger::copy_scope`].
    async fn decide_prepared(
        &self,
        delivery: &Delivery,
        scope: Option<&str>,
        prepared: Prepared<H::Message>,
    ) -> Result<(Settlement, Outcome), Crash> {
        let s = &self.inner.settings;
        let Prepared { message, key, hash } = prepared;
        let mut lease = match self.inner.inbox.lease(&s.name, &key).await {
            Ok(l) => l,
            Err(e) => return Ok(self.retry_after_db_error(delivery, &e)),
        };
        let message = if delivery.fresh {
            match self
                .run_fresh(lease.conn(), delivery, &key, &hash, message)
                .await?
            {
                Fresh::Unclaimed(message) => message,
                Fresh::Ran(ran) => {
                    tracing::Span::current().record("attempt", 1);
                    let settled = self
                        .fresh_outcome(lease.conn(), delivery, &key, &hash, ran)
                        .await;
                    lease.release().await;
                    return Ok(settled);
                }
            }
        } else {
            message
        };
        let names = self.inner.inbox.names();
        let item = AttemptItem {
            key: &key,
            hash: &hash,
            attempt: delivery.attempt.max(1),
            scope,
        };
        let (conn, lock_ids) = lease.locking();
        let claim =
            match DB::begin_attempt(conn, names, &s.name, &item, s.max_attempts, lock_ids).await {
                Ok(c) => c,
                Err(e) => return Ok(self.retry_after_db_error(delivery, &e)),
            };
        let attempt = match self.check_claim(lease.conn(), delivery, &key, claim).await {
            Ok(attempt) => attempt,
            Err(settled) => {
                lease.release().await;
                return Ok(settled);
            }
        };
        tracing::Span::current().record("attempt", attempt);

        // The handler's transaction: its writes and the inbox completion commit together;
        // the completion also releases the database lock (see `Backend::complete`).
        let mut unlocked = false;
        let (conn, held) = lease.held();
        let ran = self
            .run_in_own_transaction(conn, held, &mut unlocked, delivery, &key, attempt, message)
            .await;
        if unlocked {
            lease.released_in_db();
        }
        let attempted = ran?;
        let settled = self
            .settle_attempt(lease.conn(), delivery, &key, attempt, attempted)
            .await;
        lease.release().await;
        Ok(settled)
    }

    /// The fresh path (see [`Delivery::fresh`]): in one transaction, claim the key as
    /// completed, run the handler, commit. No attempt is counted ahead: a fresh delivery is
    /// nobody's repeat, so a crash during it leaves nothing to count (the redelivery then
    /// takes the counted path). `Fresh::Unclaimed` gives the message back when the key has
    /// a row: the counted path decides (duplicate, conflict, pending attempts).
    async fn run_fresh(
        &self,
        conn: &mut DB::Connection,
        delivery: &Delivery,
        key: &str,
        hash: &str,
        message: H::Message,
    ) -> Result<Fresh<H::Message>, Crash> {
        let s = &self.inner.settings;
        let names = self.inner.inbox.names();
        let mut tx = match DB::begin_handler(conn, s.timeout).await {
            Ok(tx) => tx,
            Err(e) => return Ok(Fresh::Ran(Err(e))),
        };
        match DB::claim_fresh(&mut tx, names, &s.name, key, hash, s.retention).await {
            Ok(true) => {}
            Ok(false) => {
                if let Err(e) = tx.rollback().await {
                    return Ok(Fresh::Ran(Err(e)));
                }
                return Ok(Fresh::Unclaimed(message));
            }
            Err(e) => return Ok(Fresh::Ran(Err(e))),
        }
        let result = {
            let mut ctx = self.context(&mut tx, key, 1, delivery);
            self.invoke(&mut ctx, message, false).await
        };
        match result {
            Ok(()) => {
                self.fault(FaultPoint::BeforeCommit, key)?;
                // A commit that fails takes the claim with it: no attempt is left counted. The
                // database's failure is retried as one (no attempt); refused writes are the
                // handler's failed attempt.
                Ok(Fresh::Ran(match tx.commit().await {
                    Ok(()) => {
                        Stats::bump(&self.inner.stats.fresh_completed);
                        Ok(None)
                    }
                    Err(e) if refused_writes(&e) => {
                        Ok(Some(HandlerError::transient(CommitFailed(e))))
                    }
                    Err(e) => Err(e),
                }))
            }
            Err(HandlerError {
                crash: Some(point), ..
            }) => Err(Crash(point)),
            Err(failure) => {
                if let Err(rb) = tx.rollback().await {
                    tracing::warn!(error = %rb, "rollback failed");
                }
                Ok(Fresh::Ran(Ok(Some(failure))))
            }
        }
    }

    /// Settles a fresh attempt that ran: a failure is counted first (its claim was rolled
    /// back), then retried or dead-lettered as any failed attempt 1.
    async fn fresh_outcome(
        &self,
        conn: &mut DB::Connection,
        delivery: &Delivery,
        key: &str,
        hash: &str,
        ran: Result<Option<HandlerError>, sqlx::Error>,
    ) -> (Settlement, Outcome) {
        match ran {
            Err(e) => self.retry_after_db_error(delivery, &e),
            Ok(None) => (Settlement::Ack, Outcome::Completed),
            Ok(Some(failure)) => {
                let names = self.inner.inbox.names();
                let s = &self.inner.settings;
                if let Err(e) = DB::count_fresh_failure(conn, names, &s.name, key, hash).await {
                    Stats::bump(&self.inner.stats.db_errors);
                    tracing::warn!(key, error = %e, "could not count a failed attempt");
                }
                self.fail(conn, delivery, key, 1, &failure).await
            }
        }
    }

    /// The fresh path for the fresh members of a batch: one transaction claims their keys
    /// (one statement), runs their handlers and commits. Keys that have a row already go to
    /// `unclaimed`, for the counted path after this batch. If a handler fails, the batch
    /// rolls back and each message runs alone on the fresh path.
    async fn run_fresh_batch(
        &self,
        fresh: Vec<Pending<H::Message>>,
        settled: &mut Vec<Settled>,
        unclaimed: &mut Vec<Pending<H::Message>>,
    ) -> Result<(), Crash> {
        let s = &self.inner.settings;
        let keys: Vec<&str> = fresh.iter().map(|(_, _, p)| p.key.as_str()).collect();
        let mut lease = match self.inner.inbox.lease_many(&s.name, &keys).await {
            Ok(l) => l,
            Err(e) => {
                self.retry_all_after_db_error(&e, fresh, settled, unclaimed);
                return Ok(());
            }
        };
        let done = self
            .fresh_batch_on(lease.conn(), fresh, settled, unclaimed)
            .await;
        lease.release().await;
        done
    }

    /// [`Worker::run_fresh_batch`] on the leased connection `conn`.
    async fn fresh_batch_on(
        &self,
        conn: &mut DB::Connection,
        fresh: Vec<Pending<H::Message>>,
        settled: &mut Vec<Settled>,
        unclaimed: &mut Vec<Pending<H::Message>>,
    ) -> Result<(), Crash> {
        let s = &self.inner.settings;
        let names = self.inner.inbox.names();
        let mut tx = match DB::begin_handler(&mut *conn, s.timeout).await {
            Ok(tx) => tx,
            Err(e) => {
                self.retry_all_after_db_error(&e, fresh, settled, unclaimed);
                return Ok(());
            }
        };
        let items: Vec<(&str, &str)> = fresh
            .iter()
            .map(|(_, _, p)| (p.key.as_str(), p.hash.as_str()))
            .collect();
        let claimed = DB::claim_fresh_many(&mut tx, names, &s.name, &items, s.retention).await;
        let taken = match claimed {
            Ok(taken) => taken,
            Err(e) => {
                drop(tx);
                self.retry_all_after_db_error(&e, fresh, settled, unclaimed);
                return Ok(());
            }
        };
        let to_run = if taken.is_empty() {
            fresh
        } else {
            let taken: std::collections::HashSet<String> = taken.into_iter().collect();
            let (to_run, taken): (Vec<_>, Vec<_>) = fresh
                .into_iter()
                .partition(|(_, _, p)| !taken.contains(&p.key));
            unclaimed.extend(taken);
            to_run
        };
        if to_run.is_empty() {
            drop(tx);
            return Ok(());
        }
        let to_run = to_run.into_iter().map(|pending| (pending, 1)).collect();
        let (members, failed, tentative_runs) = self.run_handlers(&mut tx, to_run).await?;
        if !failed {
            for (_, _, key, _) in &members {
                self.fault(FaultPoint::BeforeCommit, key)?;
            }
            let committed = tx.commit().await;
            match &committed {
                Ok(()) => Stats::bump(&self.inner.stats.batches),
                Err(e) => tracing::warn!(error = %e, "batch commit failed"),
            }
            for (delivery, acker, key, _) in members {
                let (settlement, outcome) = match &committed {
                    Ok(()) => {
                        Stats::bump(&self.inner.stats.fresh_completed);
                        (Settlement::Ack, Outcome::Completed)
                    }
                    Err(e) if refused_writes(e) => {
                        let failure = HandlerError::transient(format!("batch commit failed: {e}"));
                        // The hash claimed with the key, taken again from the payload (which
                        // decoded before): a commit failure is rare.
                        let hash = serde_json::from_slice::<Value>(&delivery.payload)
                            .map(|v| canonical_hash(&v))
                            .unwrap_or_default();
                        self.fresh_outcome(&mut *conn, &delivery, &key, &hash, Ok(Some(failure)))
                            .await
                    }
                    // The database's failure: the claims rolled back with it, nothing is
                    // counted, and the members are retried as after any database error.
                    Err(e) => self.retry_after_db_error(&delivery, e),
                };
                settled.push(self.settled(acker, &key, settlement, outcome));
            }
            return Ok(());
        }
        self.abandon_batch(tx, tentative_runs).await;
        // One by one. The messages were moved into the handlers: decode them again.
        for (delivery, acker, key, _) in members {
            let (settlement, outcome) = match self.prepare(&delivery) {
                Err(settled) => settled,
                Ok(p) => {
                    let hash = p.hash.clone();
                    match self
                        .run_fresh(&mut *conn, &delivery, &key, &hash, p.message)
                        .await?
                    {
                        Fresh::Unclaimed(message) => {
                            let p = Prepared { message, key, hash };
                            unclaimed.push((delivery, acker, p));
                            continue;
                        }
                        Fresh::Ran(ran) => {
                            self.fresh_outcome(&mut *conn, &delivery, &key, &hash, ran)
                                .await
                        }
                    }
                }
            };
            settled.push(self.settled(acker, &key, settlement, outcome));
        }
        Ok(())
    }

    fn context<'c>(
        &'c self,
        conn: &'c mut DB::Connection,
        key: &'c str,
        attempt: u32,
        delivery: &'c Delivery,
    ) -> Context<'c, DB> {
        Context {
            conn,
            handler: &self.inner.settings.name,
            key,
            attempt,
            delivery,
            faults: self.inner.config.faults.as_deref(),
        }
    }

    /// One message in one transaction: run the handler, mark the key completed (releasing
    /// the database locks `unlock` in that statement, and then setting `unlocked`), commit.
    /// `Err` is a simulated crash.
    #[allow(clippy::too_many_arguments)]
    async fn run_in_own_transaction(
        &self,
        conn: &mut DB::Connection,
        unlock: &[i64],
        unlocked: &mut bool,
        delivery: &Delivery,
        key: &str,
        attempt: u32,
        message: H::Message,
    ) -> Result<Attempted, Crash> {
        let s = &self.inner.settings;
        let mut tx = match DB::begin_handler(conn, s.timeout).await {
            Ok(tx) => tx,
            Err(e) => return Ok(Attempted::NotBegun(e)),
        };
        let result = {
            let mut ctx = self.context(&mut tx, key, attempt, delivery);
            self.invoke(&mut ctx, message, false).await
        };
        if let Err(HandlerError {
            crash: Some(point), ..
        }) = &result
        {
            return Err(Crash(*point));
        }
        Ok(match result {
            Ok(()) => {
                self.fault(FaultPoint::BeforeCommit, key)?;
                let names = self.inner.inbox.names();
                match DB::complete(&mut tx, names, &s.name, key, attempt, s.retention, unlock).await
                {
                    Ok(true) => {
                        *unlocked = !unlock.is_empty();
                        match tx.commit().await {
                            Ok(()) => Attempted::Committed,
                            Err(e) => Attempted::commit_failed(e),
                        }
                    }
                    Ok(false) => {
                        *unlocked = !unlock.is_empty();
                        if let Err(rb) = tx.rollback().await {
                            tracing::warn!(error = %rb, "rollback failed");
                        }
                        Attempted::Overtaken
                    }
                    Err(e) => Attempted::commit_failed(e),
                }
            }
            Err(e) => {
                if let Err(rb) = tx.rollback().await {
                    tracing::warn!(error = %rb, "rollback failed");
                }
                Attempted::Failed(e)
            }
        })
    }

    /// Records a failed attempt's error in the key's row; with a `reason`, the key is dead.
    async fn record_failure(
        &self,
        conn: &mut DB::Connection,
        key: &str,
        reason: Option<DeadLetterReason>,
        error: &str,
    ) {
        let s = &self.inner.settings;
        // A dead key's as "reason: error", so a redelivery of it reports the same reason; a
        // pending key's error alone (it has no reason yet).
        let text = match reason {
            Some(reason) => format!("{}: {error}", reason.as_str()),
            None => error.to_owned(),
        };
        let dead = reason.is_some();
        let names = self.inner.inbox.names();
        if let Err(e) =
            DB::record_failure(conn, names, &s.name, key, &text, dead, s.retention).await
        {
            Stats::bump(&self.inner.stats.db_errors);
            tracing::warn!(error = %e, "could not record the failure in the inbox");
        }
    }
}

/// The commit of a handler's transaction failed: the outcome is unknown, so retry; if it did
/// commit, the redelivery is recognised as a duplicate.
#[derive(Debug, thiserror::Error)]
#[error("commit failed")]
struct CommitFailed(#[source] sqlx::Error);

/// The largest attempt number a delivery is taken to carry: what the inbox's `INTEGER`
/// columns hold. A header claiming more (a producer's, or a corrupted one) is read as this,
/// and every number derived from it saturates, so no header can overflow the arithmetic.
const MAX_ATTEMPT: u32 = i32::MAX as u32;

/// A transport's attempt number, bounded to `1..=`[`MAX_ATTEMPT`].
fn bounded_attempt(attempt: u32) -> u32 {
    attempt.clamp(1, MAX_ATTEMPT)
}

/// The number of the copy that follows attempt `n`, bounded like a delivery's: a copy is
/// never numbered above what its delivery will be read as, or that delivery would be taken
/// for a replay the copy supersedes.
fn next_attempt(n: u32) -> u32 {
    n.saturating_add(1).min(MAX_ATTEMPT)
}

fn split_reason(text: &str) -> (DeadLetterReason, &str) {
    text.split_once(": ")
        .and_then(|(r, e)| DeadLetterReason::parse(r).map(|r| (r, e)))
        .unwrap_or((DeadLetterReason::MaxAttemptsExceeded, text))
}

fn panic_message(panic: &(dyn std::any::Any + Send)) -> String {
    if let Some(s) = panic.downcast_ref::<&str>() {
        (*s).to_owned()
    } else if let Some(s) = panic.downcast_ref::<String>() {
        s.clone()
    } else {
        "non-string panic payload".to_owned()
    }
}

fn log_join(done: Result<(), tokio::task::JoinError>) {
    if let Err(e) = done {
        if e.is_panic() {
            tracing::error!(error = %e, "delivery task panicked outside the handler");
        }
    }
}
