//! The runtime's exactly-once scenario matrix (`consumer-scenarios`) against real
//! PostgreSQL: a fresh schema per test, several independent pools standing in for several
//! worker processes. Each scenario runs with one transaction per delivery, batched, and
//! batched through a batch function. The same matrix runs on SQLite in consumer-core's own
//! tests (`consumer-core/tests/scenarios.rs`).

// Test code may panic: a panic is how a test fails.
#![allow(clippy::unwrap_used)]

use std::sync::Arc;

use consumer_core::{BatchConfig, InboxConfig};
use consumer_scenarios::jobs::{bulk_pg, pg_ledger, record_pg};
use consumer_scenarios::{scenarios, Harness, BATCHED};
use consumer_tests::common::PgEnv;
use sqlx::Postgres;

async fn pg_harness(batch: Option<BatchConfig>) -> Harness<Postgres, record_pg> {
    pg_harness_with(record_pg, batch).await
}

async fn pg_bulk_harness(batch: Option<BatchConfig>) -> Harness<Postgres, bulk_pg> {
    pg_harness_with(bulk_pg, batch).await
}

async fn pg_harness_with<H>(handler: H, batch: Option<BatchConfig>) -> Harness<Postgres, H> {
    let env = Arc::new(PgEnv::new().await);
    Harness {
        handler,
        batch,
        new_inbox: Box::new({
            let env = env.clone();
            move || {
                let env = env.clone();
                Box::pin(async move { env.inbox().await })
            }
        }),
        other_inbox: Box::new(move |grace| {
            let env = env.clone();
            Box::pin(async move {
                env.inbox_with(InboxConfig::table("consumer_inbox").with_copy_grace(grace))
                    .await
            })
        }),
        ledger: pg_ledger,
        order: |inbox, id, create| {
            Box::pin(async move {
                if create {
                    sqlx::query("INSERT INTO orders (id) VALUES ($1)")
                        .bind(id)
                        .execute(inbox.pool())
                        .await
                        .expect("insert order");
                }
                sqlx::query_scalar("SELECT status FROM orders WHERE id = $1")
                    .bind(id)
                    .fetch_one(inbox.pool())
                    .await
                    .expect("order status")
            })
        },
    }
}

scenarios!(postgres, pg_harness, None);
scenarios!(postgres_batched, pg_harness, BATCHED);
scenarios!(postgres_batch_function, pg_bulk_harness, BATCHED);
