//! The verdicts: how an attempt ended becomes how its delivery is settled. A committed
//! group is acked as completed ([`Inner::committed`]); an attempt that did not commit
//! ([`Attempted`]) is retried after backoff or dead-lettered, its failure recorded in the
//! inbox first ([`Inner::conclude`]); a job the inbox could not serve is retried without
//! counting an attempt ([`Inner::retry_after_db_error`]). [`super::settle`] applies them.

use std::sync::Arc;

use super::attempt::{self, AfterFailure};
use super::claim::dead_text;
use super::inner::Inner;
use super::job::{Job, Outcome, Verdict};
use super::settle::Settled;
use crate::delivery::{DeadLetterReason, Delivery, Settlement};
use crate::handler::Handler;
use crate::inbox::Backend;
use crate::key::refused_by_database;
use crate::HandlerError;

/// How one job's attempt in a transaction ended.
#[derive(Debug)]
pub(super) enum Attempted {
    /// The handler failed (or its transaction was aborted by a statement of its own, or its
    /// writes were refused at the commit): rolled back; a failed attempt.
    Failed(HandlerError),
    /// The key's row was no longer this attempt's at the completion (another worker
    /// completed it or counted a newer attempt on it): rolled back, and the delivery is a
    /// duplicate of the one that holds the key now.
    Overtaken,
    /// The completion or the commit failed for a reason of the database's own (a
    /// failover, a lost connection): the outcome is unknown, and it is no failed attempt.
    CommitFailed(Arc<sqlx::Error>),
}

impl<DB: Backend, H: Handler<DB>> Inner<DB, H> {
    /// Settles `jobs`, whose writes and claims (or completions) committed together: each
    /// is acked as completed, and the counters move once for the group.
    pub(super) fn committed(&self, jobs: Vec<Job<H::Message>>, settled: &mut Vec<Settled>) {
        if let [job] = jobs.as_slice() {
            // A field of the per-delivery span (a batch's span has none).
            tracing::Span::current().record("attempt", job.attempt);
        }
        let fresh = jobs.iter().filter(|j| j.fresh).count();
        if fresh > 0 {
            self.stats.fresh_completed.add(fresh as u64);
        }
        for job in jobs {
            settled.push(self.settled(job, Verdict::ack(Outcome::Completed)));
        }
    }

    /// The verdict on an attempt that ran (or tried to) in a transaction that did not commit,
    /// on the lease's connection `conn` (a committed one: [`Inner::committed`]).
    pub(super) async fn conclude(
        &self,
        conn: &mut DB::Connection,
        job: &mut Job<H::Message>,
        attempted: Attempted,
    ) -> Verdict {
        // A field of the per-delivery span (a batch's span has none).
        tracing::Span::current().record("attempt", job.attempt);
        match attempted {
            Attempted::Failed(failure) => {
                if job.fresh {
                    // The fresh claim rolled back with the failure: count the attempt now.
                    let (key, hash) = (job.key(), job.hash.as_str());
                    if let Err(e) = self.inbox.count_fresh_failure(conn, key, hash).await {
                        self.stats.db_errors.bump();
                        tracing::warn!(key = job.key(), error = %e, "could not count a failed attempt");
                    }
                }
                self.fail(conn, job, &failure).await
            }
            Attempted::Overtaken => {
                tracing::warn!(
                    key = job.key(),
                    attempt = job.attempt,
                    "the key was completed or counted again by another worker while this attempt ran: rolled back, settled as a duplicate"
                );
                Verdict::ack(Outcome::Duplicate)
            }
            Attempted::CommitFailed(e) => {
                // A fresh claim rolled back with the commit: nothing was counted.
                if !job.fresh {
                    self.give_back(job.key(), job.attempt).await;
                }
                self.retry_after_db_error(&job.delivery, &e)
            }
        }
    }

    /// Records a failed attempt and decides: retry after backoff, or dead-letter.
    async fn fail(
        &self,
        conn: &mut DB::Connection,
        job: &mut Job<H::Message>,
        failure: &HandlerError,
    ) -> Verdict {
        let s = &self.settings;
        let error = failure.to_string();
        let next = attempt::after_failure(
            failure.kind(),
            job.attempt,
            job.delivery.attempt,
            s.max_attempts,
        );
        let reason = match next {
            AfterFailure::DeadLetter(reason) => Some(reason),
            AfterFailure::Retry { .. } => None,
        };
        tracing::warn!(key = job.key(), attempt = job.attempt, error = %error, "handler failed");
        if let Err(verdict) = self
            .record_failure(conn, &job.delivery, job.key(), reason, &error)
            .await
        {
            return verdict;
        }
        match next {
            AfterFailure::DeadLetter(reason) => Verdict::dead_letter(
                &s.name,
                &job.delivery,
                reason,
                Some(job.key()),
                job.attempt,
                error,
            ),
            AfterFailure::Retry { ran, copy } => Verdict {
                settlement: Settlement::Retry {
                    delay: s.backoff.next_delay(ran),
                    attempt: copy,
                },
                outcome: Outcome::Retry { counted: true },
            },
        }
    }

