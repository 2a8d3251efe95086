//! The consumer: a poll thread that owns the librdkafka consumer, a shared table of partitions
//! and their offset trackers, and a [`Stream`] of [`Incoming`] deliveries for the worker.
//!
//! - The poll thread polls at least every 50ms whatever the handlers do, so
//!   `max.poll.interval.ms` is never exceeded by a slow handler. Each partition's records
//!   come in a queue of its own; back-pressure leaves a full partition's queue unread (not
//!   the loop), which keeps what librdkafka prefetched for it (see `queues`).
//! - The stream hands out a record only when its partition's order allows it (see
//!   [`ProcessingOrder`](crate::ProcessingOrder)) and the partition is not being revoked.
//! - An acknowledger marks its offset settled; commits go up to the last contiguous settled
//!   record of each partition this member owns.
//! - Rebalance callbacks run on the poll thread: a revoke stops handing out the partitions,
//!   waits (bounded) for their in-flight records, commits what is contiguous and forgets them;
//!   later settlements for them are dropped.
//!
//! This module holds [`KafkaConsumer`] and its stream; `client` makes the librdkafka
//! consumer (at start, and again after a fence or a lost coordinator, see `coordinator`);
//! `record` is a fetched record and its headers, `partitions` the shared table of owned partitions and a record's acknowledger,
//! `rebalance` the rebalance callbacks and the commits, `poll` the poll thread, `acker` a
//! record's settlement, and `copies` what its retry and dead-letter copies carry.

use std::collections::VecDeque;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, OnceLock};
use std::task::{Context, Poll};
use std::time::Instant;

use consumer_core::transport::{Incoming, LogPosition, TransportError};
use crossbeam_utils::CachePadded;
use futures::Stream;
use tokio::sync::watch;

use crate::config::KafkaConfig;
use crate::observer::KafkaObserver;
use crate::producer;
use crate::{Error, KafkaPublisher};
use client::Client;
use partitions::{KafkaAcker, Settings, Shared, State};

mod acker;
mod client;
mod coordinator;
mod copies;
mod fetch;
mod partitions;
mod poll;
mod queues;
mod rebalance;
mod record;
mod record_headers;
#[cfg(test)]
mod tests;

/// A Kafka consumer as a [`consumer_core::transport::Transport`]: give it to
/// [`consumer_core::Worker::run`].
///
/// Dropping it (the worker does, when it stops) stops the poll thread, which commits what is
/// settled, waits (up to `revoke_timeout`) for records still in flight, and leaves the
/// group; [`KafkaConsumer::closed`] resolves when that is done.
pub struct KafkaConsumer {
    shared: Arc<Shared>,
    closed: watch::Receiver<bool>,
    /// Records taken from their partitions and not handed out yet (see [`TAKE_AT_ONCE`]):
    /// in flight to the partitions. When a revoke has begun since they were taken
    /// (`taken_at`, a count of [`Shared::revocations`]), those of the revoked partitions go
    /// back to them before anything is handed out, so the revoke does not wait for records
    /// no handler has; dropped with the consumer they are abandoned, as unsettled hand-outs
    /// are.
    taken: VecDeque<Taken>,
    taken_at: u64,
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
        let shared = Arc::new(Shared::new(&config, producer, closed_tx));
        let client = Client::new(&config);
        let consumer = client.open(&shared)?;
        tracing::info!(group = %config.group_id, topics = ?client.topics(), "kafka consumer started");
        let thread_shared = shared.clone();
        std::thread::Builder::new()
            .name("kafka-poll".to_owned())
            .spawn(move || poll::poll_loop(consumer, &client, &thread_shared))
            .map_err(|e| Error::client("starting the poll thread", e))?;
        Ok(KafkaConsumer {
            shared,
            closed: closed_rx,
            taken: VecDeque::new(),
            taken_at: 0,
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

impl Shared {
    /// The state of a consumer of `config` (validated), with its producer, before any
    /// partition is assigned; `closed` is sent `true` when the poll thread is done.
    fn new(
        config: &KafkaConfig,
        producer: producer::Producer,
        closed: watch::Sender<bool>,
    ) -> Self {
        let retry_sources = config
            .topics
            .iter()
            .map(|t| (config.retry_topic(t), Arc::<str>::from(t.as_str())))
            .collect();
        Shared {
            state: CachePadded::new(Mutex::new(State::default())),
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
            closed,
            key_seed: foldhash::quality::RandomState::default(),
            revocations: AtomicU64::new(0),
            blank: Arc::new(record::Record::blank()),
            poll_thread: OnceLock::new(),
        }
    }
}

impl Drop for KafkaConsumer {
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::SeqCst);
        // Not to wait for its next round (or the end of a wait before a new consumer).
        if let Some(t) = self.shared.poll_thread.get() {
            t.unpark();
        }
        // The kept acknowledgers hold `shared`: let them go (outside the lock). With `stop`
        // set no more are kept, so nothing holds it once the poll thread and the hand-outs
        // are done.
        let kept = std::mem::take(&mut self.shared.lock().ackers);
        drop(kept);
    }
}

/// Records taken from the partitions under one hold of the state lock, at most: the stream
/// hands them out one at a time from its own queue, so the lock that the poll thread and
/// the settlements also take is held once per this many hand-outs, not once per record.
const TAKE_AT_ONCE: usize = 64;

/// A record taken from its partition, to be handed out: its acknowledger, the attempt and
/// redelivered flag it carries, and its position.
struct Taken {
    acker: Box<KafkaAcker>,
    attempt: u32,
    redelivered: bool,
    position: LogPosition,
}

impl Taken {
    /// The delivery, built outside the lock.
    fn incoming(self, id_header: &str) -> Incoming {
        let delivery =
            self.acker
                .record()
                .delivery(self.attempt, self.redelivered, self.position, id_header);
        Incoming {
            delivery,
            acker: self.acker,
        }
    }
}

impl KafkaConsumer {
    /// Puts the taken records of partitions being revoked back in their places, waiting, as
    /// if never taken, and wakes the revoke that waits for them. Those of partitions already
    /// gone are dropped (abandoned) once the lock is released: an acknowledger dropped
    /// unsettled takes the lock itself.
    fn give_back_revoked(&mut self) {
        if self.taken.is_empty() {
            return;
        }
        let mut gone = Vec::new();
        let mut gave_back = false;
        {
            let mut state = self.shared.lock();
            let now = Instant::now();
            for mut t in std::mem::take(&mut self.taken) {
                let (tp, generation, offset) = t.acker.place();
                match state
                    .partitions
                    .get_mut(tp)
                    .filter(|p| p.generation == generation)
                {
                    None => gone.push(t),
                    Some(p) if !p.revoking => self.taken.push_back(t),
                    Some(p) => {
                        // Due now, carrying what it carried.
                        p.tracker.defer(offset, now);
                        t.acker.forget();
                        gave_back = true;
                    }
                }
            }
        }
        drop(gone);
        if gave_back {
            self.shared.signal_revoke();
        }
    }
}

impl Stream for KafkaConsumer {
    type Item = Result<Incoming, TransportError>;

