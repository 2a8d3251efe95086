//! The scenarios' PostgreSQL harness (`consumer-scenarios`' [`Harness`]): a fresh schema
//! per test, several independent pools standing in for several worker processes, and the
//! database fault of the model test: one of the schema's server processes terminated.

use std::sync::Arc;

use consumer_core::{BatchConfig, InboxConfig};
use consumer_scenarios::jobs::{bulk_pg, pg_ledger, record_pg};
use consumer_scenarios::{DbFault, Harness};
use sqlx::Postgres;

use crate::common::PgEnv;

/// A fresh schema with the per-delivery record handler.
pub async fn pg_harness(batch: Option<BatchConfig>) -> Harness<Postgres, record_pg> {
    pg_harness_with(record_pg, batch).await
}

/// A fresh schema with the record handler that has a batch function.
pub async fn pg_bulk_harness(batch: Option<BatchConfig>) -> Harness<Postgres, bulk_pg> {
    pg_harness_with(bulk_pg, batch).await
}

/// A fresh schema with `handler`; each "new process" has a pool of its own.
pub async fn pg_harness_with<H>(handler: H, batch: Option<BatchConfig>) -> Harness<Postgres, H> {
    let env = Arc::new(PgEnv::new().await);
    Harness {
        handler,
        batch,
        db_fault: Some(terminate_one_backend(env.clone())),
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

/// Terminates one of the server processes whose connections use `env`'s schema (each of
/// its pools names the schema as its `application_name`), chosen at random; none if there
/// is none.
fn terminate_one_backend(env: Arc<PgEnv>) -> DbFault {
    Arc::new(move || {
        let env = env.clone();
        Box::pin(async move {
            let killer = env.pool(1).await;
            let terminated = sqlx::query_scalar::<_, bool>(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity \
                 WHERE application_name = $1 AND pid <> pg_backend_pid() \
                 ORDER BY random() LIMIT 1",
            )
            .bind(&env.schema)
            .fetch_optional(&killer)
            .await;
            tracing::info!(?terminated, "model: terminated a backend");
            killer.close().await;
        })
    })
}
