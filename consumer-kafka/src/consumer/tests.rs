//! The stream and its acknowledgers over a partition table filled by hand: no broker, no
//! poll thread.

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::Duration;

use consumer_core::transport::{Incoming, Settlement};
use futures::{FutureExt as _, StreamExt as _};
use tokio::sync::watch;

use super::partitions::{Partition, Shared};
use super::record::{Handout, Record, Tp};
use super::KafkaConsumer;
use crate::config::{KafkaConfig, ProcessingOrder};

/// The partition the tests' records are in.
fn tp() -> Tp {
    (Arc::from("kept"), 0)
}

/// A stream over partition `kept/0` (assignment 1) holding records at offsets `0..n` (see
/// [`add`]), ordered by key. Nothing listens on the brokers' address: the producer is never
/// used.
fn stream(n: i64) -> KafkaConsumer {
    stream_with(n, |_| {})
}

/// [`stream`], its configuration changed by `configure` first.
fn stream_with(n: i64, configure: impl FnOnce(&mut KafkaConfig)) -> KafkaConsumer {
    let mut config = KafkaConfig::new("127.0.0.1:9", "kept-ackers", ["kept"]);
    config.order = ProcessingOrder::Key;
    configure(&mut config);
    let producer =
        crate::producer::create(&config.producer_client_config(), Duration::from_secs(1))
            .expect("a producer needs no broker to be created");
    let (closed, closed_rx) = watch::channel(false);
    let shared = Arc::new(Shared::new(&config, producer, closed));
    assign(&shared, &tp());
    for offset in 0..n {
        add(&shared, offset);
    }
    KafkaConsumer {
        shared,
        closed: closed_rx,
        taken: VecDeque::new(),
        taken_at: 0,
    }
}

/// Adds partition `tp` (assignment 1, empty) to the table, as an assignment would.
fn assign(shared: &Shared, tp: &Tp) {
    let log = Arc::from(format!("kept-ackers/{}/{}", tp.0, tp.1));
    shared
        .lock()
        .partitions
        .insert(tp.clone(), Partition::new(1, log));
}

/// Adds the record at `offset` to the partition, of a key of its own, as the poll thread
/// would.
fn add(shared: &Shared, offset: i64) {
    add_to(shared, &tp(), offset);
}

/// Adds the record at `offset` to partition `tp`, of a key of its own.
fn add_to(shared: &Shared, tp: &Tp, offset: i64) {
    let record = Record {
        tp: tp.clone(),
        offset,
        ..Record::blank()
    };
    let handout = Handout {
        record: Arc::new(record),
        attempt: 1,
        redelivered: false,
    };
    let mut state = shared.lock();
    let p = state.partitions.get_mut(tp).expect("the partition");
    assert!(p.tracker.push(offset, Some(offset as u64), None, handout));
}

/// The next delivery, which must be ready.
fn next(stream: &mut KafkaConsumer) -> Incoming {
    stream
        .next()
        .now_or_never()
        .expect("ready")
        .expect("not ended")
        .expect("not an error")
}

/// Acks `first` and `others` together, as the worker does a batch.
fn ack(first: Incoming, others: Vec<Incoming>) -> Vec<bool> {
    let others = others.into_iter().map(|i| i.acker).collect();
    first
        .acker
        .ack_with(others)
        .now_or_never()
        .expect("a Kafka ack needs no waiting")
        .iter()
        .map(Result::is_ok)
        .collect()
}

#[test]
fn a_settled_acknowledger_is_kept_and_handed_out_again() {
    let mut stream = stream(2);
    let shared = stream.shared.clone();
    let (a, b) = (next(&mut stream), next(&mut stream));
    assert_eq!(ack(a, vec![b]), [true, true]);
    {
        let state = shared.lock();
        // Both kept, holding the blank record; their records handed to the poll thread.
        assert_eq!(state.ackers.len(), 2);
        assert!(state
            .ackers
            .iter()
            .all(|k| std::ptr::eq(k.record(), &*shared.blank)));
        let offsets: Vec<i64> = state.retired.iter().map(|r| r.offset).collect();
        assert_eq!(offsets, [0, 1]);
    }
    // The next record's delivery takes one of them, and settles its own record.
    add(&shared, 2);
    let c = next(&mut stream);
    assert_eq!(c.delivery.source.location.to_string(), "kept/0@2");
    assert_eq!(shared.lock().ackers.len(), 1);
    assert_eq!(ack(c, Vec::new()), [true]);
    let state = shared.lock();
    assert_eq!(state.ackers.len(), 2);
    let p = state.partitions.values().next().expect("the partition");
    assert_eq!(p.tracker.commit_point(), Some(3));
}

