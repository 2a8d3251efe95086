//! The counts a worker keeps: each one has one owner, a `Count`, which is read in process
//! ([`Stats::snapshot`]) and exported through the [`metrics`] facade under the name and
//! labels of the table below (the crate doc's "Metrics" section lists every metric).
//!
//! The library never installs a recorder. Without one, the facade's handles do nothing; with
//! one (a Prometheus exporter, say) installed **before** the worker is built, every count is
//! exported, labelled with the handler's name. Handles are registered once per worker, so a
//! count costs an atomic add in process and whatever the recorder's handle costs.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use metrics::{Counter, Histogram};

use crate::delivery::DeadLetterReason;

/// One count: the in-process tally and the exported counter it feeds.
#[derive(Debug)]
pub(crate) struct Count {
    value: AtomicU64,
    metric: Counter,
}

impl Count {
    fn new(metric: Counter) -> Self {
        Count {
            value: AtomicU64::new(0),
            metric,
        }
    }

    /// Adds one.
    pub(crate) fn bump(&self) {
        self.add(1);
    }

    /// Adds `n`.
    pub(crate) fn add(&self, n: u64) {
        self.value.fetch_add(n, Ordering::Relaxed);
        self.metric.increment(n);
    }

    fn get(&self) -> u64 {
        self.value.load(Ordering::Relaxed)
    }
}

/// The name of the counter family of settled deliveries, by `outcome`.
pub(crate) const DELIVERIES: &str = "consumer_deliveries_total";

