//! Scenarios about how often a job runs: duplicates over several workers, crashes before and
//! after the commit, a key reused with another payload, panics, crash loops (on a queue and
//! on a log), a log's freshness mark, transient and permanent failures, and the numbering of
//! retry copies.

use std::sync::Arc;

use consumer_core::fault::{CrashAlways, CrashOnce, FaultAction, FaultPoint};
use consumer_core::inbox::{Backend, EntryStatus};
use consumer_core::memory::{MemoryBroker, Message};
use consumer_core::stats::StatsSnapshot;
use consumer_core::transport::Origin;
use consumer_core::{DeadLetterReason, Error, Handler, Worker};
use futures::StreamExt;
use serde_json::json;

use crate::env::{unique, wait_until, DEADLINE};
use crate::harness::{msg, run_log_until_drained, run_until_drained, sum, Harness, Log};

/// A hundred deliveries of one key over four workers (four processes on PostgreSQL) run
/// the handler once: one effect, 99 duplicates.
pub async fn same_key_over_four_workers<DB: Backend, H: Handler<DB> + Clone>(h: Harness<DB, H>) {
    let broker = MemoryBroker::new();
    let queue = unique("q");
    for _ in 0..100 {
        broker.publish(
            &queue,
            msg("job-1", json!({"id": "job-1", "sleep_ms": 300})),
        );
    }
    let mut runs = Vec::new();
    for _ in 0..4 {
        let worker =
            Worker::with_config((h.new_inbox)().await, h.handler.clone(), h.config()).unwrap();
        let broker = broker.clone();
        let queue = queue.clone();
        runs.push(tokio::spawn(async move {
            run_until_drained(&worker, &broker, &queue).await.unwrap();
            worker.snapshot()
        }));
    }
    let mut total = StatsSnapshot::default();
    for r in runs {
        total = sum(total, r.await.unwrap());
    }
    let inbox = (h.new_inbox)().await;
    assert_eq!(total.received, 100);
    assert_eq!(total.handler_runs, 1, "{total:?}");
    assert_eq!(total.duplicates, 99, "{total:?}");
    assert_eq!((h.ledger)(inbox, "job-1".into()).await, 1);
}

/// A crash between the commit and the ack: the redelivery is settled as a duplicate without
/// running.
pub async fn crash_after_commit_is_skipped_on_redelivery<DB: Backend, H: Handler<DB> + Clone>(
    h: Harness<DB, H>,
) {
    let broker = MemoryBroker::new();
    let queue = unique("q");
    broker.publish(&queue, msg("a", json!({"id": "a"})));
    let crash = Arc::new(CrashOnce::new(
        FaultAction::StopWorker,
        [(FaultPoint::AfterCommit, "a".to_owned())],
    ));
    let inbox = (h.new_inbox)().await;
    let cfg = h.config().with_faults(crash.clone());
    let first = Worker::with_config(inbox.clone(), h.handler.clone(), cfg.clone()).unwrap();
    let r = run_until_drained(&first, &broker, &queue).await;
    assert!(matches!(r, Err(Error::Crashed("after_commit"))), "{r:?}");
    assert_eq!(
        broker.depth(&queue).ready,
        1,
        "the unacked delivery is back"
    );

    let second = Worker::with_config(inbox.clone(), h.handler.clone(), cfg).unwrap();
    run_until_drained(&second, &broker, &queue).await.unwrap();
    let s = second.snapshot();
    assert_eq!((s.handler_runs, s.duplicates), (0, 1), "{s:?}");
    assert_eq!((h.ledger)(inbox, "a".into()).await, 1);
}

/// A crash before the commit rolls the effect back; the redelivery, in a new process, runs
/// it once, as attempt 1.
pub async fn crash_before_commit_gives_one_effect<DB: Backend, H: Handler<DB> + Clone>(
    h: Harness<DB, H>,
) {
    let broker = MemoryBroker::new();
    let queue = unique("q");
    broker.publish(&queue, msg("b", json!({"id": "b"})));
    let crash = Arc::new(CrashOnce::new(
        FaultAction::StopWorker,
        [(FaultPoint::BeforeCommit, "b".to_owned())],
    ));
    let inbox = (h.new_inbox)().await;
    let cfg = h.config().with_faults(crash);
    let first = Worker::with_config(inbox.clone(), h.handler.clone(), cfg.clone()).unwrap();
    let r = run_until_drained(&first, &broker, &queue).await;
    assert!(matches!(r, Err(Error::Crashed("before_commit"))), "{r:?}");
    assert_eq!(
        (h.ledger)(inbox.clone(), "b".into()).await,
        0,
        "rolled back"
    );

    // A new process: the crashed one's connection (and its key lock) are gone.
    let second = Worker::with_config((h.new_inbox)().await, h.handler.clone(), cfg).unwrap();
    run_until_drained(&second, &broker, &queue).await.unwrap();
    assert_eq!(second.snapshot().handler_runs, 1);
    assert_eq!((h.ledger)(inbox.clone(), "b".into()).await, 1);
    let entry = inbox.entry("record", "b").await.unwrap().unwrap();
    assert_eq!(entry.status, EntryStatus::Completed);
    // The crashed attempt was a fresh delivery: it left no row, so the redelivery, which is
    // counted, is attempt 1.
    assert_eq!(entry.attempts, 1, "the crashed fresh attempt left nothing");
}

