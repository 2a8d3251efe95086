//! The ordering key of a record, and each key's queue of unsettled offsets.

use std::collections::{HashMap, VecDeque};

/// The ordering key of a record: a hash of its Kafka key (`None` for records without a key,
/// which count as one key). The hash must be keyed with a random seed (see
/// [`KeyIdHasher`]). Two keys with the same hash are ordered as one key: stricter, never
/// looser.
pub(crate) type KeyId = Option<u64>;

/// Hashes a [`KeyId`] for the tracker's key map by folding its words, not by hashing them
/// again: a key id is already a randomly seeded hash of the key (so producers cannot aim at
/// one bucket), and a second SipHash on every push and settlement is measurable.
#[derive(Debug, Default)]
pub(crate) struct KeyIdHasher(u64);

impl std::hash::Hasher for KeyIdHasher {
    fn finish(&self) -> u64 {
        self.0
    }

    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.write_u64(u64::from(b));
        }
    }

    fn write_u64(&mut self, word: u64) {
        self.0 = (self.0.rotate_left(5) ^ word).wrapping_mul(0x517c_c1b7_2722_0a95);
    }

    fn write_usize(&mut self, word: usize) {
        self.write_u64(word as u64);
    }

    fn write_isize(&mut self, word: isize) {
        self.write_u64(word as u64);
    }
}

pub(super) type KeyMap = HashMap<KeyId, KeyQueue, std::hash::BuildHasherDefault<KeyIdHasher>>;

/// A key's unsettled offsets, oldest first. Most keys have one at a time, which needs no
/// allocation.
#[derive(Debug)]
pub(super) enum KeyQueue {
    One(i64),
    Many(VecDeque<i64>),
}

impl KeyQueue {
    pub(super) fn push(&mut self, offset: i64) {
        match self {
            KeyQueue::One(first) => *self = KeyQueue::Many(VecDeque::from([*first, offset])),
            KeyQueue::Many(q) => q.push_back(offset),
        }
    }

    pub(super) fn front(&self) -> Option<i64> {
        match self {
            KeyQueue::One(first) => Some(*first),
            KeyQueue::Many(q) => q.front().copied(),
        }
    }

    /// Removes `offset`; returns whether the queue is now empty.
    pub(super) fn remove(&mut self, offset: i64) -> bool {
        match self {
            KeyQueue::One(first) => *first == offset,
            KeyQueue::Many(q) => {
                if let Some(i) = q.iter().position(|&o| o == offset) {
                    q.remove(i);
                }
                q.is_empty()
            }
        }
    }
}
