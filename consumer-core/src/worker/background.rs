//! The worker's background tasks beside the pipeline: the retention purge, the inbox
//! gauges, and the return of kept connections left unused.

use std::future::Future;
use std::sync::Arc;

use super::Worker;
use crate::handler::Handler;
use crate::inbox::{Backend, Kept};

impl<DB: Backend, H: Handler<DB>> Worker<DB, H> {
    /// Starts the background tasks of one run of the worker.
    pub(super) fn spawn_background(&self) -> Vec<tokio::task::JoinHandle<()>> {
        [
            self.spawn_retention(),
            self.spawn_inbox_gauges(),
            self.spawn_kept_expiry(),
        ]
        .into_iter()
        .flatten()
        .collect()
    }

    /// Stops the run's background `tasks` and gives the kept connections back to the pool.
    pub(super) fn stop_background(&self, tasks: Vec<tokio::task::JoinHandle<()>>) {
        for task in tasks {
            task.abort();
        }
        self.inner.kept.clear();
    }

    /// The task that purges expired inbox rows every [`WorkerConfig::retention_interval`](super::WorkerConfig::retention_interval),
    /// and the handler's pending rows past [`WorkerConfig::pending_retention`](super::WorkerConfig::pending_retention).
    fn spawn_retention(&self) -> Option<tokio::task::JoinHandle<()>> {
        let inbox = self.inner.inbox.inbox().clone();
        let batch = self.inner.retention_batch;
        let stats = self.inner.stats.clone();
        let pending = self.inner.pending_retention;
        let handlers: Arc<[String]> = self.inner.settings.names().into();
        every(self.inner.retention_interval?, move || {
            let (inbox, stats, handlers) = (inbox.clone(), stats.clone(), handlers.clone());
            async move {
                match inbox.purge_expired(batch).await {
                    Ok(0) => {}
                    Ok(n) => {
                        stats.purged.add(n);
                        tracing::debug!(deleted = n, "purged expired inbox rows");
                    }
                    Err(e) => tracing::warn!(error = %e, "inbox retention purge failed"),
                }
                let Some(retention) = pending else { return };
                match inbox.purge_stale_pending(&handlers, retention, batch).await {
                    Ok(0) => {}
                    Ok(n) => {
                        stats.purged_pending.add(n);
                        tracing::info!(deleted = n, "purged pending inbox rows no copy can reach");
                    }
                    Err(e) => tracing::warn!(error = %e, "pending rows' retention purge failed"),
                }
            }
        })
    }

    /// The task that sets the inbox gauges (rows by status, the stalest pending key's age)
    /// every [`WorkerConfig::inbox_gauge_interval`](super::WorkerConfig::inbox_gauge_interval).
    fn spawn_inbox_gauges(&self) -> Option<tokio::task::JoinHandle<()>> {
        let inbox = self.inner.inbox.clone();
        let stats = self.inner.stats.clone();
        every(self.inner.inbox_gauge_interval?, move || {
            let (inbox, stats) = (inbox.clone(), stats.clone());
            async move {
                match inbox.counts().await {
                    Ok(counts) => stats.inbox.set(&counts),
                    Err(e) => tracing::debug!(error = %e, "could not count the inbox's rows"),
                }
            }
        })
    }

    /// The task that gives the kept connections left unused for [`Kept::IDLE`] back to the
    /// pool, every [`Kept::IDLE`], so an idle worker holds none for long.
    fn spawn_kept_expiry(&self) -> Option<tokio::task::JoinHandle<()>> {
        let kept = self.inner.kept.clone();
        every(Kept::<DB>::IDLE, move || {
            kept.expire();
            std::future::ready(())
        })
    }
}

/// A background task running `task` every `interval`, the first time at once; a run that
/// overruns delays the next instead of bunching them.
fn every<F, Fut>(interval: std::time::Duration, task: F) -> Option<tokio::task::JoinHandle<()>>
where
    F: Fn() -> Fut + Send + 'static,
    Fut: Future<Output = ()> + Send,
{
    Some(tokio::spawn(async move {
        let mut tick = tokio::time::interval(interval);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tick.tick().await;
            task().await;
        }
    }))
}
