//! The per-partition offset tracker: which records were fetched, handed out and settled, which
//! may be handed out next, and how far the partition may be committed.
//!
//! Kafka keeps one committed offset per partition, and committing `n` says "everything below
//! `n` is done". So the commit point is the offset of the first record not yet settled (or,
//! when all are settled, one past the last fetched record): a fast record settled behind a
//! slow one never moves it. Offsets need not be contiguous numbers (compaction, transaction
//! markers), so "contiguous" means contiguous in the sequence of fetched records.

use std::collections::{HashSet, VecDeque};
use std::time::Instant;

use crate::ProcessingOrder;

/// The ordering key of a record: a hash of its Kafka key (`None` for records without a key,
/// which count as one key).
pub(crate) type KeyId = Option<u64>;

#[derive(Debug)]
enum Status {
    /// Fetched, waiting to be handed out (not before the instant, if any).
    Waiting { not_before: Option<Instant> },
    /// Handed out, not settled.
    InFlight,
    /// Settled: may be committed past.
    Settled,
    /// Handed out, then dropped unsettled (the worker stopped): never settles in this process.
    Abandoned,
}

#[derive(Debug)]
struct Entry<T> {
    offset: i64,
    key: KeyId,
    status: Status,
    item: T,
}

/// The records of one partition between the commit point and the fetch position.
#[derive(Debug)]
pub(crate) struct PartitionTracker<T> {
    entries: VecDeque<Entry<T>>,
    /// One past the last fetched offset.
    next_offset: Option<i64>,
}

impl<T> Default for PartitionTracker<T> {
    fn default() -> Self {
        PartitionTracker {
            entries: VecDeque::new(),
            next_offset: None,
        }
    }
}

impl<T> PartitionTracker<T> {
    /// Adds a fetched record. Returns `false` (and drops it) if it is not past the last one,
    /// e.g. a record fetched again after a pause.
    pub(crate) fn push(
        &mut self,
        offset: i64,
        key: KeyId,
        not_before: Option<Instant>,
        item: T,
    ) -> bool {
        if self.next_offset.is_some_and(|n| offset < n) {
            return false;
        }
        self.next_offset = Some(offset + 1);
        self.entries.push_back(Entry {
            offset,
            key,
            status: Status::Waiting { not_before },
            item,
        });
        true
    }

    /// Adds a fetched record that needs no processing (already settled), e.g. another
    /// group's retry copy. Returns `false` if it is not past the last one.
    pub(crate) fn push_settled(&mut self, offset: i64, item: T) -> bool {
        if !self.push(offset, None, None, item) {
            return false;
        }
        if let Some(e) = self.entries.back_mut() {
            e.status = Status::InFlight;
        }
        self.settle(offset);
        true
    }

    /// The next record that may be handed out under `order` at `now`, marked in flight.
    pub(crate) fn take_next(&mut self, order: ProcessingOrder, now: Instant) -> Option<(i64, &T)> {
        let due = |s: &Status| is_due(s, now);
        let index = match order {
            ProcessingOrder::Partition => self
                .entries
                .iter()
                .position(|e| !matches!(e.status, Status::Settled))
                .filter(|&i| due(&self.entries[i].status)),
            ProcessingOrder::Key => {
                // A record may go if no earlier unsettled record has its key.
                let mut blocked: HashSet<KeyId> = HashSet::new();
                let mut found = None;
                for (i, e) in self.entries.iter().enumerate() {
                    if matches!(e.status, Status::Settled) || blocked.contains(&e.key) {
                        continue;
                    }
                    if due(&e.status) {
                        found = Some(i);
                        break;
                    }
                    blocked.insert(e.key);
                }
                found
            }
        }?;
        let e = &mut self.entries[index];
        e.status = Status::InFlight;
        Some((e.offset, &e.item))
    }

    fn find(&mut self, offset: i64) -> Option<&mut Entry<T>> {
        let i = self
            .entries
            .binary_search_by_key(&offset, |e| e.offset)
            .ok()?;
        self.entries.get_mut(i)
    }

    /// Marks an in-flight record settled. Returns whether the commit point moved.
    pub(crate) fn settle(&mut self, offset: i64) -> bool {
        match self.find(offset) {
            Some(e) if matches!(e.status, Status::InFlight) => e.status = Status::Settled,
            _ => return false,
        }
        let before = self.entries.len();
        while self
            .entries
            .front()
            .is_some_and(|e| matches!(e.status, Status::Settled))
        {
            self.entries.pop_front();
        }
        self.entries.len() != before
    }

    /// Puts an in-flight record back in its place, to be handed out again not before
    /// `not_before` (a blocking retry). Returns the item to update, e.g. its attempt.
    pub(crate) fn defer(&mut self, offset: i64, not_before: Instant) -> Option<&mut T> {
        let e = self.find(offset)?;
        if !matches!(e.status, Status::InFlight) {
            return None;
        }
        e.status = Status::Waiting {
            not_before: Some(not_before),
        };
        Some(&mut e.item)
    }

    /// An in-flight record was dropped unsettled: it stays uncommitted, but nothing waits
    /// for it any more.
    pub(crate) fn abandon(&mut self, offset: i64) {
        if let Some(e) = self.find(offset) {
            if matches!(e.status, Status::InFlight) {
                e.status = Status::Abandoned;
            }
        }
    }

    /// The offset to commit: everything below it is settled. `None` before the first fetch.
    pub(crate) fn commit_point(&self) -> Option<i64> {
        match self.entries.front() {
            Some(e) => Some(e.offset),
            None => self.next_offset,
        }
    }

    /// A one-line summary for debug logs.
    pub(crate) fn describe(&self) -> String {
        format!(
            "commit_point={:?} tracked={} in_flight={} head={:?}",
            self.commit_point(),
            self.entries.len(),
            self.in_flight(),
            self.entries.front().map(|e| (e.offset, &e.status))
        )
    }

