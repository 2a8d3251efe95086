//! The layer's background task, started by its first request and ended once the layer is
//! gone: it purges expired records every
//! [`purge_interval`](crate::IdempotencyConfigBuilder::purge_interval) and sets the gauges
//! every [`gauge_interval`](crate::IdempotencyConfigBuilder::gauge_interval).

use std::sync::atomic::Ordering;
use std::sync::{Arc, Weak};
use std::time::Duration;

use tokio::time::{interval, Interval, MissedTickBehavior};

use crate::config::PURGE_BATCH;
use crate::flow::Shared;
use crate::store::StoreBackend;

impl<DB: StoreBackend> Shared<DB> {
    /// Starts the background task, once for the layer and all its clones, if a tokio
    /// runtime runs this (a request's service call does).
    pub(crate) fn start_housekeeping(self: &Arc<Self>) {
        if self.housekeeping.load(Ordering::Relaxed)
            || self.housekeeping.swap(true, Ordering::SeqCst)
        {
            return;
        }
        match tokio::runtime::Handle::try_current() {
            Ok(runtime) => {
                let purge = self.config.purge_interval().map(every);
                let gauges = every(self.config.gauge_interval);
                runtime.spawn(housekeeping(Arc::downgrade(self), purge, gauges));
            }
            Err(_) => self.housekeeping.store(false, Ordering::SeqCst),
        }
    }

    /// Deletes the expired records and counts them (`consumer_http_records_purged_total`),
    /// and the finished operations past their keep (`consumer_http_operations_purged_total`).
    /// A failure is logged and tried again next time.
    async fn purge(&self) {
        let table = self.store.table();
        let records = self.store.purge_expired(PURGE_BATCH).await;
        purged(
            records,
            "consumer_http_records_purged_total",
            table,
            "expired idempotency records",
        );
        let operations = self.store.operations().purge_finished(PURGE_BATCH).await;
        purged(
            operations,
            "consumer_http_operations_purged_total",
            table,
            "finished operations",
        );
    }

    /// Sets the gauges: the records by status (`consumer_http_records`), and how long the
    /// longest-running request of this process has held its key
    /// (`consumer_http_oldest_in_progress_seconds`, 0 when none runs).
    async fn set_gauges(&self) {
        let table = self.store.table().to_owned();
        let oldest = self.held.oldest().unwrap_or_default();
        metrics::gauge!("consumer_http_oldest_in_progress_seconds", "table" => table.clone())
            .set(oldest.as_secs_f64());
        match self.store.counts().await {
            Ok(counts) => {
                // Counts far below 2^53.
                #[allow(clippy::cast_precision_loss)]
                for (status, n) in [
                    ("in_progress", counts.in_progress),
                    ("completed", counts.completed),
                ] {
                    metrics::gauge!("consumer_http_records", "table" => table.clone(), "status" => status)
                        .set(n as f64);
                }
            }
            Err(e) => tracing::debug!(error = %e, "counting idempotency records failed"),
        }
    }
}

/// Counts and logs what a purge of `what` deleted, under `counter`; logs its failure.
fn purged(result: Result<u64, crate::Error>, counter: &'static str, table: &str, what: &str) {
    match result {
        Ok(0) => {}
        Ok(n) => {
            tracing::info!(n, "purged {what}");
            metrics::counter!(counter, "table" => table.to_owned()).increment(n);
        }
        Err(e) => tracing::warn!(error = %e, "purging {what} failed"),
    }
}

/// An interval whose first tick is at once, and which skips ticks it missed.
fn every(period: Duration) -> Interval {
    let mut tick = interval(period);
    tick.set_missed_tick_behavior(MissedTickBehavior::Delay);
    tick
}

/// Purges on `purge`'s ticks (never without it) and sets the gauges on `gauges`', while
/// the layer lives.
async fn housekeeping<DB: StoreBackend>(
    shared: Weak<Shared<DB>>,
    mut purge: Option<Interval>,
    mut gauges: Interval,
) {
    loop {
        let purging = async {
            match purge.as_mut() {
                Some(tick) => tick.tick().await,
                None => std::future::pending().await,
            }
        };
        let job = tokio::select! {
            _ = purging => Job::Purge,
            _ = gauges.tick() => Job::Gauges,
        };
        // The layer's handle only while a job runs: dropping the layer ends the task.
        let Some(shared) = shared.upgrade() else {
            return;
        };
        match job {
            Job::Purge => shared.purge().await,
            Job::Gauges => shared.set_gauges().await,
        }
    }
}

/// What a tick of the background task does.
enum Job {
    Purge,
    Gauges,
}
