//! Shared by the outbox, replies and app tests: two handlers linked by the outbox
//! (`place_order` publishes an event to the `events` queue, `count_event` records each event
//! it receives), the worker configuration they run with, and [`drain`].

#![allow(dead_code, unreachable_pub)]

use std::sync::Arc;

use consumer_core::memory::MemoryBroker;
use consumer_core::outbox::OutboxMessage;
use consumer_core::retry::NoJitter;
use consumer_core::{handler, Context, Handler, HandlerError, Worker, WorkerConfig};
use consumer_scenarios::env::{SqliteEnv, DEADLINE};
use serde::Deserialize;
use serde_json::json;
use sqlx::Sqlite;

/// An order: its id, and whether placing it fails.
#[derive(Debug, Deserialize)]
pub struct Order {
    pub id: i64,
    #[serde(default)]
    pub fail: bool,
}

/// Writes the order's ledger row (its id) and publishes `{"order": id}` to `events`, keyed
/// by the order; fails permanently (after both) when the order says so.
#[handler(name = "place_order")]
pub async fn place_order(ctx: &mut Context<'_, Sqlite>, order: Order) -> Result<(), HandlerError> {
    sqlx::query("INSERT INTO ledger (job_id, attempt) VALUES (?1, ?2)")
        .bind(order.id.to_string())
        .bind(i64::from(ctx.attempt()))
        .execute(ctx.db())
        .await?;
    ctx.publish(
        OutboxMessage::json("events", &json!({"order": order.id}))?.key(order.id.to_string()),
    )
    .await?;
    if order.fail {
        return Err(HandlerError::permanent("the order cannot be placed"));
    }
    Ok(())
}

/// Records each event it receives as the ledger row `event-<order>`, in its own transaction.
#[handler(name = "count_event")]
pub async fn count_event(
    ctx: &mut Context<'_, Sqlite>,
    event: serde_json::Value,
) -> Result<(), HandlerError> {
    sqlx::query("INSERT INTO ledger (job_id, attempt) VALUES (?1, 0)")
        .bind(format!("event-{}", event["order"]))
        .execute(ctx.db())
        .await?;
    Ok(())
}

/// No retention task, no jitter.
pub fn config() -> WorkerConfig {
    WorkerConfig::default()
        .with_retention_interval(None)
        .with_jitter(Arc::new(NoJitter))
}

/// Runs `handler` on `queue` until the queue is drained.
pub async fn drain<H: Handler<Sqlite>>(
    env: &SqliteEnv,
    broker: &MemoryBroker,
    handler: H,
    queue: &str,
) -> Worker<Sqlite, H> {
    let worker = Worker::with_config(env.inbox.clone(), handler, config()).unwrap();
    tokio::time::timeout(
        DEADLINE,
        worker.run(broker.consume(queue), broker.drained(queue)),
    )
    .await
    .unwrap()
    .unwrap();
    worker
}