/// A key reused with another payload, even one that only spells out the job's defaults, is
/// dead-lettered `key_conflict`, never skipped: the handler runs once.
pub async fn key_reused_with_other_payload_is_a_conflict<DB: Backend, H: Handler<DB> + Clone>(
    h: Harness<DB, H>,
) {
    let broker = MemoryBroker::new();
    let queue = unique("q");
    broker.publish(&queue, msg("c", json!({"id": "c"})));
    broker.publish(
        &queue,
        msg("c", json!({"id": "c", "order_id": null, "fail_times": 0})),
    );
    broker.publish(&queue, msg("c", json!({"id": "c-other"})));
    let inbox = (h.new_inbox)().await;
    let w = Worker::with_config(
        inbox.clone(),
        h.handler.clone(),
        h.config().with_concurrency(1),
    )
    .unwrap();
    run_until_drained(&w, &broker, &queue).await.unwrap();
    let dead = broker.dead_letters(&queue);
    assert_eq!(dead.len(), 2, "{dead:?}");
    assert!(dead
        .iter()
        .all(|d| d.dead_letter.reason == DeadLetterReason::KeyConflict));
    assert_eq!(w.snapshot().handler_runs, 1);
    assert_eq!((h.ledger)(inbox, "c".into()).await, 1);
}

/// A handler that panics every time is retried and dead-lettered after `max_attempts` with
/// the panic's message; the job beside it completes.
pub async fn panicking_handler_is_dead_lettered_after_max_attempts<
    DB: Backend,
    H: Handler<DB> + Clone,
>(
    h: Harness<DB, H>,
) {
    let broker = MemoryBroker::new();
    let queue = unique("q");
    broker.publish(&queue, msg("p", json!({"id": "p", "panic": true})));
    broker.publish(&queue, msg("ok", json!({"id": "ok"})));
    let inbox = (h.new_inbox)().await;
    let w = Worker::with_config(inbox.clone(), h.handler.clone(), h.config()).unwrap();
    run_until_drained(&w, &broker, &queue).await.unwrap();
    let s = w.snapshot();
    assert_eq!(s.panics, 3, "{s:?}");
    assert_eq!(s.retries, 2, "{s:?}");
    let dead = broker.dead_letters(&queue);
    assert_eq!(dead.len(), 1, "only the panicking job: {dead:?}");
    let d = &dead[0].dead_letter;
    assert_eq!(d.reason, DeadLetterReason::MaxAttemptsExceeded);
    assert_eq!(
        (d.handler.as_str(), d.key.as_deref(), d.attempts),
        ("record", Some("p"), 3)
    );
    assert!(
        d.error.contains("panicked") && d.error.contains("always panics"),
        "{}",
        d.error
    );
    assert_eq!(d.source.transport, "memory");
    assert_eq!((h.ledger)(inbox.clone(), "ok".into()).await, 1);
    let entry = inbox.entry("record", "p").await.unwrap().unwrap();
    assert_eq!(entry.status, EntryStatus::Dead);
}

/// A delivery that crashes its worker every time is quarantined after its attempts instead of
/// looping.
pub async fn crash_loop_is_quarantined<DB: Backend, H: Handler<DB> + Clone>(h: Harness<DB, H>) {
    crash_loop(h, None).await;
}

/// On a log, no delivery says it was handed out before: only the log mark, raised before the
/// first run, makes the restarted worker count the crashed record's attempts.
pub async fn crash_loop_over_a_log_is_quarantined<DB: Backend, H: Handler<DB> + Clone>(
    h: Harness<DB, H>,
) {
    crash_loop(h, Some(Log::new(&["k"]))).await;
}

