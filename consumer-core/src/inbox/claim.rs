//! Counting an attempt: the delivery it is for, its outcome, and the rule by which a newer
//! retry copy supersedes a delivery.

use std::time::Duration;

use super::entry::{EntryStatus, InboxEntry};

/// One delivery to count an attempt for: its key, payload hash, own attempt number and the
/// scope its retry copies go to (see [`Backend::begin_attempt`]).
#[derive(Debug, Clone)]
#[doc(hidden)]
pub struct AttemptItem<'a> {
    pub(crate) key: &'a str,
    pub(crate) hash: &'a str,
    pub(crate) attempt: u32,
    /// [`Acknowledger::copy_scope`](crate::transport::Acknowledger::copy_scope) of the delivery.
    pub(crate) scope: Option<&'a str>,
}

impl InboxEntry {
    /// Whether the newest retry copy supersedes a delivery carrying `attempt` that comes
    /// through `scope`: the copy is numbered above it, goes to the same consumers, and is
    /// not overdue by more than `grace`. The statements that count attempts apply the same
    /// rule in SQL (see `BEGIN_ATTEMPT` in the backends); this is its one statement in Rust.
    pub(crate) fn superseded(&self, attempt: u32, scope: Option<&str>, grace: Duration) -> bool {
        let grace = i64::try_from(grace.as_millis()).unwrap_or(i64::MAX);
        self.retried_to > attempt
            && scope.is_some()
            && self.retry_scope.as_deref() == scope
            && self
                .copy_due_in_ms
                .is_some_and(|due| due > grace.saturating_neg())
    }
}

/// The outcome of counting an attempt.
#[derive(Debug, Clone, PartialEq, Eq)]
#[doc(hidden)]
pub enum Claim {
    /// Run the handler; this is attempt `attempt`.
    Run {
        /// The attempt number, crashes included.
        attempt: u32,
    },
    /// Already completed with the same payload.
    Duplicate,
    /// The key exists with another payload.
    Conflict {
        /// Status of the existing row.
        status: EntryStatus,
    },
    /// Previously dead-lettered.
    Dead {
        /// Attempts counted.
        attempts: u32,
        /// Why.
        last_error: Option<String>,
    },
    /// A newer copy of the message is with the broker (its attempt number is above this
    /// delivery's), on its way to the consumers this delivery came through and not overdue
    /// (see [`InboxEntry::superseded`]): this delivery is a replay of an attempt that already
    /// failed and was retried, so it is acked without running and without counting an attempt.
    Superseded {
        /// The newer copy's attempt number.
        by: u32,
    },
    /// Attempts used up without a recorded outcome.
    Exhausted {
        /// Attempts counted.
        attempts: u32,
        /// The last recorded failure, if any.
        last_error: Option<String>,
    },
}

impl Claim {
    /// Decides from an existing row when the attempt of `item` was not counted.
    pub(crate) fn from_entry(entry: InboxEntry, item: &AttemptItem<'_>, grace: Duration) -> Claim {
        if entry.payload_hash != item.hash {
            return Claim::Conflict {
                status: entry.status,
            };
        }
        match entry.status {
            EntryStatus::Completed => Claim::Duplicate,
            EntryStatus::Dead => Claim::Dead {
                attempts: entry.attempts,
                last_error: entry.last_error,
            },
            EntryStatus::Pending if entry.superseded(item.attempt, item.scope, grace) => {
                Claim::Superseded {
                    by: entry.retried_to,
                }
            }
            EntryStatus::Pending => Claim::Exhausted {
                attempts: entry.attempts,
                last_error: entry.last_error,
            },
        }
    }
}
