//! Who runs beside whom. A job attempted before has its attempt counted and committed before
//! it runs, so a crash while it is in flight costs it an attempt, whoever caused the crash.
//! A delivery the broker flags as redelivered was in a consumer's hands when that consumer
//! went away: it may be what crashed it. Such a job takes its turn alone, with nothing else
//! of the worker in flight, so the crash it may cause again is charged to it and to nothing
//! else, and a crash that another job causes is not charged to it. Every other group shares
//! its turn with the rest. Without that, innocent deliveries that kept a crash loop company
//! were quarantined beside it.
//!
//! A Kafka record read again after a crash is not flagged (a log is read again, not
//! redelivered), so on a log only the batched mode keeps counted jobs apart, one per
//! transaction, and concurrent partitions share their turns.

use tokio::sync::{RwLock, RwLockReadGuard, RwLockWriteGuard};

/// The worker's turns: shared by default, alone for a redelivered job.
#[derive(Debug, Default)]
pub(super) struct Turns(RwLock<()>);

/// A turn held (one of the two guards); released when dropped.
pub(super) struct Turn<'a> {
    _shared: Option<RwLockReadGuard<'a, ()>>,
    _alone: Option<RwLockWriteGuard<'a, ()>>,
}

impl Turns {
    /// Waits for a turn: alone if `alone`, otherwise beside the other shared turns. Taken
    /// before a group's key locks and dropped after they are released, so that no job waits
    /// for a turn while it holds a key another job's turn needs.
    pub(super) async fn take(&self, alone: bool) -> Turn<'_> {
        if alone {
            Turn {
                _shared: None,
                _alone: Some(self.0.write().await),
            }
        } else {
            Turn {
                _shared: Some(self.0.read().await),
                _alone: None,
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use futures::FutureExt;

    use super::*;

    #[tokio::test]
    async fn shared_turns_run_together_and_an_alone_turn_waits_for_them() {
        let turns = Turns::default();
        let first = turns.take(false).await;
        let second = turns.take(false).now_or_never();
        assert!(second.is_some(), "two shared turns run together");
        let alone = turns.take(true);
        futures::pin_mut!(alone);
        assert!(alone.as_mut().now_or_never().is_none(), "alone waits");
        drop((first, second));
        let alone = tokio::time::timeout(Duration::from_secs(5), alone)
            .await
            .expect("alone runs once the shared turns end");
        assert!(
            turns.take(false).now_or_never().is_none(),
            "nothing shares an alone turn"
        );
        drop(alone);
        assert!(turns.take(false).now_or_never().is_some());
    }
}
