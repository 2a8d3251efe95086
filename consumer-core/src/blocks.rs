//! [`Blocks`]: shared blocks that a transport copies the bytes of many messages into.

use bytes::{Bytes, BytesMut};

/// How large a block is, unless one message's bytes need more.
const BLOCK: usize = 8 * 1024;

/// Shared blocks that a transport copies the bytes of many messages into (their keys,
/// payloads and [`Headers`](crate::transport::Headers)), when the client's buffers must be let go
/// as soon as a message is read (librdkafka's, say): each copy is a [`Bytes`] slice of the
/// current block, with no allocation of its own.
///
/// A block is shared by the copies made into it and reused in place, or freed, once the last
/// of them is gone. A message whose bytes outgrow a block gets one of its own. A long-lived
/// copy (a message held back for a while) keeps at most its one block alive; its neighbours'
/// copies are gone with them.
#[derive(Debug, Default)]
pub struct Blocks {
    block: BytesMut,
}

impl Blocks {
    /// New blocks (none allocated until the first copy).
    pub fn new() -> Self {
        Blocks::default()
    }

    /// `parts`, one after the other, as one slice of the current block.
    pub fn copy(&mut self, parts: &[&[u8]]) -> Bytes {
        self.reserve(parts.iter().map(|p| p.len()).sum());
        for part in parts {
            self.block.extend_from_slice(part);
        }
        self.split()
    }

    /// Makes room for `len` more bytes in the current block: a new block if it lacks them
    /// (or the old one reclaimed in place, if every copy in it is gone).
    pub(crate) fn reserve(&mut self, len: usize) {
        if self.block.capacity() - self.block.len() < len {
            self.block.reserve(len.max(BLOCK));
        }
    }

    /// The bytes written since the last copy.
    pub(crate) fn split(&mut self) -> Bytes {
        self.block.split().freeze()
    }

    /// The current block, to write the next copy into (after [`Blocks::reserve`]).
    pub(crate) fn block(&mut self) -> &mut BytesMut {
        &mut self.block
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn copies_share_a_block_and_reuse_it_once_they_are_gone() {
        let mut blocks = Blocks::new();
        let a = blocks.copy(&[b"k1", b"first"]);
        let b = blocks.copy(&[b"second"]);
        assert_eq!((&a[..], &b[..]), (&b"k1first"[..], &b"second"[..]));
        // Copied one after the other into one block.
        assert_eq!(a.as_ptr().wrapping_add(a.len()), b.as_ptr());
        let start = a.as_ptr();
        // Fill the block; a copy that does not fit starts a new one while `a` and `b` live.
        let filler = blocks.copy(&[&vec![b'x'; BLOCK - a.len() - b.len()]]);
        let next = blocks.copy(&[b"next"]);
        assert_ne!(next.as_ptr(), filler.as_ptr().wrapping_add(filler.len()));
        // Once every copy of the newer block is gone, it is reclaimed in place.
        let big = blocks.copy(&[&vec![b'y'; BLOCK - next.len()]]);
        let second_start = next.as_ptr();
        drop((next, big));
        let again = blocks.copy(&[b"again"]);
        assert_eq!(again.as_ptr(), second_start);
        assert_eq!(&again[..], b"again");
        // The first block's copies are untouched by all this.
        assert_eq!((&a[..], &b[..]), (&b"k1first"[..], &b"second"[..]));
        assert_eq!(a.as_ptr(), start);
        // A copy larger than a block gets one of its own.
        let huge = blocks.copy(&[&vec![b'z'; 3 * BLOCK]]);
        assert_eq!(huge.len(), 3 * BLOCK);
        assert!(huge.iter().all(|&c| c == b'z'));
    }
}
