//! Scenarios about a key's life in the inbox: guards won once, retention of completed and
//! dead rows, many distinct jobs (batched through the batch function where there is one),
//! retry copies that are lost or overdue, two inboxes that share no locks, and a dead key
//! released for a replay.

use std::sync::Arc;
use std::time::Duration;

use consumer_core::inbox::{Backend, EntryStatus};
use consumer_core::memory::{MemoryBroker, MemoryConsumer};
use consumer_core::transport::{Incoming, Origin, Transport};
use consumer_core::{DeadLetterReason, Handler, Worker};
use futures::StreamExt;
use serde_json::json;

use crate::env::{run_until, unique, wait_until};
use crate::harness::{msg, run_until_drained, Harness};
use crate::jobs::BATCH_CALLS;

/// Two jobs for one order: the state transition and the flag guard are each won once, by
/// the same job.
pub async fn guards_are_won_once<DB: Backend, H: Handler<DB> + Clone>(h: Harness<DB, H>) {
    let broker = MemoryBroker::new();
    let queue = unique("q");
    let inbox = (h.new_inbox)().await;
    assert_eq!((h.order)(inbox.clone(), 7, true).await, "created");
    // Two different jobs (different keys, both run) touching the same order.
    broker.publish(&queue, msg("g1", json!({"id": "g1", "order_id": 7})));
    broker.publish(&queue, msg("g2", json!({"id": "g2", "order_id": 7})));
    let w = Worker::with_config(inbox.clone(), h.handler.clone(), h.config()).unwrap();
    run_until_drained(&w, &broker, &queue).await.unwrap();
    assert_eq!(w.snapshot().completed, 2);
    assert_eq!((h.ledger)(inbox.clone(), "email-7".into()).await, 1);
    assert_eq!((h.order)(inbox, 7, false).await, "invoiced");
}

/// The background retention task purges completed rows once they have expired.
pub async fn expired_rows_are_purged<DB: Backend, H: Handler<DB> + Clone>(h: Harness<DB, H>) {
    let broker = MemoryBroker::new();
    let queue = unique("q");
    for i in 0..5 {
        broker.publish(
            &queue,
            msg(&format!("e{i}"), json!({"id": format!("e{i}")})),
        );
    }
    let inbox = (h.new_inbox)().await;
    let w = Worker::with_config(
        inbox.clone(),
        h.handler.clone(),
        h.config()
            .with_retention(Duration::from_millis(1))
            .with_retention_interval(Some(Duration::from_millis(50)))
            .with_retention_batch(2),
    )
    .unwrap();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let run = {
        let w = w.clone();
        let broker = broker.clone();
        let queue = queue.clone();
        tokio::spawn(async move {
            w.run(broker.consume(&queue), async {
                let _ = stopped.await;
            })
            .await
        })
    };
    // First every job must have run (an entry that was never written is not a purged one).
    wait_until("all five jobs to complete", || {
        let done = w.snapshot().completed == 5;
        async move { done }
    })
    .await;
    wait_until("the background task to purge every expired row", || {
        let inbox = inbox.clone();
        async move {
            let mut left = 0;
            for i in 0..5 {
                left += usize::from(
                    inbox
                        .entry("record", &format!("e{i}"))
                        .await
                        .unwrap()
                        .is_some(),
                );
            }
            left == 0
        }
    })
    .await;
    stop.send(()).unwrap();
    run.await.unwrap().unwrap();
    assert_eq!(w.snapshot().completed, 5);
}

