//! The runtime: takes deliveries from a transport, runs the handler exactly once per key, and
//! settles each delivery only after its outcome is durable.
//!
//! This file is the worker's public face: [`Worker`], its construction and its run loop,
//! which takes deliveries (filling a batch: [`gather`]) and hands each batch to the
//! [`pipeline`] under one of the concurrency slots ([`slot`]). Every delivery goes through
//! that one pipeline, in batches (a batch of one in the per-message mode):
//!
//! 1. **prepare** ([`job`]): decode the payload and derive the key, once; a message that
//!    cannot run gets its verdict here. The inbox then judges which jobs are fresh
//!    ([`Freshness`]).
//! 2. **claim** ([`claim`]): fresh jobs claim their keys in the handler's transaction;
//!    the others (attempted before) each count their attempt first, alone, and the claim
//!    decides: run as attempt n, or settle (duplicate, conflict, dead, quarantined).
//! 3. **execute** ([`execute`]): one transaction for the group (the fresh jobs, or one job
//!    attempted before), one commit; if a handler fails in a group of several, each job
//!    runs again alone. How each attempt ended becomes a verdict ([`verdict`]: failures
//!    recorded, retry or dead letter).
//! 4. **settle** ([`settle`]): verdicts applied through the acknowledgers (a dead letter
//!    first kept in the inbox where the transport keeps none: [`dead_letters`]).
//!    The batch's concurrency slot is free by then, unless a repeated key of it is still to
//!    run ([`slot`]): settling waits on the broker.
//!
//! A redelivered job attempted before takes its turn alone, with nothing else of the worker
//! in flight ([`turn`]). [`attempt`] computes every attempt number; [`background`] runs the
//! retention purge and the gauges; [`spare`] keeps batch buffers; [`inner`] holds what the
//! stages share (the stages' code is in `pipeline` for prepare and the run of a batch, in
//! `execute`, `verdict` and `settle` for theirs).
//!
//! The worker reaches the database only through the handler's inbox, a [`HandlerInbox`]: it
//! holds the table names, the handler's name, its retention, attempt budget and timeout, so
//! each call passes only what varies (the connection, the keys, their hashes or attempts),
//! and it picks an operation's one-row or many-row statement by the number of items. What is
//! not the handler's alone (the dead-letter table, the retention purge, the outbox relays'
//! wake-up) goes through the whole [`Inbox`] it holds. The log marks that prove a job fresh
//! are [`Freshness`]'s.

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
mod pipeline;
mod settle;
mod slot;
mod spare;
#[cfg(test)]
mod tests;
mod turn;
mod verdict;

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use futures::{FutureExt, StreamExt};
use tokio::sync::{watch, Semaphore};
use tokio::task::JoinSet;

pub use config::{BatchConfig, WorkerConfig};

use self::claim::Claims;
use self::config::Settings;
use self::inner::{Crash, Inner};
use self::slot::Slot;
use self::spare::SpareBatches;
use crate::delivery::Transport;
use crate::fault::point::FaultPoint;
use crate::handler::Handler;
use crate::inbox::{Backend, HandlerInbox, Inbox, Kept};
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
        let handler_inbox = HandlerInbox::new(
            inbox.serving(&settings.aliases),
            Arc::from(settings.name.as_str()),
            settings.retention,
            settings.max_attempts,
            settings.timeout,
        );
        let stats = Arc::new(Stats::new(&settings.name));
        Ok(Worker {
            inner: Arc::new(Inner {
                freshness: Freshness::new(inbox.clone(), settings.name.clone()),
                kept: Kept::new(inbox.pool.clone(), config.concurrency),
                inbox: handler_inbox,
                handler,
                settings,
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
        self.inner.inbox.inbox()
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
                .check_key_template(self.inner.inbox.inbox())
                .await
            {
                Ok(()) => break,
                Err(e) if e.is_database_unavailable() => {
                    tracing::warn!(handler = %self.inner.inbox.name(), error = %e, retry_in = ?delay, "database unavailable at startup; checking again");
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

fn log_join(done: Result<(), tokio::task::JoinError>) {
    if let Err(e) = done {
        if e.is_panic() {
            tracing::error!(error = %e, "delivery task panicked outside the handler");
        }
    }
}
