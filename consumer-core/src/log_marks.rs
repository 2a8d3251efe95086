//! Proving a record from a log fresh (see [`LogPosition`]).
//!
//! Per handler and log, the database keeps a mark: at least the highest offset the handler
//! may ever have been handed there. A process reads and raises it in one serialised step
//! ([`Backend::advance_log_mark`](crate::inbox::Backend)), a [`MARK_STEP`] past the record in hand,
//! and commits that before it runs the record. The offsets from the mark it read up to the
//! mark it set are then its own: no one ran them before (the old mark says so) and no one
//! else runs them as fresh (anyone else reads the new mark). [`LogWindows`] remembers that
//! window per log for the current epoch, so the database is visited once per step, not
//! once per record.

use std::collections::HashMap;
use std::sync::Arc;

use crate::delivery::{Delivery, LogPosition, Origin};
use crate::inbox::{Backend, Inbox};

/// How far past the record in hand the mark is raised: one database commit per this many
/// offsets of a log. After a crash or a reassignment, up to this many records of a log take
/// the counted path (they may have been handed out), which costs time, never correctness.
pub(crate) const MARK_STEP: i64 = 10_000;

/// The offsets `lo..hi` of one log that this process may run as fresh in `epoch`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Window {
    epoch: u64,
    lo: i64,
    hi: i64,
}

/// What a first delivery from a log may do.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Check {
    /// Inside this process's window: never handed out before.
    Fresh,
    /// Below the window: it may have run before (and crashed), so its attempt is counted.
    Counted,
    /// Past the window, or a new epoch: raise the mark to `to` first, then check again.
    Advance {
        /// The mark to set.
        to: i64,
    },
}

/// The windows of the logs one worker reads, by log name (looked up for every delivery from a
/// log, so hashed with foldhash rather than SipHash; the names come from configuration).
#[derive(Debug, Default)]
pub(crate) struct LogWindows {
    windows: HashMap<Arc<str>, Window, foldhash::fast::RandomState>,
}

impl LogWindows {
    /// Where `pos` falls.
    pub(crate) fn check(&self, pos: &LogPosition) -> Check {
        match self.windows.get(&pos.log) {
            Some(w) if w.epoch == pos.epoch && pos.offset < w.lo => Check::Counted,
            Some(w) if w.epoch == pos.epoch && pos.offset < w.hi => Check::Fresh,
            _ => Check::Advance {
                to: pos.offset.saturating_add(MARK_STEP),
            },
        }
    }

    /// The database mark of `pos.log` was `before` and is now at least `to` (committed):
    /// the window for `pos.epoch` is what lies between, joined to the current window when
    /// nobody else moved the mark since this process last did.
    pub(crate) fn advanced(&mut self, pos: &LogPosition, before: Option<i64>, to: i64) {
        let current = self
            .windows
            .get(&pos.log)
            .filter(|w| w.epoch == pos.epoch)
            .copied();
        let lo = match (current, before) {
            (Some(w), Some(b)) if b == w.hi => w.lo,
            (_, Some(b)) => b,
            // No mark was ever set: nothing of this log was run through one.
            (_, None) => i64::MIN,
        };
        let hi = before.map_or(to, |b| b.max(to));
        self.windows.insert(
            pos.log.clone(),
            Window {
                epoch: pos.epoch,
                lo,
                hi,
            },
        );
    }
}

/// Whether a delivery takes the fresh path (see [`Delivery::origin`]): the one owner of that
/// decision. The transport reports what it knows (a first delivery it can vouch for, or a
/// position in a log); a delivery from a log is fresh when it is a first delivery at or
/// past the log's mark as this process read it, the mark raised and committed past it
/// first if need be. If the mark cannot be raised, the delivery is counted.
pub(crate) struct Freshness<DB: Backend> {
    inbox: Inbox<DB>,
    handler: String,
    windows: tokio::sync::Mutex<LogWindows>,
}

impl<DB: Backend> Freshness<DB> {
    /// The judge for `handler`'s deliveries.
    pub(crate) fn new(inbox: Inbox<DB>, handler: String) -> Self {
        Freshness {
            inbox,
            handler,
            windows: tokio::sync::Mutex::default(),
        }
    }

    /// Sets each item's flag to whether its delivery is fresh, under one hold of the log
    /// windows (a batch from a log usually needs no database visit at all).
    pub(crate) async fn judge<T>(
        &self,
        items: &mut [T],
        of: impl Fn(&mut T) -> (&Delivery, &mut bool),
    ) {
        let mut windows = None;
        for item in items.iter_mut() {
            let (delivery, fresh) = of(item);
            // A redelivery, or a copy of an attempt that ran, is counted whatever its origin.
            let first = delivery.attempt == 1 && !delivery.redelivered;
            *fresh = match &delivery.origin {
                Origin::First => first,
                Origin::Log(pos) if first => {
                    let windows = match &mut windows {
                        Some(w) => w,
                        None => windows.insert(self.windows.lock().await),
                    };
                    self.in_log(windows, pos).await
                }
                _ => false,
            };
        }
    }

