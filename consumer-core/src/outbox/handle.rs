//! The [`Outbox`] handle: the table beside an inbox, and writing to it in a transaction.

use std::borrow::Cow;
use std::sync::Arc;

use sqlx::Pool;
use tokio::sync::Notify;

use super::message::{self, OutboxMessage};
use crate::inbox::{Backend, NewRow, OutboxStats, TableNames};
use crate::trace::TRACEPARENT;
use crate::{Error, Inbox};

/// The outbox of an [`Inbox`](crate::Inbox): its table (`<inbox table>_outbox`, created by
/// the inbox's migrations) on the inbox's pool. Cheap to clone. Get it with
/// [`Inbox::outbox`](crate::Inbox::outbox).
pub struct Outbox<DB: Backend> {
    pub(crate) pool: Pool<DB>,
    pub(crate) names: Arc<TableNames>,
    /// Wakes this process's relays after a commit that wrote rows.
    pub(crate) written: Arc<Notify>,
}

impl<DB: Backend> Inbox<DB> {
    /// The outbox beside this inbox (the table `<inbox table>_outbox`, created with it): write
    /// messages into it in a transaction ([`crate::Outbox::enqueue`], or
    /// [`Context::publish`](crate::Context::publish) in a handler) and run a
    /// [`crate::Relay`] on it to publish them.
    pub fn outbox(&self) -> Outbox<DB> {
        Outbox {
            pool: self.pool.clone(),
            names: self.names.clone(),
            written: self.outbox_written.clone(),
        }
    }
}

impl<DB: Backend> Clone for Outbox<DB> {
    fn clone(&self) -> Self {
        Outbox {
            pool: self.pool.clone(),
            names: self.names.clone(),
            written: self.written.clone(),
        }
    }
}

impl<DB: Backend> std::fmt::Debug for Outbox<DB> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Outbox")
            .field("backend", &<DB as Backend>::NAME)
            .field("table", &self.names.outbox)
            .finish_non_exhaustive()
    }
}

impl<DB: Backend> Outbox<DB> {
    /// Writes `message` into the outbox on `conn`, which should be inside the application's
    /// transaction: the message is published once that transaction commits, and never if it
    /// rolls back. Returns its message id: the message's own, or a random one.
    ///
    /// Inside a handler use [`Context::publish`](crate::Context::publish) instead, which
    /// derives the id from the handler's key. On SQLite, call [`Outbox::written`] after the
    /// commit to wake a relay of this process at once rather than at its next poll.
    pub async fn enqueue(
        &self,
        conn: &mut DB::Connection,
        message: &OutboxMessage,
    ) -> Result<String, Error> {
        let id = message
            .message_id
            .clone()
            .unwrap_or_else(message::random_message_id);
        insert::<DB>(conn, &self.names, message, &id, None).await?;
        Ok(id)
    }

    /// Tells this process's relays that rows were committed.
    pub fn written(&self) {
        self.written.notify_one();
    }

    /// How many rows wait, how many of them failed, the oldest one's age, and how many
    /// published rows the retention still keeps.
    pub async fn stats(&self) -> Result<OutboxStats, Error> {
        Ok(DB::outbox_stats(&self.pool, &self.names).await?)
    }

    /// The quoted, qualified outbox table name.
    pub fn table(&self) -> &str {
        &self.names.outbox
    }
}

/// Validates and writes one message with the id `id` (the message's own, or the one the
/// outbox assigned). A message without a `traceparent` carries the current span's (with the
/// `opentelemetry` feature), else `inherited` (the incoming message's, for a handler's
/// message), so that one trace runs from the request to what it caused.
pub(crate) async fn insert<DB: Backend>(
    conn: &mut DB::Connection,
    names: &TableNames,
    message: &OutboxMessage,
    id: &str,
    inherited: Option<&str>,
) -> Result<(), Error> {
    message.validate(id)?;
    let parent = trace_to_carry(message, inherited);
    let extra_header = parent.as_deref().map(|p| (TRACEPARENT, p));
    Ok(DB::outbox_insert(conn, names, message, id, extra_header).await?)
}

/// [`insert`] of each of `messages` (a message, its id, the trace context it inherits), in
/// one statement where the database can (PostgreSQL), in their order.
pub(crate) async fn insert_all<DB: Backend>(
    conn: &mut DB::Connection,
    names: &TableNames,
    messages: &[(OutboxMessage, String, Option<&str>)],
) -> Result<(), Error> {
    let mut parents = Vec::with_capacity(messages.len());
    for (message, id, inherited) in messages {
        message.validate(id)?;
        parents.push(trace_to_carry(message, *inherited));
    }
    let rows: Vec<NewRow<'_>> = messages
        .iter()
        .zip(&parents)
        .map(|((message, id, _), parent)| NewRow {
            message,
            message_id: id,
            extra_header: parent.as_deref().map(|p| (TRACEPARENT, p)),
        })
        .collect();
    Ok(DB::outbox_insert_all(conn, names, &rows).await?)
}

/// The trace context to add to `message`: none if it has its own, else the current span's,
/// else `inherited`.
fn trace_to_carry<'m>(message: &OutboxMessage, inherited: Option<&'m str>) -> Option<Cow<'m, str>> {
    if message.headers.contains_key(TRACEPARENT) {
        return None;
    }
    crate::trace::current_traceparent()
        .map(Cow::Owned)
        .or_else(|| inherited.map(Cow::Borrowed))
}
