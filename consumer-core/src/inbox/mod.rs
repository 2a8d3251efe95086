//! The inbox: durable memory of which (handler, key) pairs were processed.
//!
//! One row per (handler, key) holds the payload hash, status (`pending`, `completed`,
//! `dead`), attempts, the newest retry copy's attempt number, scope and due time
//! (`retried_to`, `retry_scope`, `retry_due_at`: an older delivery of a pending key through
//! the same consumers is superseded while the copy can still arrive, see
//! `Claim::Superseded`), first seen, completed at, expires at and the last error.
//! Completed and dead rows expire after the handler's retention; [`Inbox::release`] deletes a
//! dead key's row for a replay.
//!
//! A fresh delivery (see [`Context::fresh`](crate::Context::fresh)) takes one step, under
//! the in-process key lock: `Backend::claim_fresh` inserts the key as completed in the
//! handler's transaction, unless it has a row (a concurrent insert of the same key waits on
//! the primary key for this transaction); the commit makes the handler's writes and the
//! completion durable together. If the key has a row, the delivery takes the counted path.
//! A batch's fresh keys are claimed by one statement, in key order. On PostgreSQL that is
//! first a plain insert, which costs the database less than one that tolerates rows; if a
//! key has a row after all (a republished message), that transaction is rolled back and
//! the batch claims again with the tolerant insert in a new one.
//!
//! The counted path (every other delivery) takes two steps, both under a per-key lock (an
//! in-process mutex, plus a PostgreSQL session advisory lock so workers in other processes
//! wait too):
//!
//! 1. `Backend::begin_attempt` counts the attempt in its own small transaction and commits it
//!    *before* the handler runs, so an attempt that kills the process is still counted.
//! 2. The handler's transaction ends with `Backend::complete`, which marks the key completed
//!    in the same commit as the handler's writes — only if the row is still pending at this
//!    attempt's count, so that no second run's effects commit even where the locks do not
//!    hold (another inbox instance, a pooler that breaks session locks). The same statement releases the database
//!    lock: from there the updated row's lock, held to the commit, keeps another worker's
//!    attempt count on the key waiting, and that count then sees the key completed.
//!
//! The module's public face is the [`Inbox`] and its [`InboxConfig`] (both also at the
//! crate's root), what an operator reads from it ([`InboxEntry`], [`EntryStatus`],
//! [`InboxCounts`], [`StoredDeadLetter`]), the sealed [`Backend`] trait of its two databases,
//! and [`is_aborted`].
//!
//! # Layout
//!
//! - `config`: [`InboxConfig`], and the validated table names and statements built from it.
//! - `entry`: what a row holds ([`InboxEntry`], [`EntryStatus`]) and a handler's
//!   [`InboxCounts`].
//! - `claim`: the outcome of counting an attempt (`Claim`) and the rule by which a retry
//!   copy supersedes a delivery.
//! - `backend`: the sealed [`Backend`] trait, and [`GuardValue`](crate::guard::GuardValue).
//! - `flow`: the operations both databases run alike, written once; `dialect`: what each
//!   database binds and decodes its own way, and the one executor of the statements.
//! - `postgres`, `sqlite`: each database's SQL and true differences (advisory locks and
//!   one-statement batches on PostgreSQL); `migrations`: the shipped migrations of each and
//!   their runner.
//! - `templates`: each handler name's key template, checked when a worker starts.
//! - `outbox_store`: the operations on the outbox table (see [`crate::outbox`]), which
//!   the migrations create beside the inbox; `outbox_sql`: their SQL on each database.
//! - `dead_letter_store`: the statements on the dead-letter table, also beside the inbox,
//!   where the runtime keeps the dead letters of transports without a dead-letter
//!   destination of their own ([`StoredDeadLetter`]).
//! - `handle`: the [`Inbox`]; `handler_inbox`: `HandlerInbox`, the inbox of one handler,
//!   through which its worker makes every call on the database (it holds the table names,
//!   the handler's name, retention and attempt budget once, and picks an operation's
//!   one-row or many-row variant by the number of items).
//! - `lease`: a connection holding keys' locks; `kept`: the connections a worker keeps
//!   between its leases, out of the pool; `locks`: the in-process key locks (by a hash of
//!   the key seeded per process), the database lock ids (stable across workers and
//!   versions, computed only for the counted path) and the outbox's rest lock.

pub(crate) mod backend;
mod claim;
mod config;
mod dead_letter_store;
pub(crate) mod dialect;
mod entry;
mod flow;
mod handle;
mod handler_inbox;
mod kept;
mod lease;
mod locks;
mod migrations;
mod outbox_sql;
pub(crate) mod outbox_store;
mod postgres;
mod sqlite;
mod templates;

pub use backend::{is_aborted, Backend};
pub(crate) use claim::{AttemptItem, Claim};
pub use config::InboxConfig;
pub(crate) use config::TableNames;
pub(crate) use dead_letter_store::LetterToKeep;
pub use dead_letter_store::StoredDeadLetter;
pub use entry::{EntryStatus, InboxCounts, InboxEntry};
pub use handle::Inbox;
pub(crate) use handler_inbox::HandlerInbox;
pub(crate) use kept::Kept;
pub(crate) use lease::Lease;
pub(crate) use locks::IdMap;
pub(crate) use outbox_store::{NewRow, OutboxRow, OutboxStats};
