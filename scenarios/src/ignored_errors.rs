//! A handler that ignores a failed statement and returns `Ok`, as `let _ = insert(..).await;`
//! does. PostgreSQL aborts the transaction at the failed statement, ignores every statement
//! after it and answers the `COMMIT` with a rollback, without an error; SQLite undoes the
//! failed statement alone and commits the rest. Either way nothing may be lost: the job's
//! effect commits once, or the job is dead-lettered once, with the reason.

use consumer_core::inbox::{Backend, EntryStatus};
use consumer_core::memory::MemoryBroker;
use consumer_core::{DeadLetterReason, Handler, Worker};
use serde_json::json;

use crate::env::unique;
use crate::harness::{msg, run_until_drained, Harness};

/// Jobs that succeed around one whose handler ignores a failed statement (so that a batch
/// holds both), one of them running its failed statement in a savepoint: the others
/// complete once each; the one completes with its row (SQLite) or,
/// failing every attempt, is dead-lettered after its attempts with the reason (PostgreSQL).
/// Never acked with its row lost.
pub async fn a_handler_that_ignores_a_failed_statement_loses_nothing<
    DB: Backend,
    H: Handler<DB> + Clone,
>(
    h: Harness<DB, H>,
) {
    let broker = MemoryBroker::new();
    let queue = unique("q");
    let others = ["ok-1", "ok-2", "ok-3"];
    broker.publish(&queue, msg(others[0], json!({"id": others[0]})));
    // The idiom that works on both backends: the failed statement in a savepoint.
    let savepoint = json!({"id": "savepoint", "failed_statement_in_savepoint": true});
    broker.publish(&queue, msg("savepoint", savepoint));
    broker.publish(
        &queue,
        msg(
            "ignores",
            json!({"id": "ignores", "ignore_failed_statement": true}),
        ),
    );
    for id in &others[1..] {
        broker.publish(&queue, msg(id, json!({ "id": id })));
    }
    let inbox = (h.new_inbox)().await;
    let w = Worker::with_config(inbox.clone(), h.handler.clone(), h.config()).unwrap();
    run_until_drained(&w, &broker, &queue).await.unwrap();

    for id in others.into_iter().chain(["savepoint"]) {
        assert_eq!((h.ledger)(inbox.clone(), id.into()).await, 1, "{id}");
    }
    let s = w.snapshot();
    let rows = (h.ledger)(inbox.clone(), "ignores".into()).await;
    let dead = broker.dead_letters(&queue);
    let entry = inbox.entry("record", "ignores").await.unwrap();
    if rows == 1 {
        // The transaction survived the failed statement (SQLite): the job completed.
        assert!(dead.is_empty(), "{dead:?}");
        assert_eq!(s.completed, 5, "{s:?}");
        assert_eq!(entry.unwrap().status, EntryStatus::Completed);
        return;
    }
    assert_eq!(rows, 0, "the aborted transaction committed nothing");
    assert_eq!(s.completed, 4, "the job was not taken for completed: {s:?}");
    assert_eq!(dead.len(), 1, "the job was dead-lettered once: {dead:?}");
    let d = &dead[0].dead_letter;
    assert_eq!(d.reason, DeadLetterReason::MaxAttemptsExceeded);
    assert_eq!((d.key.as_deref(), d.attempts), (Some("ignores"), 3));
    assert!(
        d.error
            .contains("the handler's transaction was aborted by an earlier error it ignored"),
        "{}",
        d.error
    );
    let entry = entry.expect("the key's row");
    assert_eq!(entry.status, EntryStatus::Dead, "{entry:?}");
}
