//! The dead-letter table's statements on each database, behind one sealed trait that
//! [`Backend`](crate::inbox::Backend) requires: where the runtime keeps the dead letters of a
//! transport that has no dead-letter destination of its own (see
//! [`Acknowledger::keeps_dead_letters`](crate::transport::Acknowledger::keeps_dead_letters)). The
//! table is created by the inbox's migrations, beside the inbox. The operations are written once,
//! on each database's statements through [`Execute`]; each database supplies its SQL.

use std::collections::BTreeMap;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use futures::future::BoxFuture;
use sha2::{Digest, Sha256};
use sqlx::{Pool, Postgres, Sqlite};

use super::config::{DeadLetterSql, TableNames};
use super::dialect::{Arg, Clock, DeadLetterRaw, Execute};
use crate::delivery::DeadLetter;
use crate::headers::Headers;

/// A dead letter as the inbox's dead-letter table keeps it: the whole message, where it
/// came from, and why it was dead-lettered.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct StoredDeadLetter {
    /// The row's id: what `show`, `replay` and `discard` name it by.
    pub id: i64,
    /// The handler's stable name.
    pub handler: String,
    /// The transport it came through ([`Source::transport`](crate::transport::Source::transport):
    /// `webhook`, `memory`).
    pub transport: String,
    /// Where in that transport: the webhook route, the in-memory queue.
    pub location: String,
    /// The delivery's message id (a webhook event's id), if it had one. In this and the
    /// other text fields a NUL, which PostgreSQL's text cannot hold, reads as U+FFFD.
    pub message_id: Option<String>,
    /// The idempotency key, when one was derived.
    pub key: Option<String>,
    /// The reason ([`DeadLetterReason::as_str`](crate::DeadLetterReason::as_str)).
    pub reason: String,
    /// The error text.
    pub error: String,
    /// Attempts counted by the inbox (0 when the handler never ran).
    pub attempts: u32,
    /// The delivery's headers.
    pub headers: BTreeMap<String, String>,
    /// The body, byte for byte.
    pub payload: Bytes,
    /// How often this same message (handler, source, message id and body) was
    /// dead-lettered: a provider's resends of a dead letter count here.
    pub deliveries: u32,
    /// When it was first dead-lettered.
    pub first_at: SystemTime,
    /// When it was last dead-lettered.
    pub last_at: SystemTime,
}

/// What the runtime keeps of a dead-lettered delivery: the settlement's letter, and the
/// message itself.
#[derive(Debug, Clone, Copy)]
pub(crate) struct LetterToKeep<'a> {
    pub(crate) letter: &'a DeadLetter,
    pub(crate) message_id: Option<&'a str>,
    pub(crate) headers: &'a Headers,
    pub(crate) payload: &'a [u8],
}

impl LetterToKeep<'_> {
    /// What identifies the message: a hash of its handler, transport, location, message id
    /// and body, each length-prefixed so that no two messages share one.
    fn fingerprint(&self) -> String {
        let location = self.letter.source.location.to_string();
        let parts: [&[u8]; 5] = [
            self.letter.handler.as_bytes(),
            self.letter.source.transport.as_bytes(),
            location.as_bytes(),
            self.message_id.unwrap_or_default().as_bytes(),
            self.payload,
        ];
        let mut hash = Sha256::new();
        hash.update([u8::from(self.message_id.is_some())]);
        for part in parts {
            hash.update((part.len() as u64).to_le_bytes());
            hash.update(part);
        }
        hex(&hash.finalize())
    }
}

/// `text` as a text column of either database holds it: a NUL (which PostgreSQL's text
/// refuses, and which a message id or key dead-lettered `invalid_key` may hold) becomes
/// U+FFFD. Otherwise such a letter could never be kept, and would come back for ever.
fn storable(text: &str) -> std::borrow::Cow<'_, str> {
    match text.contains('\0') {
        true => std::borrow::Cow::Owned(text.replace('\0', "\u{fffd}")),
        false => std::borrow::Cow::Borrowed(text),
    }
}

