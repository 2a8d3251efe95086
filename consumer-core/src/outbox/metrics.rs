//! The relay's metrics: what it published and failed to publish, and the rows waiting.

use crate::inbox::OutboxStats;

/// The relay's handles, registered when it is built (see the crate doc's metrics table).
pub(crate) struct RelayMetrics {
    published: metrics::Counter,
    unavailable: metrics::Counter,
    refused: metrics::Counter,
    pending: metrics::Gauge,
    failing: metrics::Gauge,
    oldest_pending: metrics::Gauge,
}

impl RelayMetrics {
    /// The handles of the outbox `table` (its qualified name, unquoted: one label value per
    /// table).
    pub(crate) fn new(table: &str) -> Self {
        let table = table.replace('"', "");
        let failures = |kind: &'static str| metrics::counter!("consumer_outbox_publish_failures_total", "outbox" => table.clone(), "kind" => kind);
        RelayMetrics {
            published: metrics::counter!("consumer_outbox_published_total", "outbox" => table.clone()),
            unavailable: failures("unavailable"),
            refused: failures("refused"),
            pending: metrics::gauge!("consumer_outbox_pending", "outbox" => table.clone()),
            failing: metrics::gauge!("consumer_outbox_failing", "outbox" => table.clone()),
            oldest_pending: metrics::gauge!("consumer_outbox_oldest_pending_seconds", "outbox" => table),
        }
    }

    /// Counts a round's outcome.
    pub(crate) fn round(&self, published: usize, unavailable: usize, refused: usize) {
        self.published.increment(published as u64);
        self.unavailable.increment(unavailable as u64);
        self.refused.increment(refused as u64);
    }

    /// Sets the gauges from `stats`.
    pub(crate) fn set(&self, stats: &OutboxStats) {
        // Row counts far below 2^53: exact as f64.
        #[allow(clippy::cast_precision_loss)]
        {
            self.pending.set(stats.pending as f64);
            self.failing.set(stats.failing as f64);
        }
        self.oldest_pending
            .set(stats.oldest_pending.map_or(0.0, |d| d.as_secs_f64()));
    }
}
