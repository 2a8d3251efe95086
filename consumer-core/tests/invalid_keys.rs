//! Keys the inbox database cannot hold (`consumer_scenarios::invalid`) on SQLite and the
//! in-memory broker, per message and batched: a message id with a NUL and a templated key
//! longer than a btree index entry are dead-lettered `invalid_key` at once, and the messages
//! beside them complete. The PostgreSQL variants are in `tests/tests/invalid_keys.rs`.

use consumer_core::BatchConfig;
use consumer_scenarios::env::SqliteEnv;
use consumer_scenarios::invalid::{
    by_id_sqlite, key_with_nul, overlong_key, sqlite_ledger, templated_sqlite, BATCHED_WIDE,
};

async fn nul(batch: Option<BatchConfig>) {
    let env = SqliteEnv::new().await;
    key_with_nul(env.inbox.clone(), by_id_sqlite, sqlite_ledger, batch).await;
}

async fn overlong(batch: Option<BatchConfig>) {
    let env = SqliteEnv::new().await;
    overlong_key(env.inbox.clone(), templated_sqlite, sqlite_ledger, batch).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_key_with_nul_is_dead_lettered_invalid_key() {
    nul(None).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_key_with_nul_is_dead_lettered_invalid_key_batched() {
    nul(BATCHED_WIDE).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_overlong_key_is_dead_lettered_invalid_key() {
    overlong(None).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_overlong_key_is_dead_lettered_invalid_key_batched() {
    overlong(BATCHED_WIDE).await;
}
