//! The per-partition offset tracker: which records were fetched, handed out and settled, which
//! may be handed out next, and how far the partition may be committed.
//!
//! Kafka keeps one committed offset per partition, and committing `n` says "everything below
//! `n` is done". So the commit point is the offset of the first record not yet settled (or,
//! when all are settled, one past the last fetched record): a fast record settled behind a
//! slow one never moves it. Offsets need not be contiguous numbers (compaction, transaction
//! markers), so "contiguous" means contiguous in the sequence of fetched records.

use std::collections::VecDeque;
use std::time::Instant;

use crate::ProcessingOrder;
use heads::Heads;
use keys::KeyMap;

mod heads;
mod keys;

pub(crate) use keys::KeyId;

/// What a buffered item costs in memory, counted against the partition's byte limit.
pub(crate) trait Weigh {
    /// The item's size in bytes (the same every time it is asked).
    fn weight(&self) -> usize;
}

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
    status: Status,
    /// Its [`Weigh::weight`], taken when it was pushed.
    weight: usize,
    /// `None` once settled: the item is let go at settlement, while the settler still holds
    /// its own handle on it (so the last handle is not dropped, and the record freed, under
    /// whatever lock guards the tracker), not when the commit point passes it later.
    item: Option<T>,
    /// The next record of its key, pushed while this one was unsettled: it may go once this
    /// one settles.
    next: Option<i64>,
}

/// The records of one partition between the commit point and the fetch position.
///
/// Besides the records in offset order it keeps each key's records chained (a record names
/// the next of its key, pushed while it was unsettled), and the set of waiting records that
/// are the first unsettled record of their key (`heads`). Under [`ProcessingOrder::Key`]
/// exactly those may go, so handing one out does not scan the buffer (up to
/// `max_buffered_per_partition` records, most of them in flight or settled behind a slower
/// one). Only a push looks a key up (the last record pushed with it); a settlement follows
/// its record's chain, so the key map stays with the thread that fetches.
#[derive(Debug)]
pub(crate) struct PartitionTracker<T> {
    entries: VecDeque<Entry<T>>,
    /// One past the last fetched offset.
    next_offset: Option<i64>,
    /// Per key, the last record pushed with it (which may have settled since: then the next
    /// one pushed starts a new chain). Records pushed settled are not in it. Keys whose last
    /// record has settled are dropped when the map outgrows the buffer.
    keys: KeyMap,
    /// The waiting records that no earlier unsettled record of their key holds back.
    heads: Heads,
    /// The summed [`Weigh::weight`] of `entries`.
    bytes: usize,
}

impl<T> Default for PartitionTracker<T> {
    fn default() -> Self {
        PartitionTracker {
            entries: VecDeque::new(),
            next_offset: None,
            keys: KeyMap::default(),
            heads: Heads::default(),
            bytes: 0,
        }
    }
}

impl<T: Weigh> PartitionTracker<T> {
    /// Adds a fetched record. Returns `false` (and drops it) if it is not past the last one,
    /// e.g. a record fetched again after a pause.
    pub(crate) fn push(
        &mut self,
        offset: i64,
        key: KeyId,
        not_before: Option<Instant>,
        item: T,
    ) -> bool {
        if !self.append(offset, Status::Waiting { not_before }, Some(item)) {
            return false;
        }
        // Held back if the last record of its key is still unsettled: chained behind it.
        let last = self.keys.insert(key, offset);
        match last.and_then(|last| unsettled(&self.entries, last)) {
            Some(i) => self.entries[i].next = Some(offset),
            None => {
                self.heads.insert(offset);
            }
        }
        if self.keys.len() > 2 * self.entries.len() + KEYS_SLACK {
            let entries = &self.entries;
            self.keys
                .retain(|_, &mut last| unsettled(entries, last).is_some());
        }
        true
    }

    /// Adds a fetched record that needs no processing (already settled), e.g. another
    /// group's retry copy. Returns `false` if it is not past the last one.
    pub(crate) fn push_settled(&mut self, offset: i64) -> bool {
        if !self.append(offset, Status::Settled, None) {
            return false;
        }
        self.pop_settled();
        true
    }

    fn append(&mut self, offset: i64, status: Status, item: Option<T>) -> bool {
        if self.next_offset.is_some_and(|n| offset < n) {
            return false;
        }
        self.next_offset = Some(offset + 1);
        let weight = item.as_ref().map_or(0, Weigh::weight);
        self.bytes += weight;
        self.entries.push_back(Entry {
            offset,
            status,
            weight,
            item,
            next: None,
        });
        true
    }

    /// The next record that may be handed out under `order` at `now`, marked in flight.
    pub(crate) fn take_next(&mut self, order: ProcessingOrder, now: Instant) -> Option<(i64, &T)> {
        let index = match order {
            // The front is the first unsettled record: settled ones are popped off it.
            ProcessingOrder::Partition => {
                let i = self
                    .entries
                    .iter()
                    .position(|e| !matches!(e.status, Status::Settled))
                    .filter(|&i| is_due(&self.entries[i].status, now))?;
                // The record may be a head too; it is not waiting any more.
                self.heads.remove(self.entries[i].offset);
                i
            }
            ProcessingOrder::Key => {
                // A record may go if no earlier unsettled record has its key: the heads.
                let offset = if self.heads.first().is_some_and(|o| self.due_at(o, now)) {
                    self.heads.pop_first()?
                } else {
                    // Some head waits for its due time (a retry copy): the first one due.
                    let o = self.heads.iter().find(|&o| self.due_at(o, now))?;
                    self.heads.remove(o);
                    o
                };
                self.index_of(offset)?
            }
        };
        let e = &mut self.entries[index];
        e.status = Status::InFlight;
        Some((e.offset, e.item.as_ref()?))
    }

