//! The consumer: a poll thread that owns the librdkafka consumer, a shared table of partitions
//! and their offset trackers, and a [`Stream`] of [`Incoming`] deliveries for the worker.
//!
//! - The poll thread polls every 50ms whatever the handlers do, so `max.poll.interval.ms` is
//!   never exceeded by a slow handler. Back-pressure pauses partitions (not the loop).
//! - The stream hands out a record only when its partition's order allows it (see
//!   [`ProcessingOrder`]) and the partition is not being revoked.
//! - An acknowledger marks its offset settled; commits go up to the last contiguous settled
//!   record of each partition this member owns.
//! - Rebalance callbacks run on the poll thread: a revoke stops handing out the partitions,
//!   waits (bounded) for their in-flight records, commits what is contiguous and forgets them;
//!   later settlements for them are dropped.

use std::collections::{BTreeMap, VecDeque};
use std::future::Future;
use std::hash::{BuildHasher, RandomState};
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::task::{Context, Poll, Waker};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use consumer_core::{
    Acknowledger, DeadLetter, DeadLetterReason, Delivery, Incoming, LogPosition, Settlement,
    Source, TransportError,
};
use futures::future::BoxFuture;
use futures::Stream;
use rdkafka::consumer::{
    BaseConsumer, CommitMode as RdCommitMode, Consumer, ConsumerContext, Rebalance,
};
use rdkafka::error::{KafkaError, KafkaResult};
use rdkafka::message::{BorrowedMessage, Headers, Message};
use rdkafka::producer::FutureProducer;
use rdkafka::types::RDKafkaErrorCode;
use rdkafka::{ClientContext, Offset, TopicPartitionList};
use tokio::sync::watch;

use crate::config::{CommitMode, KafkaConfig, ProcessingOrder, RetryMode};
use crate::observer::{KafkaObserver, OffsetEvent};
use crate::producer::{self, LogContext, OutgoingRecord};
use crate::tracker::{KeyId, PartitionTracker, Weigh};
use crate::{headers, Error, KafkaPublisher};

/// How long one poll waits for a record before housekeeping runs.
const POLL_WAIT: Duration = Duration::from_millis(50);
/// How long one poll waits while a partition is paused because its buffer is full: its
/// resume (at the next housekeeping) must not wait for [`POLL_WAIT`], or the handlers run dry.
const POLL_WAIT_PAUSED: Duration = Duration::from_millis(5);
/// Records taken per round before housekeeping runs.
const POLL_BATCH: usize = 500;
/// Every this many commit intervals the current positions are committed again, even if
/// unchanged (see [`Shared::commit`]), but not more often than [`MIN_COMMIT_REFRESH`].
const COMMIT_REFRESH_FACTOR: u32 = 10;
const MIN_COMMIT_REFRESH: Duration = Duration::from_secs(1);
/// A dead-letter or retry copy that could not be written is tried again after this long.
const REWRITE_DELAY: Duration = Duration::from_secs(1);

/// A partition: topic and number.
type Tp = (Arc<str>, i32);

/// One fetched record, shared by its hand-outs and its acknowledger.
///
/// It keeps what librdkafka gave (payload, key, headers as bytes) and what the transport read
/// from its headers; the [`Delivery`] is built from it when it is handed out
/// ([`Record::delivery`]), off the poll thread and outside the state lock.
#[derive(Debug)]
struct Record {
    topic: Arc<str>,
    partition: i32,
    offset: i64,
    /// The topic its retry and dead-letter topics are named after (the retry topic's source).
    origin: Arc<str>,
    key: Option<Vec<u8>>,
    payload: Bytes,
    null_payload: bool,
    /// The headers as text, as deliveries carry them: one map shared by every hand-out.
    headers: Arc<BTreeMap<String, String>>,
    /// The headers as librdkafka gave them, kept only where the text map does not hold
    /// exactly the same (see [`read_headers`]): retry and dead-letter copies carry these.
    raw_headers: Option<RawHeaders>,
    /// From the message id header, else (if configured) the record's position.
    message_id: Option<String>,
    /// From the `x-attempt` header (1 without one).
    attempt: u32,
    /// A retry copy this group wrote (on a retry topic, with this group's
    /// [`headers::RETRY_GROUP`]): only then are its due time and origin headers its own.
    own_copy: bool,
    /// Payload, key and header bytes: what it counts against the partition's byte limit.
    bytes: usize,
}

/// `topic/partition@offset`: where a record is, and the message id derived from it.
fn location(topic: &str, partition: i32, offset: i64) -> String {
    format!("{topic}/{partition}@{offset}")
}

impl Record {
    /// `topic/partition@offset`.
    fn location(&self) -> String {
        location(&self.topic, self.partition, self.offset)
    }

    /// The envelope handed to the worker.
    fn delivery(&self, attempt: u32, redelivered: bool, position: LogPosition) -> Delivery {
        let mut headers = self.headers.clone();
        if attempt > 1 {
            let attempt = attempt.to_string();
            // A retry copy usually says so already; a record retried in place does not.
            if headers.get(headers::ATTEMPT) != Some(&attempt) {
                Arc::make_mut(&mut headers).insert(headers::ATTEMPT.to_owned(), attempt);
            }
        }
        Delivery {
            message_id: self.message_id.clone(),
            payload: self.payload.clone(),
            headers,
            redelivered,
            attempt,
            // A record past the committed offset may have been processed by a member that
            // then died: Kafka cannot say. Its position lets the runtime tell.
            fresh: false,
            position: Some(position),
            source: Source {
                transport: "kafka",
                location: self.location(),
            },
        }
    }

    /// The headers as the record carried them, in its order, as (name, value) pairs.
    fn original_headers(&self) -> RawHeaders {
        match &self.raw_headers {
            Some(raw) => raw.clone(),
            None => self
                .headers
                .iter()
                .map(|(k, v)| (k.clone(), Some(v.clone().into_bytes())))
                .collect(),
        }
    }
}

