//! The poll thread: it owns the librdkafka consumer and polls whatever the handlers do,
//! reads the consumer's queue and each partition's own (see [`Queues`]), holds back full
//! partitions, pauses and resumes partitions, and commits every interval. When another
//! member takes its instance id (static membership), or the group's coordinator stays out
//! of reach (see `coordinator`), it forgets its partitions and joins again with a new
//! consumer.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use consumer_core::transport::{Blocks, TransportError};
use rdkafka::consumer::{BaseConsumer, CommitMode as RdCommitMode, Consumer};
use rdkafka::error::KafkaError;
use rdkafka::types::RDKafkaErrorCode;
use rdkafka::TopicPartitionList;

use super::client::Client;
use super::fetch::{fenced_by, handle_poll_error, Fetched, Room, Topic, CHUNK, POLL_BATCH};
use super::partitions::Shared;
use super::queues::Queues;
use super::rebalance::ConsumerCtx;
use super::rebalance::Lost;
use super::record::{Record, Spares};

/// How long the poll thread sleeps, when a round read nothing, before housekeeping runs
/// (a record arriving in an empty queue wakes it sooner).
const POLL_WAIT: Duration = Duration::from_millis(50);
/// How long it sleeps at most while a partition's buffer is full. The settlement that
/// gives the partition room again wakes it (see [`Shared::poll_thread`]); this bounds the
/// wait besides, as reading the partition again must never wait for [`POLL_WAIT`], or the
/// handlers run dry.
const POLL_WAIT_PAUSED: Duration = Duration::from_millis(5);
/// Every this many commit intervals the current positions are committed again, even if
/// unchanged (see [`Shared::commit`]), but not more often than [`MIN_COMMIT_REFRESH`].
const COMMIT_REFRESH_FACTOR: u32 = 10;
const MIN_COMMIT_REFRESH: Duration = Duration::from_secs(1);
/// For this long after a partition is assigned, its progress is committed every
/// [`EAGER_COMMIT_GAP`] instead of every `commit_interval`. A crash replays what its
/// partitions did since their last commit, and a worker that crashes soon after it starts,
/// over and over (a crash loop; the chaos suite's fault points, which also fire while it
/// skips the duplicates of the last crash), would otherwise commit nothing: its whole life
/// is shorter than a join and one interval, and each incarnation replays the same records.
/// The cost: up to 50 commits a second per member for a few seconds after each rebalance.
pub(super) const EAGER_COMMIT_FOR: Duration = Duration::from_secs(5);
const EAGER_COMMIT_GAP: Duration = Duration::from_millis(20);
/// How often the paused-partition gauge is set.
const GAUGE_INTERVAL: Duration = Duration::from_secs(5);

