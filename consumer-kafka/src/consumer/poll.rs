//! The poll thread: it owns the librdkafka consumer and polls whatever the handlers do,
//! reads the consumer's queue and each partition's own (see [`Queues`]), holds back full
//! partitions, pauses and resumes partitions, and commits every interval.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use consumer_core::Blocks;
use rdkafka::consumer::{BaseConsumer, CommitMode as RdCommitMode, Consumer};
use rdkafka::TopicPartitionList;

use super::fetch::{handle_poll_error, Fetched, Room, CHUNK, POLL_BATCH};
use super::partitions::Shared;
use super::queues::Queues;
use super::rebalance::ConsumerCtx;
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

/// The poll thread's loop: the consumer's queue (events, and records fetched before their
/// partition's queue was split off), then each partition's own queue, then housekeeping and
/// the commits; it sleeps when a round read nothing, until a queue becomes non-empty or the
/// next housekeeping is due.
pub(super) fn poll_loop(mut consumer: BaseConsumer<ConsumerCtx>, shared: Arc<Shared>) {
    let poll_thread = std::thread::current();
    // Only this thread sets it.
    let _ = shared.poll_thread.set(poll_thread.clone());
    consumer.set_nonempty_callback(move || poll_thread.unpark());
    let consumer = Arc::new(consumer);
    let mut queues = Queues::new();
    let mut last_commit = Instant::now();
    let mut last_refresh = Instant::now();
    let refresh_interval =
        (shared.settings.commit_interval * COMMIT_REFRESH_FACTOR).max(MIN_COMMIT_REFRESH);
    let mut last_summary = Instant::now();
    let mut last_gauges = Instant::now();
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
                    let fetched = shared.read(&m, &mut topics, &mut blocks, &mut spares);
                    if let Fetched::Record { record, .. } = &fetched {
                        chunk_bytes += record.bytes;
                    }
                    chunk.push(fetched);
                    if room.filled(chunk.len(), chunk_bytes) {
                        room = shared.ingest(&mut chunk);
                        chunk_bytes = 0;
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
        read_any |= queues.follow(&consumer, &shared);
        if drained {
            let (t, b, s, c) = (&mut topics, &mut blocks, &mut spares, &mut chunk);
            read_any |= queues.read(&shared, t, b, s, c, &mut room);
        }
        let buffers = shared.housekeeping(&consumer, &mut retired, &mut spares);
        if tracing::enabled!(tracing::Level::DEBUG)
            && last_summary.elapsed() >= Duration::from_secs(2)
        {
            last_summary = Instant::now();
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