/// A record's headers as librdkafka gives them: names, and values that may be null.
type RawHeaders = Vec<(String, Option<Vec<u8>>)>;

/// A record's headers as text (a null value reads as empty, invalid UTF-8 is replaced, the
/// last of a repeated name wins), the headers as they were when that text says less than
/// they did (a null or non-UTF-8 value, a repeated name, names out of order), and their
/// size in bytes. Most records need only the text.
fn read_headers<H: Headers>(
    hs: Option<&H>,
) -> (BTreeMap<String, String>, Option<RawHeaders>, usize) {
    let mut text = BTreeMap::new();
    let mut bytes = 0;
    let Some(hs) = hs else {
        return (text, None, bytes);
    };
    let mut exact = true;
    let mut last: Option<&str> = None;
    for h in hs.iter() {
        bytes += h.key.len() + h.value.map_or(0, <[u8]>::len);
        exact &= last.is_none_or(|l| l < h.key);
        last = Some(h.key);
        let value = match h.value.map(std::str::from_utf8) {
            Some(Ok(v)) => v.to_owned(),
            Some(Err(_)) => {
                exact = false;
                String::from_utf8_lossy(h.value.unwrap_or_default()).into_owned()
            }
            None => {
                exact = false;
                String::new()
            }
        };
        text.insert(h.key.to_owned(), value);
    }
    let raw = (!exact).then(|| {
        hs.iter()
            .map(|h| (h.key.to_owned(), h.value.map(<[u8]>::to_vec)))
            .collect()
    });
    (text, raw, bytes)
}

/// A record as the tracker holds it: the record and the attempt its next hand-out carries.
#[derive(Debug)]
struct Handout {
    record: Arc<Record>,
    attempt: u32,
    redelivered: bool,
}

impl Weigh for Handout {
    fn weight(&self) -> usize {
        self.record.bytes
    }
}

struct Partition {
    generation: u64,
    /// `group/topic/partition`: the log its deliveries' [`LogPosition`]s name.
    log: Arc<str>,
    tracker: PartitionTracker<Handout>,
    revoking: bool,
    paused: bool,
    /// Last commit point committed (or stored).
    committed: Option<i64>,
    /// Paused because its buffer was full: resumed when it is half empty.
    full: bool,
}

#[derive(Default)]
struct State {
    partitions: BTreeMap<Tp, Partition>,
    cursor: usize,
    waker: Option<Waker>,
    errors: VecDeque<TransportError>,
    /// The poll thread has exited: the stream ends once nothing is left to hand out.
    finished: bool,
    /// Settled records, freed by the poll thread at its next round. The poll thread
    /// allocated them; freed by the worker threads that settle them, their memory would go
    /// back through the allocator's locked, cross-thread path (glibc takes the owning
    /// arena's lock once a thread's cache is full) while the poll thread allocates the next
    /// ones from that arena, each side on the slow path. A settled record's last handle
    /// usually is the one here.
    retired: Vec<Arc<Record>>,
    next_generation: u64,
}

/// What the transport needs from the configuration after validation.
struct Settings {
    order: ProcessingOrder,
    retry: RetryMode,
    commit: CommitMode,
    commit_interval: Duration,
    max_buffered: usize,
    max_buffered_bytes: usize,
    revoke_timeout: Duration,
    produce_timeout: Duration,
    message_id_header: String,
    offset_message_ids: bool,
    /// Retry topic name → the topic it retries.
    retry_sources: BTreeMap<String, Arc<str>>,
    retry_suffix: String,
    dead_letter_suffix: String,
    group_id: String,
    /// `kafka:<group>:<retry suffix>`: the consumers that read this group's retry copies
    /// (see `Acknowledger::copy_scope`).
    copy_scope: String,
}

struct Shared {
    state: Mutex<State>,
    /// Signalled when a record settles while a revoke waits for in-flight records.
    settled: Condvar,
    /// A revoke is waiting on `settled` (set and cleared under the state lock), so a
    /// settlement must signal it; otherwise it does not (a signal costs a system call).
    revoke_waiting: AtomicBool,
    settings: Settings,
    producer: FutureProducer<LogContext>,
    observer: KafkaObserver,
    stop: AtomicBool,
    closed: watch::Sender<bool>,
    /// Seeds the hash of record keys into [`KeyId`]s.
    key_seed: RandomState,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn wake(waker: Option<Waker>) {
        if let Some(w) = waker {
            w.wake();
        }
    }
}

/// The librdkafka consumer's context: logging and the rebalance callbacks.
struct ConsumerCtx {
    shared: Arc<Shared>,
}

impl ClientContext for ConsumerCtx {
    fn log(&self, level: rdkafka::config::RDKafkaLogLevel, fac: &str, log_message: &str) {
        producer::log_librdkafka(level, fac, log_message);
    }

    fn error(&self, error: rdkafka::error::KafkaError, reason: &str) {
        tracing::warn!(error = %error, reason, "librdkafka consumer error");
    }
}

impl ConsumerContext for ConsumerCtx {
    fn pre_rebalance(&self, consumer: &BaseConsumer<Self>, rebalance: &Rebalance<'_>) {
        match rebalance {
            Rebalance::Revoke(tpl) => self.shared.revoke(consumer, tpl),
            Rebalance::Assign(_) => {}
            Rebalance::Error(e) => tracing::warn!(error = %e, "rebalance error"),
        }
    }

    fn post_rebalance(&self, consumer: &BaseConsumer<Self>, rebalance: &Rebalance<'_>) {
        if let Rebalance::Assign(tpl) = rebalance {
            self.shared.assign(consumer, tpl);
        }
    }

