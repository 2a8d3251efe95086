//! Proof that a copy's origin headers were written by the framework.
//!
//! A retry copy and a dead letter say where the message was first published
//! ([`headers::ORIGINAL_EXCHANGE`], [`headers::ORIGINAL_ROUTING_KEY`]) and when it first
//! failed ([`headers::FIRST_FAILURE`]); `consumer dlq replay` republishes a dead letter to
//! that origin. Any producer can write those headers, and RabbitMQ's `x-death` too, so
//! neither their presence nor where a message came from proves anything. With an
//! [`OriginSecret`] shared by the workers of a queue (and the operator's `consumer`
//! command), every copy the framework writes carries [`headers::ORIGIN_SIGNATURE`]: an
//! HMAC-SHA256 over the copy's kind (retry copy or dead letter), the queue it is written
//! for (the work queue, or the dead-letter queue), its message id, its attempt number and
//! those three headers. A copy whose signature does not verify is a producer's message like
//! any other: its origin headers are replaced, never carried on, and a replay does not go
//! where they point unless the operator names the destination.
//!
//! Without a secret nothing verifies: the workers take no message for their own copy (each
//! attempt's copy records where that attempt came from), and a replay needs an explicit
//! destination. There is no generated default: a secret the workers made up would have to
//! be stored where the operator's command can read it and no producer can, which the
//! transport has no place for.

use std::fmt;
use std::sync::Arc;

use hmac::{Hmac, Mac};
use lapin::types::{AMQPValue, FieldTable};
use lapin::BasicProperties;
use sha2::Sha256;

use crate::{headers, Error};

type HmacSha256 = Hmac<Sha256>;

/// The environment variable [`OriginSecret::from_env`] reads: the workers and the
/// `consumer` command use the same one.
pub const ORIGIN_SECRET_VAR: &str = "AMQP_ORIGIN_SECRET";

/// The shortest secret accepted, in bytes.
pub const MIN_ORIGIN_SECRET_LEN: usize = 16;

/// Which copy a signature is for: a retry copy is verified by the workers of its work
/// queue, a dead letter by the `consumer` command reading its dead-letter queue.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum CopyKind {
    /// A copy on its way through a retry queue back to the work queue.
    Retry,
    /// A copy in the dead-letter queue.
    DeadLetter,
}

impl CopyKind {
    fn as_str(self) -> &'static str {
        match self {
            CopyKind::Retry => "retry",
            CopyKind::DeadLetter => "dead-letter",
        }
    }
}

/// The key that signs the origin of the framework's copies (see the module docs). Its
/// bytes never appear in `Debug` output, logs or errors.
#[derive(Clone)]
pub struct OriginSecret(Arc<[u8]>);

impl OriginSecret {
    /// A secret of at least [`MIN_ORIGIN_SECRET_LEN`] bytes, e.g. the output of
    /// `openssl rand -hex 32`. A shorter one is refused, naming `amqp.origin_secret`.
    pub fn new(secret: impl AsRef<[u8]>) -> Result<Self, Error> {
        Self::named("amqp.origin_secret", secret.as_ref())
    }

    /// The secret in [`ORIGIN_SECRET_VAR`]; `None` when it is unset or empty. A value too
    /// short is refused, naming the variable.
    pub fn from_env() -> Result<Option<Self>, Error> {
        match std::env::var_os(ORIGIN_SECRET_VAR) {
            None => Ok(None),
            Some(v) if v.is_empty() => Ok(None),
            Some(v) => Self::named(ORIGIN_SECRET_VAR, v.as_encoded_bytes()).map(Some),
        }
    }

    fn named(field: &'static str, secret: &[u8]) -> Result<Self, Error> {
        if secret.len() < MIN_ORIGIN_SECRET_LEN {
            return Err(Error::config(
                field,
                format!(
                    "an origin secret needs at least {MIN_ORIGIN_SECRET_LEN} bytes \
                     (e.g. `openssl rand -hex 32`)"
                ),
            ));
        }
        Ok(OriginSecret(Arc::from(secret)))
    }

    /// Whether the dead letter with `properties`, read from `dead_letter_queue`, carries a
    /// signature over its origin made with this secret for that queue: then its
    /// `x-original-*` headers are the framework's, and a replay may go there.
    pub fn verifies_dead_letter(
        &self,
        dead_letter_queue: &str,
        properties: &BasicProperties,
    ) -> bool {
        self.verifies(CopyKind::DeadLetter, dead_letter_queue, properties)
    }

    /// Whether `properties` carry a valid signature for a copy of `kind` written for
    /// `queue` (compared in constant time).
    pub(crate) fn verifies(
        &self,
        kind: CopyKind,
        queue: &str,
        properties: &BasicProperties,
    ) -> bool {
        let table = properties.headers().as_ref();
        let Some(tag) = table
            .and_then(|t| bytes(t, headers::ORIGIN_SIGNATURE))
            .and_then(decode_hex)
        else {
            return false;
        };
        let message_id = properties.message_id().as_ref().map(|s| s.as_str());
        self.mac(kind, queue, message_id, table)
            .verify_slice(&tag)
            .is_ok()
    }

    /// Sets [`headers::ORIGIN_SIGNATURE`] in `table` (the finished headers of a copy of
    /// `kind` for `queue`, whose message id is `message_id`).
    pub(crate) fn sign(
        &self,
        kind: CopyKind,
        queue: &str,
        message_id: Option<&str>,
        table: &mut FieldTable,
    ) {
        let tag = self.mac(kind, queue, message_id, Some(table)).finalize();
        let hex: String = tag
            .into_bytes()
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect();
        headers::set_string(table, headers::ORIGIN_SIGNATURE, &hex);
    }

