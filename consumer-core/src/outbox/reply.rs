//! Replies to requests: written through the outbox in the handler's transaction, and kept
//! with the request's key so that a duplicate request is answered with the same reply.

use bytes::Bytes;

use super::handle::insert;
use super::message::OutboxMessage;
use crate::delivery::Delivery;
use crate::header_names::{CORRELATION_ID, REPLY_TO};
use crate::inbox::{Backend, TableNames};
use crate::Error;

/// Writes the reply to `delivery` (a request naming its reply address) for the run of
/// (`handler`, `key`): to the outbox, and to the key's inbox row. Returns its message id,
/// the same on every attempt.
pub(crate) async fn write<DB: Backend>(
    conn: &mut DB::Connection,
    names: &TableNames,
    handler: &str,
    key: &str,
    delivery: &Delivery,
    body: Bytes,
) -> Result<String, Error> {
    let Some(to) = delivery.headers.get(REPLY_TO) else {
        return Err(Error::Message(format!(
            "the request names no reply address (no `{REPLY_TO}` header)"
        )));
    };
    let id = crate::key::idempotency_key(handler, key, "reply");
    let mut reply = OutboxMessage::new(to, body).message_id(id.clone());
    if let Some(c) = correlation(delivery) {
        reply = reply.header(CORRELATION_ID, c);
    }
    insert::<DB>(
        conn,
        names,
        &reply,
        &id,
        delivery.headers.get(crate::trace::TRACEPARENT),
    )
    .await?;
    DB::outbox_store_reply(conn, names, handler, key, &reply).await?;
    Ok(id)
}

/// The correlation id a reply to `delivery` carries: the requester matches the reply to its
/// request by the request's correlation id, else by its message id. A duplicate request's
/// reply, resent, carries the duplicate's.
pub(crate) fn correlation(delivery: &Delivery) -> Option<&str> {
    delivery
        .headers
        .get(CORRELATION_ID)
        .or(delivery.message_id.as_deref())
}
