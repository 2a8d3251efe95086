//! The poll thread: it owns the librdkafka consumer and polls whatever the handlers do,
//! turns fetched messages into tracked records, pauses and resumes partitions, and commits
//! every interval.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use consumer_core::{Blocks, TransportError};
use rdkafka::consumer::{BaseConsumer, CommitMode as RdCommitMode, Consumer};
use rdkafka::message::{BorrowedMessage, Message};
use rdkafka::TopicPartitionList;

use super::partitions::{Settings, Shared};
use super::rebalance::ConsumerCtx;
use super::record::{key_id, read_headers, unix_millis, Handout, IdSource, Record, Spares};
use crate::headers;
use crate::tracker::KeyId;

/// How long one poll waits for a record before housekeeping runs.
const POLL_WAIT: Duration = Duration::from_millis(50);
/// How long one poll waits while a partition is paused because its buffer is full: its
/// resume (at the next housekeeping) must not wait for [`POLL_WAIT`], or the handlers run dry.
const POLL_WAIT_PAUSED: Duration = Duration::from_millis(5);
/// Records taken per round before housekeeping runs.
const POLL_BATCH: usize = 500;
/// Records fetched before they are added to their partitions under one hold of the state
/// lock (fewer if a partition has less room, or librdkafka has no more at hand).
const CHUNK: usize = 64;
/// Every this many commit intervals the current positions are committed again, even if
/// unchanged (see [`Shared::commit`]), but not more often than [`MIN_COMMIT_REFRESH`].
const COMMIT_REFRESH_FACTOR: u32 = 10;
const MIN_COMMIT_REFRESH: Duration = Duration::from_secs(1);
/// How often the paused-partition gauge is set.
const GAUGE_INTERVAL: Duration = Duration::from_secs(5);

/// A fetched message as the poll thread reads it, before it takes the state lock to add it
/// to its partition: a record to track, or another group's retry copy to skip.
pub(super) enum Fetched {
    /// A record to hand out (at `not_before`, if it is a retry copy not due yet).
    Record {
        record: Arc<Record>,
        key: KeyId,
        not_before: Option<Instant>,
    },
    /// Not ours to run: its offset is settled as it is added.
    Foreign {
        topic: Arc<str>,
        partition: i32,
        offset: i64,
    },
}

/// A topic as the poll thread knows it, looked up once per topic rather than per record:
/// one shared name (so a record does not allocate its own), and the topic it is the retry
/// topic of, if it is one.
#[derive(Clone)]
pub(super) struct Topic {
    name: Arc<str>,
    origin: Option<Arc<str>>,
}

/// How many more records (and bytes) the fullest owned partition takes before it reaches a
/// limit: a chunk of fetched records that fits in it fits in every partition, so the limits
/// hold record by record although a chunk is added under one hold of the lock.
#[derive(Debug, Clone, Copy)]
pub(super) struct Room {
    records: usize,
    bytes: usize,
}

impl Room {
    /// The room of an empty partition: the limits themselves.
    fn limits(s: &Settings) -> Room {
        Room {
            records: s.max_buffered,
            bytes: s.max_buffered_bytes,
        }
    }

    /// What is left of this room once `records` of `bytes` in all are in it.
    fn after(self, records: usize, bytes: usize) -> Room {
        Room {
            records: self.records.saturating_sub(records),
            bytes: self.bytes.saturating_sub(bytes),
        }
    }

    /// The smaller of two rooms, limit by limit.
    fn min(self, other: Room) -> Room {
        Room {
            records: self.records.min(other.records),
            bytes: self.bytes.min(other.bytes),
        }
    }

    /// No room left: a partition with this room has reached a limit.
    fn is_full(self) -> bool {
        self.records == 0 || self.bytes == 0
    }

    /// Whether `chunk` records of `bytes` in all must be added before another is fetched:
    /// the chunk is as long as [`CHUNK`] allows, or one more record could fill a partition.
    fn filled(self, chunk: usize, bytes: usize) -> bool {
        chunk >= CHUNK.min(self.records) || bytes >= self.bytes
    }
}

