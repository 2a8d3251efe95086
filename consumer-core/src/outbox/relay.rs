//! The relay: publishes committed outbox rows and marks them published, several rounds at
//! once on PostgreSQL.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use futures::future::BoxFuture;
use futures::stream::FuturesUnordered;
use futures::StreamExt;
use tokio::sync::mpsc;
use tokio::time::Instant;

use super::config::RelayConfig;
use super::handle::Outbox;
use super::metrics::RelayMetrics;
use super::publisher::Publisher;
use super::publishing::{publish_rows, Failed, RelayPoint};
use super::schedule::{Schedule, Took};
use super::wakeups::{Rest, Wakeups};
use crate::inbox::{Backend, OutboxRow};
use crate::{Error, ExponentialBackoff};

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

/// Where round `.0` tells what its take found: once, when it is known, or (nothing) when
/// the round ends before its take did.
struct TakeReport(u64, Option<mpsc::UnboundedSender<Took>>);

impl TakeReport {
    fn send(&mut self, full: bool, held_back: bool) {
        if let Some(to) = self.1.take() {
            let round = self.0;
            let _ = to.send(Took {
                round,
                full,
                held_back,
            });
        }
    }
}

impl Drop for TakeReport {
    fn drop(&mut self) {
        self.send(false, false);
    }
}

/// How long a relay coming to rest waits for the writers that did not notify to commit
/// before it looks again (and tries to rest again).
const REST_WAIT: Duration = Duration::from_millis(200);

/// What ended in the run loop.
enum Ended {
    /// Round `.0`.
    Round(u64, Result<RelayRound, Error>),
    Chores,
}

impl<DB: Backend> Relay<DB> {
    /// A relay of `outbox` through `publisher`, with the default [`RelayConfig`].
    pub fn new(outbox: Outbox<DB>, publisher: impl Publisher) -> Self {
        let config = RelayConfig::default();
        Relay {
            backoff: config.validate().expect("the default config is valid"),
            metrics: RelayMetrics::new(&outbox.names.outbox),
            outbox,
            publisher: Arc::new(publisher),
            config,
        }
    }

    /// The same relay with `config`; a bad value fails here, naming the field.
    pub fn with_config(mut self, config: RelayConfig) -> Result<Self, Error> {
        self.backoff = config.validate()?;
        self.config = config;
        Ok(self)
    }

    /// Runs rounds until `shutdown` completes, waking on the database's notifications (when
    /// listening fails or its connection is lost, the relay polls and listens again after
    /// 1 s, then after waits doubling up to 30 s), this process's commits and the poll
    /// interval. On PostgreSQL writers notify only while a relay rests: when its rounds find
    /// nothing, the relay takes the outbox's rest lock (on a connection of its own, waiting
    /// up to 200 ms for the writers that did not notify to commit, then looking once more)
    /// and releases it when woken, so that under load commits do not serialize on
    /// PostgreSQL's notification lock. On PostgreSQL up to [`RelayConfig::rounds`] rounds run at once: a round
    /// that filled its batch lets the next one take while it waits for the broker. Deletes
    /// published rows past the retention every purge interval. A round that fails (the
    /// database is down) is logged and tried again after the poll interval. Returns once
    /// the rounds in progress have ended.
    pub async fn run(self, shutdown: impl Future<Output = ()>) -> Result<(), Error> {
        tokio::pin!(shutdown);
        let relay = &self;
        let most = if DB::HOLDS_ROWS_WHILE_PUBLISHING {
            self.config.rounds as usize
        } else {
            1
        };
        let mut wakeups = Wakeups::<DB>::new();
        let (report, mut reports) = mpsc::unbounded_channel();
        let mut work: FuturesUnordered<BoxFuture<'_, Ended>> = FuturesUnordered::new();
        let mut schedule = Schedule::new(most);
        let mut next_poll = Instant::now();
        let (mut next_purge, mut next_gauges) = (Instant::now(), Instant::now());
        let mut stopping = false;
        loop {
            if !stopping && schedule.may_begin() {
                wakeups.listen(&self.outbox).await;
                let report = TakeReport(schedule.begin(), Some(report.clone()));
                work.push(Box::pin(async move {
                    Ended::Round(report.0, relay.round(report).await)
                }));
                next_poll = Instant::now() + self.config.poll_interval;
            }
            if stopping && work.is_empty() {
                return Ok(());
            }
            if !stopping && schedule.idle() {
                match wakeups.rest(&self.outbox, REST_WAIT).await {
                    // Rows the writers that did not notify committed are due: look once more.
                    Rest::Resting | Rest::Busy => {
                        schedule.wake();
                        continue;
                    }
                    Rest::NotNow => {}
                }
            }
            let rest_retry = wakeups.rest_retry().filter(|_| schedule.idle());
            tokio::select! {
                () = &mut shutdown, if !stopping => stopping = true,
                Some(took) = reports.recv() => schedule.took(took),
                Some(ended) = work.next() => {
                    let Ended::Round(round, result) = ended else { continue };
                    schedule.ended(round);
                    match result {
                        Ok(_) => {}
                        #[cfg(feature = "fault-injection")]
                        Err(e @ Error::Crashed(_)) => return Err(e),
                        Err(e) => tracing::warn!(error = %e, "outbox relay round failed"),
                    }
                    let now = Instant::now();
                    let (purge, gauges) = (now >= next_purge, now >= next_gauges);
                    if purge || gauges {
                        if purge {
                            next_purge = now + self.config.purge_interval;
                        }
                        if gauges {
                            next_gauges = now + self.config.gauge_interval;
                        }
                        work.push(Box::pin(async move {
                            relay.chores(purge, gauges).await;
                            Ended::Chores
                        }));
                    }
                }
                () = wakeups.next(), if !stopping => {
                    wakeups.unrest(&self.outbox).await;
                    schedule.wake();
                }
                () = self.outbox.written.notified(), if !stopping => {
                    wakeups.unrest(&self.outbox).await;
                    schedule.wake();
                }
                () = tokio::time::sleep_until(next_poll), if !stopping && schedule.waits() => {
                    schedule.wake();
                }
                // The loop tries to rest again.
                () = tokio::time::sleep_until(rest_retry.unwrap_or(next_poll)),
                    if !stopping && rest_retry.is_some() => {}
            }
        }
    }

