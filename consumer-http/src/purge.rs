//! The layer's own purge of expired records: a task started by the layer's first request,
//! which deletes them every [`IdempotencyConfig::purge_interval`](crate::config::IdempotencyConfig)
//! and ends once the layer is gone.

use std::sync::atomic::Ordering;
use std::sync::{Arc, Weak};
use std::time::Duration;

use crate::config::PURGE_BATCH;
use crate::flow::Shared;
use crate::store::StoreBackend;

impl<DB: StoreBackend> Shared<DB> {
    /// Starts the purge, once for the layer and all its clones, if it is configured and a
    /// tokio runtime runs this (a request's service call does).
    pub(crate) fn start_purge(self: &Arc<Self>) {
        let Some(every) = self.config.purge_interval() else {
            return;
        };
        if self.purge_started.load(Ordering::Relaxed)
            || self.purge_started.swap(true, Ordering::SeqCst)
        {
            return;
        }
        match tokio::runtime::Handle::try_current() {
            Ok(runtime) => {
                runtime.spawn(purge_every(Arc::downgrade(self), every));
            }
            Err(_) => self.purge_started.store(false, Ordering::SeqCst),
        }
    }
}

/// Deletes the expired records every `every` while the layer lives, and counts them
/// (`consumer_http_records_purged_total`). A failure is logged and tried again next time.
async fn purge_every<DB: StoreBackend>(shared: Weak<Shared<DB>>, every: Duration) {
    let mut tick = tokio::time::interval(every);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        // The layer's handle only while a purge runs: dropping the layer ends the task.
        let Some(shared) = shared.upgrade() else {
            return;
        };
        match shared.store.purge_expired(PURGE_BATCH).await {
            Ok(0) => {}
            Ok(n) => {
                tracing::info!(n, "purged expired idempotency records");
                metrics::counter!("consumer_http_records_purged_total").increment(n);
            }
            Err(e) => tracing::warn!(error = %e, "purging expired idempotency records failed"),
        }
    }
}
