//! The tracker's set of head records: offsets kept in ascending order in a ring buffer.

use std::collections::VecDeque;

/// Offsets in ascending order, each once. Records are fetched in offset order, so an offset
/// usually joins at the back and leaves from the front, without the allocation of a tree
/// node either way; one that joins in the middle (the next record of a key whose earlier
/// one just settled) shifts the later ones, at most the partition's buffer.
#[derive(Debug, Default)]
pub(super) struct Heads {
    offsets: VecDeque<i64>,
}

impl Heads {
    /// Adds `offset`; nothing if it is there already.
    pub(super) fn insert(&mut self, offset: i64) {
        match self.offsets.back() {
            Some(&last) if last >= offset => {
                if let Err(i) = self.offsets.binary_search(&offset) {
                    self.offsets.insert(i, offset);
                }
            }
            _ => self.offsets.push_back(offset),
        }
    }

    /// Removes `offset`; whether it was there.
    pub(super) fn remove(&mut self, offset: i64) -> bool {
        match self.offsets.binary_search(&offset) {
            Ok(i) => self.offsets.remove(i).is_some(),
            Err(_) => false,
        }
    }

    /// The lowest offset.
    pub(super) fn first(&self) -> Option<i64> {
        self.offsets.front().copied()
    }

    /// Removes and returns the lowest offset.
    pub(super) fn pop_first(&mut self) -> Option<i64> {
        self.offsets.pop_front()
    }

    /// The offsets, lowest first.
    pub(super) fn iter(&self) -> impl Iterator<Item = i64> + '_ {
        self.offsets.iter().copied()
    }
}

#[cfg(test)]
mod tests {
    use super::Heads;

    /// Whatever order offsets come and go in, the set holds them ascending, each once, as a
    /// `BTreeSet` would.
    #[test]
    fn heads_stay_in_ascending_order_each_once() {
        let mut heads = Heads::default();
        let mut model = std::collections::BTreeSet::new();
        // A fixed pseudo-random walk of inserts and removals, with repeats.
        let mut x: u64 = 0x2545_f491_4f6c_dd1d;
        for _ in 0..2_000 {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            let offset = i64::try_from(x % 64).expect("small");
            match x % 5 {
                0..=2 => {
                    heads.insert(offset);
                    model.insert(offset);
                }
                3 => assert_eq!(heads.remove(offset), model.remove(&offset)),
                _ => assert_eq!(heads.pop_first(), model.pop_first()),
            }
            assert_eq!(heads.first(), model.first().copied());
            assert!(heads.iter().eq(model.iter().copied()));
        }
    }
}