    fn commit_callback(&self, result: KafkaResult<()>, offsets: &TopicPartitionList) {
        tracing::debug!(ok = result.is_ok(), offsets = ?offsets.to_topic_map(), "commit result");
        if let Err(e) = result {
            tracing::warn!(error = %e, "offset commit failed; it is retried at the next interval");
            let mut state = self.shared.lock();
            for elem in offsets.elements() {
                let tp: Tp = (Arc::from(elem.topic()), elem.partition());
                if let Some(p) = state.partitions.get_mut(&tp) {
                    if elem.offset().to_raw() == p.committed {
                        p.committed = None;
                    }
                }
            }
        }
    }
}

/// The record's ordering key, hashed with this consumer's random seed (see [`KeyId`]).
fn key_id(seed: &RandomState, key: Option<&[u8]>) -> KeyId {
    key.map(|k| seed.hash_one(k))
}

fn unix_millis() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX))
        .unwrap_or_default()
}

impl Shared {
    /// Turns a fetched message into a tracked record of its partition (if still owned), and
    /// returns whether that partition's buffer has reached a limit (the caller then pauses it
    /// before taking more). `topics` keeps one shared name per topic, so a record does not
    /// allocate its own.
    fn ingest(&self, m: &BorrowedMessage<'_>, topics: &mut Vec<Arc<str>>) -> bool {
        let s = &self.settings;
        let topic = match topics.iter().find(|t| ***t == *m.topic()) {
            Some(t) => t.clone(),
            None => {
                let t: Arc<str> = Arc::from(m.topic());
                topics.push(t.clone());
                t
            }
        };
        let (partition, offset) = (m.partition(), m.offset());
        let (text_headers, raw_headers, header_bytes) = read_headers(m.headers());
        let header = |name: &str| text_headers.get(name).map(String::as_str);
        let origin = s.retry_sources.get(&*topic).cloned();
        let group = header(headers::RETRY_GROUP);
        // Another group's retry copy (groups share a topic's retry topic): not ours to run.
        let foreign = origin.is_some() && group.is_some_and(|g| g != s.group_id);
        // A record on the retry topic without a group was not written by this transport
        // (a producer wrote it there, or a tool): it runs, but as a record of its own, not
        // as our copy: its due time does not hold the partition back, its origin headers
        // are not trusted.
        let own_copy = origin.is_some() && group == Some(s.group_id.as_str());
        if foreign {
            let mut state = self.lock();
            if let Some(p) = state
                .partitions
                .get_mut(&(topic, partition))
                .filter(|p| !p.revoking)
            {
                p.tracker.push_settled(offset);
            }
            return false;
        }
        let attempt = header(headers::ATTEMPT)
            .and_then(|a| a.parse::<u32>().ok())
            .filter(|&a| a >= 1)
            .unwrap_or(1);
        // Only our own copies on a retry topic wait for their due time.
        let not_before = own_copy
            .then(|| header(headers::DUE_AT))
            .flatten()
            .and_then(|d| d.parse::<i64>().ok())
            .and_then(|due| {
                let wait = due.saturating_sub(unix_millis());
                (wait > 0).then(|| Instant::now() + Duration::from_millis(wait.unsigned_abs()))
            });
        let message_id = header(&s.message_id_header)
            .filter(|v| !v.is_empty())
            .map(str::to_owned)
            .or_else(|| {
                s.offset_message_ids
                    .then(|| location(&topic, partition, offset))
            });
        let payload = m.payload().unwrap_or_default();
        let bytes = payload.len() + m.key().map_or(0, <[u8]>::len) + header_bytes;
        let record = Arc::new(Record {
            bytes,
            origin: origin.unwrap_or_else(|| topic.clone()),
            topic: topic.clone(),
            partition,
            offset,
            key: m.key().map(<[u8]>::to_vec),
            payload: Bytes::copy_from_slice(payload),
            null_payload: m.payload().is_none(),
            headers: Arc::new(text_headers),
            raw_headers,
            message_id,
            attempt,
            own_copy,
        });
        let mut state = self.lock();
        let Some(p) = state.partitions.get_mut(&(topic, partition)) else {
            // Fetched just before its partition was revoked: the new owner reads it.
            return false;
        };
        if p.revoking {
            return false;
        }
        let key = key_id(&self.key_seed, record.key.as_deref());
        let pushed = p.tracker.push(
            offset,
            key,
            not_before,
            Handout {
                record,
                attempt,
                redelivered: false,
            },
        );
        let full = p.tracker.len() >= self.settings.max_buffered
            || p.tracker.bytes() >= self.settings.max_buffered_bytes;
        // A stream waiting for records gets this one now, not after the poll round.
        let waker = if pushed && not_before.is_none() {
            state.waker.take()
        } else {
            None
        };
        drop(state);
        Shared::wake(waker);
        full
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
    /// `retired` (empty) is swapped for the settled records, which the caller frees outside
    /// the lock (see [`State::retired`]).
    fn housekeeping(
        &self,
        consumer: &BaseConsumer<ConsumerCtx>,
        retired: &mut Vec<Arc<Record>>,
    ) -> bool {
        let now = Instant::now();
        let mut pause = TopicPartitionList::new();
        let mut resume = TopicPartitionList::new();
        let (max, max_bytes) = (self.settings.max_buffered, self.settings.max_buffered_bytes);
        let mut any_full = false;
        let waker = {
            let mut state = self.lock();
            std::mem::swap(&mut state.retired, retired);
            let mut ready = false;
            for ((topic, partition), p) in state.partitions.iter_mut() {
                let waiting_for_due = p.tracker.head_not_before().is_some_and(|t| t > now);
                let (len, bytes) = (p.tracker.len(), p.tracker.bytes());
                p.full = if p.full {
                    len > max / 2 || bytes > max_bytes / 2
                } else {
                    len >= max || bytes >= max_bytes
                };
                any_full |= p.full && !p.revoking;
                let want_pause = p.revoking || p.full || waiting_for_due;
                if want_pause != p.paused {
                    let list = if want_pause { &mut pause } else { &mut resume };
                    list.add_partition(topic, *partition);
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
        retired.clear();
        if pause.count() > 0 {
            tracing::debug!(partitions = ?pause.to_topic_map().keys(), "pausing");
            if let Err(e) = consumer.pause(&pause) {
                tracing::warn!(error = %e, "pausing partitions failed");
            }
        }
        if resume.count() > 0 {
            tracing::debug!(partitions = ?resume.to_topic_map().keys(), "resuming");
            if let Err(e) = consumer.resume(&resume) {
                tracing::warn!(error = %e, "resuming partitions failed");
            }
        }
        any_full
    }

    /// Commits (or stores) the contiguous settled position of every owned partition that
    /// moved since the last commit; with `refresh`, of every owned partition.
    ///
    /// librdkafka does not report the outcome of an asynchronous manual commit to the event
    /// API rdkafka uses, and commits sent while the group rebalances fail ("generation id
    /// not valid"). A failed commit is therefore not noticed; the periodic refresh sends the
    /// current positions again, so one always lands once the group is stable.
    fn commit(&self, consumer: &BaseConsumer<ConsumerCtx>, mode: RdCommitMode, refresh: bool) {
        let tpl = {
            let mut state = self.lock();
            let mut tpl = TopicPartitionList::new();
            let mut events = Vec::new();
            for ((topic, partition), p) in state.partitions.iter_mut() {
                if p.revoking {
                    continue;
                }
                if let Some(point) = p.tracker.commit_point() {
                    if refresh || p.committed != Some(point) {
                        if let Err(e) =
                            tpl.add_partition_offset(topic, *partition, Offset::Offset(point))
                        {
                            tracing::warn!(error = %e, "cannot build the commit list");
                            continue;
                        }
                        p.committed = Some(point);
                        events.push(OffsetEvent::Committed {
                            topic: topic.to_string(),
                            partition: *partition,
                            offset: point,
                        });
                    }
                }
            }
            // Recorded under the state lock, so the log orders commits against
            // assignments and revocations exactly as they happened.
            self.observer.record_all(events);
            tpl
        };
        self.send_commit(consumer, &tpl, mode);
    }

    fn send_commit(
        &self,
        consumer: &BaseConsumer<ConsumerCtx>,
        tpl: &TopicPartitionList,
        mode: RdCommitMode,
    ) {
        if tpl.count() == 0 {
            return;
        }
        tracing::debug!(offsets = ?tpl.to_topic_map(), ?mode, "committing");
        let result = match self.settings.commit {
            CommitMode::Manual => consumer.commit(tpl, mode),
            CommitMode::AutoStore => consumer.store_offsets(tpl),
        };
        if let Err(e) = result {
            tracing::warn!(error = %e, "committing offsets failed; retried at the next interval");
            let mut state = self.lock();
            for elem in tpl.elements() {
                let tp: Tp = (Arc::from(elem.topic()), elem.partition());
                if let Some(p) = state.partitions.get_mut(&tp) {
                    p.committed = None;
                }
            }
        }
    }

    /// The revoke callback: stop handing out, wait (bounded) for in-flight records, commit
    /// what is contiguous, forget the partitions. Runs on the poll thread.
    fn revoke(&self, consumer: &BaseConsumer<ConsumerCtx>, tpl: &TopicPartitionList) {
        let lost = consumer.assignment_lost();
        let tps: Vec<Tp> = tpl
            .elements()
            .iter()
            .map(|e| (Arc::from(e.topic()), e.partition()))
            .collect();
        let mut state = self.lock();
        for tp in &tps {
            if let Some(p) = state.partitions.get_mut(tp) {
                p.revoking = true;
            }
        }
        let in_flight = |state: &State| {
            tps.iter()
                .filter_map(|tp| state.partitions.get(tp))
                .map(|p| p.tracker.in_flight())
                .sum::<usize>()
        };
        if !lost {
            let deadline = Instant::now() + self.settings.revoke_timeout;
            // Under the state lock, so a settlement after this point signals.
            self.revoke_waiting.store(true, Ordering::SeqCst);
            loop {
                let n = in_flight(&state);
                let now = Instant::now();
                if n == 0 {
                    break;
                }
                if now >= deadline {
                    tracing::warn!(
                        in_flight = n,
                        timeout = ?self.settings.revoke_timeout,
                        "revoke: in-flight records did not settle in time; the new owner redelivers them"
                    );
                    break;
                }
                state = self
                    .settled
                    .wait_timeout(state, deadline - now)
                    .map(|(g, _)| g)
                    .unwrap_or_else(|p| p.into_inner().0);
            }
            self.revoke_waiting.store(false, Ordering::SeqCst);
        }
        let mut commit = TopicPartitionList::new();
        let mut events = Vec::new();
        for tp in &tps {
            let Some(p) = state.partitions.remove(tp) else {
                continue;
            };
            if !lost {
                // Always sent (synchronously): an earlier asynchronous commit of the same
                // position may have failed unnoticed.
                if let Some(point) = p.tracker.commit_point() {
                    if commit
                        .add_partition_offset(&tp.0, tp.1, Offset::Offset(point))
                        .is_ok()
                    {
                        events.push(OffsetEvent::Committed {
                            topic: tp.0.to_string(),
                            partition: tp.1,
                            offset: point,
                        });
                    }
                }
            }
            events.push(OffsetEvent::Revoked {
                topic: tp.0.to_string(),
                partition: tp.1,
                lost,
                unsettled: p.tracker.in_flight(),
            });
        }
        // The commit comes first in the log: it is sent while the partitions are still ours.
        self.observer.record_all(events);
        drop(state);
        tracing::info!(partitions = tps.len(), lost, "partitions revoked");
        // Synchronously, while the partitions are still assigned to this member.
        self.send_commit(consumer, &commit, RdCommitMode::Sync);
    }

    /// The assign callback (after librdkafka applied the assignment).
    fn assign(&self, consumer: &BaseConsumer<ConsumerCtx>, tpl: &TopicPartitionList) {
        let mut events = Vec::new();
        {
            let mut state = self.lock();
            for e in tpl.elements() {
                let tp: Tp = (Arc::from(e.topic()), e.partition());
                if state.partitions.contains_key(&tp) {
                    continue;
                }
                state.next_generation += 1;
                let generation = state.next_generation;
                state.partitions.insert(
                    tp,
                    Partition {
                        generation,
                        log: Arc::from(format!(
                            "{}/{}/{}",
                            self.settings.group_id,
                            e.topic(),
                            e.partition()
                        )),
                        tracker: PartitionTracker::default(),
                        revoking: false,
                        paused: false,
                        committed: None,
                        full: false,
                    },
                );
                events.push(OffsetEvent::Assigned {
                    topic: e.topic().to_owned(),
                    partition: e.partition(),
                });
            }
            self.observer.record_all(events);
        }
        tracing::info!(partitions = tpl.count(), "partitions assigned");
        // A partition paused before an earlier revoke must not stay paused.
        if let Err(e) = consumer.resume(tpl) {
            tracing::debug!(error = %e, "resume after assignment");
        }
    }

    /// Runs `f` on the partition if it is still the same assignment (`generation`), `None`
    /// if not. `f` is told whether the stream waits for a record and given the retired
    /// list (see [`State::retired`]); it says whether the stream must be woken: then its
    /// waker is returned.
    fn with_partition(
        &self,
        tp: &Tp,
        generation: u64,
        f: impl FnOnce(&mut Partition, bool, &mut Vec<Arc<Record>>) -> bool,
    ) -> Option<Option<Waker>> {
        let mut state = self.lock();
        let State {
            partitions,
            waker,
            retired,
            ..
        } = &mut *state;
        let p = partitions
            .get_mut(tp)
            .filter(|p| p.generation == generation)?;
        let wake = f(p, waker.is_some(), retired);
        Some(if wake { waker.take() } else { None })
    }

    /// Wakes a revoke waiting for in-flight records, if one is.
    fn signal_revoke(&self) {
        if self.revoke_waiting.load(Ordering::SeqCst) {
            self.settled.notify_all();
        }
    }

    fn revoked_error(&self, record: &Record) -> TransportError {
        self.observer.record_all([OffsetEvent::SettlementDropped {
            topic: record.topic.to_string(),
            partition: record.partition,
            offset: record.offset,
        }]);
        TransportError::msg(format!(
            "partition {}/{} was revoked before {} settled; the new owner redelivers it",
            record.topic,
            record.partition,
            record.location()
        ))
    }

    fn mark_settled(
        &self,
        tp: &Tp,
        generation: u64,
        record: &Arc<Record>,
    ) -> Result<(), TransportError> {
        let order = self.settings.order;
        let settled = self.with_partition(tp, generation, |p, waiting, retired| {
            p.tracker.settle(record.offset);
            retired.push(record.clone());
            // A waiting stream is woken only if the settlement let a record go (an earlier
            // record of its key, or of the partition, settled); anything else wakes it where
            // it arrives.
            waiting && p.tracker.has_next(order, Instant::now())
        });
        self.changed(settled, record)
    }

    /// After a record's settlement or deferral ([`Shared::with_partition`]'s result): wakes a
    /// waiting revoke and the stream, or reports the partition revoked.
    fn changed(
        &self,
        outcome: Option<Option<Waker>>,
        record: &Record,
    ) -> Result<(), TransportError> {
        match outcome {
            Some(waker) => {
                self.signal_revoke();
                Shared::wake(waker);
                Ok(())
            }
            None => Err(self.revoked_error(record)),
        }
    }

    /// Puts the record back in its place, due at `not_before`, carrying `attempt`.
    fn defer(
        &self,
        tp: &Tp,
        generation: u64,
        record: &Record,
        delay: Duration,
        attempt: u32,
    ) -> Result<(), TransportError> {
        let not_before = Instant::now() + delay;
        let deferred = self.with_partition(tp, generation, |p, _, _| {
            if let Some(h) = p.tracker.defer(record.offset, not_before) {
                h.attempt = attempt;
                h.redelivered = true;
            }
            true
        });
        self.changed(deferred, record)
    }

    fn owned(&self, tp: &Tp, generation: u64) -> bool {
        self.lock()
            .partitions
            .get(tp)
            .is_some_and(|p| p.generation == generation)
    }
}

/// Settles one Kafka record.
struct KafkaAcker {
    shared: Arc<Shared>,
    tp: Tp,
    generation: u64,
    record: Arc<Record>,
    done: bool,
}

impl Drop for KafkaAcker {
    fn drop(&mut self) {
        if !self.done {
            // Dropped unsettled (the worker stopped or crashed): never committed past, and a
            // revoke does not wait for it.
            let offset = self.record.offset;
            // It holds its key back for good, so nothing new can go: the stream is not woken.
            let _ = self
                .shared
                .with_partition(&self.tp, self.generation, |p, _, _| {
                    p.tracker.abandon(offset);
                    false
                });
            self.shared.signal_revoke();
        }
    }
}

impl Acknowledger for KafkaAcker {
    fn settle(
        self: Box<Self>,
        settlement: Settlement,
    ) -> BoxFuture<'static, Result<(), TransportError>> {
        Box::pin(async move {
            let mut this = self;
            let result = this.apply(settlement).await;
            this.done = true;
            result
        })
    }

    /// With a retry topic, a retry writes a copy that this consumer group reads back from
    /// the retry topic; a blocking retry puts the record back in place, and a replay of it is
    /// then its only copy.
    fn copy_scope(&self) -> Option<&str> {
        match self.shared.settings.retry {
            RetryMode::RetryTopic => Some(&self.shared.settings.copy_scope),
            RetryMode::Blocking => None,
        }
    }
}

impl KafkaAcker {
    async fn apply(&self, settlement: Settlement) -> Result<(), TransportError> {
        let shared = &self.shared;
        let (tp, generation, record) = (&self.tp, self.generation, &self.record);
        match settlement {
            Settlement::Ack => shared.mark_settled(tp, generation, record),
            Settlement::Retry { delay, attempt } => match shared.settings.retry {
                RetryMode::Blocking => shared.defer(tp, generation, record, delay, attempt),
                RetryMode::RetryTopic => {
                    if !shared.owned(tp, generation) {
                        return Err(shared.revoked_error(record));
                    }
                    let topic = format!("{}{}", record.origin, shared.settings.retry_suffix);
                    let out = retry_copy(record, &shared.settings, delay, attempt);
                    match producer::send(
                        &shared.producer,
                        &topic,
                        &out,
                        shared.settings.produce_timeout,
                    )
                    .await
                    {
                        Ok(_) => {
                            // The copy is the outcome: once it is written the retry is done,
                            // even if the partition was revoked meanwhile. The new owner's
                            // replay of this record is then superseded by the copy (see
                            // `copy_scope`).
                            if let Err(e) = shared.mark_settled(tp, generation, record) {
                                tracing::debug!(error = %e, "retry copy written after a revoke");
                            }
                            Ok(())
                        }
                        Err(e) => {
                            // Not written: retry in place instead, so the record is not stuck.
                            let _ = shared.defer(tp, generation, record, delay, attempt);
                            Err(TransportError::new("writing the retry copy failed", e))
                        }
                    }
                }
            },
            Settlement::DeadLetter(dl) => {
                if !shared.owned(tp, generation) {
                    return Err(shared.revoked_error(record));
                }
                let topic = format!("{}{}", record.origin, shared.settings.dead_letter_suffix);
                let out = dead_letter_copy(record, &dl);
                let timeout = shared.settings.produce_timeout;
                let mut written = producer::send(&shared.producer, &topic, &out, timeout).await;
                if written.as_ref().is_err_and(is_too_large) {
                    // A copy that can never be written would be retried for good, holding
                    // the partition: a dead letter pointing at the original (which stays
                    // where it is until this one is written) takes its place.
                    tracing::warn!(
                        record = %record.location(),
                        bytes = record.bytes,
                        "the dead letter is too large to write; writing a reference to the record instead"
                    );
                    let out = reference_letter(record, &dl, &shared.settings);
                    written = producer::send(&shared.producer, &topic, &out, timeout).await;
                }
                match written {
                    Ok(_) => shared.mark_settled(tp, generation, record),
                    Err(e) => {
                        // The redelivery is dead-lettered again (the inbox remembers why).
                        let _ = shared.defer(tp, generation, record, REWRITE_DELAY, record.attempt);
                        Err(TransportError::new("writing the dead letter failed", e))
                    }
                }
            }
        }
    }
}

/// The original headers without those the transport manages, and without the origin
/// headers unless the record is our own retry copy (see [`headers::ORIGIN`]).
fn carried_headers(record: &Record) -> RawHeaders {
    let mut hs = record.original_headers();
    hs.retain(|(k, _)| !headers::MANAGED.contains(&k.as_str()) && trusted_origin(record, k));
    hs
}

/// Whether header `name` may be carried into a copy of `record` as far as origin headers
/// go: anything else, and origin headers of our own copies.
fn trusted_origin(record: &Record, name: &str) -> bool {
    record.own_copy || !headers::ORIGIN.contains(&name)
}

fn text(k: &str, v: impl ToString) -> (String, Option<Vec<u8>>) {
    (k.to_owned(), Some(v.to_string().into_bytes()))
}

fn has_header(hs: &[(String, Option<Vec<u8>>)], name: &str) -> bool {
    hs.iter().any(|(k, _)| k == name)
}

/// Where a record first came from: its own position, unless it is a retry copy that says.
fn add_origin(hs: &mut Vec<(String, Option<Vec<u8>>)>, record: &Record) {
    if !has_header(hs, headers::ORIGINAL_TOPIC) {
        hs.push(text(headers::ORIGINAL_TOPIC, &record.topic));
        hs.push(text(headers::ORIGINAL_PARTITION, record.partition));
        hs.push(text(headers::ORIGINAL_OFFSET, record.offset));
    }
}

fn retry_copy(record: &Record, s: &Settings, delay: Duration, attempt: u32) -> OutgoingRecord {
    let mut hs = carried_headers(record);
    // The copy keeps the message's identity even when it was derived (offset ids).
    if let Some(id) = &record.message_id {
        if !has_header(&hs, &s.message_id_header) {
            hs.push(text(&s.message_id_header, id));
        }
    }
    let due = unix_millis().saturating_add(i64::try_from(delay.as_millis()).unwrap_or(i64::MAX));
    hs.push(text(headers::ATTEMPT, attempt));
    hs.push(text(headers::DUE_AT, due));
    hs.push(text(headers::RETRY_GROUP, &s.group_id));
    add_origin(&mut hs, record);
    OutgoingRecord {
        key: record.key.clone(),
        payload: (!record.null_payload).then(|| record.payload.to_vec()),
        headers: hs,
    }
}

fn dead_letter_copy(record: &Record, dl: &DeadLetter) -> OutgoingRecord {
    let mut hs = record.original_headers();
    hs.retain(|(k, _)| {
        (!headers::MANAGED.contains(&k.as_str()) || k.as_str() == headers::ATTEMPT)
            && trusted_origin(record, k)
    });
    hs.push(text(headers::DEAD_LETTER_REASON, dl.reason.as_str()));
    hs.push(text(headers::HANDLER, &dl.handler));
    if let Some(key) = &dl.key {
        hs.push(text(headers::KEY, key));
    }
    hs.push(text(headers::ATTEMPTS, dl.attempts));
    hs.push(text(
        headers::ERROR,
        headers::truncate(&dl.error, headers::MAX_ERROR_LEN),
    ));
    add_origin(&mut hs, record);
    OutgoingRecord {
        key: record.key.clone(),
        payload: (!record.null_payload).then(|| record.payload.to_vec()),
        headers: hs,
    }
}

/// Whether a write failed because the record is larger than the producer or the broker
/// accepts: writing it again can never succeed.
fn is_too_large(e: &Error) -> bool {
    let Error::Produce { source, .. } = e else {
        return false;
    };
    matches!(
        source.downcast_ref::<KafkaError>(),
        Some(KafkaError::MessageProduction(
            RDKafkaErrorCode::MessageSizeTooLarge
        ))
    )
}

/// The dead letter written when [`dead_letter_copy`] is too large: reason `copy_too_large`,
/// the first reason and error in its error text, the origin and the message id in its
/// headers, and as its body a JSON reference to the record (`topic`, `partition`,
/// `offset`) instead of the record's own key, body and headers.
fn reference_letter(record: &Record, dl: &DeadLetter, s: &Settings) -> OutgoingRecord {
    let mut hs = Vec::new();
    if let Some(id) = &record.message_id {
        hs.push(text(&s.message_id_header, headers::truncate(id, 1024)));
    }
    hs.push(text(
        headers::DEAD_LETTER_REASON,
        DeadLetterReason::CopyTooLarge.as_str(),
    ));
    hs.push(text(headers::HANDLER, &dl.handler));
    if let Some(key) = &dl.key {
        hs.push(text(headers::KEY, headers::truncate(key, 1024)));
    }
    hs.push(text(headers::ATTEMPTS, dl.attempts));
    let error = format!(
        "{}: {} (the record, {} bytes with key and headers, is too large to copy; it is still at {})",
        dl.reason.as_str(),
        dl.error,
        record.bytes,
        record.location()
    );
    hs.push(text(
        headers::ERROR,
        headers::truncate(&error, headers::MAX_ERROR_LEN),
    ));
    if record.own_copy {
        // A retry copy says where the message first came from; the reference is to the
        // copy itself, the record that exists.
        for name in [
            headers::ORIGINAL_TOPIC,
            headers::ORIGINAL_PARTITION,
            headers::ORIGINAL_OFFSET,
        ] {
            if let Some(v) = record.headers.get(name) {
                hs.push(text(name, v));
            }
        }
    }
    add_origin(&mut hs, record);
    // Topic names are `[A-Za-z0-9._-]`: nothing to escape.
    let reference = format!(
        r#"{{"topic":"{}","partition":{},"offset":{}}}"#,
        record.topic, record.partition, record.offset
    );
    OutgoingRecord {
        key: None,
        payload: Some(reference.into_bytes()),
        headers: hs,
    }
}

/// A Kafka consumer as a [`consumer_core::Transport`]: give it to
/// [`consumer_core::Worker::run`].
///
/// Dropping it (the worker does, when it stops) stops the poll thread, which commits what is
/// settled, waits (up to `revoke_timeout`) for records still in flight, and leaves the
/// group; [`KafkaConsumer::closed`] resolves when that is done.
pub struct KafkaConsumer {
    shared: Arc<Shared>,
    closed: watch::Receiver<bool>,
}

impl std::fmt::Debug for KafkaConsumer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KafkaConsumer").finish_non_exhaustive()
    }
}

impl KafkaConsumer {
    /// Validates `config`, creates the producer and the consumer, subscribes, and starts the
    /// poll thread. Fails naming the field on bad configuration.
    pub fn new(config: KafkaConfig) -> Result<Self, Error> {
        config.validate()?;
        let producer = producer::create(&config.producer_client_config(), config.produce_timeout)?;
        let (closed_tx, closed_rx) = watch::channel(false);
        let retry_sources = config
            .topics
            .iter()
            .map(|t| (config.retry_topic(t), Arc::<str>::from(t.as_str())))
            .collect();
        let shared = Arc::new(Shared {
            state: Mutex::new(State::default()),
            settled: Condvar::new(),
            revoke_waiting: AtomicBool::new(false),
            settings: Settings {
                order: config.order,
                retry: config.retry,
                commit: config.commit,
                commit_interval: config.commit_interval,
                max_buffered: config.max_buffered_per_partition,
                max_buffered_bytes: config.max_buffered_bytes_per_partition,
                revoke_timeout: config.revoke_timeout,
                produce_timeout: config.produce_timeout,
                message_id_header: config.message_id_header.clone(),
                offset_message_ids: config.offset_message_ids,
                retry_sources,
                retry_suffix: config.retry_topic_suffix.clone(),
                dead_letter_suffix: config.dead_letter_topic_suffix.clone(),
                group_id: config.group_id.clone(),
                copy_scope: format!("kafka:{}:{}", config.group_id, config.retry_topic_suffix),
            },
            producer,
            observer: KafkaObserver::default(),
            stop: AtomicBool::new(false),
            closed: closed_tx,
            key_seed: RandomState::new(),
        });
        let consumer: BaseConsumer<ConsumerCtx> = config
            .consumer_client_config()
            .create_with_context(ConsumerCtx {
                shared: shared.clone(),
            })
            .map_err(|e| producer::client_error("creating the consumer", e))?;
        let topics = config.subscribed_topics();
        let names: Vec<&str> = topics.iter().map(String::as_str).collect();
        consumer
            .subscribe(&names)
            .map_err(|e| producer::client_error("subscribing", e))?;
        tracing::info!(group = %config.group_id, topics = ?topics, "kafka consumer started");
        let thread_shared = shared.clone();
        std::thread::Builder::new()
            .name("kafka-poll".to_owned())
            .spawn(move || poll_loop(consumer, thread_shared))
            .map_err(|e| Error::client("starting the poll thread", e))?;
        Ok(KafkaConsumer {
            shared,
            closed: closed_rx,
        })
    }

