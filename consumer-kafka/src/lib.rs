//! The Kafka transport for consumer-core, on rdkafka (librdkafka).
//!
//! Kafka keeps one committed offset per partition, so "ack after commit" means: commit
//! offset `n` only when every record below `n` has settled. This crate gets that right and
//! keeps it right across rebalances.
//!
//! - [`KafkaConfig`] says what to consume and how; [`KafkaConfig::validate`] fails naming
//!   the field, and credentials are redacted from `Debug` output and errors.
//!   [`KafkaConfig::from_env`] builds one from `KAFKA_*` variables.
//! - [`KafkaConsumer`] is a [`consumer_core::transport::Transport`]. A poll thread owns the
//!   librdkafka consumer and keeps polling whatever the handlers do (so `max.poll.interval.ms` is
//!   never exceeded); a full partition is left unread, not the loop. Records are handed out in
//!   offset order per partition ([`ProcessingOrder::Partition`]) or per key
//!   ([`ProcessingOrder::Key`]). Each acknowledger marks its offset settled, and the
//!   transport commits only up to the last contiguous settled record of each partition this
//!   member owns.
//! - On revoke, records of the revoked partitions are no longer handed out; their in-flight
//!   records get `revoke_timeout` to settle; what is contiguous is committed; later
//!   settlements are dropped ([`OffsetEvent::SettlementDropped`]), the new owner redelivers
//!   and the inbox deduplicates.
//! - Retries: [`RetryMode::RetryTopic`] writes a copy to `<topic>.retry` with
//!   [`headers::ATTEMPT`] and [`headers::DUE_AT`] and commits past the original only after
//!   the copy's delivery report; the consumer reads the retry topic too and holds each copy
//!   until due (pausing that partition only). [`RetryMode::Blocking`] keeps the record in
//!   place and hands it out again after the delay, keeping strict order.
//! - Dead letters go to `<topic>.dlq` with the original key, value and headers plus the
//!   headers in [`headers`], after the delivery report.
//! - [`KafkaPublisher`] writes with `enable.idempotence=true` and awaits each delivery
//!   report (a thread of the producer's own serves them, asleep while there are none);
//!   [`create_topics`] creates a topic with its retry and dead-letter topics.
//! - [`KafkaObserver`] is a log of assignments, commits, revocations and dropped
//!   settlements, for tests and metrics.
//!
//! ```no_run
//! # async fn run() -> Result<(), Box<dyn std::error::Error>> {
//! use consumer_kafka::{KafkaConfig, KafkaConsumer};
//!
//! let config = KafkaConfig::from_env()?; // KAFKA_BROKERS, KAFKA_GROUP_ID, KAFKA_TOPICS, ...
//! consumer_kafka::create_topics(&config, 3, 1).await?;
//! let transport = KafkaConsumer::new(config)?;
//! // worker.run(transport, shutdown).await?;
//! # drop(transport);
//! # Ok(())
//! # }
//! ```
//!
//! # Metrics
//!
//! Through the `metrics` facade, as consumer-core's (whose crate doc has the table), labelled
//! with the consumer `group`:
//!
//! | metric | type | labels | what |
//! |---|---|---|---|
//! | `consumer_kafka_lag` | gauge | `topic`, `partition` | of each partition this consumer is assigned, the high watermark minus the group's committed position (before the first commit, the low watermark); 0 once it is no longer assigned |
//! | `consumer_kafka_paused_partitions` | gauge | | assigned partitions held back: a full buffer (left unread), or a retry copy not due yet (paused) |
//! | `consumer_kafka_fetched_records_total` | counter | `topic`, `partition` | records librdkafka fetched of each partition; one fetched again counts again (a pause drops what librdkafka had prefetched for the partition, and a rebalance what it had for those that moved), so what it exceeds the records received by is fetching repeated |
//!
//! The lag and the fetched records come from librdkafka's statistics, which the consumer
//! asks for every 5 s (`statistics.interval.ms`; a consumer property overrides it, `0` turns
//! both off).
//!
//! # Layout
//!
//! `config` (the configuration; `validate` checks it, `env` reads `KAFKA_*` variables,
//! `properties` holds the pass-through client properties, `client` builds librdkafka's
//! configurations from it), `consumer` (the transport: `record` for a fetched record and
//! its headers, `partitions` for the table of owned partitions and a record's acknowledger
//! (kept for the next hand-out once settled), `rebalance` for the rebalance callbacks and
//! commits, `poll` for the poll thread, `queues` for each partition's own queue of fetched
//! records, `fetch` for reading a fetched record and adding it to its partition, `acker`
//! for settlement,
//! `copies` for retry and dead-letter copies), `tracker` (one partition's records: which
//! may be handed out, how far to commit; `keys` for ordering keys), `producer` (the
//! client every write goes through, replaced after a write times out), `publisher`
//! ([`KafkaPublisher`], also the outbox relay's), `topics` ([`create_topics`]),
//! `observer`, `headers`, `error`.

mod config;
mod consumer;
mod error;
pub mod headers;
mod observer;
mod producer;
mod publisher;
mod topics;
mod tracker;

pub use config::client::{COPY_HEADER_ROOM, COPY_MAX_BYTES};
pub use config::properties::ClientProperties;
pub use config::{CommitMode, KafkaConfig, ProcessingOrder, RetryMode};
pub use consumer::KafkaConsumer;
pub use error::Error;
pub use observer::{KafkaObserver, OffsetEvent};
pub use producer::Published;
pub use publisher::KafkaPublisher;
pub use topics::create_topics;
