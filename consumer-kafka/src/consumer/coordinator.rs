//! The watch over a consumer's group coordinator: librdkafka's statistics say, every
//! `statistics.interval.ms`, whether the group is up with its coordinator connected; a
//! consumer whose coordinator has stayed out of reach for `coordinator_timeout` is closed
//! and replaced by the poll thread (see `poll::poll_loop`).
//!
//! Why: after a broker restart librdkafka 2.12.1 can keep a consumer's coordinator
//! connection down for good (its group request waits in the coordinator's out-queue and
//! times out every `socket.timeout.ms`, seen in CI after a controlled restart of the only
//! broker): the member's session has lapsed, its partitions were revoked, and it never joins
//! again, though every broker answers. A new consumer finds the coordinator at once. Its
//! session having lapsed long before, the replaced consumer owns nothing the group still
//! counts as its own.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use rdkafka::Statistics;

/// Whether `statistics` show the group up with its coordinator's connection up: the group
/// handler in state `up`, and librdkafka's logical `GroupCoordinator` broker in state `UP`.
/// `None` when they say nothing of a group (no `cgrp` section).
pub(super) fn coordinator_reachable(statistics: &Statistics) -> Option<bool> {
    let group = statistics.cgrp.as_ref()?;
    let connected = statistics
        .brokers
        .values()
        .filter(|b| b.name.starts_with("GroupCoordinator"))
        .all(|b| b.state == "UP");
    Some(group.state == "up" && connected)
}

/// Since when a consumer's coordinator has been out of reach, fed by its statistics; set
/// for good once that has lasted `timeout`.
#[derive(Debug)]
pub(super) struct CoordinatorWatch {
    timeout: Duration,
    /// The first sample of the current run of samples without a coordinator.
    since: Mutex<Option<Instant>>,
    lost: AtomicBool,
}

impl CoordinatorWatch {
    pub(super) fn new(timeout: Duration) -> Self {
        CoordinatorWatch {
            timeout,
            since: Mutex::new(None),
            lost: AtomicBool::new(false),
        }
    }

    /// Records a sample taken at `now`. Returns how long the coordinator has been out of
    /// reach when this sample makes it lost (once; later samples return `None`).
    pub(super) fn observe(&self, reachable: bool, now: Instant) -> Option<Duration> {
        let mut since = self
            .since
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if reachable {
            *since = None;
            return None;
        }
        let first = *since.get_or_insert(now);
        let out_of_reach = now.duration_since(first);
        (out_of_reach >= self.timeout && !self.lost.swap(true, Ordering::SeqCst))
            .then_some(out_of_reach)
    }

    /// Whether the coordinator has been out of reach for the timeout: the consumer is to be
    /// replaced.
    pub(super) fn lost(&self) -> bool {
        self.lost.load(Ordering::SeqCst)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    use rdkafka::statistics::{Broker, ConsumerGroup};

    /// A consumer's statistics with the parts `coordinator_reachable` reads.
    fn consumer_stats(group_state: &str, coordinator_state: &str) -> Statistics {
        let broker = |name: &str, state: &str| Broker {
            name: name.to_owned(),
            state: state.to_owned(),
            ..Broker::default()
        };
        let mut s = Statistics {
            cgrp: Some(ConsumerGroup {
                state: group_state.to_owned(),
                join_state: "steady".to_owned(),
                ..ConsumerGroup::default()
            }),
            ..Statistics::default()
        };
        s.brokers.insert(
            "127.0.0.1:9092/1".to_owned(),
            broker("127.0.0.1:9092/1", "UP"),
        );
        s.brokers.insert(
            "GroupCoordinator".to_owned(),
            broker("GroupCoordinator", coordinator_state),
        );
        s
    }

    #[test]
    fn the_coordinator_is_reachable_when_the_group_and_its_connection_are_up() {
        assert_eq!(
            coordinator_reachable(&consumer_stats("up", "UP")),
            Some(true)
        );
        assert_eq!(
            coordinator_reachable(&consumer_stats("up", "DOWN")),
            Some(false)
        );
        assert_eq!(
            coordinator_reachable(&consumer_stats("up", "CONNECT")),
            Some(false)
        );
        assert_eq!(
            coordinator_reachable(&consumer_stats("wait-coord", "UP")),
            Some(false)
        );
        assert_eq!(
            coordinator_reachable(&consumer_stats("wait-broker-transport", "INIT")),
            Some(false)
        );
    }

    #[test]
    fn a_coordinator_out_of_reach_for_the_timeout_is_lost_once() {
        let start = Instant::now();
        let at = |s: u64| start + Duration::from_secs(s);
        let watch = CoordinatorWatch::new(Duration::from_secs(30));
        assert_eq!(watch.observe(true, at(0)), None);
        assert_eq!(watch.observe(false, at(5)), None);
        assert_eq!(watch.observe(false, at(20)), None);
        assert!(!watch.lost());
        assert_eq!(watch.observe(false, at(35)), Some(Duration::from_secs(30)));
        assert!(watch.lost());
        // Once: the poll thread replaces the consumer on the flag, not on each sample.
        assert_eq!(watch.observe(false, at(40)), None);
        assert!(watch.lost());
    }

    #[test]
    fn a_coordinator_back_in_reach_starts_the_count_again() {
        let start = Instant::now();
        let at = |s: u64| start + Duration::from_secs(s);
        let watch = CoordinatorWatch::new(Duration::from_secs(30));
        assert_eq!(watch.observe(false, at(0)), None);
        assert_eq!(watch.observe(false, at(25)), None);
        assert_eq!(watch.observe(true, at(26)), None);
        assert_eq!(watch.observe(false, at(30)), None);
        assert_eq!(watch.observe(false, at(55)), None);
        assert!(!watch.lost());
        assert_eq!(watch.observe(false, at(60)), Some(Duration::from_secs(30)));
    }
}