    /// Records handed out and not settled.
    pub(crate) fn in_flight(&self) -> usize {
        self.entries
            .iter()
            .filter(|e| matches!(e.status, Status::InFlight))
            .count()
    }

    /// Records fetched and not settled (waiting, in flight or abandoned).
    pub(crate) fn len(&self) -> usize {
        self.entries.len()
    }

    /// When the first unsettled record may be handed out, if it is waiting for a due time.
    pub(crate) fn head_not_before(&self) -> Option<Instant> {
        match self.entries.front()?.status {
            Status::Waiting { not_before } => not_before,
            _ => None,
        }
    }

    /// Whether some waiting record is due (it may be handed out unless order holds it).
    pub(crate) fn has_due_waiting(&self, now: Instant) -> bool {
        self.entries.iter().any(|e| is_due(&e.status, now))
    }
}

fn is_due(status: &Status, now: Instant) -> bool {
    match status {
        Status::Waiting { not_before } => not_before.is_none_or(|t| t <= now),
        _ => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    fn tracker(records: &[(i64, Option<u64>)]) -> PartitionTracker<i64> {
        let mut t = PartitionTracker::default();
        for &(offset, key) in records {
            assert!(t.push(offset, key, None, offset));
        }
        t
    }

    fn take(t: &mut PartitionTracker<i64>, order: ProcessingOrder) -> Option<i64> {
        t.take_next(order, Instant::now()).map(|(o, _)| o)
    }

    #[test]
    fn partition_order_hands_out_one_at_a_time() {
        let mut t = tracker(&[(0, Some(1)), (1, Some(2)), (2, Some(3))]);
        assert_eq!(take(&mut t, ProcessingOrder::Partition), Some(0));
        assert_eq!(take(&mut t, ProcessingOrder::Partition), None);
        assert!(t.settle(0));
        assert_eq!(t.commit_point(), Some(1));
        assert_eq!(take(&mut t, ProcessingOrder::Partition), Some(1));
    }

    #[test]
    fn commit_point_never_passes_an_unsettled_record() {
        // The slow record at offset 10 is followed by fast ones with other keys.
        let mut t = tracker(&[(10, Some(1)), (11, Some(2)), (13, Some(3)), (14, Some(4))]);
        for expect in [10, 11, 13, 14] {
            assert_eq!(take(&mut t, ProcessingOrder::Key), Some(expect));
        }
        assert!(!t.settle(13));
        assert!(!t.settle(14));
        assert!(!t.settle(11));
        assert_eq!(
            t.commit_point(),
            Some(10),
            "the slow record holds the commit point"
        );
        assert!(t.settle(10));
        assert_eq!(t.commit_point(), Some(15), "gaps in offsets are fine");
        assert_eq!(t.len(), 0);
    }

    #[test]
    fn one_key_stays_in_order() {
        let mut t = tracker(&[
            (0, Some(1)),
            (1, Some(1)),
            (2, Some(2)),
            (3, None),
            (4, None),
        ]);
        assert_eq!(take(&mut t, ProcessingOrder::Key), Some(0));
        assert_eq!(take(&mut t, ProcessingOrder::Key), Some(2));
        assert_eq!(take(&mut t, ProcessingOrder::Key), Some(3));
        // 1 waits for 0 (same key); 4 waits for 3 (no key counts as one key).
        assert_eq!(take(&mut t, ProcessingOrder::Key), None);
        t.settle(3);
        assert_eq!(take(&mut t, ProcessingOrder::Key), Some(4));
        t.settle(0);
        assert_eq!(take(&mut t, ProcessingOrder::Key), Some(1));
    }

    #[test]
    fn deferred_record_keeps_its_place_and_blocks_its_key() {
        let mut t = tracker(&[(0, Some(1)), (1, Some(1)), (2, Some(2))]);
        assert_eq!(take(&mut t, ProcessingOrder::Key), Some(0));
        let later = Instant::now() + Duration::from_secs(60);
        *t.defer(0, later).unwrap() = 100;
        assert_eq!(t.head_not_before(), Some(later));
        // Key 1 is blocked by the deferred record; key 2 may go.
        assert_eq!(take(&mut t, ProcessingOrder::Key), Some(2));
        assert_eq!(take(&mut t, ProcessingOrder::Key), None);
        assert_eq!(t.commit_point(), Some(0));
        let (offset, item) = t.take_next(ProcessingOrder::Key, later).unwrap();
        assert_eq!((offset, *item), (0, 100));
        assert!(t.has_due_waiting(later) || t.in_flight() == 2);
    }

    #[test]
    fn records_pushed_settled_do_not_hold_the_commit_point() {
        let mut t = tracker(&[(0, None)]);
        assert!(t.push_settled(1, 1));
        assert_eq!(t.commit_point(), Some(0));
        assert_eq!(take(&mut t, ProcessingOrder::Partition), Some(0));
        t.settle(0);
        assert_eq!(t.commit_point(), Some(2));
        assert!(t.push_settled(2, 2));
        assert_eq!(t.commit_point(), Some(3));
        assert_eq!(take(&mut t, ProcessingOrder::Partition), None);
    }

    #[test]
    fn refetched_records_are_ignored_and_abandoned_ones_are_not_committed() {
        let mut t = tracker(&[(5, None), (6, None)]);
        assert!(!t.push(5, None, None, 5));
        assert_eq!(take(&mut t, ProcessingOrder::Partition), Some(5));
        t.abandon(5);
        assert_eq!(t.in_flight(), 0);
        assert_eq!(t.commit_point(), Some(5));
        assert_eq!(take(&mut t, ProcessingOrder::Partition), None);
    }
}