    /// Whether a first delivery at `pos` is fresh, with the log windows held.
    async fn in_log(&self, windows: &mut LogWindows, pos: &LogPosition) -> bool {
        let to = match windows.check(pos) {
            Check::Fresh => return true,
            Check::Counted => return false,
            Check::Advance { to } => to,
        };
        match self
            .inbox
            .advance_log_mark(&self.handler, &pos.log, to)
            .await
        {
            Ok(before) => {
                tracing::debug!(log = %pos.log, ?before, to, "log mark raised");
                windows.advanced(pos, before, to);
                windows.check(pos) == Check::Fresh
            }
            Err(e) => {
                tracing::warn!(error = %e, log = %pos.log, "raising the log mark failed; the delivery takes the counted path");
                false
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pos(epoch: u64, offset: i64) -> LogPosition {
        LogPosition {
            log: Arc::from("g/t/0"),
            epoch,
            offset,
        }
    }

    #[test]
    fn first_record_raises_the_mark_then_its_window_is_fresh() {
        let mut w = LogWindows::default();
        assert_eq!(w.check(&pos(1, 5)), Check::Advance { to: 5 + MARK_STEP });
        w.advanced(&pos(1, 5), None, 5 + MARK_STEP);
        assert_eq!(w.check(&pos(1, 5)), Check::Fresh);
        assert_eq!(w.check(&pos(1, 0)), Check::Fresh, "no mark was ever set");
        assert_eq!(w.check(&pos(1, 4 + MARK_STEP)), Check::Fresh);
        assert_eq!(
            w.check(&pos(1, 5 + MARK_STEP)),
            Check::Advance {
                to: 5 + 2 * MARK_STEP
            }
        );
    }

    #[test]
    fn records_below_the_mark_read_are_counted() {
        let mut w = LogWindows::default();
        // An earlier process (or member) was handed offsets up to 99.
        w.advanced(&pos(1, 40), Some(100), 40 + MARK_STEP);
        assert_eq!(w.check(&pos(1, 40)), Check::Counted);
        assert_eq!(w.check(&pos(1, 99)), Check::Counted);
        assert_eq!(w.check(&pos(1, 100)), Check::Fresh);
    }

    #[test]
    fn a_mark_far_ahead_leaves_no_window_below_it() {
        let mut w = LogWindows::default();
        w.advanced(&pos(1, 10), Some(50_000), 10 + MARK_STEP);
        assert_eq!(w.check(&pos(1, 10)), Check::Counted);
        assert_eq!(w.check(&pos(1, 49_999)), Check::Counted);
        assert_eq!(w.check(&pos(1, 50_000)), Check::Advance { to: 60_000 });
    }

    #[test]
    fn an_untouched_mark_extends_the_window() {
        let mut w = LogWindows::default();
        w.advanced(&pos(1, 0), Some(0), MARK_STEP);
        w.advanced(&pos(1, MARK_STEP), Some(MARK_STEP), 2 * MARK_STEP);
        assert_eq!(w.check(&pos(1, 0)), Check::Fresh);
        assert_eq!(w.check(&pos(1, 2 * MARK_STEP - 1)), Check::Fresh);
    }

    #[test]
    fn a_mark_moved_by_someone_else_starts_a_new_window() {
        let mut w = LogWindows::default();
        w.advanced(&pos(1, 0), Some(0), MARK_STEP);
        // Another member raised it meanwhile: what lies below its mark may have run there.
        w.advanced(&pos(1, MARK_STEP), Some(MARK_STEP + 500), 2 * MARK_STEP);
        assert_eq!(w.check(&pos(1, 10)), Check::Counted);
        assert_eq!(w.check(&pos(1, MARK_STEP + 499)), Check::Counted);
        assert_eq!(w.check(&pos(1, MARK_STEP + 500)), Check::Fresh);
    }

    #[test]
    fn a_new_epoch_trusts_nothing_from_the_last() {
        let mut w = LogWindows::default();
        w.advanced(&pos(1, 0), None, MARK_STEP);
        assert_eq!(w.check(&pos(1, 7)), Check::Fresh);
        // Reassigned: offset 7 may have been handed out in epoch 1 and not settled.
        assert_eq!(w.check(&pos(2, 7)), Check::Advance { to: 7 + MARK_STEP });
        w.advanced(&pos(2, 7), Some(MARK_STEP), 7 + MARK_STEP);
        assert_eq!(w.check(&pos(2, 7)), Check::Counted);
        assert_eq!(w.check(&pos(2, MARK_STEP)), Check::Fresh);
    }
}
