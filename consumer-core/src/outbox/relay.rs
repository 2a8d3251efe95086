//! The relay: publishes committed outbox rows and marks them published.

use std::collections::HashSet;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use super::handle::Outbox;
use super::metrics::RelayMetrics;
use super::publisher::Publisher;
use super::wakeups::Wakeups;
use crate::inbox::{Backend, OutboxRow};
use crate::{Error, ExponentialBackoff};

/// How a [`Relay`] works. Validated by [`Relay::with_config`], which names a bad field.
#[derive(Clone)]
#[non_exhaustive]
pub struct RelayConfig {
    /// Rows taken per round (default 100).
    pub batch: u32,
    /// How often to look for rows without a wake-up (default 1 s; at least 10 ms).
    pub poll_interval: Duration,
    /// The backoff after a failed publish of a row: from `.0`, doubling, capped at `.1`
    /// (default 1 s to 5 min).
    pub backoff: (Duration, Duration),
    /// How long a published row is kept before the relay deletes it (default 24 h).
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
            batch: 100,
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
}

/// What one round of a relay did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct RelayRound {
    /// Rows taken.
    pub taken: usize,
    /// Rows published and marked.
    pub published: usize,
    /// Rows whose publish failed (counted, held back by the backoff).
    pub failed: usize,
}

/// Publishes the outbox's committed rows through a [`Publisher`]; see the [module
/// docs](crate::outbox) for what it guarantees.
pub struct Relay<DB: Backend> {
    outbox: Outbox<DB>,
    publisher: Arc<dyn Publisher>,
    config: RelayConfig,
    backoff: ExponentialBackoff,
    metrics: RelayMetrics,
}

impl<DB: Backend> std::fmt::Debug for Relay<DB> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Relay")
            .field("outbox", &self.outbox)
            .field("config", &self.config)
            .finish_non_exhaustive()
    }
}

/// The fault points of a round.
#[derive(Clone, Copy)]
enum RelayPoint {
    BeforePublish,
    AfterPublish,
}

impl<DB: Backend> Relay<DB> {
    /// A relay of `outbox` through `publisher`, with the default [`RelayConfig`].
    pub fn new(outbox: Outbox<DB>, publisher: impl Publisher) -> Self {
        let config = RelayConfig::default();
        Relay {
            backoff: backoff(&config).expect("the default backoff is valid"),
            metrics: RelayMetrics::new(&outbox.names.outbox),
            outbox,
            publisher: Arc::new(publisher),
            config,
        }
    }

    /// The same relay with `config`; a bad value fails here, naming the field.
    pub fn with_config(mut self, config: RelayConfig) -> Result<Self, Error> {
        if config.batch == 0 {
            return Err(Error::config("relay.batch", "must be at least 1"));
        }
        if config.poll_interval < Duration::from_millis(10) {
            return Err(Error::config(
                "relay.poll_interval",
                "must be at least 10ms",
            ));
        }
        if config.purge_interval.is_zero() {
            return Err(Error::config("relay.purge_interval", "must not be zero"));
        }
        if config.gauge_interval.is_zero() {
            return Err(Error::config("relay.gauge_interval", "must not be zero"));
        }
        self.backoff = backoff(&config)?;
        self.config = config;
        Ok(self)
    }

    /// Runs rounds until `shutdown` completes, waking on the database's notifications (when
    /// listening fails or its connection is lost, the relay polls and listens again after
    /// 1 s, then after waits doubling up to 30 s), this process's commits and the poll
    /// interval; deletes published rows past the retention
    /// every purge interval. A round that fails (the database is down) is logged and tried
    /// again after the poll interval. Returns once the round in progress has ended.
    pub async fn run(self, shutdown: impl Future<Output = ()>) -> Result<(), Error> {
        tokio::pin!(shutdown);
        let mut wakeups = Wakeups::new();
        let mut next_purge = tokio::time::Instant::now();
        let mut next_gauges = tokio::time::Instant::now();
        loop {
            wakeups.listen(&self.outbox).await;
            let full = match self.run_once().await {
                Ok(round) => round.taken > 0 && round.taken as u64 >= u64::from(self.config.batch),
                #[cfg(feature = "fault-injection")]
                Err(e @ Error::Crashed(_)) => return Err(e),
                Err(e) => {
                    tracing::warn!(error = %e, "outbox relay round failed");
                    false
                }
            };
            if tokio::time::Instant::now() >= next_purge {
                self.purge().await;
                next_purge = tokio::time::Instant::now() + self.config.purge_interval;
            }
            if tokio::time::Instant::now() >= next_gauges {
                match self.outbox.stats().await {
                    Ok(stats) => self.metrics.set(&stats),
                    Err(e) => tracing::debug!(error = %e, "outbox: reading the stats failed"),
                }
                next_gauges = tokio::time::Instant::now() + self.config.gauge_interval;
            }
            if full {
                // More rows are waiting: no wait, but let a shutdown in.
                if futures::poll!(&mut shutdown).is_ready() {
                    return Ok(());
                }
                continue;
            }
            tokio::select! {
                () = &mut shutdown => return Ok(()),
                () = wakeups.next() => {}
                () = self.outbox.written.notified() => {}
                () = tokio::time::sleep(self.config.poll_interval) => {}
            }
        }
    }