impl Shared {
    /// Marks the partitions whose buffer is full (left unread, see [`Queues`]; paused if
    /// they have no queue of their own), pauses those being revoked or whose next retry is
    /// not due, resumes the others, and wakes the stream when something may be handed out.
    /// Returns whether a partition's buffer is full, and whether one was given room again.
    ///
    /// A full partition is read again only when its buffer is half empty, not at the first
    /// free slot, so that it is read in runs rather than a record at a time.
    ///
    /// `retired` (empty) is swapped for the settled records, which go to `spares` (or are
    /// freed) outside the lock (see [`State::retired`](super::partitions::State::retired)).
    fn housekeeping(
        &self,
        consumer: &BaseConsumer<ConsumerCtx>,
        retired: &mut Vec<Arc<Record>>,
        spares: &mut Spares,
    ) -> Buffers {
        let now = Instant::now();
        // librdkafka's lists are built only in a round that changes a partition: most rounds
        // change none, and an empty list is still two allocations in C and a free of each.
        let mut pause: Option<TopicPartitionList> = None;
        let mut resume: Option<TopicPartitionList> = None;
        let limits = Room::limits(&self.settings);
        let mut any_full = false;
        let mut room_again = false;
        let mut young_progress = false;
        let waker = {
            let mut state = self.lock();
            std::mem::swap(&mut state.retired, retired);
            let mut ready = false;
            for ((topic, partition), p) in state.partitions.iter_mut() {
                let waiting_for_due = p.tracker.head_not_before().is_some_and(|t| t > now);
                let (len, bytes) = (p.tracker.len(), p.tracker.bytes());
                let full = if p.full {
                    p.held_back(&self.settings)
                } else {
                    limits.after(len, bytes).is_full()
                };
                if full != p.full {
                    let what = if full {
                        "holding back"
                    } else {
                        room_again = true;
                        "reading again"
                    };
                    tracing::debug!("{what} {topic}/{partition}: {len} records of {bytes} bytes");
                    p.full = full;
                }
                any_full |= p.full && !p.revoking;
                let want_pause = p.revoking || waiting_for_due || (p.full && !p.own_queue);
                if want_pause != p.paused {
                    let list = if want_pause { &mut pause } else { &mut resume };
                    list.get_or_insert_with(TopicPartitionList::new)
                        .add_partition(topic, *partition);
                    p.paused = want_pause;
                }
                ready |= !p.revoking && p.tracker.has_due_waiting(now);
                young_progress |= !p.revoking
                    && now.duration_since(p.assigned_at) < EAGER_COMMIT_FOR
                    && p.tracker
                        .commit_point()
                        .is_some_and(|point| p.committed != Some(point));
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
        Buffers {
            any_full,
            room_again,
            young_progress,
        }
    }
}

/// What [`Shared::housekeeping`] found of the partitions' buffers.
struct Buffers {
    /// A partition's buffer is full (its queue left unread).
    any_full: bool,
    /// A partition held back for a full buffer has room again: its queue is to be read
    /// without sleeping first, as it is not empty and so no new record wakes the thread.
    room_again: bool,
    /// A partition assigned less than [`EAGER_COMMIT_FOR`] ago has progress not committed.
    young_progress: bool,
}

impl Shared {
    /// Sets the gauge of how many of the partitions this consumer owns are held back (a
    /// full buffer, left unread; or paused, a retry copy not due yet). The lag gauges come
    /// from librdkafka's statistics (see [`ConsumerCtx`]).
    fn set_gauges(&self) {
        let paused = {
            let state = self.lock();
            state
                .partitions
                .values()
                .filter(|p| (p.paused || p.full) && !p.revoking)
                .count()
        };
        // A handful of partitions: exact as f64.
        #[allow(clippy::cast_precision_loss)]
        metrics::gauge!("consumer_kafka_paused_partitions", "group" => self.settings.group_id.clone())
            .set(paused as f64);
    }
}

/// The poll thread: runs a librdkafka consumer (see [`Poller::run`]) until the transport
/// stops; when another member takes this one's instance id, forgets its partitions, waits
/// and runs a new consumer (see [`Fences`]).
pub(super) fn poll_loop(
    mut consumer: BaseConsumer<ConsumerCtx>,
    client: &Client,
    shared: &Arc<Shared>,
) {
    // Only this thread sets it.
    let _ = shared.poll_thread.set(std::thread::current());
    let mut poller = Poller::new(shared);
    let mut fences = Fences::default();
    loop {
        match poller.run(consumer, shared) {
            Ended::Stopped => break,
            Ended::Fenced(code) => {
                let Some(delay) = fences.admit(Instant::now()) else {
                    tracing::error!(
                        error = %code,
                        window = ?FENCE_WINDOW,
                        "the instance id stayed another member's: two live workers share it; the transport stops"
                    );
                    shared.fail(TransportError::new(
                        "the kafka instance id is another live member's",
                        KafkaError::MessageConsumptionFatal(code),
                    ));
                    break;
                };
                tracing::warn!(
                    error = %code,
                    ?delay,
                    "another member has this consumer's instance id: its partitions are forgotten and it joins again"
                );
                let until = Instant::now() + delay;
                while !shared.stop.load(Ordering::SeqCst) && Instant::now() < until {
                    std::thread::park_timeout(until.saturating_duration_since(Instant::now()));
                }
                if shared.stop.load(Ordering::SeqCst) {
                    break;
                }
            }
            // At once: the new consumer's own watch waits `coordinator_timeout` again
            // before it could be replaced in turn.
            Ended::CoordinatorLost => {}
        }
        match client.open(shared) {
            Ok(c) => consumer = c,
            Err(e) => {
                tracing::error!(error = %e, "opening the consumer again failed: the transport stops");
                shared.fail(TransportError::new("reopening the kafka consumer", e));
                break;
            }
        }
    }
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

/// Why [`Poller::run`] returned.
enum Ended {
    /// The transport stops: settled offsets were committed and the group left.
    Stopped,
    /// Another member took (the classic protocol's `FENCED_INSTANCE_ID`) or holds (the
    /// consumer protocol's `UNRELEASED_INSTANCE_ID`) this consumer's instance id: its
    /// partitions were forgotten as lost and the consumer closed.
    Fenced(RDKafkaErrorCode),
    /// The group's coordinator stayed out of reach for `coordinator_timeout` (see
    /// `coordinator`): its partitions were forgotten as lost and the consumer closed.
    CoordinatorLost,
}

/// How long a run of fences lasts at most: a consumer whose instance id is still another
/// member's this long after the first fence of the run stops. A member that took the id
/// while this one's session lapsed (a coordinator moving to another broker) is gone once
/// this one joins again; a worker started with the name of a live one is not, and the two
/// would take the name from each other for ever.
const FENCE_WINDOW: Duration = Duration::from_secs(120);
/// The wait before the first new consumer of a run of fences; it doubles with each further
/// fence of the run, up to [`MAX_REOPEN_DELAY`]. Under the consumer protocol a killed
/// member holds its instance id until its session expires (45 s by default): the refused
/// newcomer asks again until then.
const FIRST_REOPEN_DELAY: Duration = Duration::from_secs(1);
const MAX_REOPEN_DELAY: Duration = Duration::from_secs(16);

/// The fences of a consumer: since when its instance id has been another member's, and how
/// long to wait before the next new consumer.
#[derive(Debug, Default)]
struct Fences {
    /// The first fence of the current run and the last one.
    run: Option<(Instant, Instant)>,
    delay: Duration,
}

impl Fences {
    /// Records a fence at `now`: the wait before a new consumer, or `None` when the run of
    /// fences has lasted [`FENCE_WINDOW`]. A fence more than [`FENCE_WINDOW`] after the last
    /// one starts a new run.
    fn admit(&mut self, now: Instant) -> Option<Duration> {
        match self.run {
            Some((first, last)) if now.duration_since(last) < FENCE_WINDOW => {
                if now.duration_since(first) >= FENCE_WINDOW {
                    return None;
                }
                self.run = Some((first, now));
                self.delay = (self.delay * 2).min(MAX_REOPEN_DELAY);
            }
            _ => {
                self.run = Some((now, now));
                self.delay = FIRST_REOPEN_DELAY;
            }
        }
        Some(self.delay)
    }
}

/// The poll thread's state that outlives a librdkafka consumer.
struct Poller {
    last_commit: Instant,
    last_refresh: Instant,
    refresh_interval: Duration,
    last_summary: Instant,
    last_gauges: Instant,
    topics: Vec<Topic>,
    blocks: Blocks,
    retired: Vec<Arc<Record>>,
    spares: Spares,
    /// Fetched records are added to their partitions in chunks, one hold of the state lock
    /// (which the stream and the settlements also take) for each.
    chunk: Vec<Fetched>,
}

impl Poller {
    fn new(shared: &Shared) -> Self {
        Poller {
            last_commit: Instant::now(),
            last_refresh: Instant::now(),
            refresh_interval: (shared.settings.commit_interval * COMMIT_REFRESH_FACTOR)
                .max(MIN_COMMIT_REFRESH),
            last_summary: Instant::now(),
            last_gauges: Instant::now(),
            topics: Vec::new(),
            blocks: Blocks::new(),
            retired: Vec::new(),
            spares: Spares::default(),
            chunk: Vec::with_capacity(CHUNK),
        }
    }

    /// Polls `consumer` until the transport stops or the consumer is fenced: the
    /// consumer's queue (events, and records fetched before their partition's queue was
    /// split off), then each partition's own queue, then housekeeping and the commits; it
    /// sleeps when a round read nothing, until a queue becomes non-empty or the next
    /// housekeeping is due. Closes the consumer before it returns.
    fn run(&mut self, mut consumer: BaseConsumer<ConsumerCtx>, shared: &Shared) -> Ended {
        let poll_thread = std::thread::current();
        consumer.set_nonempty_callback(move || poll_thread.unpark());
        let consumer = Arc::new(consumer);
        let mut queues = Queues::new();
        let mut chunk_bytes = 0;
        let mut room = Room::limits(&shared.settings);
        let mut fenced = None;
        while !shared.stop.load(Ordering::SeqCst) {
            // The consumer's queue first: the rebalance callbacks run here, and a partition's
            // records that reached it before its own queue was split off come before those in
            // its own queue, which is read only in a round that emptied this one.
            let mut drained = false;
            let mut read_any = false;
            for _ in 0..POLL_BATCH {
                match consumer.poll(Duration::ZERO) {
                    None => {
                        drained = true;
                        break;
                    }
                    Some(Ok(m)) => {
                        read_any = true;
                        let fetched =
                            shared.read(&m, &mut self.topics, &mut self.blocks, &mut self.spares);
                        if let Fetched::Record { record, .. } = &fetched {
                            chunk_bytes += record.bytes;
                        }
                        self.chunk.push(fetched);
                        if room.filled(self.chunk.len(), chunk_bytes) {
                            room = shared.ingest(&mut self.chunk);
                            chunk_bytes = 0;
                            if room.is_full() {
                                break;
                            }
                        }
                    }
                    Some(Err(e)) => {
                        fenced = fenced_by(&e);
                        if fenced.is_none() {
                            handle_poll_error(shared, e);
                        }
                        break;
                    }
                }
            }
            if !self.chunk.is_empty() {
                room = shared.ingest(&mut self.chunk);
                chunk_bytes = 0;
            }
            let ended = match fenced {
                Some(code) => Some((Lost::Fenced(code), Ended::Fenced(code))),
                None if consumer.context().coordinator.lost() => {
                    Some((Lost::NoCoordinator, Ended::CoordinatorLost))
                }
                None => None,
            };
            if let Some((lost, ended)) = ended {
                shared.lose_all(lost);
                // The queues hold the consumer too: the last handle closes it.
                drop(queues);
                drop(consumer);
                return ended;
            }
            read_any |= queues.follow(&consumer, shared);
            if drained {
                let (t, b, s, c) = (
                    &mut self.topics,
                    &mut self.blocks,
                    &mut self.spares,
                    &mut self.chunk,
                );
                read_any |= queues.read(shared, t, b, s, c, &mut room);
            }
            let buffers = shared.housekeeping(&consumer, &mut self.retired, &mut self.spares);
            self.periodic(&consumer, shared, buffers.young_progress);
            if !read_any && !buffers.room_again {
                // Until a queue becomes non-empty, or a settlement gives a full partition room
                // again; a full partition is also looked at again soon in any case.
                std::thread::park_timeout(if buffers.any_full {
                    POLL_WAIT_PAUSED
                } else {
                    POLL_WAIT
                });
            }
        }
        tracing::info!("kafka consumer stopping: committing settled offsets and leaving the group");
        shared.commit(&consumer, RdCommitMode::Sync, true);
        // The queues hold the consumer too: the last handle closes it. Closing runs the revoke
        // callback (bounded wait, contiguous commit) and leaves the group.
        drop(queues);
        drop(consumer);
        Ended::Stopped
    }

    /// What a round does when its time comes: the debug summary, the gauges, the commits
    /// (every `commit_interval`, or every [`EAGER_COMMIT_GAP`] while `young_progress`).
    fn periodic(
        &mut self,
        consumer: &BaseConsumer<ConsumerCtx>,
        shared: &Shared,
        young_progress: bool,
    ) {
        if tracing::enabled!(tracing::Level::DEBUG)
            && self.last_summary.elapsed() >= Duration::from_secs(2)
        {
            self.last_summary = Instant::now();
            let state = shared.lock();
            for ((topic, partition), p) in &state.partitions {
                tracing::debug!(
                    "{topic}/{partition}: {} revoking={} paused={} full={} committed={:?}",
                    p.tracker.describe(),
                    p.revoking,
                    p.paused,
                    p.full,
                    p.committed
                );
            }
        }
        if self.last_gauges.elapsed() >= GAUGE_INTERVAL {
            self.last_gauges = Instant::now();
            shared.set_gauges();
        }
        let interval = if young_progress {
            EAGER_COMMIT_GAP.min(shared.settings.commit_interval)
        } else {
            shared.settings.commit_interval
        };
        if self.last_commit.elapsed() >= interval {
            let refresh = self.last_refresh.elapsed() >= self.refresh_interval;
            if refresh {
                self.last_refresh = Instant::now();
            }
            shared.commit(consumer, RdCommitMode::Async, refresh);
            self.last_commit = Instant::now();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fences_wait_longer_each_time_and_stop_after_the_window() {
        let start = Instant::now();
        let mut f = Fences::default();
        let at = |s: u64| start + Duration::from_secs(s);
        assert_eq!(f.admit(at(0)), Some(Duration::from_secs(1)));
        assert_eq!(f.admit(at(5)), Some(Duration::from_secs(2)));
        assert_eq!(f.admit(at(10)), Some(Duration::from_secs(4)));
        assert_eq!(f.admit(at(20)), Some(Duration::from_secs(8)));
        assert_eq!(f.admit(at(40)), Some(Duration::from_secs(16)));
        assert_eq!(f.admit(at(60)), Some(Duration::from_secs(16)));
        assert_eq!(f.admit(at(119)), Some(Duration::from_secs(16)));
        // Another member's for the whole window: a live twin.
        assert_eq!(f.admit(at(120)), None);
    }

    #[test]
    fn a_fence_long_after_the_last_starts_a_new_run() {
        let start = Instant::now();
        let mut f = Fences::default();
        let at = |s: u64| start + Duration::from_secs(s);
        assert_eq!(f.admit(at(0)), Some(Duration::from_secs(1)));
        assert_eq!(f.admit(at(100)), Some(Duration::from_secs(2)));
        // 120 s after the last fence: a coordinator moved again, not a twin.
        assert_eq!(f.admit(at(220)), Some(Duration::from_secs(1)));
        assert_eq!(f.admit(at(300)), Some(Duration::from_secs(2)));
    }
}
