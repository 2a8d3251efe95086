//! Each owned partition's own queue of fetched records, split off the consumer's queue, so
//! that a partition whose buffer is full is left unread rather than paused.
//!
//! librdkafka drops what it prefetched for a partition when the partition is paused, and
//! its resume fetches those records again: over a backlog, pausing full partitions fetched
//! each record about twice. A partition's own queue that nobody reads fills up to
//! librdkafka's prefetch limits (`queued.max.messages.kbytes`, `queued.min.messages`, which
//! then hold for each partition on its own) and its fetching stops there, keeping what it
//! has. The consumer's queue keeps the events (the rebalance callbacks, errors, statistics)
//! and the records fetched before a partition's queue was split off.

use std::sync::Arc;
use std::time::Duration;

use consumer_core::transport::Blocks;
use rdkafka::consumer::base_consumer::PartitionQueue;
use rdkafka::consumer::BaseConsumer;

use super::fetch::{handle_poll_error, Fetched, Room, Topic, CHUNK, POLL_BATCH};
use super::partitions::Shared;
use super::rebalance::ConsumerCtx;
use super::record::{Spares, Tp};

/// One partition's queue, and the room its partition had at the start of a round.
struct Queue {
    tp: Tp,
    queue: PartitionQueue<ConsumerCtx>,
    /// Split off in this round: records of its partition fetched before the split may still
    /// sit in the consumer's queue, and those come first, so it is read from the next round
    /// on (once the consumer's queue has been drained with no new ones possible).
    split_now: bool,
    room: Option<Room>,
}

/// The owned partitions' queues, in no particular order, and which assignments they follow.
pub(super) struct Queues {
    queues: Vec<Queue>,
    /// The partition table's assignment count and size when the queues last followed it: a
    /// round in which neither changed has nothing to split or drop.
    seen: (u64, usize),
}

impl Queues {
    /// No queues yet.
    pub(super) fn new() -> Self {
        Queues {
            queues: Vec::new(),
            seen: (0, 0),
        }
    }

    /// Splits off the queue of each owned partition that has none (and marks the partition
    /// as having one), and drops those of partitions no longer owned. Returns whether it
    /// split one off (its queue may hold records already, which no wake-up announces). A
    /// partition whose queue could not be split off is tried again next round.
    pub(super) fn follow(
        &mut self,
        consumer: &Arc<BaseConsumer<ConsumerCtx>>,
        shared: &Shared,
    ) -> bool {
        let owned: Vec<Tp> = {
            let state = shared.lock();
            let now = (state.next_generation, state.partitions.len());
            if now == self.seen {
                return false;
            }
            self.seen = now;
            state.partitions.keys().cloned().collect()
        };
        self.queues.retain(|q| owned.contains(&q.tp));
        let mut split = false;
        for tp in owned {
            if self.queues.iter().any(|q| q.tp == tp) {
                continue;
            }
            let Some(mut queue) = consumer.split_partition_queue(&tp.0, tp.1) else {
                // Its records keep arriving on the consumer's queue, which is read as well.
                tracing::debug!(topic = %tp.0, partition = tp.1, "no queue of its own yet");
                self.seen = (u64::MAX, 0);
                continue;
            };
            // Called on the poll thread, which a queue's first record wakes.
            let poll_thread = std::thread::current();
            queue.set_nonempty_callback(move || poll_thread.unpark());
            self.queues.push(Queue {
                tp,
                queue,
                split_now: true,
                room: None,
            });
            split = true;
        }
        // Marked in every partition with one, including one assigned anew whose queue was
        // split off in an earlier assignment.
        let mut state = shared.lock();
        for q in &self.queues {
            if let Some(p) = state.partitions.get_mut(&q.tp) {
                p.own_queue = true;
            }
        }
        split
    }

    /// Reads the queue of each partition that takes more records (owned, not being revoked,
    /// not paused, its buffer not full) up to its room, at most [`POLL_BATCH`] records from
    /// each, adding them to their partitions in chunks. Returns whether it read any; `least`
    /// becomes the room of the fullest partition after the last chunk added, if any was.
    pub(super) fn read(
        &mut self,
        shared: &Shared,
        topics: &mut Vec<Topic>,
        blocks: &mut Blocks,
        spares: &mut Spares,
        chunk: &mut Vec<Fetched>,
        least: &mut Room,
    ) -> bool {
        {
            let limits = Room::limits(&shared.settings);
            let state = shared.lock();
            for q in &mut self.queues {
                q.room = state
                    .partitions
                    .get(&q.tp)
                    .filter(|p| !q.split_now && !p.revoking && !p.paused && !p.full)
                    .map(|p| limits.after(p.tracker.len(), p.tracker.bytes()));
                q.split_now = false;
            }
        }
        let mut read_any = false;
        for q in &mut self.queues {
            let Some(mut room) = q.room else {
                continue;
            };
            let mut records = 0;
            while records < POLL_BATCH && !room.is_full() {
                match q.queue.poll(Duration::ZERO) {
                    None => break,
                    Some(Ok(m)) => {
                        let fetched = shared.read(&m, topics, blocks, spares);
                        if let Fetched::Record { record, .. } = &fetched {
                            room = room.after(1, record.bytes);
                        }
                        chunk.push(fetched);
                        records += 1;
                        if chunk.len() >= CHUNK {
                            *least = shared.ingest(chunk);
                        }
                    }
                    Some(Err(e)) => {
                        handle_poll_error(shared, e);
                        break;
                    }
                }
            }
            read_any |= records > 0;
            if !chunk.is_empty() {
                *least = shared.ingest(chunk);
            }
        }
        read_any
    }
}