    /// Offsets, assignments and dropped settlements, as they happen (for tests and metrics).
    pub fn observer(&self) -> KafkaObserver {
        self.shared.observer.clone()
    }

    /// A publisher sharing this consumer's idempotent producer.
    pub fn publisher(&self) -> KafkaPublisher {
        KafkaPublisher::from_producer(
            self.shared.producer.clone(),
            self.shared.settings.message_id_header.clone(),
            self.shared.settings.produce_timeout,
        )
    }

    /// Resolves once the poll thread has committed what was settled and left the group
    /// (after this consumer was dropped).
    pub fn closed(&self) -> impl Future<Output = ()> + Send + 'static {
        let mut rx = self.closed.clone();
        async move {
            // An error means the sender is gone: the thread has ended too.
            let _ = rx.wait_for(|closed| *closed).await;
        }
    }
}

impl Drop for KafkaConsumer {
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::SeqCst);
    }
}

impl Stream for KafkaConsumer {
    type Item = Result<Incoming, TransportError>;

    fn poll_next(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        let shared = &self.shared;
        let order = shared.settings.order;
        let mut state = shared.lock();
        if let Some(e) = state.errors.pop_front() {
            return Poll::Ready(Some(Err(e)));
        }
        let now = Instant::now();
        let n = state.partitions.len();
        let start = state.cursor;
        let mut taken = None;
        for i in 0..n {
            let index = (start + i) % n;
            let Some((tp, p)) = state.partitions.iter_mut().nth(index) else {
                break;
            };
            if p.revoking {
                continue;
            }
            let Some((_, h)) = p.tracker.take_next(order, now) else {
                continue;
            };
            let position = LogPosition {
                log: p.log.clone(),
                epoch: p.generation,
                offset: h.record.offset,
            };
            let acker = KafkaAcker {
                shared: shared.clone(),
                tp: tp.clone(),
                generation: p.generation,
                record: h.record.clone(),
                done: false,
            };
            taken = Some((acker, h.attempt, h.redelivered, position));
            state.cursor = index + 1;
            break;
        }
        if let Some((acker, attempt, redelivered, position)) = taken {
            // Built outside the lock: the poll thread and the settlements wait on it.
            drop(state);
            let delivery = acker.record.delivery(attempt, redelivered, position);
            return Poll::Ready(Some(Ok(Incoming {
                delivery,
                acker: Box::new(acker),
            })));
        }
        if state.finished {
            return Poll::Ready(None);
        }
        state.waker = Some(cx.waker().clone());
        Poll::Pending
    }
}