    /// One round: takes up to a batch of due rows, publishes them (per key one at a time,
    /// across keys at once), marks what was published and counts what failed, and commits.
    /// On PostgreSQL one transaction holds the rows from the take to the marks; on SQLite
    /// the take and the marks are transactions of their own, so the database's write lock is
    /// never held while the broker answers.
    pub async fn run_once(&self) -> Result<RelayRound, Error> {
        let mut conn = self.outbox.pool.acquire().await?;
        let mut tx = DB::outbox_begin(&mut conn).await?;
        let names = &self.outbox.names;
        let rows = DB::outbox_take(&mut tx, names, self.config.batch).await?;
        let mut round = RelayRound {
            taken: rows.len(),
            ..RelayRound::default()
        };
        if rows.is_empty() {
            tx.commit().await?;
            return Ok(round);
        }
        let held = if DB::HOLDS_ROWS_WHILE_PUBLISHING {
            Some(tx)
        } else {
            tx.commit().await?;
            None
        };
        let mut published = Vec::with_capacity(rows.len());
        let mut failed = Vec::new();
        let mut refused = 0;
        let mut remaining = rows;
        while !remaining.is_empty() {
            // One wave: the first row of each key (and every row without a key).
            let mut keys = HashSet::new();
            let (wave, later): (Vec<OutboxRow>, Vec<OutboxRow>) =
                remaining.into_iter().partition(|r| match &r.message.key {
                    Some(k) => keys.insert(k.clone()),
                    None => true,
                });
            for row in &wave {
                self.fault(RelayPoint::BeforePublish, row)?;
            }
            let results = futures::future::join_all(
                wave.iter().map(|row| self.publisher.publish(&row.message)),
            )
            .await;
            let mut stopped = HashSet::new();
            for (row, result) in wave.into_iter().zip(results) {
                match result {
                    Ok(()) => {
                        self.fault(RelayPoint::AfterPublish, &row)?;
                        published.push(row.id);
                    }
                    Err(e) => {
                        let attempts = row.attempts.saturating_add(1);
                        let id = row.message.message_id.as_deref().unwrap_or_default();
                        if e.is_refused() {
                            refused += 1;
                            tracing::error!(message_id = id, destination = %row.message.destination,
                                attempts, error = %e, "outbox: the broker refused a message; it stays in the outbox");
                        } else {
                            tracing::warn!(message_id = id, destination = %row.message.destination,
                                attempts, error = %e, "outbox: publish failed; it will be tried again");
                        }
                        if let Some(k) = &row.message.key {
                            stopped.insert(k.clone());
                        }
                        failed.push((row.id, attempts, e.to_string()));
                    }
                }
            }
            // A key whose message failed keeps its later messages back.
            remaining = later
                .into_iter()
                .filter(|r| r.message.key.as_ref().is_none_or(|k| !stopped.contains(k)))
                .collect();
        }
        match held {
            Some(mut tx) => {
                self.mark(&mut tx, &published, &failed).await?;
                tx.commit().await?;
            }
            None => {
                let mut conn = self.outbox.pool.acquire().await?;
                let mut tx = DB::outbox_begin(&mut conn).await?;
                self.mark(&mut tx, &published, &failed).await?;
                tx.commit().await?;
            }
        }
        round.published = published.len();
        round.failed = failed.len();
        self.metrics
            .round(round.published, round.failed - refused, refused);
        Ok(round)
    }

    /// Marks the rows `published`, and each `failed` one (id, attempts, error) with its
    /// error and the backoff of its attempts.
    async fn mark(
        &self,
        tx: &mut sqlx::Transaction<'_, DB>,
        published: &[i64],
        failed: &[(i64, u32, String)],
    ) -> Result<(), Error> {
        let names = &self.outbox.names;
        DB::outbox_mark_published(tx, names, published).await?;
        for (id, attempts, error) in failed {
            let delay = self.backoff.next_delay(*attempts);
            DB::outbox_mark_failed(tx, names, *id, error, delay).await?;
        }
        Ok(())
    }