impl Shared {
    /// Reads a fetched message into what the state lock needs to track it, without the lock.
    /// `topics` keeps what the poll thread knows of each topic (see [`Topic`]); `blocks`
    /// takes its bytes (see [`Blocks`]), and a spare record holds it if there is one.
    fn read(
        &self,
        m: &BorrowedMessage<'_>,
        topics: &mut Vec<Topic>,
        blocks: &mut Blocks,
        spares: &mut Spares,
    ) -> Fetched {
        let s = &self.settings;
        let index = match topics.iter().position(|t| *t.name == *m.topic()) {
            Some(i) => i,
            None => {
                let name: Arc<str> = Arc::from(m.topic());
                let origin = s.retry_sources.get(&*name).cloned();
                topics.push(Topic { name, origin });
                topics.len() - 1
            }
        };
        let Topic {
            name: topic,
            origin,
        } = &topics[index];
        let (partition, offset) = (m.partition(), m.offset());
        // The transport's own headers, picked out as the headers are read.
        let wanted = [
            headers::RETRY_GROUP,
            headers::ATTEMPT,
            headers::DUE_AT,
            &s.message_id_header,
        ];
        let read = read_headers(m.headers(), blocks, wanted);
        let [group, attempt, due_at, id] = read.values();
        // Another group's retry copy (groups share a topic's retry topic): not ours to run.
        if origin.is_some() && group.is_some_and(|g| g != s.group_id) {
            return Fetched::Foreign {
                topic: topic.clone(),
                partition,
                offset,
            };
        }
        // A record on the retry topic without a group was not written by this transport
        // (a producer wrote it there, or a tool): it runs, but as a record of its own, not
        // as our copy: its due time does not hold the partition back, its origin headers
        // are not trusted.
        let own_copy = origin.is_some() && group == Some(s.group_id.as_str());
        let attempt = attempt
            .and_then(|a| a.parse::<u32>().ok())
            .filter(|&a| a >= 1)
            .unwrap_or(1);
        // Only our own copies on a retry topic wait for their due time.
        let not_before = own_copy
            .then_some(due_at)
            .flatten()
            .and_then(|d| d.parse::<i64>().ok())
            .and_then(|due| {
                let wait = due.saturating_sub(unix_millis());
                (wait > 0).then(|| Instant::now() + Duration::from_millis(wait.unsigned_abs()))
            });
        let message_id = if id.is_some_and(|v| !v.is_empty()) {
            IdSource::Header
        } else if s.offset_message_ids {
            IdSource::Position
        } else {
            IdSource::None
        };
        let payload = m.payload().unwrap_or_default();
        let key_len = m.key().map_or(0, <[u8]>::len);
        let bytes = payload.len() + key_len + read.bytes;
        // The key and the payload copied together, into a block shared with other records
        // (beside its headers).
        let mut copied = blocks.copy(&[m.key().unwrap_or_default(), payload]);
        let key = key_id(&self.key_seed, m.key());
        // The key split off the copy, not sliced: a slice would take one more handle on the
        // shared block, which the worker threads' handles also count.
        let record_key = m.key().map(|_| copied.split_to(key_len));
        let record = spares.make(Record {
            bytes,
            tp: (topic.clone(), partition),
            offset,
            retried: origin.clone(),
            key: record_key,
            payload: copied,
            null_payload: m.payload().is_none(),
            headers: read.text,
            raw_headers: read.raw,
            message_id,
            attempt,
            own_copy,
        });
        Fetched::Record {
            record,
            key,
            not_before,
        }
    }

    /// Adds a chunk of fetched messages (emptied) to their partitions (those still owned)
    /// under one hold of the lock, and wakes the stream once if it can take one now. Returns
    /// the room left in the fullest partition (if none, the caller pauses it before fetching
    /// more).
    fn ingest(&self, chunk: &mut Vec<Fetched>) -> Room {
        let limits = Room::limits(&self.settings);
        let mut state = self.lock();
        let mut wake = false;
        for fetched in chunk.drain(..) {
            match fetched {
                Fetched::Foreign {
                    topic,
                    partition,
                    offset,
                } => {
                    if let Some(p) = state
                        .partitions
                        .get_mut(&(topic, partition))
                        .filter(|p| !p.revoking)
                    {
                        p.tracker.push_settled(offset);
                    }
                }
                Fetched::Record {
                    record,
                    key,
                    not_before,
                } => {
                    // Gone: fetched just before its partition was revoked; the new owner
                    // reads it.
                    let Some(p) = state.partitions.get_mut(&record.tp).filter(|p| !p.revoking)
                    else {
                        continue;
                    };
                    let (offset, attempt) = (record.offset, record.attempt);
                    let handout = Handout {
                        record,
                        attempt,
                        redelivered: false,
                    };
                    let pushed = p.tracker.push(offset, key, not_before, handout);
                    // A stream waiting for records gets these now, not after the poll round.
                    wake |= pushed && not_before.is_none();
                }
            }
        }
        let room = state
            .partitions
            .values()
            .filter(|p| !p.revoking)
            .map(|p| limits.after(p.tracker.len(), p.tracker.bytes()))
            .fold(limits, Room::min);
        let waker = if wake { state.waker.take() } else { None };
        drop(state);
        Shared::wake(waker);
        room
    }