#[test]
fn the_acknowledger_of_a_revoked_partition_reports_it_and_is_not_kept() {
    let mut stream = stream(2);
    let shared = stream.shared.clone();
    let (a, b) = (next(&mut stream), next(&mut stream));
    shared.lock().partitions.clear();
    assert_eq!(ack(a, vec![b]), [false, false]);
    let state = shared.lock();
    assert!(state.ackers.is_empty() && state.retired.is_empty());
}

#[test]
fn dropping_the_stream_lets_go_of_the_kept_acknowledgers() {
    let mut stream = stream(3);
    let shared = stream.shared.clone();
    let (a, b, c) = (next(&mut stream), next(&mut stream), next(&mut stream));
    assert_eq!(ack(a, vec![b]), [true, true]);
    assert_eq!(shared.lock().ackers.len(), 2);
    drop(stream);
    assert!(shared.lock().ackers.is_empty());
    // One settled after the stream is gone is not kept either: once it is, nothing but
    // this test holds the shared state (the kept ones held it, and it holds them).
    assert_eq!(ack(c, Vec::new()), [true]);
    assert!(shared.lock().ackers.is_empty());
    assert_eq!(Arc::strong_count(&shared), 1);
}

/// Records of several partitions are handed out one of each in turn, a partition with none
/// left is passed over, and the turn goes on where it stopped across the stream's takes
/// from the table (up to [`super::TAKE_AT_ONCE`] at a time).
#[test]
fn partitions_take_turns_across_takes() {
    let mut stream = stream(0);
    let shared = stream.shared.clone();
    let counts = [70, 70, 3];
    for (partition, &count) in (0..).zip(&counts) {
        let tp: Tp = (Arc::from("kept"), partition);
        if partition != 0 {
            assign(&shared, &tp);
        }
        for offset in 0..count {
            add_to(&shared, &tp, offset);
        }
    }
    // The turns as a model takes them: one of each partition that has any left.
    let mut left = counts;
    let mut expected = Vec::new();
    while left.iter().any(|&l| l > 0) {
        for (partition, l) in (0..).zip(left.iter_mut()) {
            if *l > 0 {
                expected.push(format!("kept/{partition}@{}", counts[partition] - *l));
                *l -= 1;
            }
        }
    }
    assert!(expected.len() > 2 * super::TAKE_AT_ONCE);
    let handed: Vec<String> = (0..expected.len())
        .map(|_| next(&mut stream).delivery.source.location.to_string())
        .collect();
    assert_eq!(handed, expected);
    assert!(stream.next().now_or_never().is_none(), "nothing left");
}

/// Acks `incoming` alone, as a delivery settled on its own is.
fn ack_alone(incoming: Incoming) {
    incoming
        .acker
        .settle(Settlement::Ack)
        .now_or_never()
        .expect("a Kafka ack needs no waiting")
        .expect("acked");
}

/// Takes the four records of a full partition of a limit of four, settles the first with
/// `first` and the second with `second`, and checks that the poll thread was woken then:
/// the partition has room again at two records.
fn settling_half_wakes_the_poll_thread(first: fn(Incoming), second: fn(Incoming)) {
    let mut stream = stream_with(4, |c| c.max_buffered_per_partition = 4);
    let shared = stream.shared.clone();
    shared
        .lock()
        .partitions
        .get_mut(&tp())
        .expect("partition")
        .full = true;
    let (woken_tx, woken) = std::sync::mpsc::channel();
    let poll_thread = std::thread::spawn(move || {
        std::thread::park();
        let _ = woken_tx.send(());
    });
    assert!(shared.poll_thread.set(poll_thread.thread().clone()).is_ok());
    let mut taken: VecDeque<Incoming> = (0..4).map(|_| next(&mut stream)).collect();
    first(taken.pop_front().expect("first"));
    assert!(shared.lock().partitions[&tp()].held_back(&shared.settings));
    second(taken.pop_front().expect("second"));
    woken
        .recv_timeout(Duration::from_secs(10))
        .expect("the poll thread is woken once two of four records have settled");
    poll_thread.join().expect("the poll thread's stand-in ends");
    assert!(!shared.lock().partitions[&tp()].held_back(&shared.settings));
}

#[test]
fn an_ack_alone_that_gives_a_full_partition_room_again_wakes_the_poll_thread() {
    settling_half_wakes_the_poll_thread(|i| assert_eq!(ack(i, Vec::new()), [true]), ack_alone);
}

#[test]
fn a_batch_ack_that_gives_a_full_partition_room_again_wakes_the_poll_thread() {
    settling_half_wakes_the_poll_thread(ack_alone, |i| assert_eq!(ack(i, Vec::new()), [true]));
}