    /// Deletes published rows past the retention; a failure is logged.
    async fn purge(&self) {
        let mut total = 0;
        loop {
            match DB::outbox_purge(
                &self.outbox.pool,
                &self.outbox.names,
                self.config.retention,
                1000,
            )
            .await
            {
                Ok(n) => {
                    total += n;
                    if n < 1000 {
                        break;
                    }
                }
                Err(e) => {
                    tracing::warn!(error = %e, "outbox: purging published rows failed");
                    break;
                }
            }
        }
        if total > 0 {
            tracing::debug!(rows = total, "outbox: purged published rows");
        }
    }

    #[cfg(feature = "fault-injection")]
    fn fault(&self, point: RelayPoint, row: &OutboxRow) -> Result<(), Error> {
        use crate::fault::{FaultAction, FaultPoint};
        let Some(faults) = &self.config.faults else {
            return Ok(());
        };
        let point = match point {
            RelayPoint::BeforePublish => FaultPoint::OutboxBeforePublish,
            RelayPoint::AfterPublish => FaultPoint::OutboxAfterPublish,
        };
        let id = row.message.message_id.as_deref().unwrap_or_default();
        match faults.check(point, "outbox", id) {
            None => Ok(()),
            Some(FaultAction::Abort) => {
                tracing::error!(
                    fault_point = point.as_str(),
                    message_id = id,
                    "fault point: aborting the process"
                );
                std::process::abort()
            }
            Some(FaultAction::StopWorker) => Err(Error::Crashed(point.as_str())),
        }
    }

    #[cfg(not(feature = "fault-injection"))]
    #[inline]
    fn fault(&self, _point: RelayPoint, _row: &OutboxRow) -> Result<(), Error> {
        Ok(())
    }
}

fn backoff(config: &RelayConfig) -> Result<ExponentialBackoff, Error> {
    ExponentialBackoff::new(config.backoff.0, config.backoff.1).map_err(|e| match e {
        Error::Config { reason, .. } => Error::config("relay.backoff", reason),
        other => other,
    })
}

#[cfg(test)]
mod tests {
    use futures::future::BoxFuture;
    use metrics_util::debugging::{DebugValue, DebuggingRecorder};

    use super::*;
    use crate::outbox::{OutboxMessage, PublishError};
    use crate::Inbox;

    /// Refuses every message for `nowhere`, takes the rest.
    struct Picky;

    impl Publisher for Picky {
        fn publish<'a>(&'a self, m: &'a OutboxMessage) -> BoxFuture<'a, Result<(), PublishError>> {
            let refused = m.destination == "nowhere";
            Box::pin(async move {
                if refused {
                    Err(PublishError::refused("no route"))
                } else {
                    Ok(())
                }
            })
        }
    }

    #[tokio::test]
    async fn a_relay_counts_what_it_published_and_refused_and_gauges_what_waits() {
        let dir = tempfile::tempdir().unwrap();
        let inbox = Inbox::open_sqlite(dir.path().join("inbox.db"))
            .await
            .unwrap();
        let outbox = inbox.outbox();
        let mut tx = inbox.pool().begin().await.unwrap();
        for dest in ["events", "events", "nowhere"] {
            let m = OutboxMessage::new(dest, "x");
            outbox.enqueue(&mut tx, &m).await.unwrap();
        }
        tx.commit().await.unwrap();

        let recorder = DebuggingRecorder::new();
        let snapshotter = recorder.snapshotter();
        // The handles are registered when the relay is built.
        let relay = metrics::with_local_recorder(&recorder, || Relay::new(outbox, Picky));
        // A shutdown that has already happened: one round, the purge and the gauges, then out.
        relay.run(std::future::ready(())).await.unwrap();

        let snapshot = snapshotter.snapshot().into_vec();
        let value = |name: &str, kind: Option<&str>| {
            snapshot.iter().find_map(|(key, _, _, value)| {
                let key = key.key();
                let labels_match =
                    kind.is_none_or(|k| key.labels().any(|l| l.key() == "kind" && l.value() == k));
                (key.name() == name && labels_match).then_some(value)
            })
        };
        let counter = |name, kind| match value(name, kind) {
            Some(DebugValue::Counter(n)) => *n,
            other => panic!("{name}: {other:?}"),
        };
        let gauge = |name| match value(name, None) {
            Some(DebugValue::Gauge(g)) => g.into_inner(),
            other => panic!("{name}: {other:?}"),
        };
        assert_eq!(counter("consumer_outbox_published_total", None), 2);
        assert_eq!(
            counter("consumer_outbox_publish_failures_total", Some("refused")),
            1
        );
        assert_eq!(
            counter(
                "consumer_outbox_publish_failures_total",
                Some("unavailable")
            ),
            0
        );
        assert_eq!(gauge("consumer_outbox_pending"), 1.0);
        assert_eq!(gauge("consumer_outbox_failing"), 1.0);
        assert!(gauge("consumer_outbox_oldest_pending_seconds") >= 0.0);
    }
}
