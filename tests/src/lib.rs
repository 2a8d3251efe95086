//! Shared fixtures of the cross-crate integration tests in `tests/`: the real servers
//! (PostgreSQL, RabbitMQ, Kafka) with a schema, queue or topic unique to each test, workers
//! running in tasks, and independent reads of what the transports left behind.

pub mod amqp;
pub mod common;
pub mod gauge;
pub mod kafka;
