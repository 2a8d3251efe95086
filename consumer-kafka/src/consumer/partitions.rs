//! The partitions this member owns, each with its offset tracker, in one table shared by
//! the poll thread, the stream and the acknowledgers; what a record's settlement or
//! deferral does to its partition; and the acknowledger of a record ([`KafkaAcker`], kept
//! for reuse once settled), whose settlements the `acker` module carries out.

use std::collections::{BTreeMap, VecDeque};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, OnceLock};
use std::task::Waker;
use std::thread::Thread;
use std::time::{Duration, Instant};

use consumer_core::transport::{AckResults, TransportError};
use crossbeam_utils::CachePadded;
use tokio::sync::watch;

use super::record::{Handout, Record, Tp};
use crate::config::{CommitMode, ProcessingOrder, RetryMode};
use crate::observer::{KafkaObserver, OffsetEvent};
use crate::producer::Producer;
use crate::tracker::PartitionTracker;

/// One owned partition: its assignment, its tracker, and whether it is being revoked, paused
/// or full.
pub(super) struct Partition {
    pub(super) generation: u64,
    /// `group/topic/partition`: the log its deliveries'
    /// [`LogPosition`](consumer_core::transport::LogPosition)s name.
    pub(super) log: Arc<str>,
    pub(super) tracker: PartitionTracker<Handout>,
    pub(super) revoking: bool,
    pub(super) paused: bool,
    /// Last commit point committed (or stored).
    pub(super) committed: Option<i64>,
    /// Its buffer was full: its queue is left unread until the buffer is half empty.
    pub(super) full: bool,
    /// Its records come in a queue of its own (see `queues`). Until they do, they come in
    /// the consumer's queue with every partition's, and a full buffer pauses it instead.
    pub(super) own_queue: bool,
    /// When it was assigned: for a while after, its progress is committed at once (see
    /// `poll::EAGER_COMMIT_FOR`).
    pub(super) assigned_at: Instant,
}

impl Partition {
    /// A partition just assigned, as assignment `generation`, whose deliveries name `log`:
    /// nothing buffered, nothing committed, not paused.
    pub(super) fn new(generation: u64, log: Arc<str>) -> Self {
        Partition {
            generation,
            log,
            tracker: PartitionTracker::default(),
            revoking: false,
            paused: false,
            committed: None,
            full: false,
            own_queue: false,
            assigned_at: Instant::now(),
        }
    }

    /// Whether it was marked full and its buffer is still above half of either limit:
    /// until it is not, its queue is left unread, so that it is read in runs rather than a
    /// record at a time.
    pub(super) fn held_back(&self, s: &Settings) -> bool {
        self.full
            && (self.tracker.len() > s.max_buffered / 2
                || self.tracker.bytes() > s.max_buffered_bytes / 2)
    }

    /// Whether it was marked full and its buffer has come down to half: the poll thread
    /// may read its queue again.
    fn has_room_again(&self, s: &Settings) -> bool {
        self.full && !self.held_back(s)
    }
}

/// What the poll thread, the stream and the acknowledgers share under one lock.
#[derive(Default)]
pub(super) struct State {
    pub(super) partitions: BTreeMap<Tp, Partition>,
    pub(super) cursor: usize,
    pub(super) waker: Option<Waker>,
    pub(super) errors: VecDeque<TransportError>,
    /// The poll thread has exited: the stream ends once nothing is left to hand out.
    pub(super) finished: bool,
    /// Settled records, reused for the next fetched ones (or freed) by the poll thread at
    /// its next round. The poll thread allocated them; freed by the worker threads that
    /// settle them, their memory would go back through the allocator's locked, cross-thread
    /// path (glibc takes the owning arena's lock once a thread's cache is full) while the
    /// poll thread allocates the next ones from that arena, each side on the slow path. A
    /// settled record's last handle usually is the one here.
    pub(super) retired: Vec<Arc<Record>>,
    /// Settled acknowledgers, for the stream's next hand-outs, each holding
    /// [`Shared::blank`] in its record's place: a hand-out then allocates no box, and the
    /// worker thread that settles one does not free it (as with `retired`). Each holds the
    /// `Shared` that holds them, so they are kept only while the stream lives: dropping it
    /// sets [`Shared::stop`] and then empties this, and none is kept once `stop` is set.
    #[allow(
        clippy::vec_box,
        reason = "the boxes are what is kept, to be handed out again"
    )]
    pub(super) ackers: Vec<Box<KafkaAcker>>,
    pub(super) next_generation: u64,
}

