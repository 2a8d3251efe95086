//! Attempt numbers: the one place they are computed.
//!
//! A delivery carries the number its transport read (a retry header; 1 for a first
//! delivery), which may be anything a producer wrote: [`delivered`] bounds it. A counted
//! attempt runs as the number the inbox counted for it ([`Claim::Run`](crate::inbox::Claim)),
//! a fresh one as 1. After a failure, [`after_failure`] decides between a retry and a dead
//! letter, and the number the retry copy carries.

use crate::delivery::DeadLetterReason;
use crate::ErrorKind;

/// The largest attempt number a delivery is taken to carry: what the inbox's `INTEGER`
/// columns hold. A header claiming more (a producer's, or a corrupted one) is read as this,
/// and every number derived from it saturates, so no header can overflow the arithmetic.
pub(super) const MAX_ATTEMPT: u32 = i32::MAX as u32;

/// A transport's attempt number, bounded to `1..=`[`MAX_ATTEMPT`].
pub(super) fn delivered(attempt: u32) -> u32 {
    attempt.clamp(1, MAX_ATTEMPT)
}

/// The number of the copy that follows attempt `ran` of a delivery that carried
/// `delivered`.
///
/// The copy is numbered above the delivery as well as above the count: a delivery's number
/// can run ahead of the count (retries after database errors are not counted), and the
/// inbox may hold that number as the newest copy's, which must never supersede the copy
/// written now. It is bounded like a delivery's: a copy is never numbered above what its
/// delivery will be read as, or that delivery would be taken for a replay the copy
/// supersedes.
pub(super) fn copy_after(ran: u32, delivered: u32) -> u32 {
    ran.max(delivered).saturating_add(1).min(MAX_ATTEMPT)
}

/// What follows a failed attempt.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum AfterFailure {
    /// Retry: the copy carries `copy`; the backoff is that of the failed attempt `ran`.
    Retry {
        /// The failed attempt's number (paces the backoff).
        ran: u32,
        /// The copy's number.
        copy: u32,
    },
    /// No attempt is left, or none can help.
    DeadLetter(DeadLetterReason),
}

/// Decides what follows a failure of `kind` in attempt `ran` (of `max_attempts`) of a
/// delivery that carried `delivered`.
pub(super) fn after_failure(
    kind: ErrorKind,
    ran: u32,
    delivered: u32,
    max_attempts: u32,
) -> AfterFailure {
    if kind == ErrorKind::Permanent {
        AfterFailure::DeadLetter(DeadLetterReason::PermanentError)
    } else if ran >= max_attempts {
        AfterFailure::DeadLetter(DeadLetterReason::MaxAttemptsExceeded)
    } else {
        AfterFailure::Retry {
            ran,
            copy: copy_after(ran, delivered),
        }
    }
}

/// What follows a failure of the inbox itself: the handler did not run and no attempt was
/// counted, so the delivery's own number paces the backoff and the copy is numbered after it.
pub(super) fn after_database_error(delivered: u32) -> AfterFailure {
    AfterFailure::Retry {
        ran: delivered,
        copy: copy_after(delivered, delivered),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_delivery_number_is_bounded_both_ways() {
        assert_eq!(delivered(0), 1);
        assert_eq!(delivered(1), 1);
        assert_eq!(delivered(7), 7);
        assert_eq!(delivered(u32::MAX), MAX_ATTEMPT);
    }

    #[test]
    fn a_copy_is_numbered_after_the_count_and_after_the_delivery() {
        assert_eq!(copy_after(1, 1), 2);
        // The count runs behind the delivery after uncounted retries.
        assert_eq!(copy_after(2, 5), 6);
        // The count runs ahead of the delivery after crashes.
        assert_eq!(copy_after(4, 1), 5);
        // Saturates at what a delivery is read as.
        assert_eq!(copy_after(MAX_ATTEMPT, MAX_ATTEMPT), MAX_ATTEMPT);
        assert_eq!(copy_after(MAX_ATTEMPT - 1, 1), MAX_ATTEMPT);
    }

    #[test]
    fn a_failure_retries_until_the_last_attempt_then_dead_letters() {
        assert_eq!(
            after_failure(ErrorKind::Transient, 1, 1, 3),
            AfterFailure::Retry { ran: 1, copy: 2 }
        );
        assert_eq!(
            after_failure(ErrorKind::Transient, 2, 2, 3),
            AfterFailure::Retry { ran: 2, copy: 3 }
        );
        assert_eq!(
            after_failure(ErrorKind::Transient, 3, 3, 3),
            AfterFailure::DeadLetter(DeadLetterReason::MaxAttemptsExceeded)
        );
        // A crash loop counted past the budget still ends.
        assert_eq!(
            after_failure(ErrorKind::Transient, 9, 1, 3),
            AfterFailure::DeadLetter(DeadLetterReason::MaxAttemptsExceeded)
        );
    }

    #[test]
    fn a_permanent_failure_dead_letters_at_once() {
        assert_eq!(
            after_failure(ErrorKind::Permanent, 1, 1, 5),
            AfterFailure::DeadLetter(DeadLetterReason::PermanentError)
        );
    }

    #[test]
    fn a_database_error_retries_after_the_delivery_number() {
        assert_eq!(
            after_database_error(1),
            AfterFailure::Retry { ran: 1, copy: 2 }
        );
        assert_eq!(
            after_database_error(MAX_ATTEMPT),
            AfterFailure::Retry {
                ran: MAX_ATTEMPT,
                copy: MAX_ATTEMPT
            }
        );
    }
}