fn hex(bytes: &[u8]) -> String {
    use std::fmt::Write;
    bytes.iter().fold(String::with_capacity(64), |mut s, b| {
        let _ = write!(s, "{b:02x}");
        s
    })
}

/// The dead-letter operations of a database. Sealed (its supertrait cannot be named outside
/// the crate): part of [`Backend`](crate::inbox::Backend), not a public API.
pub trait DeadLetterStore: Execute {
    /// The statements on the dead-letter table of the inbox `names` describes.
    #[doc(hidden)]
    fn dead_letter_sql(names: &TableNames) -> DeadLetterSql;

    /// Keeps `letter`, or counts one more delivery on the row of the same message.
    #[doc(hidden)]
    #[allow(private_interfaces)]
    fn dead_letter_keep<'a>(
        pool: &'a Pool<Self>,
        names: &'a TableNames,
        letter: LetterToKeep<'a>,
    ) -> BoxFuture<'a, Result<(), sqlx::Error>> {
        Box::pin(async move {
            let mut conn = pool.acquire().await?;
            let fingerprint = letter.fingerprint();
            let location = storable(&letter.letter.source.location.to_string()).into_owned();
            // JSON escapes a NUL: the headers are stored as they are.
            let headers =
                serde_json::to_string(&letter.headers.to_map()).unwrap_or_else(|_| "{}".to_owned());
            let dead = letter.letter;
            let message_id = letter.message_id.map(storable);
            let key = dead.key.as_deref().map(storable);
            let error = storable(&dead.error);
            let args = [
                Arg::Text(&fingerprint),
                Arg::Text(&dead.handler),
                Arg::Text(dead.source.transport),
                Arg::Text(&location),
                Arg::OptText(message_id.as_deref()),
                Arg::OptText(key.as_deref()),
                Arg::Text(dead.reason.as_str()),
                Arg::Text(&error),
                Arg::Attempt(dead.attempts),
                Arg::Text(&headers),
                Arg::Bytes(letter.payload),
                Arg::Now(Clock::read()),
            ];
            Self::execute(&mut conn, &names.dead_letter_sql.keep, &args).await?;
            Ok(())
        })
    }

    /// Every kept letter, oldest first.
    #[doc(hidden)]
    fn dead_letter_list<'a>(
        pool: &'a Pool<Self>,
        names: &'a TableNames,
    ) -> BoxFuture<'a, Result<Vec<StoredDeadLetter>, sqlx::Error>> {
        Box::pin(async move {
            let mut conn = pool.acquire().await?;
            let raw = Self::fetch_dead_letters(&mut conn, &names.dead_letter_sql.list, &[]).await?;
            raw.into_iter().map(decode).collect()
        })
    }

    /// The letter `id`, if it is kept.
    #[doc(hidden)]
    fn dead_letter_fetch<'a>(
        pool: &'a Pool<Self>,
        names: &'a TableNames,
        id: i64,
    ) -> BoxFuture<'a, Result<Option<StoredDeadLetter>, sqlx::Error>> {
        Box::pin(async move {
            let mut conn = pool.acquire().await?;
            let args = [Arg::Int(id)];
            let raw = Self::fetch_dead_letters(&mut conn, &names.dead_letter_sql.fetch, &args);
            raw.await?.into_iter().next().map(decode).transpose()
        })
    }

    /// Deletes the letter `id`; whether it was kept.
    #[doc(hidden)]
    fn dead_letter_delete<'a>(
        pool: &'a Pool<Self>,
        names: &'a TableNames,
        id: i64,
    ) -> BoxFuture<'a, Result<bool, sqlx::Error>> {
        Box::pin(async move {
            let mut conn = pool.acquire().await?;
            let args = [Arg::Int(id)];
            Ok(Self::execute(&mut conn, &names.dead_letter_sql.delete, &args).await? > 0)
        })
    }
}