/// What the transport needs from the configuration after validation.
pub(super) struct Settings {
    pub(super) order: ProcessingOrder,
    pub(super) retry: RetryMode,
    pub(super) commit: CommitMode,
    pub(super) commit_interval: Duration,
    pub(super) max_buffered: usize,
    pub(super) max_buffered_bytes: usize,
    pub(super) revoke_timeout: Duration,
    pub(super) produce_timeout: Duration,
    pub(super) message_id_header: String,
    pub(super) offset_message_ids: bool,
    /// Retry topic name → the topic it retries.
    pub(super) retry_sources: BTreeMap<String, Arc<str>>,
    pub(super) retry_suffix: String,
    pub(super) dead_letter_suffix: String,
    pub(super) group_id: String,
    /// `kafka:<group>:<retry suffix>`: the consumers that read this group's retry copies
    /// (see `Acknowledger::copy_scope`).
    pub(super) copy_scope: String,
}

/// The state, settings and clients shared by the poll thread (and the rebalance callbacks
/// it runs), the stream and the acknowledgers.
pub(super) struct Shared {
    /// On cache lines of its own ([`CachePadded`]: aligned and padded to the span the
    /// target's cores fetch together). The three threads that take the lock for every
    /// chunk, hand-out and settlement would otherwise also move the lines of what they only
    /// read, and of the `Arc`'s counts, which every acknowledger moves: a write to a line
    /// takes it from every other core that holds it.
    pub(super) state: CachePadded<Mutex<State>>,
    /// Signalled when a record settles while a revoke waits for in-flight records.
    pub(super) settled: Condvar,
    /// A revoke is waiting on `settled` (set and cleared under the state lock), so a
    /// settlement must signal it; otherwise it does not (a signal costs a system call).
    pub(super) revoke_waiting: AtomicBool,
    pub(super) settings: Settings,
    pub(super) producer: Producer,
    pub(super) observer: KafkaObserver,
    pub(super) stop: AtomicBool,
    pub(super) closed: watch::Sender<bool>,
    /// Seeds the hash of record keys into [`KeyId`](crate::tracker::KeyId)s (foldhash, tuned
    /// for quality: the key map folds an id's words without hashing them again).
    pub(super) key_seed: foldhash::quality::RandomState,
    /// Counts the revokes begun (incremented under the state lock as the partitions are
    /// marked revoking): the stream checks it before handing out what it took earlier.
    pub(super) revocations: AtomicU64,
    /// The record of no message that a kept acknowledger holds ([`State::ackers`]).
    pub(super) blank: Arc<Record>,
    /// The poll thread, once it runs: a settlement that gives a full partition room again
    /// wakes it, as nothing else would (its queue is not empty, so no new record does).
    pub(super) poll_thread: OnceLock<Thread>,
}

impl Shared {
    pub(super) fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub(super) fn wake(waker: Option<Waker>) {
        if let Some(w) = waker {
            w.wake();
        }
    }

    /// Wakes the poll thread if `room_again`: a settlement gave a full partition room.
    fn wake_poll_thread(&self, room_again: bool) {
        if let Some(t) = self.poll_thread.get().filter(|_| room_again) {
            t.unpark();
        }
    }
}