fn poll_loop(consumer: BaseConsumer<ConsumerCtx>, shared: Arc<Shared>) {
    let mut last_commit = Instant::now();
    let mut last_refresh = Instant::now();
    let refresh_interval =
        (shared.settings.commit_interval * COMMIT_REFRESH_FACTOR).max(MIN_COMMIT_REFRESH);
    let mut last_summary = Instant::now();
    let mut any_full = false;
    let mut topics = Vec::new();
    let mut retired = Vec::new();
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
                    // A partition that reached its limit is paused at once (housekeeping),
                    // not after the rest of the round: the limits hold record by record.
                    if shared.ingest(&m, &mut topics) {
                        break;
                    }
                }
                Some(Err(e)) => {
                    handle_poll_error(&shared, e);
                    break;
                }
            }
        }
        any_full = shared.housekeeping(&consumer, &mut retired);
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

#[cfg(test)]
mod tests {
    use super::*;
    use rdkafka::message::{Header, OwnedHeaders};

    /// Headers as a test writes them: name, value (`None` for null).
    type Pairs<'a> = &'a [(&'a str, Option<&'a [u8]>)];

    fn headers(pairs: Pairs<'_>) -> OwnedHeaders {
        pairs.iter().fold(OwnedHeaders::new(), |hs, &(key, value)| {
            hs.insert(Header { key, value })
        })
    }