    /// One round: takes up to a batch of due rows, publishes them (per key one at a time,
    /// across keys at once), marks what was published and counts what failed, and commits.
    /// On PostgreSQL one transaction holds the rows from the take to the marks; on SQLite
    /// the take and the marks are transactions of their own, so the database's write lock is
    /// never held while the broker answers.
    pub async fn run_once(&self) -> Result<RelayRound, Error> {
        self.round(TakeReport(0, None)).await
    }

    /// [`Relay::run_once`], telling `report` what its take found as soon as it is known.
    async fn round(&self, mut report: TakeReport) -> Result<RelayRound, Error> {
        let mut conn = self.outbox.pool.acquire().await?;
        let mut tx = DB::outbox_begin(&mut conn).await?;
        let names = &self.outbox.names;
        let taken = DB::outbox_take(&mut tx, names, self.config.batch).await?;
        let rows = taken.rows;
        report.send(rows.len() >= self.config.batch as usize, taken.held_back);
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
        let fault = |point, row: &OutboxRow| self.fault(point, row);
        let published = publish_rows(&*self.publisher, rows, &fault).await?;
        match held {
            Some(mut tx) => {
                self.mark(&mut tx, &published.ids, &published.failed)
                    .await?;
                tx.commit().await?;
            }
            None => {
                let mut conn = self.outbox.pool.acquire().await?;
                let mut tx = DB::outbox_begin(&mut conn).await?;
                self.mark(&mut tx, &published.ids, &published.failed)
                    .await?;
                tx.commit().await?;
            }
        }
        round.published = published.ids.len();
        round.failed = published.failed.len();
        let refused = published.failed.iter().filter(|f| f.refused).count();
        self.metrics
            .round(round.published, round.failed - refused, refused);
        Ok(round)
    }

    /// Marks the rows `published`, and each `failed` one with its error and the backoff of
    /// its attempts.
    async fn mark(
        &self,
        tx: &mut sqlx::Transaction<'_, DB>,
        published: &[i64],
        failed: &[Failed],
    ) -> Result<(), Error> {
        let names = &self.outbox.names;
        let kept = !self.config.retention.is_zero();
        DB::outbox_settle_published(tx, names, published, kept).await?;
        for f in failed {
            let delay = self.backoff.next_delay(f.attempts);
            DB::outbox_mark_failed(tx, names, f.id, &f.error, delay).await?;
        }
        Ok(())
    }

    /// Deletes published rows past the retention (`purge`) and reads the outbox's stats into
    /// the gauges (`gauges`); a failure is logged.
    async fn chores(&self, purge: bool, gauges: bool) {
        if purge {
            self.purge().await;
        }
        if gauges {
            match self.outbox.stats().await {
                Ok(stats) => self.metrics.set(&stats),
                Err(e) => tracing::debug!(error = %e, "outbox: reading the stats failed"),
            }
        }
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