impl Shared {
    /// Runs `f` on the partition if it is still the same assignment (`generation`), `None`
    /// if not. `f` is told whether the stream waits for a record and given the retired
    /// list (see [`State::retired`]); it says whether the stream must be woken: then its
    /// waker is returned.
    pub(super) fn with_partition(
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
    pub(super) fn signal_revoke(&self) {
        if self.revoke_waiting.load(Ordering::SeqCst) {
            self.settled.notify_all();
        }
    }

    pub(super) fn revoked_error(&self, record: &Record) -> TransportError {
        self.observer.record_all([OffsetEvent::SettlementDropped {
            topic: record.topic().to_string(),
            partition: record.partition(),
            offset: record.offset,
        }]);
        TransportError::msg(format!(
            "partition {}/{} was revoked before {} settled; the new owner redelivers it",
            record.topic(),
            record.partition(),
            record.location()
        ))
    }

    pub(super) fn mark_settled(
        &self,
        generation: u64,
        record: &Arc<Record>,
    ) -> Result<(), TransportError> {
        let order = self.settings.order;
        let mut room_again = false;
        let settled = self.with_partition(&record.tp, generation, |p, waiting, retired| {
            p.tracker.settle(record.offset);
            retired.push(record.clone());
            room_again = p.has_room_again(&self.settings);
            // A waiting stream is woken only if the settlement let a record go (an earlier
            // record of its key, or of the partition, settled); anything else wakes it where
            // it arrives.
            waiting && p.tracker.has_next(order, Instant::now())
        });
        self.wake_poll_thread(room_again);
        self.changed(settled, record)
    }

    /// After a record's settlement or deferral ([`Shared::with_partition`]'s result): wakes a
    /// waiting revoke and the stream, or reports the partition revoked.
    pub(super) fn changed(
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
    pub(super) fn defer(
        &self,
        generation: u64,
        record: &Record,
        delay: Duration,
        attempt: u32,
    ) -> Result<(), TransportError> {
        let not_before = Instant::now() + delay;
        let deferred = self.with_partition(&record.tp, generation, |p, _, _| {
            if let Some(h) = p.tracker.defer(record.offset, not_before) {
                h.attempt = attempt;
                h.redelivered = true;
            }
            true
        });
        self.changed(deferred, record)
    }

    pub(super) fn owned(&self, tp: &Tp, generation: u64) -> bool {
        self.lock()
            .partitions
            .get(tp)
            .is_some_and(|p| p.generation == generation)
    }
}

/// Settles one Kafka record (see the `acker` module for how).
pub(super) struct KafkaAcker {
    pub(super) shared: Arc<Shared>,
    pub(super) generation: u64,
    pub(super) record: Arc<Record>,
    /// Settled, given back or kept: dropping it does nothing to its record.
    pub(super) done: bool,
}

impl KafkaAcker {
    /// The acknowledger of `record`, handed out from its partition in assignment
    /// `generation`.
    pub(super) fn new(shared: Arc<Shared>, generation: u64, record: Arc<Record>) -> Self {
        KafkaAcker {
            shared,
            generation,
            record,
            done: false,
        }
    }

    /// The record it settles.
    pub(super) fn record(&self) -> &Record {
        &self.record
    }

    /// Its record's partition, assignment and offset.
    pub(super) fn place(&self) -> (&Tp, u64, i64) {
        (&self.record.tp, self.generation, self.record.offset)
    }

    /// Its record was put back in its partition, unsettled and not in flight: dropping the
    /// acknowledger leaves it there.
    pub(super) fn forget(&mut self) {
        self.done = true;
    }

    /// A kept acknowledger (see [`State::ackers`]) made the acknowledger of `record`, handed
    /// out from its partition in assignment `generation`.
    pub(super) fn reuse(&mut self, generation: u64, record: Arc<Record>) {
        self.generation = generation;
        self.record = record;
        self.done = false;
    }

    /// Done with its record, which it hands over, holding `blank` in its place: it may be
    /// kept for a later record, and holds no record meanwhile.
    fn retire(&mut self, blank: &Arc<Record>) -> Arc<Record> {
        self.done = true;
        std::mem::replace(&mut self.record, blank.clone())
    }
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
                .with_partition(&self.record.tp, self.generation, |p, _, _| {
                    p.tracker.abandon(offset);
                    false
                });
            self.shared.signal_revoke();
        }
    }
}

/// At most this many settled acknowledgers are kept for the stream's next hand-outs (a
/// box of 32 bytes each): as many as a few workers' batches settle at once.
const KEPT_ACKERS: usize = 1024;