    /// Pauses partitions whose buffer is full or whose next retry is not due, resumes the
    /// others, and wakes the stream when something may be handed out. Returns whether a
    /// partition is paused because its buffer is full.
    ///
    /// A full partition is resumed only when its buffer is half empty, not at the first free
    /// slot: librdkafka drops what it prefetched for a partition when it is paused, so every
    /// resume costs a fetch, which waits behind any fetch request already at the broker (up
    /// to `fetch.wait.max.ms` when that one asks only for partitions without new records).
    /// Resuming at one free slot would pay that for a handful of records each time.
    ///
    /// `retired` (empty) is swapped for the settled records, which go to `spares` (or are
    /// freed) outside the lock (see [`State::retired`](super::partitions::State::retired)).
    fn housekeeping(
        &self,
        consumer: &BaseConsumer<ConsumerCtx>,
        retired: &mut Vec<Arc<Record>>,
        spares: &mut Spares,
    ) -> bool {
        let now = Instant::now();
        // librdkafka's lists are built only in a round that changes a partition: most rounds
        // change none, and an empty list is still two allocations in C and a free of each.
        let mut pause: Option<TopicPartitionList> = None;
        let mut resume: Option<TopicPartitionList> = None;
        let limits = Room::limits(&self.settings);
        let (half_records, half_bytes) = (limits.records / 2, limits.bytes / 2);
        let mut any_full = false;
        let waker = {
            let mut state = self.lock();
            std::mem::swap(&mut state.retired, retired);
            let mut ready = false;
            for ((topic, partition), p) in state.partitions.iter_mut() {
                let waiting_for_due = p.tracker.head_not_before().is_some_and(|t| t > now);
                let (len, bytes) = (p.tracker.len(), p.tracker.bytes());
                p.full = if p.full {
                    len > half_records || bytes > half_bytes
                } else {
                    limits.after(len, bytes).is_full()
                };
                any_full |= p.full && !p.revoking;
                let want_pause = p.revoking || p.full || waiting_for_due;
                if want_pause != p.paused {
                    let list = if want_pause { &mut pause } else { &mut resume };
                    list.get_or_insert_with(TopicPartitionList::new)
                        .add_partition(topic, *partition);
                    p.paused = want_pause;
                }
                ready |= !p.revoking && p.tracker.has_due_waiting(now);
            }
            if ready {
                state.waker.take()
            } else {
                None
            }
        };
        Shared::wake(waker);
        spares.keep(retired);
        if let Some(pause) = pause {
            tracing::debug!(partitions = ?pause.to_topic_map().keys(), "pausing");
            if let Err(e) = consumer.pause(&pause) {
                tracing::warn!(error = %e, "pausing partitions failed");
            }
        }
        if let Some(resume) = resume {
            tracing::debug!(partitions = ?resume.to_topic_map().keys(), "resuming");
            if let Err(e) = consumer.resume(&resume) {
                tracing::warn!(error = %e, "resuming partitions failed");
            }
        }
        any_full
    }
}

impl Shared {
    /// Sets the gauge of how many of the partitions this consumer owns are paused (a full
    /// buffer, or a retry copy not due yet). The lag gauges come from librdkafka's
    /// statistics (see [`ConsumerCtx`]).
    fn set_gauges(&self) {
        let paused = {
            let state = self.lock();
            state
                .partitions
                .values()
                .filter(|p| p.paused && !p.revoking)
                .count()
        };
        // A handful of partitions: exact as f64.
        #[allow(clippy::cast_precision_loss)]
        metrics::gauge!("consumer_kafka_paused_partitions", "group" => self.settings.group_id.clone())
            .set(paused as f64);
    }
}

