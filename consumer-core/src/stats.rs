//! Counters a worker keeps, for tallies, tests and metrics.

use std::sync::atomic::{AtomicU64, Ordering};

macro_rules! counters {
    ($($(#[$doc:meta])* $name:ident),* $(,)?) => {
        /// Live counters of one worker (shared, lock-free), read through
        /// [`Stats::snapshot`]; only the worker moves them.
        #[derive(Debug, Default)]
        pub struct Stats {
            $($(#[$doc])* pub(crate) $name: AtomicU64,)*
        }

        /// A copy of [`Stats`] at one moment.
        #[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
        pub struct StatsSnapshot {
            $($(#[$doc])* pub $name: u64,)*
        }

        impl Stats {
            /// Reads every counter.
            pub fn snapshot(&self) -> StatsSnapshot {
                StatsSnapshot { $($name: self.$name.load(Ordering::Relaxed),)* }
            }
        }
    };
}

counters! {
    /// Deliveries received.
    received,
    /// Handler invocations (attempts that ran the handler; a batch function counts once per
    /// message of its batch).
    handler_runs,
    /// Deliveries whose handler committed.
    completed,
    /// Of `completed`, those that took the fresh path ([`crate::Context::fresh`]: the key
    /// claimed in the handler's transaction, no attempt counted ahead).
    fresh_completed,
    /// Deliveries acked as duplicates without running the handler.
    duplicates,
    /// Deliveries acked without running because a newer retry copy of their message was
    /// already with the broker (a replay of an attempt that failed and was retried; see
    /// [`crate::Acknowledger::copy_scope`]). No attempt is counted for them.
    superseded,
    /// Key conflicts (same key, different payload).
    conflicts,
    /// Deliveries sent back for a delayed retry.
    retries,
    /// Deliveries dead-lettered (any reason).
    dead_lettered,
    /// Of those, quarantined: attempts used up by crashes.
    quarantined,
    /// Handler panics caught.
    panics,
    /// Handler timeouts.
    timeouts,
    /// Inbox database errors outside handlers.
    db_errors,
    /// Settlements the transport failed to apply (the broker will redeliver).
    settle_errors,
    /// Batched mode: transactions that committed a batch.
    batches,
    /// Batched mode: handler runs rolled back because another message of the batch failed,
    /// or the batch function did (those messages then ran again one by one). Included in
    /// `handler_runs`.
    batch_reruns,
}

impl Stats {
    /// Adds `n` to `counter`.
    pub(crate) fn add(counter: &AtomicU64, n: u64) {
        counter.fetch_add(n, Ordering::Relaxed);
    }

    pub(crate) fn bump(counter: &AtomicU64) {
        counter.fetch_add(1, Ordering::Relaxed);
    }
}