impl Shared {
    /// [`Shared::mark_settled`] for the records of several acknowledgers, all of this
    /// consumer, under one hold of the lock: one result each, in their order. The stream is
    /// woken at most once, and a waiting revoke signalled once.
    ///
    /// The acknowledgers whose records settled are kept for the stream's next hand-outs
    /// (see [`State::ackers`]) while it lives, so a hand-out costs no allocation, and its
    /// box is not freed by the worker thread that settles it (see [`State::retired`]).
    #[allow(
        clippy::vec_box,
        reason = "the boxes are the acknowledgers' own, as `ack_together` hands them over"
    )]
    pub(super) fn mark_all_settled(&self, mut run: Vec<Box<KafkaAcker>>) -> AckResults {
        let order = self.settings.order;
        let now = Instant::now();
        let mut settled = Vec::with_capacity(run.len());
        // One each, in order: settled, or the acknowledger of a revoked partition's record.
        let mut results = Vec::with_capacity(run.len());
        let mut freed = Vec::new();
        let (waker, any, room_again) = {
            let mut state = self.lock();
            let State {
                partitions,
                waker,
                retired,
                ackers,
                ..
            } = &mut *state;
            // Read under the lock: the stream's drop sets it before it empties `ackers`.
            let keep = !self.stop.load(Ordering::SeqCst);
            let waiting = waker.is_some();
            let mut wake = false;
            let mut room_again = false;
            // The partition of the records before, found once for a run of its records.
            let mut current: Option<(&Tp, u64, Option<&mut Partition>)> = None;
            for acker in &run {
                let (tp, generation) = (&acker.record.tp, acker.generation);
                let same = current
                    .as_ref()
                    .is_some_and(|(t, g, _)| *g == generation && *t == tp);
                if !same {
                    if let Some((_, _, Some(p))) = current.take() {
                        wake |= waiting && p.tracker.has_next(order, now);
                        room_again |= p.has_room_again(&self.settings);
                    }
                    let found = partitions
                        .get_mut(tp)
                        .filter(|p| p.generation == generation);
                    current = Some((tp, generation, found));
                }
                match &mut current {
                    Some((_, _, Some(p))) => {
                        p.tracker.settle(acker.record.offset);
                        settled.push(true);
                    }
                    _ => settled.push(false),
                }
            }
            if let Some((_, _, Some(p))) = current {
                wake |= waiting && p.tracker.has_next(order, now);
                room_again |= p.has_room_again(&self.settings);
            }
            for (mut acker, &ok) in run.drain(..).zip(&settled) {
                if !ok {
                    acker.done = true;
                    results.push(Err(acker));
                    continue;
                }
                results.push(Ok(()));
                retired.push(acker.retire(&self.blank));
                if keep && ackers.len() < KEPT_ACKERS {
                    ackers.push(acker);
                } else {
                    freed.push(acker);
                }
            }
            let any = settled.contains(&true);
            (if wake { waker.take() } else { None }, any, room_again)
        };
        self.wake_poll_thread(room_again);
        drop(freed);
        if any {
            self.signal_revoke();
            Shared::wake(waker);
        }
        results
            .into_iter()
            .map(|r| r.map_err(|acker| self.revoked_error(&acker.record)))
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use std::mem::{align_of, offset_of, size_of};
    use std::sync::Mutex;

    use crossbeam_utils::CachePadded;

    use super::{Shared, State};

    #[test]
    fn the_state_lock_shares_no_cache_line_with_the_other_fields_or_the_arc_counts() {
        // The span the padding keeps to itself: on x86-64 two 64-byte lines, the layout the
        // bench measured.
        let span = align_of::<CachePadded<()>>();
        #[cfg(target_arch = "x86_64")]
        assert_eq!(span, 128);
        // The lock starts and ends on span boundaries, so no other field of `Shared` lies on
        // its spans; `Shared` is aligned to a span, so the `Arc`'s counts, just before it,
        // lie on another.
        let start = offset_of!(Shared, state);
        let end = start + size_of::<CachePadded<Mutex<State>>>();
        assert_eq!((start % span, end % span), (0, 0), "{start}..{end}");
        assert!(align_of::<Shared>() >= span, "{}", align_of::<Shared>());
    }
}
