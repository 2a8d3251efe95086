//! What a handler (or the application) writes into the outbox.

use std::collections::BTreeMap;

use bytes::Bytes;
use serde::Serialize;

use crate::Error;

/// The longest message id, destination or ordering key the outbox accepts, in bytes.
pub const MAX_OUTBOX_NAME_BYTES: usize = 512;

/// A message to publish once the transaction that writes it commits.
///
/// `destination` is where the relay's [`Publisher`](crate::Publisher) sends it: a queue (a
/// routing key on the configured exchange) on RabbitMQ, a topic on Kafka, a queue of the
/// in-memory broker. `key` orders it: the relay publishes the messages of one key in the
/// order they were written, each only after the one before it was published; messages
/// without a key are not ordered. On Kafka the key is also the record key (it picks the
/// partition).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OutboxMessage {
    /// Where to publish it.
    pub destination: String,
    /// Its ordering key (and Kafka record key), if any.
    pub key: Option<String>,
    /// Its message id; `None` until written, when the outbox assigns one (see
    /// [`Context::publish`](crate::Context::publish)). The consumer's inbox deduplicates a
    /// re-send by it.
    pub message_id: Option<String>,
    /// Text headers, published as the message's headers.
    pub headers: BTreeMap<String, String>,
    /// The body.
    pub payload: Bytes,
}

impl OutboxMessage {
    /// A message of `payload` bytes for `destination`.
    pub fn new(destination: impl Into<String>, payload: impl Into<Bytes>) -> Self {
        OutboxMessage {
            destination: destination.into(),
            key: None,
            message_id: None,
            headers: BTreeMap::new(),
            payload: payload.into(),
        }
    }

    /// A message of `value` as JSON for `destination`, with the header
    /// `content-type: application/json`.
    pub fn json<T: Serialize + ?Sized>(
        destination: impl Into<String>,
        value: &T,
    ) -> Result<Self, Error> {
        let payload = serde_json::to_vec(value)
            .map_err(|e| Error::Message(format!("cannot encode the payload as JSON: {e}")))?;
        Ok(OutboxMessage::new(destination, payload).header("content-type", "application/json"))
    }

    /// The same message with an ordering key.
    pub fn key(mut self, key: impl Into<String>) -> Self {
        self.key = Some(key.into());
        self
    }

    /// The same message with its own message id instead of the one the outbox assigns.
    pub fn message_id(mut self, id: impl Into<String>) -> Self {
        self.message_id = Some(id.into());
        self
    }

    /// The same message with one more header (replacing one of the same name).
    pub fn header(mut self, name: impl Into<String>, value: impl Into<String>) -> Self {
        self.headers.insert(name.into(), value.into());
        self
    }

    /// Checks what the outbox stores: a destination, and names that fit, the message id
    /// being `id` (the message's own, or the one the outbox assigned).
    pub(crate) fn validate(&self, id: &str) -> Result<(), Error> {
        check_name("destination", &self.destination)?;
        if let Some(key) = &self.key {
            check_name("ordering key", key)?;
        }
        check_name("message id", id)
    }
}

/// A destination, key or id must be non-empty, at most [`MAX_OUTBOX_NAME_BYTES`], and hold
/// no control character.
fn check_name(what: &str, value: &str) -> Result<(), Error> {
    if value.is_empty() {
        return Err(Error::Message(format!("the {what} is empty")));
    }
    if value.len() > MAX_OUTBOX_NAME_BYTES {
        return Err(Error::Message(format!(
            "the {what} is longer than {MAX_OUTBOX_NAME_BYTES} bytes"
        )));
    }
    if value.chars().any(char::is_control) {
        return Err(Error::Message(format!(
            "the {what} holds a control character"
        )));
    }
    Ok(())
}

/// A random 128-bit message id, as 32 hex digits: for a message written outside a handler
/// without an id of its own.
pub(crate) fn random_message_id() -> String {
    use std::hash::{BuildHasher, Hasher};
    use std::sync::atomic::{AtomicU64, Ordering};
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    // Each `RandomState` has its own random keys; the counter and the clock keep two ids of
    // one state apart.
    let half = |salt: u64| {
        let mut h = std::collections::hash_map::RandomState::new().build_hasher();
        h.write_u64(salt);
        h.write_u64(COUNTER.fetch_add(1, Ordering::Relaxed));
        h.write_u128(
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_nanos())
                .unwrap_or_default(),
        );
        h.finish()
    };
    format!("{:016x}{:016x}", half(1), half(2))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_message_needs_a_destination_and_printable_names() {
        assert!(OutboxMessage::new("q", "x").validate("id").is_ok());
        assert!(OutboxMessage::new("", "x").validate("id").is_err());
        assert!(OutboxMessage::new("q", "x")
            .key("a\nb")
            .validate("id")
            .is_err());
        let long = "k".repeat(MAX_OUTBOX_NAME_BYTES + 1);
        assert!(OutboxMessage::new("q", "x").validate(&long).is_err());
        assert!(OutboxMessage::new("q", "x").validate("").is_err());
    }

    #[test]
    fn random_ids_differ() {
        let a = random_message_id();
        assert_eq!(a.len(), 32);
        assert_ne!(a, random_message_id());
    }

    #[test]
    fn json_sets_the_content_type() {
        let m = OutboxMessage::json("q", &serde_json::json!({"a": 1})).unwrap();
        assert_eq!(m.payload.as_ref(), br#"{"a":1}"#);
        assert_eq!(m.headers["content-type"], "application/json");
    }
}
