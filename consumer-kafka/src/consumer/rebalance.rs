//! The librdkafka consumer's context, called on the poll thread: the rebalance callbacks
//! (assign, revoke) and the commits of settled offsets, which the poll loop sends every
//! interval and a revoke sends before the partitions go.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Instant;

use rdkafka::consumer::{
    BaseConsumer, CommitMode as RdCommitMode, Consumer, ConsumerContext, Rebalance,
};
use rdkafka::error::KafkaResult;
use rdkafka::types::RDKafkaErrorCode;
use rdkafka::{ClientContext, Offset, TopicPartitionList};

use super::coordinator::{coordinator_reachable, CoordinatorWatch};
use super::partitions::{Partition, Shared, State};
use super::record::Tp;
use crate::config::CommitMode;
use crate::observer::OffsetEvent;
use crate::producer;

/// Why a consumer's partitions are all forgotten at once (see [`Shared::lose_all`]).
#[derive(Debug, Clone, Copy)]
pub(super) enum Lost {
    /// Another member took or held this consumer's instance id (`code`).
    Fenced(RDKafkaErrorCode),
    /// The group's coordinator stayed out of reach for `coordinator_timeout`.
    NoCoordinator,
}

/// The librdkafka consumer's context: logging, the statistics (gauges and the watch over
/// the group coordinator) and the rebalance callbacks.
pub(super) struct ConsumerCtx {
    pub(super) shared: Arc<Shared>,
    pub(super) coordinator: CoordinatorWatch,
}

impl ClientContext for ConsumerCtx {
    fn log(&self, level: rdkafka::config::RDKafkaLogLevel, fac: &str, log_message: &str) {
        producer::log_librdkafka(level, fac, log_message);
    }

    fn error(&self, error: rdkafka::error::KafkaError, reason: &str) {
        producer::log_client_error(&error, reason);
    }

    /// librdkafka's statistics (every `statistics.interval.ms`): the lag of each partition
    /// assigned to this consumer (its high watermark minus the group's committed position),
    /// as a gauge, 0 once a partition is no longer assigned; and the records librdkafka has
    /// fetched of each partition, as a counter (a record fetched again after a pause
    /// counts again); and whether the group's coordinator is in reach (see
    /// [`CoordinatorWatch`]).
    fn stats(&self, statistics: rdkafka::Statistics) {
        if let Some(reachable) = coordinator_reachable(&statistics) {
            if let Some(out_of_reach) = self.coordinator.observe(reachable, Instant::now()) {
                tracing::warn!(
                    ?out_of_reach,
                    "the group's coordinator has been out of reach too long: the consumer is replaced"
                );
            }
        }
        let group = &self.shared.settings.group_id;
        for (topic, t) in &statistics.topics {
            // Partition -1 is librdkafka's internal "unassigned" queue.
            for p in t.partitions.values().filter(|p| p.partition >= 0) {
                // The committed position, or where the group starts reading before its
                // first commit (earliest).
                let from = if p.committed_offset >= 0 {
                    p.committed_offset
                } else {
                    p.lo_offset
                };
                let lag = if p.desired && p.hi_offset >= 0 && from >= 0 {
                    (p.hi_offset - from).max(0)
                } else {
                    0
                };
                let labels = [
                    ("group", group.clone()),
                    ("topic", topic.clone()),
                    ("partition", p.partition.to_string()),
                ];
                // Offsets far below 2^53.
                #[allow(clippy::cast_precision_loss)]
                metrics::gauge!("consumer_kafka_lag", &labels).set(lag as f64);
                // librdkafka keeps a partition's count for the consumer's life, across
                // assignments, so it only grows.
                metrics::counter!("consumer_kafka_fetched_records_total", &labels)
                    .absolute(p.rxmsgs);
            }
        }
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

impl Shared {
    /// Commits (or stores) the contiguous settled position of every owned partition that
    /// moved since the last commit; with `refresh`, of every owned partition.
    ///
    /// librdkafka does not report the outcome of an asynchronous manual commit to the event
    /// API rdkafka uses, and commits sent while the group rebalances fail ("generation id
    /// not valid"). A failed commit is therefore not noticed; the periodic refresh sends the
    /// current positions again, so one always lands once the group is stable.
    pub(super) fn commit(
        &self,
        consumer: &BaseConsumer<ConsumerCtx>,
        mode: RdCommitMode,
        refresh: bool,
    ) {
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
    pub(super) fn revoke(&self, consumer: &BaseConsumer<ConsumerCtx>, tpl: &TopicPartitionList) {
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
        // Records the stream took and has not handed out yet go back when it next hands out
        // (see `KafkaConsumer::taken`), so the wait below is for those really in flight.
        self.revocations.fetch_add(1, Ordering::SeqCst);
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

    /// Forgets every owned partition as lost, before the consumer is closed and replaced
    /// (see [`Lost`]): nothing is committed for them, and settlements of their records in
    /// flight are dropped (the partitions' next owner, maybe this member again, redelivers
    /// them and the inbox deduplicates).
    pub(super) fn lose_all(&self, why: Lost) {
        let group = self.settings.group_id.clone();
        let event = match why {
            Lost::Fenced(code) => {
                metrics::counter!("consumer_kafka_fenced_total", "group" => group).increment(1);
                OffsetEvent::Fenced {
                    error: format!("{code:?}"),
                }
            }
            Lost::NoCoordinator => {
                metrics::counter!("consumer_kafka_coordinator_lost_total", "group" => group)
                    .increment(1);
                OffsetEvent::CoordinatorLost
            }
        };
        let mut state = self.lock();
        self.revocations.fetch_add(1, Ordering::SeqCst);
        let mut events = vec![event];
        let partitions = std::mem::take(&mut state.partitions);
        // Their records are freed outside the lock, which the stream and the settlements take.
        drop(state);
        for ((topic, partition), p) in partitions {
            events.push(OffsetEvent::Revoked {
                topic: topic.to_string(),
                partition,
                lost: true,
                unsettled: p.tracker.in_flight(),
            });
        }
        self.observer.record_all(events);
    }

    /// The assign callback (after librdkafka applied the assignment).
    pub(super) fn assign(&self, consumer: &BaseConsumer<ConsumerCtx>, tpl: &TopicPartitionList) {
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
                let log = format!("{}/{}/{}", self.settings.group_id, e.topic(), e.partition());
                state
                    .partitions
                    .insert(tp, Partition::new(generation, Arc::from(log)));
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
}