async fn crash_loop<DB: Backend, H: Handler<DB> + Clone>(h: Harness<DB, H>, log: Option<Log>) {
    let broker = MemoryBroker::new();
    let queue = unique("q");
    broker.publish(&queue, msg("k", json!({"id": "k"})));
    let cfg = h.config().with_faults(Arc::new(CrashAlways {
        point: FaultPoint::BeforeCommit,
        key: "k".to_owned(),
        action: FaultAction::StopWorker,
    }));
    let mut crashes = 0;
    let mut runs = 0;
    loop {
        // Every restart is a new "process": new pool, new in-process state.
        let w = Worker::with_config((h.new_inbox)().await, h.handler.clone(), cfg.clone()).unwrap();
        let r = match &log {
            None => run_until_drained(&w, &broker, &queue).await,
            Some(log) => run_log_until_drained(&w, &broker, &queue, log).await,
        };
        runs += w.snapshot().handler_runs;
        match r {
            Err(Error::Crashed(_)) => crashes += 1,
            Ok(()) => break,
            Err(e) => panic!("{e}"),
        }
        assert!(
            crashes <= 4,
            "the message loops instead of being quarantined"
        );
    }
    // max_attempts is 3. The first delivery is fresh, so its crash is not counted (there
    // was nothing to count it in: its claim rolled back); the three redeliveries are, and
    // the fourth finds the attempts used up without an outcome.
    assert_eq!((crashes, runs), (4, 4));
    let dead = broker.dead_letters(&queue);
    assert_eq!(dead.len(), 1);
    assert_eq!(dead[0].dead_letter.reason, DeadLetterReason::Quarantined);
    assert_eq!(dead[0].dead_letter.attempts, 3);
    assert_eq!((h.ledger)((h.new_inbox)().await, "k".into()).await, 0);
}

/// A delivery that crashes its worker every time, sharing a queue (and, in batched mode,
/// its batches) with innocent ones: only it is quarantined. Redelivered jobs run alone, so
/// the crashes it causes cost the others no attempt once they have been redelivered.
pub async fn crash_loop_quarantines_only_its_own_message<DB: Backend, H: Handler<DB> + Clone>(
    h: Harness<DB, H>,
) {
    let broker = MemoryBroker::new();
    let queue = unique("q");
    let innocent = ["a", "b", "c"];
    broker.publish(&queue, msg("k", json!({"id": "k"})));
    for id in innocent {
        broker.publish(&queue, msg(id, json!({ "id": id })));
    }
    let cfg = h.config().with_faults(Arc::new(CrashAlways {
        point: FaultPoint::BeforeCommit,
        key: "k".to_owned(),
        action: FaultAction::StopWorker,
    }));
    let mut crashes = 0;
    loop {
        let w = Worker::with_config((h.new_inbox)().await, h.handler.clone(), cfg.clone()).unwrap();
        match run_until_drained(&w, &broker, &queue).await {
            Err(Error::Crashed(_)) => crashes += 1,
            Ok(()) => break,
            Err(e) => panic!("{e}"),
        }
        assert!(
            crashes <= 8,
            "the message loops instead of being quarantined"
        );
    }
    let dead = broker.dead_letters(&queue);
    let dead_keys: Vec<_> = dead
        .iter()
        .map(|d| (d.dead_letter.key.as_deref(), d.dead_letter.reason))
        .collect();
    assert_eq!(dead_keys, [(Some("k"), DeadLetterReason::Quarantined)]);
    let inbox = (h.new_inbox)().await;
    for id in innocent {
        assert_eq!((h.ledger)(inbox.clone(), id.into()).await, 1, "{id}");
        let entry = inbox.entry("record", id).await.unwrap().unwrap();
        assert_eq!(entry.status, EntryStatus::Completed, "{id}");
    }
}

