//! [`RelayConfig`]: how a [`Relay`](super::Relay) works.

use std::time::Duration;

#[cfg(feature = "fault-injection")]
use std::sync::Arc;

use crate::{Error, ExponentialBackoff};

/// How a [`Relay`](super::Relay) works. Validated by
/// [`Relay::with_config`](super::Relay::with_config), which names a bad field.
#[derive(Clone)]
#[non_exhaustive]
pub struct RelayConfig {
    /// Rows taken per round (default 500).
    pub batch: u32,
    /// Rounds in progress at once (default 2; at least 1): the next round takes while the
    /// rounds before it wait for their confirms, so at most `rounds × batch` rows are in
    /// flight. Each round holds a connection of the pool from its take to its commit. More
    /// than two did not publish faster in the bench and slowed the takes down (each skips
    /// the rows the others hold). On SQLite, where a round's take and marks are transactions
    /// of their own, one round runs at a time, whatever this says.
    pub rounds: u32,
    /// How often to look for rows without a wake-up (default 1 s; at least 10 ms).
    pub poll_interval: Duration,
    /// The backoff after a failed publish of a row: from `.0`, doubling, capped at `.1`
    /// (default 1 s to 5 min).
    pub backoff: (Duration, Duration),
    /// How long a published row is kept before the relay deletes it (default 24 h), for an
    /// operator to see what went out. Zero: the round that publishes a row deletes it in its
    /// transaction instead of marking it, which costs the database less per row (no new row
    /// version, no index entries) and leaves the table holding only what is still to go.
    pub retention: Duration,
    /// How often the relay deletes published rows past their retention (default 1 min).
    pub purge_interval: Duration,
    /// How often the relay reads the outbox's stats into its gauges (default 30 s).
    pub gauge_interval: Duration,
    /// Fault points for the chaos suite and the tests: `outbox_before_publish` and
    /// `outbox_after_publish`, checked with the row's message id as the key. Only with the
    /// `fault-injection` feature.
    #[cfg(feature = "fault-injection")]
    pub faults: Option<Arc<dyn crate::fault::FaultInjector>>,
}

impl Default for RelayConfig {
    fn default() -> Self {
        RelayConfig {
            batch: 500,
            rounds: 2,
            poll_interval: Duration::from_secs(1),
            backoff: (Duration::from_secs(1), Duration::from_secs(300)),
            retention: Duration::from_secs(24 * 3600),
            purge_interval: Duration::from_secs(60),
            gauge_interval: Duration::from_secs(30),
            #[cfg(feature = "fault-injection")]
            faults: None,
        }
    }
}

impl std::fmt::Debug for RelayConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let mut d = f.debug_struct("RelayConfig");
        d.field("batch", &self.batch)
            .field("rounds", &self.rounds)
            .field("poll_interval", &self.poll_interval)
            .field("backoff", &self.backoff)
            .field("retention", &self.retention)
            .field("purge_interval", &self.purge_interval)
            .field("gauge_interval", &self.gauge_interval);
        #[cfg(feature = "fault-injection")]
        d.field("faults", &self.faults.is_some());
        d.finish()
    }
}

impl RelayConfig {
    /// Sets [`RelayConfig::batch`].
    pub fn with_batch(mut self, batch: u32) -> Self {
        self.batch = batch;
        self
    }

    /// Sets [`RelayConfig::rounds`].
    pub fn with_rounds(mut self, rounds: u32) -> Self {
        self.rounds = rounds;
        self
    }

    /// Sets [`RelayConfig::poll_interval`].
    pub fn with_poll_interval(mut self, interval: Duration) -> Self {
        self.poll_interval = interval;
        self
    }

    /// Sets [`RelayConfig::backoff`].
    pub fn with_backoff(mut self, base: Duration, cap: Duration) -> Self {
        self.backoff = (base, cap);
        self
    }

    /// Sets [`RelayConfig::retention`].
    pub fn with_retention(mut self, retention: Duration) -> Self {
        self.retention = retention;
        self
    }

    /// Sets [`RelayConfig::faults`].
    #[cfg(feature = "fault-injection")]
    pub fn with_faults(mut self, faults: Arc<dyn crate::fault::FaultInjector>) -> Self {
        self.faults = Some(faults);
        self
    }

    /// Checks every field, naming a bad one; the backoff it describes.
    pub(super) fn validate(&self) -> Result<ExponentialBackoff, Error> {
        if self.batch == 0 {
            return Err(Error::config("relay.batch", "must be at least 1"));
        }
        if self.rounds == 0 {
            return Err(Error::config("relay.rounds", "must be at least 1"));
        }
        if self.poll_interval < Duration::from_millis(10) {
            return Err(Error::config(
                "relay.poll_interval",
                "must be at least 10ms",
            ));
        }
        if self.purge_interval.is_zero() {
            return Err(Error::config("relay.purge_interval", "must not be zero"));
        }
        if self.gauge_interval.is_zero() {
            return Err(Error::config("relay.gauge_interval", "must not be zero"));
        }
        ExponentialBackoff::new(self.backoff.0, self.backoff.1).map_err(|e| match e {
            Error::Config { reason, .. } => Error::config("relay.backoff", reason),
            other => other,
        })
    }
}
