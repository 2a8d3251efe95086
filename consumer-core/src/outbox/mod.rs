//! The transactional outbox: messages written in the same transaction as the effects that
//! cause them, published by a [`Relay`] once that transaction has committed.
//!
//! A handler that must tell the next step ("the invoice exists: send the email") cannot
//! publish safely by itself: before its commit, a rollback leaves a message about an effect
//! that never happened; after it, a crash loses the message. With the outbox it writes the
//! message into a table in its own transaction ([`Context::publish`](crate::Context::publish),
//! [`BatchContext::publish`](crate::BatchContext::publish), a batch's messages in one
//! statement with [`BatchContext::publish_all`](crate::BatchContext::publish_all), or
//! [`Outbox::enqueue`] in the application's own transaction): the message commits with the
//! effects or not at all.
//!
//! # The relay
//!
//! A [`Relay`] takes committed rows in id order, publishes them through a [`Publisher`]
//! (confirmed by the broker), and marks them published in the transaction that took them.
//! A round publishes its rows at once, each key's one after another, so the broker has the
//! whole round in flight (RabbitMQ: its confirms awaited together; Kafka: the producer
//! batches the records). On PostgreSQL up to [`RelayConfig::rounds`] rounds are in progress
//! together: a round that filled its batch lets the next one take while it waits for its
//! confirms.
//!
//! - **At least once.** A relay that dies after a publish and before its mark leaves the rows
//!   unpublished; the next round publishes them again, with the same message id (fixed when
//!   the row was written), and the consumer's inbox deduplicates the copy.
//! - **Order per key.** The messages of one [`OutboxMessage::key`] are published in the order
//!   they were written, each after the one before it was confirmed; a message whose publish
//!   failed holds its key's later messages back until it is published. Two transactions that
//!   write one key at the same time are ordered by their inserts, not their commits: write
//!   them under a lock of the entity (as a handler keyed by the entity is).
//! - **Several relays.** On PostgreSQL any number may run on one table: a relay locks the rows
//!   it takes (`FOR UPDATE SKIP LOCKED`, held to its mark), so two relays never publish the
//!   same row in the normal case, and it leaves a key alone while another relay holds one of
//!   its earlier rows. On SQLite run one relay per database file: its take and its marks are
//!   short transactions of their own, and the write lock is never held while the broker
//!   answers (a handler's commit does not wait for a publish).
//! - **Wake-up.** On PostgreSQL a trigger notifies the channel `consumer_outbox` when rows
//!   commit while a relay rests, and the relay `LISTEN`s there (listening again after 1 s,
//!   then after waits doubling up to 30 s, when its connection is lost); in the same process
//!   the worker wakes it after a commit that published. A relay rests when its rounds find
//!   nothing: it takes the outbox's rest lock (an advisory lock, on a connection of its own),
//!   which writers take shared when they can (then they do not notify: a notifying commit
//!   takes PostgreSQL's notification lock, which serializes such commits server-wide through
//!   their WAL flush); once it has the lock every writer that did not notify has ended, and
//!   the relay looks once more. A second relay that finds the lock taken looks every 200 ms.
//!   It also polls every [`RelayConfig::poll_interval`] (1 s), which is the only wake-up on
//!   SQLite for rows written outside a handler.
//! - **Failures.** A publish that fails is counted on the row with its error and tried again
//!   after an exponential backoff; a message the broker refuses (unroutable, too large) is
//!   logged at error level each time and never dropped. Only publication deletes a row:
//!   published rows are deleted [`RelayConfig::retention`] after their publication, or, with
//!   a retention of zero, by the round that published them (cheaper than marking them: a
//!   delete writes no new row version and no index entry).
//!
//! # Layout
//!
//! - `handle`: [`Outbox`], written to in a transaction; `message`: [`OutboxMessage`];
//! - `publisher`: the [`Publisher`] trait and [`PublishError`]; `reply`: replies to requests;
//! - `relay`: [`Relay`], its run loop and its rounds; `config`: [`RelayConfig`];
//!   `schedule`: when the run loop begins its next round; `publishing`: how a round publishes
//!   its rows, in each key's order; `wakeups`: the relay's notifications from the database,
//!   listened to again when they fail, and its rest;
//! - the outbox's statements on each database live with the inbox's (`inbox::outbox_store`),
//!   and its migrations create the table beside the inbox: `<inbox table>_outbox`.

mod config;
mod handle;
pub(crate) mod message;
mod metrics;
mod publisher;
mod publishing;
mod relay;
pub(crate) mod reply;
mod schedule;
mod wakeups;

pub use crate::inbox::outbox_store::OutboxStats;
pub use config::RelayConfig;
pub use handle::Outbox;
pub(crate) use handle::{insert, insert_all};
pub use message::{OutboxMessage, MAX_OUTBOX_NAME_BYTES};
pub use publisher::{PublishError, Publisher};
pub use relay::{Relay, RelayRound};
