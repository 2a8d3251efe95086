//! The batch buffers the intake fills and the pipeline empties, kept for reuse.

use std::sync::{Mutex, MutexGuard};

use crate::delivery::Incoming;

/// Batch buffers emptied by the pipeline, kept for the intake to fill again.
///
/// A batch's buffer is allocated where deliveries are taken in and emptied where the batch
/// runs, on another thread: allocated afresh each time, the large block would be freed
/// across threads and make the allocator consolidate the intake's small free blocks (those
/// of the deliveries, freed by the workers) for every batch. Kept here, it is allocated
/// once per batch in flight.
pub(super) struct SpareBatches {
    buffers: Mutex<Vec<Vec<Incoming>>>,
    /// At most this many are kept (the batches that can be in flight at once).
    keep: usize,
}

impl SpareBatches {
    /// A pool that keeps at most `keep` buffers.
    pub(super) fn new(keep: usize) -> Self {
        SpareBatches {
            buffers: Mutex::new(Vec::with_capacity(keep)),
            keep,
        }
    }

    /// The kept buffers (a panic while they were held left nothing half done).
    fn buffers(&self) -> MutexGuard<'_, Vec<Vec<Incoming>>> {
        self.buffers.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// An empty buffer with room for at least `capacity` deliveries.
    pub(super) fn take(&self, capacity: usize) -> Vec<Incoming> {
        let spare = self.buffers().pop();
        match spare {
            Some(mut buffer) => {
                buffer.reserve(capacity);
                buffer
            }
            None => Vec::with_capacity(capacity),
        }
    }

    /// Keeps `buffer`, emptied, for a later batch (or drops it, if enough are kept).
    pub(super) fn give_back(&self, mut buffer: Vec<Incoming>) {
        buffer.clear();
        let mut buffers = self.buffers();
        if buffers.len() < self.keep {
            buffers.push(buffer);
        }
    }

    /// The capacities of the buffers kept now.
    #[cfg(test)]
    pub(super) fn capacities(&self) -> Vec<usize> {
        self.buffers().iter().map(Vec::capacity).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::SpareBatches;

    #[test]
    fn an_emptied_batch_buffer_is_filled_again_and_no_more_are_kept_than_batches_in_flight() {
        let spares = SpareBatches::new(2);
        let first = spares.take(64);
        assert!(first.capacity() >= 64);
        let at = first.as_ptr();
        spares.give_back(first);
        let again = spares.take(64);
        assert_eq!(
            again.as_ptr(),
            at,
            "the buffer given back is the one taken next"
        );
        assert!(again.is_empty() && again.capacity() >= 64);
        // Three given back, two kept.
        for buffer in [again, spares.take(64), spares.take(64)] {
            spares.give_back(buffer);
        }
        let kept = [spares.take(1), spares.take(1), spares.take(1)];
        assert_eq!(kept.iter().filter(|b| b.capacity() >= 64).count(), 2);
    }
}