macro_rules! counters {
    ($($(#[$doc:meta])* $name:ident => $metric:tt),* $(,)?) => {
        /// Live counters of one worker (shared, lock-free), read through
        /// [`Stats::snapshot`]; only the worker moves them. Each is also exported through
        /// the `metrics` facade (see the crate doc's "Metrics" section).
        #[derive(Debug)]
        pub struct Stats {
            $($(#[$doc])* pub(crate) $name: Count,)*
            /// Dead letters by reason, in [`DeadLetterReason::ALL`]'s order (their sum is `dead_lettered`).
            dead_letters: Vec<Counter>,
            /// Seconds a handler run took (a batch function's run counts once).
            pub(crate) handler_duration: Histogram,
            /// Deliveries a batched worker took together.
            pub(crate) batch_size: Histogram,
            /// The handler's inbox rows, set by the worker's gauge task.
            pub(crate) inbox: InboxGauges,
        }

        /// A copy of [`Stats`] at one moment.
        #[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
        pub struct StatsSnapshot {
            $($(#[$doc])* pub $name: u64,)*
        }

        impl Stats {
            /// The counters of the handler `handler`, registered with the installed
            /// recorder (if any) under that label.
            pub fn new(handler: &str) -> Self {
                let handler = handler.to_owned();
                Stats {
                    $($name: Count::new(counters!(@metric handler, $metric)),)*
                    dead_letters: DeadLetterReason::ALL
                        .iter()
                        .map(|r| {
                            metrics::counter!(
                                DELIVERIES,
                                "handler" => handler.clone(),
                                "outcome" => "dead_lettered",
                                "reason" => r.as_str(),
                            )
                        })
                        .collect(),
                    handler_duration: metrics::histogram!(
                        "consumer_handler_duration_seconds",
                        "handler" => handler.clone(),
                    ),
                    batch_size: metrics::histogram!(
                        "consumer_batch_size",
                        "handler" => handler.clone(),
                    ),
                    inbox: InboxGauges::new(&handler),
                }
            }

            /// Reads every counter.
            pub fn snapshot(&self) -> StatsSnapshot {
                StatsSnapshot { $($name: self.$name.get(),)* }
            }
        }
    };
    (@metric $handler:ident, none) => { Counter::noop() };
    (@metric $handler:ident, ($family:expr, $outcome:literal)) => {
        metrics::counter!($family, "handler" => $handler.clone(), "outcome" => $outcome)
    };
    (@metric $handler:ident, $name:literal) => {
        metrics::counter!($name, "handler" => $handler.clone())
    };
}

counters! {
    /// Deliveries received.
    received => "consumer_received_total",
    /// Handler invocations (attempts that ran the handler; a batch function counts once per
    /// message of its batch).
    handler_runs => "consumer_handler_runs_total",
    /// Deliveries whose handler committed.
    completed => (DELIVERIES, "completed"),
    /// Of `completed`, those that took the fresh path ([`crate::Context::fresh`]: the key
    /// claimed in the handler's transaction, no attempt counted ahead).
    fresh_completed => "consumer_fresh_completed_total",
    /// Deliveries acked as duplicates without running the handler.
    duplicates => (DELIVERIES, "duplicate"),
    /// Deliveries acked without running because a newer retry copy of their message was
    /// already with the broker (a replay of an attempt that failed and was retried; see
    /// [`crate::transport::Acknowledger::copy_scope`]). No attempt is counted for them.
    superseded => (DELIVERIES, "superseded"),
    /// Key conflicts (same key, different payload), dead-lettered or skipped.
    conflicts => "consumer_conflicts_total",
    /// Of `conflicts`, those acked without running ([`crate::ConflictPolicy`]).
    conflicts_skipped => (DELIVERIES, "conflict_skipped"),
    /// Deliveries sent back for a delayed retry.
    retries => (DELIVERIES, "retried"),
    /// Deliveries dead-lettered (any reason; exported by reason).
    dead_lettered => none,
    /// Of those, quarantined: attempts used up by crashes (exported as the dead letters of
    /// reason `quarantined`).
    quarantined => none,
    /// Deliveries older than the handler's retention (their key may have been purged):
    /// run, or dead-lettered `too_old` ([`crate::WorkerConfig::dead_letter_too_old`]).
    too_old => "consumer_too_old_total",
    /// Handler panics caught.
    panics => "consumer_handler_panics_total",
    /// Handler timeouts.
    timeouts => "consumer_handler_timeouts_total",
    /// Inbox database errors outside handlers.
    db_errors => "consumer_db_errors_total",
    /// Settlements the transport failed to apply (the broker will redeliver).
    settle_errors => "consumer_settle_errors_total",
    /// Batched mode: transactions that committed a batch.
    batches => "consumer_batches_total",
    /// Batched mode: handler runs rolled back because another message of the batch failed,
    /// or the batch function did (those messages then ran again one by one). Included in
    /// `handler_runs`.
    batch_reruns => "consumer_batch_reruns_total",
    /// Expired inbox rows the worker's retention task deleted.
    purged => "consumer_inbox_purged_total",
    /// Pending inbox rows the worker's retention task deleted: no copy of their message
    /// could still arrive (see `WorkerConfig::pending_retention`).
    purged_pending => "consumer_inbox_pending_purged_total",
}

impl Stats {
    /// Counts a dead letter of `reason`.
    pub(crate) fn dead_letter(&self, reason: DeadLetterReason) {
        self.dead_lettered.value.fetch_add(1, Ordering::Relaxed);
        if let Some(i) = DeadLetterReason::ALL.iter().position(|r| *r == reason) {
            self.dead_letters[i].increment(1);
        }
    }

    /// Records how long a handler run took.
    pub(crate) fn handler_ran(&self, took: Duration) {
        self.handler_duration.record(took.as_secs_f64());
    }
}

/// The gauges of a handler's inbox rows, set by the worker's gauge task.
#[derive(Debug)]
pub(crate) struct InboxGauges {
    pending: metrics::Gauge,
    completed: metrics::Gauge,
    dead: metrics::Gauge,
    stalest_pending: metrics::Gauge,
}

impl InboxGauges {
    /// The gauges of `handler`'s rows.
    pub(crate) fn new(handler: &str) -> Self {
        let keys = |status: &'static str| metrics::gauge!("consumer_inbox_keys", "handler" => handler.to_owned(), "status" => status);
        InboxGauges {
            pending: keys("pending"),
            completed: keys("completed"),
            dead: keys("dead"),
            stalest_pending: metrics::gauge!(
                "consumer_inbox_stalest_pending_seconds",
                "handler" => handler.to_owned(),
            ),
        }
    }

    /// Sets the gauges from `counts`.
    pub(crate) fn set(&self, counts: &crate::inbox::InboxCounts) {
        // Row counts far below 2^53: exact as f64.
        #[allow(clippy::cast_precision_loss)]
        {
            self.pending.set(counts.pending as f64);
            self.completed.set(counts.completed as f64);
            self.dead.set(counts.dead as f64);
        }
        self.stalest_pending
            .set(counts.stalest_pending.map_or(0.0, |d| d.as_secs_f64()));
    }
}