/// Sixty distinct jobs, a few failing once and a few redelivered: each has one effect,
/// batched mode forms batches, and only a handler with a batch function is called per batch.
pub async fn many_distinct_jobs_each_once<DB: Backend, H: Handler<DB> + Clone>(h: Harness<DB, H>) {
    let broker = MemoryBroker::new();
    let queue = unique("q");
    for i in 0..60 {
        let fail_times = u32::from(i % 20 == 0);
        broker.publish(
            &queue,
            msg(
                &format!("m{i}"),
                json!({"id": format!("m{i}"), "fail_times": fail_times}),
            ),
        );
    }
    // Redelivered copies of a few, as a broker would after a lost ack.
    for i in 0..6 {
        broker.publish(
            &queue,
            msg(
                &format!("m{i}"),
                json!({"id": format!("m{i}"), "fail_times": u32::from(i % 20 == 0)}),
            ),
        );
    }
    let inbox = (h.new_inbox)().await;
    let w = Worker::with_config(inbox.clone(), h.handler.clone(), h.config()).unwrap();
    run_until_drained(&w, &broker, &queue).await.unwrap();
    let s = w.snapshot();
    assert_eq!(s.completed, 60, "{s:?}");
    assert_eq!(s.retries, 3, "{s:?}");
    for i in 0..60 {
        assert_eq!((h.ledger)(inbox.clone(), format!("m{i}")).await, 1, "m{i}");
    }
    if h.batch.is_some() {
        assert!(
            s.batches > 0 && s.batches < 60,
            "batched mode batched nothing: {s:?}"
        );
    } else {
        assert_eq!(s.batches, 0);
    }
    let calls = BATCH_CALLS
        .lock()
        .unwrap()
        .iter()
        .filter(|q| **q == queue)
        .count();
    if h.batch.is_some() && h.handler.handles_batches() {
        assert!(calls > 0, "the batch function was never called: {s:?}");
    } else {
        assert_eq!(calls, 0, "a batch function outside batched mode");
    }
}

/// Holds back the retry copies (attempt 2 and up) of `deliveries` in `held`, and hands on
/// the rest as redeliveries (not fresh), as a log's replay or a lost ack's redelivery comes.
fn holding_copies(
    deliveries: MemoryConsumer,
    held: Arc<std::sync::Mutex<Vec<Incoming>>>,
) -> impl Transport {
    deliveries.filter_map(move |item| {
        let item = match item {
            Ok(incoming) if incoming.delivery.attempt >= 2 => {
                held.lock().unwrap().push(incoming);
                None
            }
            Ok(mut incoming) => {
                incoming.delivery.origin = Origin::Unknown;
                incoming.delivery.redelivered = true;
                Some(Ok(incoming))
            }
            other => Some(other),
        };
        futures::future::ready(item)
    })
}

/// Finding: a retry copy that will never be consumed must not supersede the message. The
/// copy of a failed attempt is left with a broker that is then replaced (as a retry queue
/// deleted, a retry topic no longer read, or another consumer group would leave it); the
/// producer publishes the job again, to the new broker. That delivery comes through other
/// consumers than the copy's, so it runs, and the job's effect happens once.
pub async fn a_copy_that_can_no_longer_arrive_does_not_supersede<
    DB: Backend,
    H: Handler<DB> + Clone,
>(
    h: Harness<DB, H>,
) {
    let queue = unique("q");
    let inbox = (h.new_inbox)().await;
    let body = json!({"id": "gone", "fail_times": 1});
    let first = MemoryBroker::new();
    let held = Arc::new(std::sync::Mutex::new(Vec::new()));
    let w1 = Worker::with_config(inbox.clone(), h.handler.clone(), h.config()).unwrap();
    first.publish(&queue, msg("gone", body.clone()));
    run_until(
        &w1,
        holding_copies(first.consume(&queue), held.clone()),
        "the first attempt failed, its copy held and recorded",
        || {
            let (inbox, held) = (inbox.clone(), held.clone());
            async move {
                let entry = inbox.entry("record", "gone").await.unwrap();
                entry.is_some_and(|e| e.retried_to == 2) && held.lock().unwrap().len() == 1
            }
        },
    )
    .await;
    let entry = inbox.entry("record", "gone").await.unwrap().unwrap();
    assert_eq!(
        entry.last_error.as_deref(),
        Some("transient failure on attempt 1"),
        "a pending key's error names no dead-letter reason: {entry:?}"
    );
    // The stuck key is visible to an operator.
    let counts = inbox.counts("record").await.unwrap();
    assert_eq!((counts.pending, counts.completed), (1, 0), "{counts:?}");
    assert!(counts.stalest_pending.is_some(), "{counts:?}");

    let second = MemoryBroker::new();
    second.publish(&queue, msg("gone", body));
    let w2 = Worker::with_config(inbox.clone(), h.handler.clone(), h.config()).unwrap();
    run_until_drained(&w2, &second, &queue).await.unwrap();
    let s = w2.snapshot();
    assert_eq!((s.superseded, s.completed), (0, 1), "{s:?}");
    assert_eq!((h.ledger)(inbox.clone(), "gone".to_owned()).await, 1);
    let entry = inbox.entry("record", "gone").await.unwrap().unwrap();
    assert_eq!(
        (entry.status, entry.attempts),
        (EntryStatus::Completed, 2),
        "{entry:?}"
    );
    let counts = inbox.counts("record").await.unwrap();
    assert_eq!((counts.pending, counts.completed), (0, 1), "{counts:?}");
    assert_eq!(counts.stalest_pending, None, "{counts:?}");
}