    /// The HMAC over every signed field, each preceded by its length, so no two field lists
    /// give the same input.
    fn mac(
        &self,
        kind: CopyKind,
        queue: &str,
        message_id: Option<&str>,
        table: Option<&FieldTable>,
    ) -> HmacSha256 {
        // An HMAC takes a key of any length; the error type exists for other MACs.
        let mut mac =
            <HmacSha256 as Mac>::new_from_slice(&self.0).unwrap_or_else(|_| unreachable!());
        let attempt = headers::attempt(table).to_string();
        let header = |name: &str| table.and_then(|t| bytes(t, name)).unwrap_or_default();
        let fields: [&[u8]; 8] = [
            b"consumer-amqp origin v1",
            kind.as_str().as_bytes(),
            queue.as_bytes(),
            message_id.unwrap_or_default().as_bytes(),
            attempt.as_bytes(),
            header(headers::ORIGINAL_EXCHANGE),
            header(headers::ORIGINAL_ROUTING_KEY),
            header(headers::FIRST_FAILURE),
        ];
        for field in fields {
            mac.update(&(field.len() as u64).to_be_bytes());
            mac.update(field);
        }
        mac
    }
}

impl fmt::Debug for OriginSecret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("OriginSecret(<redacted>)")
    }
}

/// A string header's bytes; a header of another type signs as absent.
fn bytes<'t>(table: &'t FieldTable, name: &str) -> Option<&'t [u8]> {
    match table.inner().get(name)? {
        AMQPValue::LongString(s) => Some(s.as_bytes()),
        AMQPValue::ShortString(s) => Some(s.as_str().as_bytes()),
        _ => None,
    }
}

fn decode_hex(hex: &[u8]) -> Option<Vec<u8>> {
    if !hex.len().is_multiple_of(2) {
        return None;
    }
    hex.chunks(2)
        .map(|pair| u8::from_str_radix(std::str::from_utf8(pair).ok()?, 16).ok())
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    const SECRET: &str = "0123456789abcdef-test-secret";

    fn copy(secret: &OriginSecret, kind: CopyKind, queue: &str) -> BasicProperties {
        let mut t = FieldTable::default();
        headers::set_string(&mut t, headers::ORIGINAL_EXCHANGE, "orders");
        headers::set_string(&mut t, headers::ORIGINAL_ROUTING_KEY, "eu.orders");
        headers::set_string(&mut t, headers::FIRST_FAILURE, "2024-05-01T12:00:00.123Z");
        headers::set_int(&mut t, headers::ATTEMPT, 2);
        secret.sign(kind, queue, Some("m-1"), &mut t);
        BasicProperties::default()
            .with_headers(t)
            .with_message_id("m-1".into())
    }

    fn with_header(p: &BasicProperties, name: &'static str, value: &str) -> BasicProperties {
        let mut t = p.headers().clone().unwrap_or_default();
        headers::set_string(&mut t, name, value);
        p.clone().with_headers(t)
    }

    #[test]
    fn a_signed_copy_verifies_for_its_kind_and_queue_only() {
        let secret = OriginSecret::new(SECRET).unwrap();
        let p = copy(&secret, CopyKind::Retry, "orders");
        assert!(secret.verifies(CopyKind::Retry, "orders", &p));
        assert!(!secret.verifies(CopyKind::Retry, "payments", &p));
        assert!(!secret.verifies(CopyKind::DeadLetter, "orders", &p));
        let other = OriginSecret::new("another-secret-of-16+ bytes").unwrap();
        assert!(!other.verifies(CopyKind::Retry, "orders", &p));
        let dead = copy(&secret, CopyKind::DeadLetter, "orders.dlq");
        assert!(secret.verifies_dead_letter("orders.dlq", &dead));
    }

    #[test]
    fn changing_a_signed_field_breaks_the_signature() {
        let secret = OriginSecret::new(SECRET).unwrap();
        let p = copy(&secret, CopyKind::Retry, "orders");
        for (name, value) in [
            (headers::ORIGINAL_EXCHANGE, ""),
            (headers::ORIGINAL_ROUTING_KEY, "victims"),
            (headers::FIRST_FAILURE, "2024-05-01T12:00:00.124Z"),
            (headers::ATTEMPT, "3"),
            (headers::ORIGIN_SIGNATURE, "00"),
            (headers::ORIGIN_SIGNATURE, "not hex"),
        ] {
            let forged = with_header(&p, name, value);
            assert!(
                !secret.verifies(CopyKind::Retry, "orders", &forged),
                "{name}"
            );
        }
        let other_id = p.clone().with_message_id("m-2".into());
        assert!(!secret.verifies(CopyKind::Retry, "orders", &other_id));
        let unsigned = BasicProperties::default().with_message_id("m-1".into());
        assert!(!secret.verifies(CopyKind::Retry, "orders", &unsigned));
    }

    #[test]
    fn a_short_secret_is_refused_without_showing_it() {
        let e = OriginSecret::new("short").unwrap_err();
        let shown = e.to_string();
        assert!(shown.contains("amqp.origin_secret"), "{shown}");
        assert!(!shown.contains("short"), "{shown}");
        let secret = OriginSecret::new(SECRET).unwrap();
        assert_eq!(format!("{secret:?}"), "OriginSecret(<redacted>)");
    }
}
