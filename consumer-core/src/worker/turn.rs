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
//!
//! A simulated crash (a fault point's `StopWorker`) stops the turns: the crashing job's
//! turn ends as its error unwinds, before the worker drops the jobs still in flight, and a
//! job waiting for that turn would otherwise take it and count an attempt that the crash
//! then cuts short, which a process that died could not have done.

use std::sync::atomic::{AtomicBool, Ordering};

use tokio::sync::{RwLock, RwLockReadGuard, RwLockWriteGuard};

/// The worker's turns: shared by default, alone for a redelivered job.
#[derive(Debug, Default)]
pub(super) struct Turns {
    lock: RwLock<()>,
    /// The worker crashed (simulated): no job takes a turn any more.
    stopped: AtomicBool,
}

/// A turn held (one of the two guards); released when dropped.
pub(super) struct Turn<'a> {
    _shared: Option<RwLockReadGuard<'a, ()>>,
    _alone: Option<RwLockWriteGuard<'a, ()>>,
}

impl Turns {
    /// Waits for a turn: alone if `alone`, otherwise beside the other shared turns. Taken
    /// before a group's key locks and dropped after they are released, so that no job waits
    /// for a turn while it holds a key another job's turn needs. Once the turns are
    /// [stopped](Turns::stop) it never returns: the job waits until the worker drops it.
    pub(super) async fn take(&self, alone: bool) -> Turn<'_> {
        let turn = if alone {
            Turn {
                _shared: None,
                _alone: Some(self.lock.write().await),
            }
        } else {
            Turn {
                _shared: Some(self.lock.read().await),
                _alone: None,
            }
        };
        if self.stopped.load(Ordering::SeqCst) {
            std::future::pending::<()>().await;
        }
        turn
    }

    /// The worker crashed (simulated): no job takes a turn from now on, not even one already
    /// waiting for the crashing job's.
    pub(super) fn stop(&self) {
        self.stopped.store(true, Ordering::SeqCst);
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

    #[tokio::test]
    async fn after_a_crash_no_job_takes_the_turn_it_waited_for() {
        let turns = Turns::default();
        let crashing = turns.take(true).await;
        let mut waiting = Box::pin(turns.take(true));
        assert!(waiting.as_mut().now_or_never().is_none(), "alone waits");
        // The crashing job stops the turns, and its turn ends as its error unwinds.
        turns.stop();
        drop(crashing);
        assert!(
            waiting.as_mut().now_or_never().is_none(),
            "a job waiting when the worker crashed never runs"
        );
        // Dropped as the worker drops its jobs: the lock is free, and still no job runs.
        drop(waiting);
        assert!(turns.take(false).now_or_never().is_none());
    }
}