/// Finding: a copy that is overdue by more than the inbox's grace period is taken as lost
/// (a retry topic past its retention, say): a later delivery of the message through the same
/// consumers runs instead of being superseded.
pub async fn an_overdue_copy_does_not_supersede<DB: Backend, H: Handler<DB> + Clone>(
    h: Harness<DB, H>,
) {
    let broker = MemoryBroker::new();
    let queue = unique("q");
    let inbox = (h.other_inbox)(Duration::ZERO).await;
    let body = json!({"id": "late", "fail_times": 1});
    let held = Arc::new(std::sync::Mutex::new(Vec::new()));
    let w = Worker::with_config(inbox.clone(), h.handler.clone(), h.config()).unwrap();
    broker.publish(&queue, msg("late", body.clone()));
    run_until(
        &w,
        holding_copies(broker.consume(&queue), held.clone()),
        "the copy held, recorded, and overdue",
        || {
            let (inbox, held) = (inbox.clone(), held.clone());
            async move {
                let entry = inbox.entry("record", "late").await.unwrap();
                let overdue = entry.is_some_and(|e| {
                    e.retried_to == 2 && e.copy_due_in_ms.is_some_and(|due| due < 0)
                });
                overdue && held.lock().unwrap().len() == 1
            }
        },
    )
    .await;
    // The held copy is never delivered: it was lost. The job comes again.
    broker.publish(&queue, msg("late", body));
    run_until(
        &w,
        holding_copies(broker.consume(&queue), held.clone()),
        "the job's effect",
        || {
            let (inbox, ledger) = (inbox.clone(), h.ledger);
            async move { ledger(inbox, "late".to_owned()).await == 1 }
        },
    )
    .await;
    let s = w.snapshot();
    assert_eq!((s.superseded, s.completed), (0, 1), "{s:?}");
}

/// Finding: completion has a status guard. Two inboxes on one table whose key locks do not
/// see each other (PostgreSQL: the table spelled `"schema"."consumer_inbox"` and, through
/// the search path, `consumer_inbox`; SQLite: two inboxes on one file) are each handed a
/// redelivery of one key, and their handlers overlap. The key's effect is committed once;
/// the other delivery is settled as a duplicate.
pub async fn two_inboxes_that_share_no_locks_complete_a_key_once<
    DB: Backend,
    H: Handler<DB> + Clone,
>(
    h: Harness<DB, H>,
) {
    let broker = MemoryBroker::new();
    let (qa, qb) = (unique("qa"), unique("qb"));
    let inbox_a = (h.new_inbox)().await;
    let inbox_b = (h.other_inbox)(Duration::from_secs(300)).await;
    let body = json!({"id": "both", "sleep_ms": 500});
    broker.publish(&qa, msg("both", body.clone()));
    broker.publish(&qb, msg("both", body));
    let wa = Worker::with_config(inbox_a.clone(), h.handler.clone(), h.config()).unwrap();
    let wb = Worker::with_config(inbox_b, h.handler.clone(), h.config()).unwrap();
    let held = Arc::new(std::sync::Mutex::new(Vec::new()));
    let settled = |w: &Worker<DB, H>| {
        let s = w.snapshot();
        s.completed + s.duplicates
    };
    let (a, b) = tokio::join!(
        run_until(
            &wa,
            holding_copies(broker.consume(&qa), held.clone()),
            "a settled",
            || {
                let n = settled(&wa);
                async move { n == 1 }
            }
        ),
        run_until(
            &wb,
            holding_copies(broker.consume(&qb), held.clone()),
            "b settled",
            || {
                let n = settled(&wb);
                async move { n == 1 }
            }
        ),
    );
    let ((), ()) = (a, b);
    assert_eq!((h.ledger)(inbox_a.clone(), "both".to_owned()).await, 1);
    let (sa, sb) = (wa.snapshot(), wb.snapshot());
    assert_eq!(sa.completed + sb.completed, 1, "{sa:?} {sb:?}");
    assert_eq!(sa.duplicates + sb.duplicates, 1, "{sa:?} {sb:?}");
}

