//! The randomized model test (`consumer-scenarios`' `model`) against real PostgreSQL, per
//! message and batched, with worker crashes, lost broker connections, commits made to fail
//! once and backends terminated while the workers run. The same model runs on SQLite in
//! consumer-core's own tests (`consumer-core/tests/model.rs`). `MODEL_SEEDS=N` runs N random
//! seeds instead of the fixed ones; `MODEL_SEED=S` one.

use consumer_scenarios::model;
use consumer_tests::harness::pg_harness;

model!(postgres, pg_harness);