/// A row of the list and fetch statements as a [`StoredDeadLetter`].
fn decode(raw: DeadLetterRaw) -> Result<StoredDeadLetter, sqlx::Error> {
    let (id, handler, transport, location, message_id, key, reason, error, attempts, headers) = (
        raw.0, raw.1, raw.2, raw.3, raw.4, raw.5, raw.6, raw.7, raw.8, raw.9,
    );
    let (payload, deliveries, first_ms, last_ms) = (raw.10, raw.11, raw.12, raw.13);
    let headers = serde_json::from_str(&headers).map_err(|e| sqlx::Error::Decode(e.into()))?;
    let count = |n: i64| u32::try_from(n).unwrap_or(0);
    let at = |ms: i64| UNIX_EPOCH + Duration::from_millis(u64::try_from(ms).unwrap_or(0));
    Ok(StoredDeadLetter {
        id,
        handler,
        transport,
        location,
        message_id,
        key,
        reason,
        error,
        attempts: count(attempts),
        headers,
        payload: Bytes::from(payload),
        deliveries: count(deliveries),
        first_at: at(first_ms),
        last_at: at(last_ms),
    })
}

/// The columns the list and fetch statements return, in order.
const COLUMNS_PG: &str = "id, handler, transport, location, message_id, key, reason, error, \
     attempts::bigint, headers, payload, deliveries::bigint, \
     (extract(epoch FROM first_at) * 1000)::bigint, \
     (extract(epoch FROM last_at) * 1000)::bigint";

const COLUMNS_SQLITE: &str = "id, handler, transport, location, message_id, key, reason, error, \
     attempts, headers, payload, deliveries, first_at, last_at";

impl DeadLetterStore for Postgres {
    fn dead_letter_sql(names: &TableNames) -> DeadLetterSql {
        let r = |s: &str| names.render(&s.replace("{columns}", COLUMNS_PG));
        DeadLetterSql {
            keep: r(
                "INSERT INTO {dead_letters} AS d (fingerprint, handler, transport, location, \
                     message_id, key, reason, error, attempts, headers, payload) \
                     VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11) \
                     ON CONFLICT (fingerprint) DO UPDATE SET deliveries = d.deliveries + 1, \
                     last_at = now(), key = COALESCE(EXCLUDED.key, d.key), \
                     reason = EXCLUDED.reason, error = EXCLUDED.error, \
                     attempts = EXCLUDED.attempts, headers = EXCLUDED.headers",
            ),
            list: r("SELECT {columns} FROM {dead_letters} ORDER BY id"),
            fetch: r("SELECT {columns} FROM {dead_letters} WHERE id = $1"),
            delete: r("DELETE FROM {dead_letters} WHERE id = $1"),
        }
    }
}

impl DeadLetterStore for Sqlite {
    fn dead_letter_sql(names: &TableNames) -> DeadLetterSql {
        let r = |s: &str| names.render(&s.replace("{columns}", COLUMNS_SQLITE));
        DeadLetterSql {
            keep: r(
                "INSERT INTO {dead_letters} AS d (fingerprint, handler, transport, location, \
                     message_id, key, reason, error, attempts, headers, payload, first_at, \
                     last_at) \
                     VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11, ?12, ?12) \
                     ON CONFLICT (fingerprint) DO UPDATE SET deliveries = d.deliveries + 1, \
                     last_at = excluded.last_at, key = COALESCE(excluded.key, d.key), \
                     reason = excluded.reason, error = excluded.error, \
                     attempts = excluded.attempts, headers = excluded.headers",
            ),
            list: r("SELECT {columns} FROM {dead_letters} ORDER BY id"),
            fetch: r("SELECT {columns} FROM {dead_letters} WHERE id = ?1"),
            delete: r("DELETE FROM {dead_letters} WHERE id = ?1"),
        }
    }
}
