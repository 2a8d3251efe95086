//! What the inbox holds: an entry's status and columns, and a handler's counts by status.

use std::time::Duration;

/// The state of one key in the inbox.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EntryStatus {
    /// Seen, not completed (in flight, failed, or crashed).
    Pending,
    /// Completed: later deliveries are duplicates.
    Completed,
    /// Dead-lettered.
    Dead,
}

impl EntryStatus {
    pub(super) fn parse(s: &str) -> Self {
        match s {
            "completed" => EntryStatus::Completed,
            "dead" => EntryStatus::Dead,
            _ => EntryStatus::Pending,
        }
    }
}

/// One inbox row, for operators and tests.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct InboxEntry {
    /// Status.
    pub status: EntryStatus,
    /// Attempts counted (crashed ones included).
    pub attempts: u32,
    /// SHA-256 of the canonical payload first seen with this key.
    pub payload_hash: String,
    /// The last failure, if any.
    pub last_error: Option<String>,
    /// The highest attempt number of a retry copy of the message that its broker confirmed
    /// (0: none). While the key is pending, a delivery with a lower number is superseded by
    /// that copy (acked without running), if it comes through the same consumers
    /// ([`InboxEntry::retry_scope`]) before the copy is overdue.
    pub retried_to: u32,
    /// Where that copy went: the consumers that will read it
    /// ([`Acknowledger::copy_scope`](crate::transport::Acknowledger::copy_scope)).
    pub retry_scope: Option<String>,
    /// Milliseconds until that copy is due, by the database's clock (negative once it is
    /// overdue); `None` without a recorded copy.
    pub copy_due_in_ms: Option<i64>,
}

/// A handler's keys by status (see [`Inbox::counts`](crate::Inbox::counts)).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct InboxCounts {
    /// Seen, not completed.
    pub pending: u64,
    /// Completed, not yet expired.
    pub completed: u64,
    /// Dead-lettered, not yet expired or released.
    pub dead: u64,
    /// How long ago the stalest pending key last saw an attempt, by the database's clock.
    pub stalest_pending: Option<Duration>,
}

impl InboxCounts {
    /// From (status, count, idle milliseconds of the stalest row) rows.
    pub(super) fn from_rows(rows: impl IntoIterator<Item = (String, i64, Option<i64>)>) -> Self {
        let mut counts = InboxCounts::default();
        for (status, n, idle_ms) in rows {
            let n = u64::try_from(n).unwrap_or(0);
            match EntryStatus::parse(&status) {
                EntryStatus::Pending => {
                    counts.pending += n;
                    counts.stalest_pending =
                        idle_ms.map(|ms| Duration::from_millis(u64::try_from(ms).unwrap_or(0)));
                }
                EntryStatus::Completed => counts.completed += n,
                EntryStatus::Dead => counts.dead += n,
            }
        }
        counts
    }
}