    /// Whether [`PartitionTracker::take_next`] would hand out a record under `order` at `now`.
    pub(crate) fn has_next(&self, order: ProcessingOrder, now: Instant) -> bool {
        match order {
            ProcessingOrder::Partition => self
                .entries
                .iter()
                .find(|e| !matches!(e.status, Status::Settled))
                .is_some_and(|e| is_due(&e.status, now)),
            ProcessingOrder::Key => self.has_due_waiting(now),
        }
    }

    fn due_at(&self, offset: i64, now: Instant) -> bool {
        self.index_of(offset)
            .is_some_and(|i| is_due(&self.entries[i].status, now))
    }

    fn index_of(&self, offset: i64) -> Option<usize> {
        index_in(&self.entries, offset)
    }

    fn find(&mut self, offset: i64) -> Option<&mut Entry<T>> {
        let i = self.index_of(offset)?;
        self.entries.get_mut(i)
    }

    /// Marks an in-flight record settled and drops its item (the caller should hold its own
    /// handle on it, see [`Entry::item`]). Returns whether the commit point moved.
    pub(crate) fn settle(&mut self, offset: i64) -> bool {
        // A record in flight is the first unsettled one of its key: the next one may go.
        let next = match self.find(offset) {
            Some(e) if matches!(e.status, Status::InFlight) => {
                e.status = Status::Settled;
                e.item = None;
                e.next.take()
            }
            _ => return false,
        };
        if let Some(next) = next {
            if self
                .index_of(next)
                .is_some_and(|i| matches!(self.entries[i].status, Status::Waiting { .. }))
            {
                self.heads.insert(next);
            }
        }
        self.pop_settled()
    }

    /// Pops settled records off the front. Returns whether any was popped.
    fn pop_settled(&mut self) -> bool {
        let before = self.entries.len();
        while self
            .entries
            .front()
            .is_some_and(|e| matches!(e.status, Status::Settled))
        {
            if let Some(e) = self.entries.pop_front() {
                self.bytes -= e.weight;
            }
        }
        self.entries.len() != before
    }

    /// Puts an in-flight record back in its place, to be handed out again not before
    /// `not_before` (a blocking retry). Returns the item to update, e.g. its attempt.
    pub(crate) fn defer(&mut self, offset: i64, not_before: Instant) -> Option<&mut T> {
        let i = self.index_of(offset)?;
        if !matches!(self.entries[i].status, Status::InFlight) {
            return None;
        }
        // An in-flight record is the first unsettled one of its key, so it is a head again.
        self.heads.insert(offset);
        let e = &mut self.entries[i];
        e.status = Status::Waiting {
            not_before: Some(not_before),
        };
        e.item.as_mut()
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

    /// The summed size of the buffered records (see [`Weigh`]).
    pub(crate) fn bytes(&self) -> usize {
        self.bytes
    }

    /// When the first unsettled record may be handed out, if it is waiting for a due time.
    pub(crate) fn head_not_before(&self) -> Option<Instant> {
        match self.entries.front()?.status {
            Status::Waiting { not_before } => not_before,
            _ => None,
        }
    }

    /// Whether some waiting record is due and not held back by an earlier record of its key
    /// (it may be handed out unless partition order holds it).
    pub(crate) fn has_due_waiting(&self, now: Instant) -> bool {
        self.heads.iter().any(|o| self.due_at(o, now))
    }
}

/// Keys the key map may hold beyond twice the buffer before those whose last record has
/// settled are dropped.
const KEYS_SLACK: usize = 64;

/// The index of the record at `offset` in `entries` (in offset order).
fn index_in<T>(entries: &VecDeque<Entry<T>>, offset: i64) -> Option<usize> {
    // Offsets are usually contiguous (no compaction, no transaction markers): then the
    // distance from the front is the index.
    let front = entries.front()?.offset;
    if let Ok(i) = usize::try_from(offset - front) {
        if entries.get(i).is_some_and(|e| e.offset == offset) {
            return Some(i);
        }
    }
    entries.binary_search_by_key(&offset, |e| e.offset).ok()
}

/// The index of the record at `offset` in `entries`, if it is there and not settled.
fn unsettled<T>(entries: &VecDeque<Entry<T>>, offset: i64) -> Option<usize> {
    index_in(entries, offset).filter(|&i| !matches!(entries[i].status, Status::Settled))
}

fn is_due(status: &Status, now: Instant) -> bool {
    match status {
        Status::Waiting { not_before } => not_before.is_none_or(|t| t <= now),
        _ => false,
    }
}

#[cfg(test)]
mod tests;
