//! What the layer counts through the [`metrics`] facade (the library installs no recorder).
//!
//! | metric | type | labels | what |
//! |---|---|---|---|
//! | `consumer_http_requests_total` | counter | `route`, `outcome` | requests with a key, by route (the method and the route's path as the router matched it, e.g. `POST /payments/{id}`; `POST unmatched` outside an axum router) and how they were answered: `completed` (ran, answer stored), `replayed` (the stored answer), `mismatch` (422), `in_progress` (409), `released` (ran, not stored: a 5xx, a panic, an error; the key released), `unavailable` (the store failed: 503), `invalid_key` (400), `no_caller` (401: the caller function named no caller) |
//! | `consumer_http_store_seconds` | histogram | `route` | time to decide on a key before a run or a replay: the read or claim, and the wait on a running request with the key |
//! | `consumer_http_redis_failures_total` | counter | `op` | Redis calls that failed or timed out (the database answered alone) |
//! | `consumer_http_records_purged_total` | counter | `table` | expired records the layer's purge deleted |
//! | `consumer_http_records` | gauge | `table`, `status` | committed records, `in_progress` (claims an earlier version of the layer committed) and `completed` (expired ones until purged), counted every `gauge_interval` |
//! | `consumer_http_oldest_in_progress_seconds` | gauge | `table` | how long this process's longest-running request with a key has run (0: none), every `gauge_interval` |

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

/// The counts of one request, under its route.
pub(crate) struct Counting {
    /// Shared, so each metric call takes a reference count rather than a copy.
    route: metrics::SharedString,
}

impl Counting {
    /// The counts of the request of `parts`: its route is the method and the path the axum
    /// router matched (a template such as `/payments/{id}`, never the request's own path,
    /// which would make a series per id), or `unmatched` without one.
    pub(crate) fn of(parts: &http::request::Parts) -> Self {
        let path = parts
            .extensions
            .get::<axum::extract::MatchedPath>()
            .map_or("unmatched", axum::extract::MatchedPath::as_str);
        let route: std::sync::Arc<str> = format!("{} {path}", parts.method).into();
        Counting {
            route: metrics::SharedString::from_shared(route),
        }
    }

    /// Counts the request answered.
    pub(crate) fn answered(&self, outcome: Outcome) {
        metrics::counter!(
            "consumer_http_requests_total",
            "route" => self.route.clone(),
            "outcome" => outcome.as_str()
        )
        .increment(1);
    }

    /// Records how long the decision on its key took.
    pub(crate) fn decided(&self, took: Duration) {
        metrics::histogram!("consumer_http_store_seconds", "route" => self.route.clone())
            .record(took.as_secs_f64());
    }
}