/// A log's records take the fresh path once the log mark is raised past them; a new
/// process reading the log again does not trust what lies below the mark it finds.
pub async fn log_records_are_proven_fresh<DB: Backend, H: Handler<DB> + Clone>(h: Harness<DB, H>) {
    let ids: Vec<String> = (0..12).map(|i| format!("l{i}")).collect();
    let log = Log::new(&ids.iter().map(String::as_str).collect::<Vec<_>>());
    let broker = MemoryBroker::new();
    let queue = unique("q");
    for id in &ids[..10] {
        broker.publish(&queue, msg(id, json!({ "id": id })));
    }
    let inbox = (h.new_inbox)().await;
    let first = Worker::with_config(inbox.clone(), h.handler.clone(), h.config()).unwrap();
    run_log_until_drained(&first, &broker, &queue, &log)
        .await
        .unwrap();
    let s = first.snapshot();
    assert_eq!((s.completed, s.fresh_completed), (10, 10), "{s:?}");
    let mark = inbox.log_mark("record", &log.name).await.unwrap();
    assert!(
        mark.is_some_and(|m| m >= 10),
        "raised past every record run: {mark:?}"
    );
    assert_eq!(inbox.log_mark("record", "another log").await.unwrap(), None);

    // A second process reads the log again from offset 8 (its commit was lost), then reads
    // a new record: both below the mark the first process left, so both are counted.
    for id in &ids[8..11] {
        broker.publish(&queue, msg(id, json!({ "id": id })));
    }
    let second = Worker::with_config((h.new_inbox)().await, h.handler.clone(), h.config()).unwrap();
    run_log_until_drained(&second, &broker, &queue, &log)
        .await
        .unwrap();
    let s = second.snapshot();
    assert_eq!(
        (s.duplicates, s.completed, s.fresh_completed),
        (2, 1, 0),
        "{s:?}"
    );
    let entry = inbox.entry("record", "l10").await.unwrap().unwrap();
    assert_eq!((entry.status, entry.attempts), (EntryStatus::Completed, 1));
    for id in &ids[..11] {
        assert_eq!((h.ledger)(inbox.clone(), id.clone()).await, 1, "{id}");
    }
}

/// Transient failures are retried until the job succeeds; permanent failures, undecodable
/// payloads, a payload the job type rejects and an oversized one are dead-lettered at once.
pub async fn retries_then_succeeds<DB: Backend, H: Handler<DB> + Clone>(h: Harness<DB, H>) {
    let broker = MemoryBroker::new();
    let queue = unique("q");
    broker.publish(&queue, msg("r", json!({"id": "r", "fail_times": 2})));
    broker.publish(
        &queue,
        msg("perm", json!({"id": "perm", "permanent": true})),
    );
    broker.publish(
        &queue,
        Message {
            id: Some("bad".into()),
            payload: "{not json".into(),
            ..Message::default()
        },
    );
    broker.publish(&queue, msg("wrong", json!({"no_id_field": 1})));
    broker.publish(
        &queue,
        msg(
            "huge",
            json!({"id": "huge", "pad": "x".repeat(2 * 1024 * 1024)}),
        ),
    );
    let inbox = (h.new_inbox)().await;
    let w = Worker::with_config(inbox.clone(), h.handler.clone(), h.config()).unwrap();
    run_until_drained(&w, &broker, &queue).await.unwrap();
    let s = w.snapshot();
    assert_eq!(
        (s.handler_runs - s.batch_reruns, s.retries),
        (4, 2),
        "{s:?}"
    );
    assert_eq!((h.ledger)(inbox, "r".into()).await, 1);
    let mut reasons: Vec<_> = broker
        .dead_letters(&queue)
        .iter()
        .map(|d| {
            (
                d.message.id.clone().unwrap_or_default(),
                d.dead_letter.reason,
                d.dead_letter.attempts,
            )
        })
        .collect();
    reasons.sort_by(|a, b| a.0.cmp(&b.0));
    assert_eq!(
        reasons,
        vec![
            ("bad".to_owned(), DeadLetterReason::Undecodable, 0),
            ("huge".to_owned(), DeadLetterReason::PayloadTooLarge, 0),
            ("perm".to_owned(), DeadLetterReason::PermanentError, 1),
            ("wrong".to_owned(), DeadLetterReason::Undecodable, 0),
        ]
    );
}

