//! The exactly-once scenario matrix (`consumer-scenarios`) on SQLite and the in-memory broker:
//! per message, batched, and batched through a batch function. It needs no server; the same
//! scenarios run on PostgreSQL in the workspace tests (`tests/tests/exactly_once.rs`).

use consumer_scenarios::{scenarios, sqlite_bulk_harness, sqlite_harness, BATCHED};

scenarios!(sqlite, sqlite_harness, None);
scenarios!(sqlite_batched, sqlite_harness, BATCHED);
scenarios!(sqlite_batch_function, sqlite_bulk_harness, BATCHED);
