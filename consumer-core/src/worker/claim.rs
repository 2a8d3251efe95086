//! The claim stage's decisions: what a counted claim means for a delivery (run as attempt
//! n, or settle without a run). Pure, so every case is tested without a database.

use std::sync::atomic::{AtomicU32, Ordering};

use super::job::{Outcome, Verdict};
use crate::delivery::{DeadLetterReason, Delivery};
use crate::handler::ConflictPolicy;
use crate::inbox::Claim;

/// What to do with a delivery after its key was claimed on the counted path.
#[derive(Debug)]
pub(super) enum Decision {
    /// Run it as attempt `attempt` (the inbox's count).
    Run { attempt: u32 },
    /// Settle it without a run.
    Settle(Verdict),
    /// Its key was first seen with another payload, and the policy dead-letters it.
    Conflict(Verdict),
    /// Its attempts were used up without an outcome (a crash loop): mark the key dead with
    /// `error`, then dead-letter it `quarantined`.
    Quarantine { attempts: u32, error: String },
}

/// Turns the inbox's claim on `key` into a decision, under the handler's conflict policy.
pub(super) fn decide(
    handler: &str,
    delivery: &Delivery,
    key: &str,
    claim: Claim,
    on_conflict: ConflictPolicy,
) -> Decision {
    match claim {
        Claim::Run { attempt } => Decision::Run { attempt },
        Claim::Duplicate => Decision::Settle(Verdict::ack(Outcome::Duplicate)),
        Claim::Superseded { by } => {
            tracing::debug!(
                attempt = delivery.attempt,
                newer = by,
                "superseded by a newer retry copy"
            );
            Decision::Settle(Verdict::ack(Outcome::Superseded))
        }
        Claim::Conflict { status } => {
            let error = format!(
                "key {key:?} was first seen with a different payload (that one is {status:?})"
            );
            match on_conflict {
                ConflictPolicy::DeadLetter => Decision::Conflict(Verdict::dead_letter(
                    handler,
                    delivery,
                    DeadLetterReason::KeyConflict,
                    Some(key),
                    0,
                    error,
                )),
                ConflictPolicy::Skip => {
                    tracing::warn!(%error, "key conflict skipped by policy");
                    Decision::Settle(Verdict::ack(Outcome::ConflictSkipped))
                }
            }
        }
        Claim::Dead {
            attempts,
            last_error,
        } => {
            let text = last_error.unwrap_or_default();
            let (reason, error) = split_reason(&text);
            Decision::Settle(Verdict::dead_letter(
                handler,
                delivery,
                reason,
                Some(key),
                attempts,
                error.to_owned(),
            ))
        }
        Claim::Exhausted {
            attempts,
            last_error,
        } => Decision::Quarantine {
            attempts,
            error: format!(
                "{attempts} attempts were used up without an outcome (the worker crashed); last error: {}",
                last_error.as_deref().unwrap_or("none recorded")
            ),
        },
    }
}

/// The text a dead key's row holds: `reason: error` (see [`dead_text`]).
fn split_reason(text: &str) -> (DeadLetterReason, &str) {
    text.split_once(": ")
        .and_then(|(r, e)| DeadLetterReason::parse(r).map(|r| (r, e)))
        .unwrap_or((DeadLetterReason::MaxAttemptsExceeded, text))
}

/// What a failed attempt's row records: a dead key's error as `reason: error`, so that a
/// redelivery of it reports the same reason; a pending key's error alone (it has no reason
/// yet).
pub(super) fn dead_text(reason: Option<DeadLetterReason>, error: &str) -> String {
    match reason {
        Some(reason) => format!("{}: {error}", reason.as_str()),
        None => error.to_owned(),
    }
}

/// How a worker claims its batches' fresh keys: with the plain insert of
/// [`Backend::claim_new_many`] while fresh keys turn out to have no rows, which is the usual
/// case; with [`Backend::claim_fresh_many`], which tolerates rows, for the next
/// [`Claims::TOLERANT_AFTER_ROWS`] batches after one that found a row. On the plain insert a
/// batch that meets a republished message pays a failed insert and a second transaction, and
/// republished messages may come in runs (a producer's retried backlog); the count is a
/// chosen bound, not a measured one.
#[derive(Debug, Default)]
pub(super) struct Claims {
    /// How many more batches claim with the tolerant statement.
    tolerant: AtomicU32,
}

impl Claims {
    const TOLERANT_AFTER_ROWS: u32 = 64;