/// Finding: dead is not forever. A dead key released through the inbox runs again when its
/// dead letter is replayed; before the release, a replay is dead-lettered again.
pub async fn a_released_dead_key_runs_again<DB: Backend, H: Handler<DB> + Clone>(
    h: Harness<DB, H>,
) {
    let broker = MemoryBroker::new();
    let queue = unique("q");
    let inbox = (h.new_inbox)().await;
    let body = json!({"id": "dead", "fail_times": 1});
    let one_attempt = h.config().with_max_attempts(1);
    let w1 = Worker::with_config(inbox.clone(), h.handler.clone(), one_attempt).unwrap();
    broker.publish(&queue, msg("dead", body.clone()));
    run_until_drained(&w1, &broker, &queue).await.unwrap();
    let entry = inbox.entry("record", "dead").await.unwrap().unwrap();
    assert_eq!(entry.status, EntryStatus::Dead, "{entry:?}");
    assert!(!inbox.release("record", "missing").await.unwrap());

    // The cause is fixed (three attempts now), but the key is still dead: the replay is
    // dead-lettered again, with the recorded reason.
    let w2 = Worker::with_config(inbox.clone(), h.handler.clone(), h.config()).unwrap();
    broker.publish(&queue, msg("dead", body.clone()));
    run_until_drained(&w2, &broker, &queue).await.unwrap();
    let dead = broker.dead_letters(&queue);
    assert_eq!(dead.len(), 2);
    assert_eq!(
        dead[1].dead_letter.reason,
        DeadLetterReason::MaxAttemptsExceeded
    );
    assert_eq!((h.ledger)(inbox.clone(), "dead".to_owned()).await, 0);

    assert!(inbox.release("record", "dead").await.unwrap());
    assert!(inbox.entry("record", "dead").await.unwrap().is_none());
    broker.publish(&queue, msg("dead", body));
    run_until_drained(&w2, &broker, &queue).await.unwrap();
    assert_eq!(broker.dead_letters(&queue).len(), 2);
    assert_eq!((h.ledger)(inbox.clone(), "dead".to_owned()).await, 1);
    let entry = inbox.entry("record", "dead").await.unwrap().unwrap();
    assert_eq!(entry.status, EntryStatus::Completed, "{entry:?}");
}

/// Finding: dead rows expire after the handler's retention, like completed ones.
pub async fn dead_rows_expire_after_retention<DB: Backend, H: Handler<DB> + Clone>(
    h: Harness<DB, H>,
) {
    let broker = MemoryBroker::new();
    let queue = unique("q");
    let inbox = (h.new_inbox)().await;
    let config = h.config().with_retention(Duration::from_millis(1));
    let w = Worker::with_config(inbox.clone(), h.handler.clone(), config).unwrap();
    broker.publish(
        &queue,
        msg("poison", json!({"id": "poison", "permanent": true})),
    );
    run_until_drained(&w, &broker, &queue).await.unwrap();
    let entry = inbox.entry("record", "poison").await.unwrap().unwrap();
    assert_eq!(entry.status, EntryStatus::Dead, "{entry:?}");
    wait_until("the dead row purged", || {
        let inbox = inbox.clone();
        async move {
            inbox.purge_expired(100).await.unwrap();
            inbox.entry("record", "poison").await.unwrap().is_none()
        }
    })
    .await;
}

/// Finding: an attempt number at `u32::MAX` (a producer's or a corrupted header) does not
/// overflow the numbering of the retry copies: the message is retried and dead-lettered
/// after its attempts like any other.
pub async fn an_attempt_number_at_u32_max_is_bounded<DB: Backend, H: Handler<DB> + Clone>(
    h: Harness<DB, H>,
) {
    let broker = MemoryBroker::new();
    let queue = unique("q");
    let inbox = (h.new_inbox)().await;
    let w = Worker::with_config(inbox.clone(), h.handler.clone(), h.config()).unwrap();
    broker.publish(&queue, msg("max", json!({"id": "max", "fail_times": 10})));
    let deliveries = broker.consume(&queue).map(|item| {
        item.map(|mut incoming| {
            if incoming.delivery.attempt == 1 {
                incoming.delivery.attempt = u32::MAX;
                incoming.delivery.origin = Origin::Unknown;
            }
            incoming
        })
    });
    run_until(&w, deliveries, "the message dead-lettered", || {
        let n = broker.dead_letters(&queue).len();
        async move { n == 1 }
    })
    .await;
    let dead = broker.dead_letters(&queue);
    assert_eq!(
        (dead[0].dead_letter.reason, dead[0].dead_letter.attempts),
        (DeadLetterReason::MaxAttemptsExceeded, 3)
    );
}
