//! The runtime: takes deliveries from a transport, runs the handler exactly once per key, and
//! settles each delivery only after its outcome is durable.
//!
//! Every delivery goes through one pipeline, in batches (a batch of one in the per-message
//! mode):
//!
//! 1. **prepare** ([`job`]): decode the payload and derive the key, once; a message that
//!    cannot run gets its verdict here. The inbox then judges which jobs are fresh
//!    ([`Freshness`]).
//! 2. **claim** ([`claim`]): fresh jobs claim their keys in the handler's transaction;
//!    the others (attempted before) each count their attempt first, alone, and the claim
//!    decides: run as attempt n, or settle (duplicate, conflict, dead, quarantined).
//! 3. **execute** ([`execute`]): one transaction for the group (the fresh jobs, or one job
//!    attempted before), one commit; if a handler fails in a group of several, each job
//!    runs again alone.
//! 4. **settle** ([`settle`]): failures recorded, verdicts applied through the acknowledgers
//!    (a dead letter first kept in the inbox where the transport keeps none: [`dead_letters`]).
//!    The batch's concurrency slot is free by then, unless a repeated key of it is still to
//!    run ([`slot`]): settling waits on the broker.
//!
//! A redelivered job attempted before takes its turn alone, with nothing else of the worker
//! in flight ([`turn`]). [`attempt`] computes every attempt number; [`background`] runs the
//! retention purge and the gauges; [`gather`] fills a batch; [`spare`] keeps batch buffers;
//! [`inner`] holds what the stages share (the stages' code is here for prepare and the run
//! of a batch, in `execute` and `settle` for theirs).

mod attempt;
mod background;
mod claim;
mod config;
mod dead_letters;
mod execute;
mod faults;
mod gather;
mod inner;
mod job;
mod settle;
mod slot;
mod spare;
#[cfg(test)]
mod tests;
mod turn;

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use futures::{FutureExt, StreamExt};
use tokio::sync::{watch, Semaphore};
use tokio::task::JoinSet;
use tracing::{field, Instrument};

pub use config::{BatchConfig, WorkerConfig, DEFAULT_MAX_PAYLOAD_BYTES};

use self::claim::{Claims, Decision};
use self::config::Settings;
use self::inner::{Crash, Inner};
use self::job::{Job, Verdict};
use self::settle::{settle_all, Settled};
use self::slot::Slot;
use self::spare::SpareBatches;
use crate::delivery::{DeadLetterReason, Incoming, Transport};
use crate::fault::point::FaultPoint;
use crate::handler::Handler;
use crate::inbox::{AttemptItem, Backend, IdMap, Inbox, Kept};
use crate::log_marks::Freshness;
use crate::stats::{Stats, StatsSnapshot};
use crate::Error;

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

impl<DB: Backend, H: Handler<DB>> Worker<DB, H> {
    /// A worker with the default [`WorkerConfig`]. Fails at once, naming the option, if the
    /// handler's settings are invalid.
    pub fn new(inbox: Inbox<DB>, handler: H) -> Result<Self, Error> {
        Self::with_config(inbox, handler, WorkerConfig::default())
    }

    /// A worker with `config`. Fails at once, naming the option, on an invalid setting.
    pub fn with_config(inbox: Inbox<DB>, handler: H, config: WorkerConfig) -> Result<Self, Error> {
        let settings = Settings::validate(handler.options(), &config)?;
        let name: Arc<str> = Arc::from(settings.name.as_str());
        let stats = Arc::new(Stats::new(&settings.name));
        Ok(Worker {
            inner: Arc::new(Inner {
                freshness: Freshness::new(inbox.clone(), settings.name.clone()),
                kept: Kept::new(inbox.pool.clone(), config.concurrency),
                inbox: inbox.serving(&settings.aliases),
                handler,
                settings,
                name,
                concurrency: config.concurrency,
                batch: config.batch,
                retention_interval: config.retention_interval,
                retention_batch: config.retention_batch,
                pending_retention: config.pending_retention,
                inbox_gauge_interval: config.inbox_gauge_interval,
                stats,
                turns: turn::Turns::default(),
                claims: Claims::default(),
                spare_batches: SpareBatches::new(config.concurrency),
                #[cfg(feature = "fault-injection")]
                faults: config.faults,
                #[cfg(feature = "fault-injection")]
                broken_ack_before_commit: config.broken_ack_before_commit,
            }),
        })
    }