    fn text(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
        pairs
            .iter()
            .map(|&(k, v)| (k.to_owned(), v.to_owned()))
            .collect()
    }

    #[test]
    fn headers_the_text_map_holds_exactly_are_kept_once() {
        let hs = headers(&[("a", Some(b"1")), ("message-id", Some(b"m-7"))]);
        let (map, raw, bytes) = read_headers(Some(&hs));
        assert_eq!(map, text(&[("a", "1"), ("message-id", "m-7")]));
        assert_eq!(raw, None);
        assert_eq!(bytes, 1 + 1 + 10 + 3);
        let (map, raw, bytes) = read_headers::<OwnedHeaders>(None);
        assert!(map.is_empty() && raw.is_none() && bytes == 0);
    }

    #[test]
    fn headers_the_text_map_would_change_are_kept_as_they_were() {
        let cases: [Pairs<'_>; 4] = [
            &[("a", None)],
            &[("a", Some(b"\xff\xfe"))],
            &[("a", Some(b"1")), ("a", Some(b"2"))],
            &[("b", Some(b"1")), ("a", Some(b"2"))],
        ];
        for pairs in cases {
            let (map, raw, _) = read_headers(Some(&headers(pairs)));
            let expected: RawHeaders = pairs
                .iter()
                .map(|&(k, v)| (k.to_owned(), v.map(<[u8]>::to_vec)))
                .collect();
            assert_eq!(raw.as_ref(), Some(&expected), "{pairs:?}");
            // The text map reads as deliveries always did: null is empty, the last name wins.
            let last = |name: &str| pairs.iter().rev().find(|(k, _)| *k == name);
            for (k, v) in &map {
                let (_, value) = last(k).expect("a header of the record");
                assert_eq!(*v, String::from_utf8_lossy(value.unwrap_or_default()));
            }
        }
    }
}