    /// Whether the next batch may claim with the plain insert (if not, one fewer batch
    /// waits for it).
    pub(super) fn optimistic(&self) -> bool {
        self.tolerant
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |n| n.checked_sub(1))
            .is_err()
    }

    /// A batch's plain insert found a key with a row.
    pub(super) fn found_rows(&self) {
        self.tolerant
            .store(Self::TOLERANT_AFTER_ROWS, Ordering::Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::delivery::{Settlement, Source};
    use crate::inbox::EntryStatus;

    fn delivery() -> Delivery {
        Delivery {
            message_id: Some("m".into()),
            payload: bytes::Bytes::from_static(b"{}"),
            headers: Default::default(),
            redelivered: true,
            attempt: 2,
            origin: crate::delivery::Origin::Unknown,
            source: Source {
                transport: "memory",
                location: "q".into(),
            },
            published_at: None,
        }
    }

    fn decide_on(claim: Claim, policy: ConflictPolicy) -> Decision {
        decide("h", &delivery(), "k", claim, policy)
    }

    fn dead_letter_of(d: Decision) -> (DeadLetterReason, u32, String) {
        match d {
            Decision::Settle(Verdict {
                settlement: Settlement::DeadLetter(dl),
                outcome: Outcome::DeadLettered(_),
            })
            | Decision::Conflict(Verdict {
                settlement: Settlement::DeadLetter(dl),
                outcome: Outcome::DeadLettered(_),
            }) => (dl.reason, dl.attempts, dl.error),
            other => panic!("not a dead letter: {other:?}"),
        }
    }

    #[test]
    fn a_run_carries_the_inbox_count() {
        let d = decide_on(Claim::Run { attempt: 3 }, ConflictPolicy::DeadLetter);
        assert!(matches!(d, Decision::Run { attempt: 3 }), "{d:?}");
    }

    #[test]
    fn duplicates_and_superseded_deliveries_are_acked_without_a_run() {
        for (claim, outcome) in [
            (Claim::Duplicate, Outcome::Duplicate),
            (Claim::Superseded { by: 3 }, Outcome::Superseded),
        ] {
            match decide_on(claim, ConflictPolicy::DeadLetter) {
                Decision::Settle(Verdict {
                    settlement: Settlement::Ack,
                    outcome: o,
                }) => assert_eq!(o, outcome),
                other => panic!("{other:?}"),
            }
        }
    }

    #[test]
    fn a_conflict_follows_the_policy() {
        let conflict = || Claim::Conflict {
            status: EntryStatus::Completed,
        };
        let (reason, attempts, error) =
            dead_letter_of(decide_on(conflict(), ConflictPolicy::DeadLetter));
        assert_eq!(reason, DeadLetterReason::KeyConflict);
        assert_eq!(attempts, 0);
        assert!(error.contains("different payload"), "{error}");
        match decide_on(conflict(), ConflictPolicy::Skip) {
            Decision::Settle(v) => assert_eq!(v.outcome, Outcome::ConflictSkipped),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn a_dead_key_reports_the_reason_it_died_with() {
        let claim = |text: &str| Claim::Dead {
            attempts: 4,
            last_error: Some(dead_text(Some(DeadLetterReason::PermanentError), text)),
        };
        let (reason, attempts, error) = dead_letter_of(decide_on(
            claim("card declined"),
            ConflictPolicy::DeadLetter,
        ));
        assert_eq!(reason, DeadLetterReason::PermanentError);
        assert_eq!(attempts, 4);
        assert_eq!(error, "card declined");
        // A row from before reasons were recorded reads as attempts used up.
        let old = Claim::Dead {
            attempts: 5,
            last_error: Some("timeout".into()),
        };
        let (reason, _, error) = dead_letter_of(decide_on(old, ConflictPolicy::DeadLetter));
        assert_eq!(reason, DeadLetterReason::MaxAttemptsExceeded);
        assert_eq!(error, "timeout");
    }

    #[test]
    fn used_up_attempts_quarantine_the_key() {
        let d = decide_on(
            Claim::Exhausted {
                attempts: 5,
                last_error: None,
            },
            ConflictPolicy::DeadLetter,
        );
        match d {
            Decision::Quarantine { attempts, error } => {
                assert_eq!(attempts, 5);
                assert!(error.contains("none recorded"), "{error}");
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn a_pending_key_records_its_error_alone() {
        assert_eq!(dead_text(None, "provider down"), "provider down");
        assert_eq!(
            dead_text(Some(DeadLetterReason::MaxAttemptsExceeded), "provider down"),
            "max_attempts_exceeded: provider down"
        );
    }

    #[test]
    fn claims_are_tolerant_for_a_while_after_a_batch_found_a_row() {
        let claims = Claims::default();
        assert!(claims.optimistic() && claims.optimistic());
        claims.found_rows();
        for _ in 0..Claims::TOLERANT_AFTER_ROWS {
            assert!(!claims.optimistic());
        }
        assert!(claims.optimistic());
    }
}
