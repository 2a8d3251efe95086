//! The runtime's exactly-once scenario matrix (`consumer-scenarios`) against real
//! PostgreSQL: a fresh schema per test, several independent pools standing in for several
//! worker processes. Each scenario runs with one transaction per delivery, batched, and
//! batched through a batch function. The same matrix runs on SQLite in consumer-core's own
//! tests (`consumer-core/tests/scenarios.rs`).

// Test code may panic: a panic is how a test fails.
#![allow(clippy::unwrap_used)]

use consumer_scenarios::{scenarios, BATCHED};
use consumer_tests::harness::{pg_bulk_harness, pg_harness};

scenarios!(postgres, pg_harness, None);
scenarios!(postgres_batched, pg_harness, BATCHED);
scenarios!(postgres_batch_function, pg_bulk_harness, BATCHED);