pub(super) fn poll_loop(consumer: BaseConsumer<ConsumerCtx>, shared: Arc<Shared>) {
    let mut last_commit = Instant::now();
    let mut last_refresh = Instant::now();
    let refresh_interval =
        (shared.settings.commit_interval * COMMIT_REFRESH_FACTOR).max(MIN_COMMIT_REFRESH);
    let mut last_summary = Instant::now();
    let mut last_gauges = Instant::now();
    let mut any_full = false;
    let mut topics = Vec::new();
    let mut blocks = Blocks::new();
    let mut retired = Vec::new();
    let mut spares = Spares::default();
    // Fetched records are added to their partitions in chunks, one hold of the state lock
    // (which the stream and the settlements also take) for each.
    let mut chunk = Vec::with_capacity(CHUNK);
    let mut chunk_bytes = 0;
    let mut room = Room::limits(&shared.settings);
    while !shared.stop.load(Ordering::SeqCst) {
        let mut wait = if any_full {
            POLL_WAIT_PAUSED
        } else {
            POLL_WAIT
        };
        for _ in 0..POLL_BATCH {
            match consumer.poll(wait) {
                None => break,
                Some(Ok(m)) => {
                    wait = Duration::ZERO;
                    let fetched = shared.read(&m, &mut topics, &mut blocks, &mut spares);
                    if let Fetched::Record { record, .. } = &fetched {
                        chunk_bytes += record.bytes;
                    }
                    chunk.push(fetched);
                    if room.filled(chunk.len(), chunk_bytes) {
                        room = shared.ingest(&mut chunk);
                        chunk_bytes = 0;
                        // A partition that reached its limit is paused at once
                        // (housekeeping), not after the rest of the round: the limits hold
                        // record by record.
                        if room.is_full() {
                            break;
                        }
                    }
                }
                Some(Err(e)) => {
                    handle_poll_error(&shared, e);
                    break;
                }
            }
        }
        if !chunk.is_empty() {
            room = shared.ingest(&mut chunk);
            chunk_bytes = 0;
        }
        any_full = shared.housekeeping(&consumer, &mut retired, &mut spares);
        if tracing::enabled!(tracing::Level::DEBUG)
            && last_summary.elapsed() >= Duration::from_secs(2)
        {
            last_summary = Instant::now();
            let state = shared.lock();
            for ((topic, partition), p) in &state.partitions {
                tracing::debug!(
                    "{topic}/{partition}: {} revoking={} paused={} committed={:?}",
                    p.tracker.describe(),
                    p.revoking,
                    p.paused,
                    p.committed
                );
            }
        }
        if last_gauges.elapsed() >= GAUGE_INTERVAL {
            last_gauges = Instant::now();
            shared.set_gauges();
        }
        if last_commit.elapsed() >= shared.settings.commit_interval {
            let refresh = last_refresh.elapsed() >= refresh_interval;
            if refresh {
                last_refresh = Instant::now();
            }
            shared.commit(&consumer, RdCommitMode::Async, refresh);
            last_commit = Instant::now();
        }
    }
    tracing::info!("kafka consumer stopping: committing settled offsets and leaving the group");
    shared.commit(&consumer, RdCommitMode::Sync, true);
    // Closing runs the revoke callback (bounded wait, contiguous commit) and leaves the group.
    drop(consumer);
    let waker = {
        let mut state = shared.lock();
        state.finished = true;
        state.partitions.clear();
        state.waker.take()
    };
    Shared::wake(waker);
    shared.closed.send_replace(true);
    tracing::info!("kafka consumer closed");
}

static UNKNOWN_TOPIC_WARNINGS: AtomicU64 = AtomicU64::new(0);

fn handle_poll_error(shared: &Shared, e: rdkafka::error::KafkaError) {
    use rdkafka::error::KafkaError as K;
    use rdkafka::types::RDKafkaErrorCode as C;
    match e {
        K::MessageConsumptionFatal(code) => {
            tracing::error!(error = %code, "fatal consumer error: the transport stops");
            let waker = {
                let mut state = shared.lock();
                state.errors.push_back(TransportError::new(
                    "fatal kafka consumer error",
                    K::MessageConsumptionFatal(code),
                ));
                state.waker.take()
            };
            shared.stop.store(true, Ordering::SeqCst);
            Shared::wake(waker);
        }
        K::MessageConsumption(C::UnknownTopicOrPartition | C::UnknownTopic) => {
            // A subscribed topic (often a retry topic) does not exist yet; librdkafka keeps
            // retrying. Logged now and then, not on every metadata refresh.
            if UNKNOWN_TOPIC_WARNINGS
                .fetch_add(1, Ordering::Relaxed)
                .is_multiple_of(100)
            {
                tracing::warn!(error = %e, "a subscribed topic does not exist (create it with consumer_kafka::create_topics)");
            }
        }
        other => tracing::warn!(error = %other, "kafka consumer error"),
    }
}
