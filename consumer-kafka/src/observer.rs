//! A log of what the transport did with offsets and partitions, for tests and metrics.

use std::collections::{BTreeSet, VecDeque};
use std::sync::{Arc, Mutex, MutexGuard};

/// Events kept; older ones are dropped so a long-running consumer does not grow.
const MAX_EVENTS: usize = 100_000;

/// One thing the transport did, in the order it happened on this consumer.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum OffsetEvent {
    /// The partition was assigned to this member.
    Assigned {
        /// Topic.
        topic: String,
        /// Partition.
        partition: i32,
    },
    /// A commit (or offset store) of `offset` was sent while the partition was assigned.
    Committed {
        /// Topic.
        topic: String,
        /// Partition.
        partition: i32,
        /// The next offset to consume: everything below it is settled.
        offset: i64,
    },
    /// The partition was revoked; from here on nothing is committed for it.
    Revoked {
        /// Topic.
        topic: String,
        /// Partition.
        partition: i32,
        /// librdkafka reported the assignment lost (nothing was committed).
        lost: bool,
        /// Records still in flight when it was given up.
        unsettled: usize,
    },
    /// Another member took (classic protocol) or holds (consumer protocol) this member's
    /// instance id: every partition was revoked as lost, and a new consumer joins again.
    Fenced {
        /// librdkafka's error: `FencedInstanceId` or `UnreleasedInstanceId`.
        error: String,
    },
    /// The group's coordinator stayed out of reach for `coordinator_timeout`: every
    /// partition was revoked as lost, and a new consumer joins again.
    CoordinatorLost,
    /// A settlement arrived after its partition was revoked and was dropped.
    SettlementDropped {
        /// Topic.
        topic: String,
        /// Partition.
        partition: i32,
        /// The record's offset.
        offset: i64,
    },
}

/// A shared view of a consumer's [`OffsetEvent`] log. Cheap to clone.
#[derive(Debug, Clone, Default)]
pub struct KafkaObserver {
    events: Arc<Mutex<VecDeque<OffsetEvent>>>,
}

impl KafkaObserver {
    fn lock(&self) -> MutexGuard<'_, VecDeque<OffsetEvent>> {
        self.events.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub(crate) fn record_all(&self, events: impl IntoIterator<Item = OffsetEvent>) {
        let mut log = self.lock();
        for e in events {
            if log.len() == MAX_EVENTS {
                log.pop_front();
            }
            log.push_back(e);
        }
    }

    /// Every event so far (the newest 100,000).
    pub fn events(&self) -> Vec<OffsetEvent> {
        self.lock().iter().cloned().collect()
    }

    /// The partitions assigned now, as `(topic, partition)`.
    pub fn assignment(&self) -> BTreeSet<(String, i32)> {
        let mut owned = BTreeSet::new();
        for e in self.lock().iter() {
            match e {
                OffsetEvent::Assigned { topic, partition } => {
                    owned.insert((topic.clone(), *partition));
                }
                OffsetEvent::Revoked {
                    topic, partition, ..
                } => {
                    owned.remove(&(topic.clone(), *partition));
                }
                _ => {}
            }
        }
        owned
    }

    /// Commits sent for partitions this member did not own at that moment, replaying the
    /// log. Always empty unless the transport is broken; tests assert it.
    pub fn commits_without_ownership(&self) -> Vec<OffsetEvent> {
        let mut owned = BTreeSet::new();
        let mut bad = Vec::new();
        for e in self.lock().iter() {
            match e {
                OffsetEvent::Assigned { topic, partition } => {
                    owned.insert((topic.clone(), *partition));
                }
                OffsetEvent::Revoked {
                    topic, partition, ..
                } => {
                    owned.remove(&(topic.clone(), *partition));
                }
                OffsetEvent::Committed {
                    topic, partition, ..
                } if !owned.contains(&(topic.clone(), *partition)) => bad.push(e.clone()),
                _ => {}
            }
        }
        bad
    }

    /// How many settlements were dropped because their partition had been revoked.
    pub fn settlements_dropped(&self) -> usize {
        self.lock()
            .iter()
            .filter(|e| matches!(e, OffsetEvent::SettlementDropped { .. }))
            .count()
    }

    /// How many times another member took or held this member's instance id.
    pub fn fences(&self) -> usize {
        self.lock()
            .iter()
            .filter(|e| matches!(e, OffsetEvent::Fenced { .. }))
            .count()
    }

    /// How many times the consumer was replaced because its group's coordinator stayed out
    /// of reach.
    pub fn coordinator_losses(&self) -> usize {
        self.lock()
            .iter()
            .filter(|e| matches!(e, OffsetEvent::CoordinatorLost))
            .count()
    }

    /// How many revocations happened.
    pub fn revocations(&self) -> usize {
        self.lock()
            .iter()
            .filter(|e| matches!(e, OffsetEvent::Revoked { .. }))
            .count()
    }
}
