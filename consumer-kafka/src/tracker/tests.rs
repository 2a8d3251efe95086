//! The tracker against its rules: hand-outs in key and partition order, commit points,
//! deferrals, abandoned records, and the key map's pruning.

use super::*;
use std::time::Duration;

impl Weigh for i64 {
    fn weight(&self) -> usize {
        100
    }
}

#[test]
fn bytes_count_every_record_until_the_commit_point_passes_it() {
    let mut t = tracker(&[(0, Some(1)), (1, Some(2)), (2, Some(3))]);
    assert_eq!(t.bytes(), 300);
    let now = Instant::now();
    assert_eq!(
        t.take_next(ProcessingOrder::Key, now).map(|(o, _)| o),
        Some(0)
    );
    assert_eq!(
        t.take_next(ProcessingOrder::Key, now).map(|(o, _)| o),
        Some(1)
    );
    assert!(!t.settle(1), "the commit point stays at 0");
    assert_eq!(t.bytes(), 300, "settled behind record 0: still held");
    assert!(t.settle(0));
    assert_eq!((t.len(), t.bytes()), (1, 100));
}

fn tracker(records: &[(i64, Option<u64>)]) -> PartitionTracker<i64> {
    let mut t = PartitionTracker::default();
    for &(offset, key) in records {
        assert!(t.push(offset, key, None, offset));
    }
    t
}

fn take(t: &mut PartitionTracker<i64>, order: ProcessingOrder) -> Option<i64> {
    t.take_next(order, Instant::now()).map(|(o, _)| o)
}

#[test]
fn partition_order_hands_out_one_at_a_time() {
    let mut t = tracker(&[(0, Some(1)), (1, Some(2)), (2, Some(3))]);
    assert_eq!(take(&mut t, ProcessingOrder::Partition), Some(0));
    assert_eq!(take(&mut t, ProcessingOrder::Partition), None);
    assert!(t.settle(0));
    assert_eq!(t.commit_point(), Some(1));
    assert_eq!(take(&mut t, ProcessingOrder::Partition), Some(1));
}

#[test]
fn a_record_taken_in_partition_order_is_no_longer_a_head() {
    let mut t = tracker(&[(0, Some(1)), (1, Some(2)), (2, Some(3))]);
    for expect in [0, 1, 2] {
        assert_eq!(take(&mut t, ProcessingOrder::Partition), Some(expect));
        assert!(t.settle(expect));
    }
    assert_eq!(
        t.heads.first(),
        None,
        "no waiting record is left, nor any head"
    );
}

#[test]
fn commit_point_never_passes_an_unsettled_record() {
    // The slow record at offset 10 is followed by fast ones with other keys.
    let mut t = tracker(&[(10, Some(1)), (11, Some(2)), (13, Some(3)), (14, Some(4))]);
    for expect in [10, 11, 13, 14] {
        assert_eq!(take(&mut t, ProcessingOrder::Key), Some(expect));
    }
    assert!(!t.settle(13));
    assert!(!t.settle(14));
    assert!(!t.settle(11));
    assert_eq!(
        t.commit_point(),
        Some(10),
        "the slow record holds the commit point"
    );
    assert!(t.settle(10));
    assert_eq!(t.commit_point(), Some(15), "gaps in offsets are fine");
    assert_eq!(t.len(), 0);
}

#[test]
fn one_key_stays_in_order() {
    let mut t = tracker(&[
        (0, Some(1)),
        (1, Some(1)),
        (2, Some(2)),
        (3, None),
        (4, None),
    ]);
    assert_eq!(take(&mut t, ProcessingOrder::Key), Some(0));
    assert_eq!(take(&mut t, ProcessingOrder::Key), Some(2));
    assert_eq!(take(&mut t, ProcessingOrder::Key), Some(3));
    // 1 waits for 0 (same key); 4 waits for 3 (no key counts as one key).
    assert_eq!(take(&mut t, ProcessingOrder::Key), None);
    t.settle(3);
    assert_eq!(take(&mut t, ProcessingOrder::Key), Some(4));
    t.settle(0);
    assert_eq!(take(&mut t, ProcessingOrder::Key), Some(1));
}

#[test]
fn keys_whose_records_settled_leave_the_key_map() {
    let mut t = PartitionTracker::default();
    for offset in 0..5000 {
        let key = u64::try_from(offset).unwrap_or_default() + 1000;
        assert!(t.push(offset, Some(key), None, offset));
        assert_eq!(take(&mut t, ProcessingOrder::Key), Some(offset));
        assert!(t.settle(offset));
        assert!(t.keys.len() <= KEYS_SLACK + 2, "{} keys", t.keys.len());
    }
    // Chains still form after pruning.
    assert!(t.push(5000, Some(1), None, 5000));
    assert!(t.push(5001, Some(1), None, 5001));
    assert_eq!(take(&mut t, ProcessingOrder::Key), Some(5000));
    assert_eq!(take(&mut t, ProcessingOrder::Key), None);
    assert!(t.settle(5000));
    assert_eq!(take(&mut t, ProcessingOrder::Key), Some(5001));
}

#[test]
fn deferred_record_keeps_its_place_and_blocks_its_key() {
    let mut t = tracker(&[(0, Some(1)), (1, Some(1)), (2, Some(2))]);
    assert_eq!(take(&mut t, ProcessingOrder::Key), Some(0));
    let later = Instant::now() + Duration::from_secs(60);
    *t.defer(0, later).unwrap() = 100;
    assert_eq!(t.head_not_before(), Some(later));
    // Key 1 is blocked by the deferred record; key 2 may go.
    assert_eq!(take(&mut t, ProcessingOrder::Key), Some(2));
    assert_eq!(take(&mut t, ProcessingOrder::Key), None);
    assert_eq!(t.commit_point(), Some(0));
    let (offset, item) = t.take_next(ProcessingOrder::Key, later).unwrap();
    assert_eq!((offset, *item), (0, 100));
    assert!(t.has_due_waiting(later) || t.in_flight() == 2);
}

