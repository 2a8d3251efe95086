//! The runtime's exactly-once scenario matrix, written once.
//!
//! Each scenario is an async function generic over the backend and the handler: it runs
//! workers on the in-memory broker against a [`Harness`] (an inbox, the handler, batch mode
//! or not, and reads of the effects) and asserts what the README promises. [`scenarios!`]
//! instantiates the whole matrix as tests in the calling crate ([`invalid`]'s scenarios are
//! called one by one):
//!
//! - `consumer-core`'s own tests run it on SQLite ([`sqlite_harness`],
//!   [`sqlite_bulk_harness`]), per message and batched, with no server and no broker client;
//! - the workspace tests (`tests/`) run it on PostgreSQL, whose harness needs a server and
//!   lives there.
//!
//! # Layout
//!
//! - [`env`](mod@env): server-free fixtures every test shares (unique names, waiting on a condition
//!   with a deadline, running a worker until a condition holds, a fresh SQLite file); the
//!   workspace tests re-export them.
//! - [`jobs`]: the scenarios' job, whose fields script the handler's behaviour, and its
//!   handlers for each backend, with and without a batch function.
//! - [`harness`]: what a scenario needs from a backend, the SQLite harness, and the helpers
//!   that drain a queue or a queue made to look like a log.
//! - [`invalid`]: keys the inbox database cannot hold (a NUL, longer than an index entry),
//!   with handlers of their own.
//! - [`runs`]: how often a job runs (duplicates, crashes, conflicts, panics, quarantine,
//!   freshness on a log, retries and the numbering of their copies).
//! - `http` (feature `http`): an HTTP answer read whole, for the tests of HTTP routes.
//! - [`ignored_errors`]: a handler that ignores a failed statement and returns `Ok` (which
//!   aborts a PostgreSQL transaction, not an SQLite one).
//! - [`model`]: the randomized model test: seeded jobs, duplicates, redeliveries, crashes,
//!   lost broker connections, failed commits and database faults, checked by one oracle
//!   (instantiated apart from the matrix, by [`model!`]).
//! - [`keys`]: a key's life in the inbox (guards, retention, batches, lost and overdue
//!   copies, inboxes that share no locks, dead keys released).

// Test code may panic: a panic is how a scenario fails.
#![allow(clippy::unwrap_used)]

pub mod env;
pub mod harness;
#[cfg(feature = "http")]
pub mod http;
pub mod ignored_errors;
pub mod invalid;
pub mod jobs;
pub mod keys;
pub mod model;
pub mod runs;

pub use harness::{
    sqlite_bulk_harness, sqlite_harness, sqlite_harness_with, CommitFailure, CommitFault,
    CommitFaults, DbFault, Harness, BATCHED,
};

/// Instantiates every scenario as a `#[tokio::test]` in a module named `$backend`:
/// `scenarios!(sqlite, consumer_scenarios::sqlite_harness, None)`. `$harness` is an async
/// function from the batch mode (`None`, or [`BATCHED`]) to a [`Harness`]; the calling crate
/// depends on `tokio` with its `macros` feature.
#[macro_export]
macro_rules! scenarios {
    ($backend:ident, $harness:path, $batch:expr) => {
        mod $backend {
            #[allow(unused_imports)]
            use super::*;

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn same_key_over_four_workers_runs_once() {
                $crate::runs::same_key_over_four_workers($harness($batch).await).await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn crash_between_commit_and_ack_is_skipped() {
                $crate::runs::crash_after_commit_is_skipped_on_redelivery($harness($batch).await)
                    .await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn crash_before_commit_gives_exactly_one_effect() {
                $crate::runs::crash_before_commit_gives_one_effect($harness($batch).await).await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn key_conflict_is_dead_lettered() {
                $crate::runs::key_reused_with_other_payload_is_a_conflict($harness($batch).await)
                    .await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn panic_every_time_ends_dead_lettered() {
                $crate::runs::panicking_handler_is_dead_lettered_after_max_attempts(
                    $harness($batch).await,
                )
                .await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn crash_every_time_is_quarantined() {
                $crate::runs::crash_loop_is_quarantined($harness($batch).await).await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn crash_every_time_quarantines_only_the_crashing_message() {
                $crate::runs::crash_loop_quarantines_only_its_own_message($harness($batch).await)
                    .await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn crash_every_time_on_a_log_is_quarantined() {
                $crate::runs::crash_loop_over_a_log_is_quarantined($harness($batch).await).await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn log_records_run_fresh_below_the_mark_only_once() {
                $crate::runs::log_records_are_proven_fresh($harness($batch).await).await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn transient_failures_retry_permanent_and_undecodable_do_not() {
                $crate::runs::retries_then_succeeds($harness($batch).await).await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn a_replay_of_a_retried_delivery_is_superseded_by_its_copy() {
                $crate::runs::replay_of_a_retried_delivery_is_superseded($harness($batch).await)
                    .await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn a_delivery_numbered_ahead_of_the_count_is_retried_not_superseded() {
                $crate::runs::a_delivery_numbered_ahead_of_the_count_is_retried(
                    $harness($batch).await,
                )
                .await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn flag_and_transition_guards_win_once() {
                $crate::keys::guards_are_won_once($harness($batch).await).await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn many_distinct_jobs_with_failures_and_duplicates_each_once() {
                $crate::keys::many_distinct_jobs_each_once($harness($batch).await).await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn a_copy_that_can_no_longer_arrive_does_not_supersede() {
                $crate::keys::a_copy_that_can_no_longer_arrive_does_not_supersede(
                    $harness($batch).await,
                )
                .await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn an_overdue_copy_does_not_supersede() {
                $crate::keys::an_overdue_copy_does_not_supersede($harness($batch).await).await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn two_inboxes_that_share_no_locks_complete_a_key_once() {
                $crate::keys::two_inboxes_that_share_no_locks_complete_a_key_once(
                    $harness($batch).await,
                )
                .await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn a_released_dead_key_runs_again() {
                $crate::keys::a_released_dead_key_runs_again($harness($batch).await).await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn dead_rows_expire_after_retention() {
                $crate::keys::dead_rows_expire_after_retention($harness($batch).await).await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn an_attempt_number_at_u32_max_is_bounded() {
                $crate::keys::an_attempt_number_at_u32_max_is_bounded($harness($batch).await).await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn a_handler_that_ignores_a_failed_statement_loses_nothing() {
                $crate::ignored_errors::a_handler_that_ignores_a_failed_statement_loses_nothing(
                    $harness($batch).await,
                )
                .await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn expired_inbox_rows_are_cleaned_up() {
                $crate::keys::expired_rows_are_purged($harness($batch).await).await;
            }
        }
    };
}

/// Instantiates the model test ([`model`]) as `#[tokio::test]`s, per message and batched,
/// in a module named `$backend`: `model!(sqlite, consumer_scenarios::sqlite_harness)`.
#[macro_export]
macro_rules! model {
    ($backend:ident, $harness:path) => {
        mod $backend {
            #[allow(unused_imports)]
            use super::*;

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn the_model_holds_per_message() {
                $crate::model::the_model_holds_for_every_seed($harness(None).await).await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn the_model_holds_batched() {
                $crate::model::the_model_holds_for_every_seed($harness($crate::BATCHED).await)
                    .await;
            }
        }
    };
}
