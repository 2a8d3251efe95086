//! Keys the inbox database cannot hold, against real PostgreSQL (a fresh schema per test),
//! per message and batched: a key with a NUL and one longer than a btree index entry (the
//! scenarios in `consumer-scenarios`, also run on SQLite by consumer-core's tests), and a
//! rejection the key check does not foresee (a data exception, SQLSTATE class 22, or a
//! program limit, class 54, from an inbox statement), which is permanent too.

// Test code may panic: a panic is how a test fails.
#![allow(clippy::unwrap_used)]

use consumer_core::memory::{MemoryBroker, Message};
use consumer_core::{BatchConfig, DeadLetterReason};
use consumer_scenarios::invalid::{
    by_id_pg, drain, key_with_nul, overlong_key, pg_ledger, templated_pg, BATCHED_WIDE,
};
use consumer_tests::common::{self, PgEnv};
use serde_json::json;

/// Keys the check passes but the database refuses: a trigger on the inbox table raises a
/// data exception (SQLSTATE 22023) for keys starting `reject` and a program limit (54000)
/// for keys starting `limit`, standing in for any refusal the check does not foresee. Those
/// messages are dead-lettered naming the SQLSTATE; the messages around them (in batched
/// mode: in their batch) complete.
async fn data_exception_from_the_inbox(batch: Option<BatchConfig>) {
    let env = PgEnv::new().await;
    let inbox = env.inbox().await;
    let schema = &env.schema;
    sqlx::raw_sql(&format!(
        "CREATE FUNCTION \"{schema}\".reject_key() RETURNS trigger LANGUAGE plpgsql AS $$ \
         BEGIN IF NEW.key LIKE 'reject%' THEN \
         RAISE EXCEPTION 'key % is refused', NEW.key USING ERRCODE = '22023'; END IF; \
         IF NEW.key LIKE 'limit%' THEN \
         RAISE EXCEPTION 'key % is over a limit', NEW.key USING ERRCODE = '54000'; END IF; \
         RETURN NEW; END $$; \
         CREATE TRIGGER reject_key BEFORE INSERT ON {} \
         FOR EACH ROW EXECUTE FUNCTION \"{schema}\".reject_key();",
        inbox.table()
    ))
    .execute(inbox.pool())
    .await
    .unwrap();
    let broker = MemoryBroker::new();
    let queue = common::unique("q");
    broker.publish(&queue, Message::json("ok-1", &json!({"id": "ok-1"})));
    broker.publish(
        &queue,
        Message::json("reject-1", &json!({"id": "reject-1"})),
    );
    broker.publish(&queue, Message::json("limit-1", &json!({"id": "limit-1"})));
    broker.publish(&queue, Message::json("ok-2", &json!({"id": "ok-2"})));
    let s = drain(inbox.clone(), by_id_pg, batch, &broker, &queue).await;
    let mut dead: Vec<(String, DeadLetterReason, u32, bool)> = broker
        .dead_letters(&queue)
        .into_iter()
        .map(|d| {
            let id = d.message.id.unwrap_or_default();
            let code = if id.starts_with("reject") {
                "SQLSTATE 22023"
            } else {
                "SQLSTATE 54000"
            };
            let named = d.dead_letter.error.contains(code);
            (id, d.dead_letter.reason, d.dead_letter.attempts, named)
        })
        .collect();
    dead.sort_by(|a, b| a.0.cmp(&b.0));
    assert_eq!(
        dead,
        vec![
            ("limit-1".to_owned(), DeadLetterReason::InvalidKey, 0, true),
            ("reject-1".to_owned(), DeadLetterReason::InvalidKey, 0, true),
        ]
    );
    assert_eq!((s.completed, s.dead_lettered), (2, 2), "{s:?}");
    assert_eq!(pg_ledger(inbox.clone(), "ok-1".into()).await, 1);
    assert_eq!(pg_ledger(inbox.clone(), "ok-2".into()).await, 1);
    assert_eq!(pg_ledger(inbox.clone(), "reject-1".into()).await, 0);
    assert_eq!(pg_ledger(inbox, "limit-1".into()).await, 0);
}

macro_rules! scenarios {
    ($module:ident, $batch:expr) => {
        mod $module {
            use super::*;

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn a_key_with_nul_is_dead_lettered_invalid_key() {
                let env = PgEnv::new().await;
                key_with_nul(env.inbox().await, by_id_pg, pg_ledger, $batch).await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn an_overlong_key_is_dead_lettered_invalid_key() {
                let env = PgEnv::new().await;
                overlong_key(env.inbox().await, templated_pg, pg_ledger, $batch).await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn a_data_exception_from_the_inbox_is_permanent() {
                data_exception_from_the_inbox($batch).await;
            }
        }
    };
}

scenarios!(per_message, None);
scenarios!(batched, BATCHED_WIDE);