    /// The counters now (a consistent copy of each; the counters keep moving).
    pub fn snapshot(&self) -> StatsSnapshot {
        self.inner.stats.snapshot()
    }

    /// A handle on the live counters, for a task that reports them while the worker runs.
    pub fn stats(&self) -> Arc<Stats> {
        self.inner.stats.clone()
    }

    /// The handler's stable name.
    pub fn handler_name(&self) -> &str {
        &self.inner.settings.name
    }

    /// The handler's timeout in effect: [`WorkerConfig::handler_timeout`], else the
    /// handler's own. A transport whose broker limits how long a delivery may stay unacked
    /// checks it at startup (e.g. RabbitMQ's `consumer_timeout`).
    pub fn handler_timeout(&self) -> std::time::Duration {
        self.inner.settings.timeout
    }

    /// The inbox.
    pub fn inbox(&self) -> &Inbox<DB> {
        &self.inner.inbox
    }

    /// Consumes `transport` until it ends or `shutdown` completes.
    ///
    /// On shutdown it stops taking deliveries, lets those in flight finish and settle, then
    /// drops the transport and returns `Ok`. With the `fault-injection` feature, a fault
    /// point with `FaultAction::StopWorker` drops everything in flight unsettled, as a crash
    /// would, and returns `Error::Crashed`.
    ///
    /// Before anything starts it checks the handler's key template against the one the
    /// inbox's keys under its name (and aliases) were made with, and records it: a change
    /// while such keys exist returns `Error::Config` naming the handler and both templates
    /// (see [`WorkerConfig::allow_key_template_change`]). A database that cannot serve that
    /// check just then ([`Error::is_database_unavailable`]: restarting, the session
    /// terminated, no connection slot free) is waited for, with backoff, until it can or
    /// shutdown is requested.
    pub async fn run<T: Transport>(
        &self,
        mut transport: T,
        shutdown: impl Future<Output = ()> + Send,
    ) -> Result<(), Error> {
        let shutdown = shutdown.fuse();
        futures::pin_mut!(shutdown);
        // A database that is away (restarting, the session terminated, no slot free) is
        // waited for, as the deliveries' settling waits for it; a refusal ends the run.
        let mut delay = Duration::from_millis(100);
        loop {
            match self
                .inner
                .settings
                .check_key_template(&self.inner.inbox)
                .await
            {
                Ok(()) => break,
                Err(e) if e.is_database_unavailable() => {
                    tracing::warn!(handler = %self.inner.name, error = %e, retry_in = ?delay, "database unavailable at startup; checking again");
                    tokio::select! {
                        () = tokio::time::sleep(delay) => {}
                        () = &mut shutdown => return Ok(()),
                    }
                    delay = (delay * 2).min(Duration::from_secs(5));
                }
                Err(e) => return Err(e),
            }
        }
        let permits = Arc::new(Semaphore::new(self.inner.concurrency));
        let (crash_tx, mut crash_rx) = watch::channel(None::<FaultPoint>);
        let mut tasks = JoinSet::new();
        let background = self.spawn_background();

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
                    let batching = self.inner.batch.as_ref();
                    let room = batching.map_or(1, |b| b.max_messages);
                    let mut batch = self.inner.spare_batches.take(room);
                    batch.push(incoming);
                    if let Some(b) = batching {
                        ended = gather::gather(&mut transport, &mut batch, b).await;
                        #[allow(clippy::cast_precision_loss)] // at most max_messages
                        self.inner.stats.batch_size.record(batch.len() as f64);
                    }
                    let worker = self.clone();
                    let crash_tx = crash_tx.clone();
                    tasks.spawn(async move {
                        let slot = Slot::held(permit);
                        if let Err(Crash(point)) = worker.inner.process(batch, slot).await {
                            let _ = crash_tx.send(Some(point));
                        }
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
        self.stop_background(background);
        if let Some(point) = crashed {
            tasks.abort_all();
            while tasks.join_next().await.is_some() {}
            drop(transport);
            tracing::error!(fault_point = point.as_str(), "worker crashed (simulated)");
            return Err(crashed_at(point));
        }
        drop(transport);
        Ok(())
    }
}

#[cfg(feature = "fault-injection")]
fn crashed_at(point: FaultPoint) -> Error {
    Error::Crashed(point.as_str())
}

#[cfg(not(feature = "fault-injection"))]
fn crashed_at(point: FaultPoint) -> Error {
    unreachable!("no fault point fires without fault injection ({point:?})")
}

/// The keys of a batch's jobs so far, to find a key that comes twice without copying or
/// hashing each key again: by the key's in-process lock id (see [`Job::lock_id`]), and the job
/// (its index in the batch's jobs) that has it.
struct RepeatedKeys {
    first: IdMap<usize>,
}

impl RepeatedKeys {
    /// For a batch of `jobs` jobs: the table is sized once, not grown as they come.
    fn for_batch(jobs: usize) -> Self {
        RepeatedKeys {
            first: IdMap::with_capacity_and_hasher(jobs, Default::default()),
        }
    }

    /// Whether `job`'s key is one of `jobs`' (the jobs pushed so far, `job` to be pushed next);
    /// if not, it is remembered as the key of the next job.
    fn repeated<M>(&mut self, jobs: &[Job<M>], job: &Job<M>) -> bool {
        match self.first.get(&job.lock_id) {
            Some(&i) if jobs.get(i).is_some_and(|j| j.key() == job.key()) => true,
            // Another key with the same id (rare): compare with every job.
            Some(_) => jobs.iter().any(|j| j.key() == job.key()),
            None => {
                self.first.insert(job.lock_id, jobs.len());
                false
            }
        }
    }
}

impl<DB: Backend, H: Handler<DB>> Inner<DB, H> {
    /// The pipeline over one batch (one delivery in the per-message mode): prepare, claim,
    /// execute, settle. `Err` is a simulated crash: nothing of the batch was settled. The
    /// batch holds its `slot` until its outcomes are durable (see [`Slot`]).
    async fn process(&self, batch: Vec<Incoming>, slot: Slot) -> Result<(), Crash> {
        let span = if batch.len() == 1 {
            let delivery = &batch[0].delivery;
            let span = tracing::info_span!(
                "delivery",
                otel.kind = "consumer",
                messaging.system = crate::trace::messaging_system(delivery.source.transport),
                messaging.operation.type = "process",
                messaging.message.id = delivery.message_id.as_deref(),
                handler = %self.name,
                source = %delivery.source,
                key = field::Empty,
                attempt = field::Empty,
                outcome = field::Empty,
                trace_id = field::Empty,
            );
            crate::trace::join(&span, delivery);
            span
        } else {
            let span = tracing::info_span!(
                "batch",
                otel.kind = "consumer",
                messaging.system = batch
                    .first()
                    .map(|i| crate::trace::messaging_system(i.delivery.source.transport)),
                messaging.operation.type = "process",
                messaging.batch.message_count = batch.len(),
                handler = %self.name,
                size = batch.len()
            );
            crate::trace::link(&span, batch.iter().map(|i| &i.delivery));
            span
        };
        self.stages(batch, slot).instrument(span).await
    }

    async fn stages(&self, mut batch: Vec<Incoming>, mut slot: Slot) -> Result<(), Crash> {
        let mut settled: Vec<Settled> = Vec::with_capacity(batch.len());
        let mut jobs: Vec<Job<H::Message>> = Vec::with_capacity(batch.len());
        // A key twice in one batch: the second copy goes through the pipeline (and is
        // counted as received) after the batch, and is then seen as a duplicate.
        let mut repeats = Vec::new();
        let mut seen = (batch.len() > 1).then(|| RepeatedKeys::for_batch(batch.len()));
        let lock_id = |key: &str| self.inbox.local_lock_id(&self.name, key);
        for incoming in batch.drain(..) {
            #[cfg(feature = "fault-injection")]
            let incoming = self.broken_early_ack(incoming).await;
            if let Some(past) = job::past_retention(&self.settings, &incoming.delivery) {
                self.stats.too_old.bump();
                if self.settings.dead_letter_too_old {
                    let verdict = job::too_old(&self.settings, &incoming.delivery, past);
                    let (delivery, acker) = (&incoming.delivery, incoming.acker);
                    settled.push(self.keep_dead_letter(delivery, acker, verdict));
                    continue;
                }
                tracing::warn!(?past, "a delivery older than the handler's retention runs: its key may have been purged");
            }
            match job::prepare::<H::Message>(&self.settings, incoming, lock_id) {
                Err((incoming, verdict)) => {
                    let (delivery, acker) = (&incoming.delivery, incoming.acker);
                    settled.push(self.keep_dead_letter(delivery, acker, verdict));
                }
                Ok(job) if seen.as_mut().is_some_and(|s| s.repeated(&jobs, &job)) => {
                    repeats.push(job)
                }
                Ok(job) => jobs.push(job),
            }
        }
        self.spare_batches.give_back(batch);
        // Counted once for the batch: what settles here (a repeat is counted when it goes
        // through again).
        self.stats.received.add((settled.len() + jobs.len()) as u64);
        if let [job] = jobs.as_slice() {
            tracing::Span::current().record("key", job.key());
        }
        self.freshness
            .judge(&mut jobs, |j| (&j.delivery, &mut j.fresh))
            .await;
        // Only fault injection needs the keys once the jobs have moved on.
        let fault_keys = self.fault_keys(&jobs);
        // Only the jobs attempted before move out; the fresh ones (usually all) stay put.
        let mut fresh = jobs;
        let counted: Vec<_> = fresh.extract_if(.., |j| !j.fresh).collect();
        let mut alone = Vec::new();
        self.run_group(fresh, true, &mut settled, &mut alone)
            .await?;
        // A job attempted before (redelivered after a crash, a retry copy) runs alone: its
        // attempt is counted and committed before it runs, so a crash in a group would cost
        // every member an attempt, and a message that crashes the worker would get its
        // batch-mates quarantined with it.
        for job in counted {
            self.run_group(vec![job], false, &mut settled, &mut alone)
                .await?;
        }
        // Fresh jobs whose keys had rows (a republished duplicate, say), and the jobs of a
        // statement the inbox refused, now that this batch's locks are released.
        for mut job in alone {
            job.fresh = false;
            job.attempt = job.delivery.attempt;
            self.run_group(vec![job], false, &mut settled, &mut Vec::new())
                .await?;
        }
        if let [one] = settled.as_slice() {
            tracing::Span::current().record("outcome", one.verdict.outcome.as_str());
        }
        // A fault point fires for the batch if it fires for any of its keys.
        for key in &fault_keys {
            self.fault(FaultPoint::AfterCommit, key)?;
        }
        // Settling is the broker's round trip, not the handler's work: the slot goes to the
        // next batch, unless jobs of this one are still to run after it (a repeated key).
        if repeats.is_empty() {
            slot.give_back();
        }
        let results = settle_all(settled).await;
        for (_, result) in &results {
            if let Err(e) = result {
                self.stats.settle_errors.bump();
                tracing::warn!(error = %e, "settling failed; the broker will redeliver and the inbox will deduplicate");
            }
        }
        self.count_all(results.into_iter().map(|(outcome, _)| outcome));
        for key in &fault_keys {
            self.fault(FaultPoint::AfterAck, key)?;
        }
        for job in repeats {
            Box::pin(self.stages(vec![job.into_incoming()], Slot::kept_by_caller())).await?;
        }
        Ok(())
    }

    /// Claims and executes a group of jobs that are all fresh or all counted, under one
    /// lease of their keys.
    async fn run_group(
        &self,
        mut jobs: Vec<Job<H::Message>>,
        fresh: bool,
        settled: &mut Vec<Settled>,
        alone: &mut Vec<Job<H::Message>>,
    ) -> Result<(), Crash> {
        if jobs.is_empty() {
            return Ok(());
        }
        let _turn = (self.turns)
            .take(!fresh && jobs.iter().any(|j| j.delivery.redelivered))
            .await;
        let ids = jobs.iter().map(|j| j.lock_id).collect();
        // Only counted jobs take the keys' database locks (see `locking` below).
        let db_keys: Vec<&str> = if fresh {
            Vec::new()
        } else {
            jobs.iter().map(|j| j.key()).collect()
        };
        let kept = Some(&self.kept);
        let mut lease = match self.inbox.lease_ids(&self.name, ids, &db_keys, kept).await {
            Ok(l) => l,
            Err(e) => {
                self.retry_all_after_db_error(&e, jobs, settled, alone);
                return Ok(());
            }
        };
        if !fresh {
            let claims = {
                let items: Vec<AttemptItem<'_>> = jobs
                    .iter()
                    .map(|j| AttemptItem {
                        key: j.key(),
                        hash: j.hash.as_str(),
                        attempt: j.attempt,
                        scope: j.acker.copy_scope(),
                    })
                    .collect();
                let (conn, lock_ids) = lease.locking();
                let (names, name, max) =
                    (self.inbox.names(), &self.name, self.settings.max_attempts);
                match items.as_slice() {
                    [item] => DB::begin_attempt(conn, names, name, item, max, lock_ids)
                        .await
                        .map(|c| vec![c]),
                    _ => DB::begin_attempts(conn, names, name, &items, max, lock_ids).await,
                }
            };
            let claims = match claims {
                Ok(c) => c,
                Err(e) => {
                    lease.spoil();
                    lease.release().await;
                    self.retry_all_after_db_error(&e, jobs, settled, alone);
                    return Ok(());
                }
            };
            let mut to_run = Vec::with_capacity(jobs.len());
            for (mut job, claim) in jobs.into_iter().zip(claims) {
                let on_conflict = self.settings.on_conflict;
                match claim::decide(&self.name, &job.delivery, job.key(), claim, on_conflict) {
                    Decision::Run { attempt } => {
                        job.attempt = attempt;
                        to_run.push(job);
                    }
                    Decision::Settle(verdict) => settled.push(self.settled(job, verdict)),
                    Decision::Conflict(verdict) => {
                        // Counted here: its outcome is a dead letter. A skipped conflict is
                        // counted by its outcome.
                        self.stats.conflicts.bump();
                        settled.push(self.settled(job, verdict));
                    }
                    Decision::Quarantine { attempts, error } => {
                        let reason = DeadLetterReason::Quarantined;
                        let (conn, delivery) = (lease.conn(), &job.delivery);
                        let key = job.key();
                        if let Err(verdict) = self
                            .record_failure(conn, delivery, key, Some(reason), &error)
                            .await
                        {
                            settled.push(self.settled(job, verdict));
                            continue;
                        }
                        self.stats.quarantined.bump();
                        let verdict = Verdict::dead_letter(
                            &self.name,
                            &job.delivery,
                            reason,
                            Some(job.key()),
                            attempts,
                            error,
                        );
                        settled.push(self.settled(job, verdict));
                    }
                }
            }
            jobs = to_run;
        }
        if !jobs.is_empty() {
            if fresh {
                for job in &mut jobs {
                    job.attempt = 1;
                }
            }
            self.execute(&mut lease, jobs, fresh, settled, alone)
                .await?;
        }
        lease.release().await;
        Ok(())
    }
}

fn log_join(done: Result<(), tokio::task::JoinError>) {
    if let Err(e) = done {
        if e.is_panic() {
            tracing::error!(error = %e, "delivery task panicked outside the handler");
        }
    }
}