    /// Records a failed attempt's error in the key's row; with a `reason`, the key is dead.
    ///
    /// A key must be dead before its dead letter goes out: a dead letter whose key stayed
    /// pending could never be replayed as dead, and the key would block its message for
    /// ever. So when a dead state cannot be written (the database went away), the
    /// delivery is retried as after any database error (`Err`, the verdict to settle with)
    /// and its next delivery, its attempts used up, dead-letters it again. A retry's error
    /// text that cannot be written is only logged.
    pub(super) async fn record_failure(
        &self,
        conn: &mut DB::Connection,
        delivery: &Delivery,
        key: &str,
        reason: Option<DeadLetterReason>,
        error: &str,
    ) -> Result<(), Verdict> {
        let text = dead_text(reason, error);
        let dead = reason.is_some();
        match self.inbox.record_failure(conn, key, &text, dead).await {
            Ok(()) => Ok(()),
            Err(e) if dead => {
                tracing::warn!(key, error = %e, "could not mark the key dead: retried instead of dead-lettered");
                Err(self.retry_after_db_error(delivery, &e))
            }
            Err(e) => {
                self.stats.db_errors.bump();
                tracing::warn!(key, error = %e, "could not record the failure in the inbox");
                Ok(())
            }
        }
    }

    /// Gives back the count of an attempt whose commit failed for the database's reason (see
    /// [`Backend::uncount_attempt`]), so that a failover cannot use up a message's attempts.
    /// If the database cannot be reached yet, the count stays: the message then has one
    /// attempt fewer, as after a crash.
    async fn give_back(&self, key: &str, attempt: u32) {
        match self.inbox.uncount_attempt(key, attempt).await {
            Ok(given_back) => {
                tracing::debug!(
                    key,
                    attempt,
                    given_back,
                    "commit failed: attempt given back"
                )
            }
            Err(e) => {
                self.stats.db_errors.bump();
                tracing::warn!(key, attempt, error = %e, "commit failed, and its attempt could not be given back");
            }
        }
    }

    /// A retry when the inbox itself failed: the handler did not run, so no attempt is
    /// counted; the broker's attempt number paces the backoff. A refusal of the key (see
    /// [`refused_by_database`]) would repeat on every retry: the message is dead-lettered
    /// `invalid_key` instead.
    pub(super) fn retry_after_db_error(&self, delivery: &Delivery, e: &sqlx::Error) -> Verdict {
        self.stats.db_errors.bump();
        if let Some(reason) = refused_by_database(e) {
            let (name, why) = (&self.settings.name, DeadLetterReason::InvalidKey);
            return Verdict::dead_letter(name, delivery, why, None, 0, reason);
        }
        tracing::error!(error = %e, "inbox unavailable; delivery will be retried");
        let AfterFailure::Retry { ran, copy } = attempt::after_database_error(delivery.attempt)
        else {
            unreachable!("a database error is always retried")
        };
        Verdict {
            settlement: Settlement::Retry {
                delay: self.settings.backoff.next_delay(ran),
                attempt: copy,
            },
            outcome: Outcome::Retry { counted: false },
        }
    }

    /// [`Inner::retry_after_db_error`] for every job of a group that could not run. If the
    /// database refused the statement's input (see [`refused_by_database`]), the statement
    /// does not say whose key it was: a group's jobs go to `alone`, to run one by one after
    /// the batch, where only that one is dead-lettered.
    pub(super) fn retry_all_after_db_error(
        &self,
        e: &sqlx::Error,
        jobs: Vec<Job<H::Message>>,
        settled: &mut Vec<Settled>,
        alone: &mut Vec<Job<H::Message>>,
    ) {
        if jobs.len() > 1 && refused_by_database(e).is_some() {
            tracing::warn!(error = %e, "the inbox refused a key of the batch; its members run one by one");
            alone.extend(jobs);
            return;
        }
        for job in jobs {
            let verdict = self.retry_after_db_error(&job.delivery, e);
            settled.push(self.settled(job, verdict));
        }
    }
}