    fn poll_next(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        let this = self.get_mut();
        let revocations = this.shared.revocations.load(Ordering::SeqCst);
        if revocations != this.taken_at {
            this.give_back_revoked();
            this.taken_at = revocations;
        }
        let id_header = &this.shared.settings.message_id_header;
        if let Some(taken) = this.taken.pop_front() {
            return Poll::Ready(Some(Ok(taken.incoming(id_header))));
        }
        let shared = &this.shared;
        let order = shared.settings.order;
        let mut state = shared.lock();
        if let Some(e) = state.errors.pop_front() {
            return Poll::Ready(Some(Err(e)));
        }
        let now = Instant::now();
        let State {
            partitions,
            cursor,
            ackers,
            ..
        } = &mut *state;
        let n = partitions.len();
        // Round robin over the partitions, one record of each in turn, going on from where the
        // last take stopped, until every partition in a row had none. The partitions are
        // walked in passes over the table, not looked up one by one: a lookup by place steps
        // through the table from its start, for every record.
        let mut dry = 0;
        let mut skip = cursor.checked_rem(n).unwrap_or(0);
        'passes: while this.taken.len() < TAKE_AT_ONCE && dry < n {
            for (index, p) in partitions.values_mut().enumerate().skip(skip) {
                if this.taken.len() >= TAKE_AT_ONCE || dry >= n {
                    break 'passes;
                }
                *cursor = index + 1;
                let next = if p.revoking {
                    None
                } else {
                    p.tracker.take_next(order, now)
                };
                let Some((_, h)) = next else {
                    dry += 1;
                    continue;
                };
                dry = 0;
                let position = LogPosition {
                    log: p.log.clone(),
                    epoch: p.generation,
                    offset: h.record.offset,
                };
                // A kept acknowledger if there is one (see `State::ackers`).
                let acker = match ackers.pop() {
                    Some(mut kept) => {
                        kept.reuse(p.generation, h.record.clone());
                        kept
                    }
                    None => Box::new(KafkaAcker::new(
                        shared.clone(),
                        p.generation,
                        h.record.clone(),
                    )),
                };
                this.taken.push_back(Taken {
                    acker,
                    attempt: h.attempt,
                    redelivered: h.redelivered,
                    position,
                });
            }
            skip = 0;
        }
        if let Some(taken) = this.taken.pop_front() {
            // Built outside the lock: the poll thread and the settlements wait on it.
            drop(state);
            return Poll::Ready(Some(Ok(taken.incoming(id_header))));
        }
        if state.finished {
            return Poll::Ready(None);
        }
        state.waker = Some(cx.waker().clone());
        Poll::Pending
    }
}