#[test]
fn records_pushed_settled_do_not_hold_the_commit_point() {
    let mut t = tracker(&[(0, None)]);
    assert!(t.push_settled(1));
    assert_eq!(t.commit_point(), Some(0));
    assert_eq!(take(&mut t, ProcessingOrder::Partition), Some(0));
    t.settle(0);
    assert_eq!(t.commit_point(), Some(2));
    assert!(t.push_settled(2));
    assert_eq!(t.commit_point(), Some(3));
    assert_eq!(take(&mut t, ProcessingOrder::Partition), None);
}

#[test]
fn refetched_records_are_ignored_and_abandoned_ones_are_not_committed() {
    let mut t = tracker(&[(5, None), (6, None)]);
    assert!(!t.push(5, None, None, 5));
    assert_eq!(take(&mut t, ProcessingOrder::Partition), Some(5));
    t.abandon(5);
    assert_eq!(t.in_flight(), 0);
    assert_eq!(t.commit_point(), Some(5));
    assert_eq!(take(&mut t, ProcessingOrder::Partition), None);
}

/// The rule `take_next` implements, by brute force: under key order, the first waiting,
/// due record that no earlier unsettled record of its key holds back; under partition
/// order, the first unsettled record if it is waiting and due.
fn reference_next(
    records: &[(i64, Option<u64>, &'static str, bool)],
    order: ProcessingOrder,
) -> Option<i64> {
    let unsettled: Vec<_> = records.iter().filter(|r| r.2 != "settled").collect();
    match order {
        ProcessingOrder::Partition => unsettled
            .first()
            .filter(|r| r.2 == "waiting" && r.3)
            .map(|r| r.0),
        ProcessingOrder::Key => unsettled
            .iter()
            .enumerate()
            .find(|(i, r)| r.2 == "waiting" && r.3 && !unsettled[..*i].iter().any(|e| e.1 == r.1))
            .map(|(_, r)| r.0),
    }
}

#[test]
fn hands_out_what_the_ordering_rule_allows_under_random_operations() {
    // A small deterministic generator (xorshift): the same sequence on every run.
    let mut seed = 0x2545_f491_4f6c_dd1d_u64;
    let mut next = move |n: u64| {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        seed % n
    };
    let now = Instant::now();
    let later = now + Duration::from_secs(60);
    // Few keys (long chains), and many (most keys settle and leave the key map, which
    // is then pruned).
    let cases = [
        (ProcessingOrder::Key, 6),
        (ProcessingOrder::Partition, 6),
        (ProcessingOrder::Key, 1000),
    ];
    for (order, keys) in cases {
        for _ in 0..200 {
            let mut t = PartitionTracker::default();
            // offset, key, status, due (the model of the tracker's records).
            let mut model: Vec<(i64, Option<u64>, &'static str, bool)> = Vec::new();
            let mut offset = 0;
            for _ in 0..300 {
                match next(10) {
                    0..=3 => {
                        offset += 1 + i64::from(next(3) == 0);
                        let key = (next(5) != 0).then(|| next(keys));
                        assert!(t.push(offset, key, None, offset));
                        model.push((offset, key, "waiting", true));
                    }
                    4..=6 => {
                        let expect = reference_next(&model, order);
                        let got = t.take_next(order, now).map(|(o, _)| o);
                        assert_eq!(got, expect, "{order:?} after {model:?}");
                        if let Some(r) = model.iter_mut().find(|r| Some(r.0) == got) {
                            r.2 = "in flight";
                        }
                    }
                    _ => {
                        let in_flight: Vec<i64> = model
                            .iter()
                            .filter(|r| r.2 == "in flight")
                            .map(|r| r.0)
                            .collect();
                        if in_flight.is_empty() {
                            continue;
                        }
                        let o = in_flight
                            [usize::try_from(next(in_flight.len() as u64)).unwrap_or_default()];
                        let r = model.iter_mut().find(|r| r.0 == o).expect("in model");
                        match next(8) {
                            0 => {
                                t.defer(o, later).expect("in flight");
                                (r.2, r.3) = ("waiting", false);
                            }
                            1 => {
                                t.abandon(o);
                                r.2 = "abandoned";
                            }
                            _ => {
                                t.settle(o);
                                r.2 = "settled";
                            }
                        }
                    }
                }
                assert!(t.keys.len() <= 2 * t.entries.len() + KEYS_SLACK + 2);
                let first_unsettled = model.iter().find(|r| r.2 != "settled").map(|r| r.0);
                let fetched = (!model.is_empty()).then_some(offset + 1);
                assert_eq!(t.commit_point(), first_unsettled.or(fetched));
            }
            // Past the due time every deferred record may go again.
            for r in model.iter_mut() {
                r.3 = true;
            }
            while let Some(expect) = reference_next(&model, order) {
                let got = t.take_next(order, later).map(|(o, _)| o);
                assert_eq!(got, Some(expect), "{order:?} after {model:?}");
                assert!(!t.settle(expect) || t.commit_point() > Some(expect));
                if let Some(r) = model.iter_mut().find(|r| r.0 == expect) {
                    r.2 = "settled";
                }
            }
            assert_eq!(t.take_next(order, later).map(|(o, _)| o), None);
        }
    }
}
