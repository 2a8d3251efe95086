//! A fetched message read into a record, and records added to their partitions: what the
//! poll thread does with each message of the consumer's queue or of a partition's own.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use consumer_core::transport::{Blocks, TransportError};
use rdkafka::message::{BorrowedMessage, Message};
use rdkafka::types::RDKafkaErrorCode;

use super::partitions::{Settings, Shared};
use super::record::{key_id, unix_millis, Handout, IdSource, Record, Spares};
use super::record_headers::read_headers;
use crate::headers;
use crate::tracker::KeyId;

/// Records taken per round before housekeeping runs.
pub(super) const POLL_BATCH: usize = 500;
/// Records fetched before they are added to their partitions under one hold of the state
/// lock (fewer if a partition has less room, or librdkafka has no more at hand).
pub(super) const CHUNK: usize = 64;

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
    pub(super) fn limits(s: &Settings) -> Room {
        Room {
            records: s.max_buffered,
            bytes: s.max_buffered_bytes,
        }
    }

    /// What is left of this room once `records` of `bytes` in all are in it.
    pub(super) fn after(self, records: usize, bytes: usize) -> Room {
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
    pub(super) fn is_full(self) -> bool {
        self.records == 0 || self.bytes == 0
    }

    /// Whether `chunk` records of `bytes` in all must be added before another is fetched:
    /// the chunk is as long as [`CHUNK`] allows, or one more record could fill a partition.
    pub(super) fn filled(self, chunk: usize, bytes: usize) -> bool {
        chunk >= CHUNK.min(self.records) || bytes >= self.bytes
    }
}

impl Shared {
    /// Reads a fetched message into what the state lock needs to track it, without the lock.
    /// `topics` keeps what the poll thread knows of each topic (see [`Topic`]); `blocks`
    /// takes its bytes (see [`Blocks`]), and a spare record holds it if there is one.
    pub(super) fn read(
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
            published_at: m
                .timestamp()
                .to_millis()
                .and_then(|ms| u64::try_from(ms).ok())
                .map(|ms| std::time::UNIX_EPOCH + Duration::from_millis(ms)),
        });
        Fetched::Record {
            record,
            key,
            not_before,
        }
    }

    /// Adds a chunk of fetched messages (emptied) to their partitions (those still owned)
    /// under one hold of the lock, and wakes the stream once if it can take one now. Returns
    /// the room left in the fullest partition (if none, the caller reads no more before
    /// housekeeping holds that partition back).
    pub(super) fn ingest(&self, chunk: &mut Vec<Fetched>) -> Room {
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
}

static UNKNOWN_TOPIC_WARNINGS: AtomicU64 = AtomicU64::new(0);

/// The error code, if `e` says another member took (`FENCED_INSTANCE_ID`, classic
/// protocol) or holds (`UNRELEASED_INSTANCE_ID`, consumer protocol) this consumer's
/// instance id. librdkafka takes either for fatal; the poll thread forgets the partitions
/// and joins again with a new consumer (see `poll::Fences`).
pub(super) fn fenced_by(e: &rdkafka::error::KafkaError) -> Option<RDKafkaErrorCode> {
    match e {
        rdkafka::error::KafkaError::MessageConsumptionFatal(
            code @ (RDKafkaErrorCode::FencedInstanceId | RDKafkaErrorCode::UnreleasedInstanceId),
        ) => Some(*code),
        _ => None,
    }
}

impl Shared {
    /// Stops the transport with `error`, which the stream yields before it ends.
    pub(super) fn fail(&self, error: TransportError) {
        let waker = {
            let mut state = self.lock();
            state.errors.push_back(error);
            state.waker.take()
        };
        self.stop.store(true, Ordering::SeqCst);
        Shared::wake(waker);
    }
}

/// Logs a consumer error; a fatal one stops the transport.
pub(super) fn handle_poll_error(shared: &Shared, e: rdkafka::error::KafkaError) {
    use rdkafka::error::KafkaError as K;
    use RDKafkaErrorCode as C;
    match e {
        K::MessageConsumptionFatal(code) => {
            tracing::error!(error = %code, "fatal consumer error: the transport stops");
            shared.fail(TransportError::new(
                "fatal kafka consumer error",
                K::MessageConsumptionFatal(code),
            ));
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
        // A failed broker connection: librdkafka's own log has it (see
        // `producer::log_client_error`).
        other if crate::producer::is_connection_failure(&other) => {
            tracing::debug!(error = %other, "kafka consumer error");
        }
        other => tracing::warn!(error = %other, "kafka consumer error"),
    }
}
