//! Shared fixtures of the cross-crate integration tests in `tests/`: the real servers
//! (PostgreSQL, RabbitMQ, Kafka) with a schema, queue or topic unique to each test, workers
//! running in tasks or as the example's processes, the payments example called over HTTP,
//! independent reads of what the transports left behind, the Prometheus server that scrapes
//! a worker, and the in-memory span exporter of the trace-context tests.

pub mod amqp;
pub mod amqp_cluster;
pub mod common;
pub mod gauge;
pub mod harness;
pub mod kafka;
pub mod outbox;
pub mod payments;
pub mod process;
pub mod prometheus;
pub mod trace;
