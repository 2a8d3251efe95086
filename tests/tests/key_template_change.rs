//! A handler whose key template changed while the inbox holds keys made with the old one
//! would run each of them again under its new key: the worker refuses to start, naming the
//! handler and both templates, unless the change is accepted in its configuration.
//!
//! Against real PostgreSQL (a fresh schema).

// Test code may panic: a panic is how a test fails.
#![allow(clippy::unwrap_used)]

use std::sync::Arc;
use std::time::Duration;

use consumer_core::memory::{MemoryBroker, Message};
use consumer_core::retry::NoJitter;
use consumer_core::{handler, Context, Error, Handler, HandlerError, Inbox, Worker, WorkerConfig};
use consumer_tests::common::{self, PgEnv};
use serde::Deserialize;
use serde_json::json;
use sqlx::Postgres;

#[derive(Debug, Deserialize)]
struct Order {
    id: String,
}

#[handler(name = "orders_by_key", key = "order-{id}")]
async fn before(_ctx: &mut Context<'_, Postgres>, order: Order) -> Result<(), HandlerError> {
    let _ = order.id;
    Ok(())
}

/// The same handler with its key template edited.
#[handler(name = "orders_by_key", key = "o-{id}")]
async fn after(_ctx: &mut Context<'_, Postgres>, order: Order) -> Result<(), HandlerError> {
    let _ = order.id;
    Ok(())
}

/// Runs `handler` on one order until the queue is drained: the worker's result.
async fn run<H: Handler<Postgres>>(
    inbox: &Inbox<Postgres>,
    handler: H,
    config: WorkerConfig,
) -> Result<(), Error> {
    let broker = MemoryBroker::new();
    let queue = common::unique("q");
    broker.publish(&queue, Message::json("m-1", &json!({ "id": "1" })));
    let config = config
        .with_retention_interval(None)
        .with_jitter(Arc::new(NoJitter));
    let worker = Worker::with_config(inbox.clone(), handler, config).unwrap();
    let run = worker.run(broker.consume(&queue), broker.drained(&queue));
    tokio::time::timeout(Duration::from_secs(30), run)
        .await
        .expect("ended")
}

#[tokio::test]
async fn a_changed_key_template_is_refused_at_startup() {
    let env = PgEnv::new().await;
    let inbox = env.inbox().await;
    run(&inbox, before, WorkerConfig::default()).await.unwrap();
    assert!(inbox
        .entry("orders_by_key", "order-1")
        .await
        .unwrap()
        .is_some());

    let refused = run(&inbox, after, WorkerConfig::default()).await;
    let message = refused.expect_err("refused").to_string();
    for part in ["orders_by_key", "\"order-{id}\"", "\"o-{id}\""] {
        assert!(message.contains(part), "{part} in {message}");
    }
    assert!(inbox.entry("orders_by_key", "o-1").await.unwrap().is_none());

    // Accepted: it runs, and its template is the one recorded from then on.
    let accept = WorkerConfig::default().with_allow_key_template_change(true);
    run(&inbox, after, accept).await.unwrap();
    assert!(inbox.entry("orders_by_key", "o-1").await.unwrap().is_some());
    run(&inbox, after, WorkerConfig::default()).await.unwrap();
}

#[tokio::test]
async fn a_new_template_under_a_name_with_no_keys_is_recorded() {
    let env = PgEnv::new().await;
    let inbox = env.inbox().await;
    // Recorded, then its keys purged: nothing would run again.
    run(&inbox, before, WorkerConfig::default()).await.unwrap();
    let deleted = inbox
        .purge_older(
            consumer_core::inbox::EntryStatus::Completed,
            Duration::ZERO,
            false,
        )
        .await
        .unwrap();
    assert_eq!(deleted, 1);
    run(&inbox, after, WorkerConfig::default()).await.unwrap();
}

/// A worker whose database session ends during its startup check (terminated by an
/// administrator, the server restarting) tries the check again instead of ending with
/// "inbox database error": the chaos suite caught the invoices example's `App` stopping
/// when PostgreSQL restarted at that moment. The check waits here on a lock the test holds
/// on the templates' table, where the test terminates its session.
#[tokio::test]
async fn the_startup_check_outlasts_a_terminated_session() {
    let env = PgEnv::new().await;
    let inbox = env.inbox().await;
    let pool = env.pool(1).await;
    let table: String = sqlx::query_scalar(
        "SELECT c.relname::text FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace \
         WHERE n.nspname = $1 AND c.relname LIKE '%key_templates%' AND c.relkind = 'r'",
    )
    .bind(&env.schema)
    .fetch_one(&pool)
    .await
    .unwrap();
    let mut tx = pool.begin().await.unwrap();
    sqlx::query(&format!(
        "LOCK TABLE \"{}\".\"{table}\" IN ACCESS EXCLUSIVE MODE",
        env.schema
    ))
    .execute(&mut *tx)
    .await
    .unwrap();

    let broker = MemoryBroker::new();
    let queue = common::unique("q");
    broker.publish(&queue, Message::json("m-1", &json!({ "id": "1" })));
    let config = WorkerConfig::default()
        .with_retention_interval(None)
        .with_jitter(Arc::new(NoJitter));
    let worker = Worker::with_config(inbox.clone(), before, config).unwrap();
    let run = worker.run(broker.consume(&queue), broker.drained(&queue));
    let terminate_the_check = async {
        common::terminate_when_waiting_for_a_lock(&mut tx, &env.schema).await;
        tx.rollback().await.unwrap();
    };
    let (ran, ()) = tokio::time::timeout(Duration::from_secs(60), async {
        tokio::join!(run, terminate_the_check)
    })
    .await
    .expect("ended within a minute");
    ran.expect("the worker checks again once the database is back, then runs");
    assert!(inbox
        .entry("orders_by_key", "order-1")
        .await
        .unwrap()
        .is_some());
}
