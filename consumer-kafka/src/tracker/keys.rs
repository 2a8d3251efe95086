//! The ordering key of a record, and the map from each key to its last record.

use std::collections::HashMap;

/// The ordering key of a record: a hash of its Kafka key (`None` for records without a key,
/// which count as one key). The hash must be keyed with a random seed (see
/// [`KeyIdHasher`]). Two keys with the same hash are ordered as one key: stricter, never
/// looser.
pub(crate) type KeyId = Option<u64>;

/// Hashes a [`KeyId`] for the tracker's key map by folding its words, not by hashing them
/// again: a key id is already a randomly seeded hash of the key (so producers cannot aim at
/// one bucket), and hashing it again on every push and settlement is measurable.
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

/// Per key, the offset of the last record pushed with it.
pub(super) type KeyMap = HashMap<KeyId, i64, std::hash::BuildHasherDefault<KeyIdHasher>>;