/// A delivery whose attempt failed and whose retry copy is with the broker may come back: a
/// Kafka record replayed after a rebalance, a RabbitMQ delivery whose ack was lost. It is
/// superseded by the copy: acked without running and without counting an attempt, so the
/// message keeps its backoff and its attempt budget. The copy then runs as attempt 2.
pub async fn replay_of_a_retried_delivery_is_superseded<DB: Backend, H: Handler<DB> + Clone>(
    h: Harness<DB, H>,
) {
    let broker = MemoryBroker::new();
    let queue = unique("q");
    let inbox = (h.new_inbox)().await;
    let w = Worker::with_config(inbox.clone(), h.handler.clone(), h.config()).unwrap();
    // The retry copies (attempt 2) are held back until the replays have been seen; the
    // replays come as redeliveries (not fresh), as a log's or a lost ack's do.
    let held = Arc::new(std::sync::Mutex::new(Vec::new()));
    let replaying = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let (release, released) = futures::channel::mpsc::unbounded();
    let deliveries = broker.consume(&queue).filter_map({
        let (held, replaying) = (held.clone(), replaying.clone());
        move |item| {
            let item = match item {
                Ok(incoming) if incoming.delivery.attempt >= 2 => {
                    held.lock().unwrap().push(incoming);
                    None
                }
                Ok(mut incoming) if replaying.load(std::sync::atomic::Ordering::SeqCst) => {
                    incoming.delivery.origin = Origin::Unknown;
                    incoming.delivery.redelivered = true;
                    Some(Ok(incoming))
                }
                other => Some(other),
            };
            futures::future::ready(item)
        }
    });
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let running = tokio::spawn({
        let w = w.clone();
        let deliveries = futures::stream::select(deliveries, released);
        async move {
            w.run(deliveries, async {
                let _ = stopped.await;
            })
            .await
        }
    });
    let ids = ["s1", "s2"];
    let publish_all = || {
        for id in ids {
            broker.publish(&queue, msg(id, json!({"id": id, "fail_times": 1})));
        }
    };
    let entries = || {
        let inbox = inbox.clone();
        async move {
            let mut entries = Vec::new();
            for id in ids {
                entries.push(inbox.entry("record", id).await.unwrap());
            }
            entries
        }
    };

    publish_all();
    wait_until("both retry copies held, and recorded in the inbox", || {
        let copies = held.lock().unwrap().len();
        let entries = entries();
        async move {
            let recorded = entries
                .await
                .iter()
                .all(|e| e.as_ref().is_some_and(|e| e.retried_to == 2));
            copies == 2 && recorded
        }
    })
    .await;
    replaying.store(true, std::sync::atomic::Ordering::SeqCst);
    publish_all();
    wait_until("both replays superseded", || {
        let superseded = w.snapshot().superseded;
        async move { superseded == 2 }
    })
    .await;
    let s = w.snapshot();
    assert_eq!(s.handler_runs - s.batch_reruns, 2, "{s:?}");
    for entry in entries().await {
        let entry = entry.unwrap();
        assert_eq!((entry.status, entry.attempts), (EntryStatus::Pending, 1));
    }

    for copy in held.lock().unwrap().drain(..) {
        release.unbounded_send(Ok(copy)).unwrap();
    }
    wait_until("both copies completed", || {
        let completed = w.snapshot().completed;
        async move { completed == 2 }
    })
    .await;
    for id in ids {
        assert_eq!((h.ledger)(inbox.clone(), id.into()).await, 1, "{id}");
        let entry = inbox.entry("record", id).await.unwrap().unwrap();
        assert_eq!((entry.status, entry.attempts), (EntryStatus::Completed, 2));
    }
    stop.send(()).unwrap();
    running.await.unwrap().unwrap();
    assert!(broker.dead_letters(&queue).is_empty());
}

/// A delivery can carry a higher attempt number than the inbox has counted (its earlier
/// attempts were retried after database errors, which count nothing). Its retry copy is
/// numbered above it (4, not the count's 2), so copies are numbered upward along the
/// message's line and a copy is never below a recorded older one; the message then
/// completes.
pub async fn a_delivery_numbered_ahead_of_the_count_is_retried<
    DB: Backend,
    H: Handler<DB> + Clone,
>(
    h: Harness<DB, H>,
) {
    let broker = MemoryBroker::new();
    let queue = unique("q");
    let inbox = (h.new_inbox)().await;
    let w = Worker::with_config(inbox.clone(), h.handler.clone(), h.config()).unwrap();
    broker.publish(
        &queue,
        msg("ahead", json!({"id": "ahead", "fail_times": 1})),
    );
    // The published message arrives as the third copy of a message the inbox never saw.
    let numbers = Arc::new(std::sync::Mutex::new(Vec::new()));
    let deliveries = broker.consume(&queue).map({
        let numbers = numbers.clone();
        move |item| {
            item.map(|mut incoming| {
                let d = &mut incoming.delivery;
                if d.attempt == 1 {
                    (d.attempt, d.origin, d.redelivered) = (3, Origin::Unknown, true);
                }
                numbers.lock().unwrap().push(d.attempt);
                incoming
            })
        }
    });
    tokio::time::timeout(DEADLINE, w.run(deliveries, broker.drained(&queue)))
        .await
        .expect("worker did not drain the queue in time")
        .unwrap();
    let s = w.snapshot();
    assert_eq!((s.retries, s.superseded, s.completed), (1, 0, 1), "{s:?}");
    assert_eq!(*numbers.lock().unwrap(), vec![3, 4]);
    assert_eq!((h.ledger)(inbox.clone(), "ahead".into()).await, 1);
    let entry = inbox.entry("record", "ahead").await.unwrap().unwrap();
    assert_eq!((entry.status, entry.attempts), (EntryStatus::Completed, 2));
}
