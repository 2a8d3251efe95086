//! The randomized model test (`consumer-scenarios`' `model`) on SQLite and the in-memory
//! broker, per message and batched, with worker crashes and lost broker connections (SQLite
//! has no hook for failed commits or terminated backends). It needs no server; the same
//! model runs on PostgreSQL, with those database faults too, in the workspace tests
//! (`tests/tests/model.rs`). `MODEL_SEEDS=N` runs N random seeds instead of the fixed ones;
//! `MODEL_SEED=S` one.

use consumer_scenarios::{model, sqlite_harness};

model!(sqlite, sqlite_harness);
