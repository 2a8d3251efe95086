//! What the layer counts through the [`metrics`] facade (the library installs no recorder).
//!
//! | metric | type | labels | what |
//! |---|---|---|---|
//! | `consumer_http_requests_total` | counter | `outcome` | requests with a key, by how they were answered: `completed` (ran, answer stored), `replayed` (the stored answer), `mismatch` (422), `in_progress` (409), `released` (ran, not stored: a 5xx, a panic, an error; the key released), `unavailable` (the store failed: 503), `invalid_key` (400), `no_caller` (401: the caller function named no caller) |
//! | `consumer_http_store_seconds` | histogram | | time to read or claim a key (the decision before a run or a replay) |
//! | `consumer_http_redis_failures_total` | counter | `op` | Redis calls that failed or timed out (the database answered alone) |
//! | `consumer_http_records_purged_total` | counter | | expired records the layer's purge deleted |

use std::time::Duration;

/// How a request with a key was answered.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Outcome {
    Completed,
    Replayed,
    Mismatch,
    InProgress,
    Released,
    Unavailable,
    InvalidKey,
    NoCaller,
}

impl Outcome {
    fn as_str(self) -> &'static str {
        match self {
            Outcome::Completed => "completed",
            Outcome::Replayed => "replayed",
            Outcome::Mismatch => "mismatch",
            Outcome::InProgress => "in_progress",
            Outcome::Released => "released",
            Outcome::Unavailable => "unavailable",
            Outcome::InvalidKey => "invalid_key",
            Outcome::NoCaller => "no_caller",
        }
    }
}

/// Counts one answered request.
pub(crate) fn answered(outcome: Outcome) {
    metrics::counter!("consumer_http_requests_total", "outcome" => outcome.as_str()).increment(1);
}

/// Records how long the decision on a key took.
pub(crate) fn decided(took: Duration) {
    metrics::histogram!("consumer_http_store_seconds").record(took.as_secs_f64());
}
