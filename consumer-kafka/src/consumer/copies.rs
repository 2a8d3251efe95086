//! The retry and dead-letter copies of a record: its key, value and headers, minus the
//! headers the transport manages, plus the ones the copy needs.

use std::time::Duration;

use consumer_core::transport::DeadLetter;
use consumer_core::DeadLetterReason;

use super::partitions::Settings;
use super::record::{unix_millis, Record};
use super::record_headers::RawHeaders;
use crate::headers;
use crate::producer::OutgoingRecord;

/// The original headers without those the transport manages, and without the origin
/// headers unless the record is our own retry copy (see [`headers::ORIGIN`]).
fn carried_headers(record: &Record) -> RawHeaders {
    let mut hs = record.original_headers();
    hs.retain(|(k, _)| !headers::MANAGED.contains(&k.as_str()) && trusted_origin(record, k));
    hs
}

/// Whether header `name` may be carried into a copy of `record` as far as origin headers
/// go: anything else, and origin headers of our own copies.
fn trusted_origin(record: &Record, name: &str) -> bool {
    record.own_copy || !headers::ORIGIN.contains(&name)
}

fn text(k: &str, v: impl ToString) -> (String, Option<Vec<u8>>) {
    (k.to_owned(), Some(v.to_string().into_bytes()))
}

fn has_header(hs: &[(String, Option<Vec<u8>>)], name: &str) -> bool {
    hs.iter().any(|(k, _)| k == name)
}

/// The delivery span's own trace context in place of the record's `traceparent` (with
/// core's `opentelemetry` feature), so the copy's attempt is its child; without it, the
/// record's header is carried as it is.
fn inject_trace(hs: &mut Vec<(String, Option<Vec<u8>>)>) {
    if let Some(parent) = consumer_core::trace::current_traceparent() {
        hs.retain(|(k, _)| k != consumer_core::trace::TRACEPARENT);
        hs.push(text(consumer_core::trace::TRACEPARENT, parent));
    }
}

/// Where a record first came from: its own position, unless it is a retry copy that says.
fn add_origin(hs: &mut Vec<(String, Option<Vec<u8>>)>, record: &Record) {
    if !has_header(hs, headers::ORIGINAL_TOPIC) {
        hs.push(text(headers::ORIGINAL_TOPIC, record.topic()));
        hs.push(text(headers::ORIGINAL_PARTITION, record.partition()));
        hs.push(text(headers::ORIGINAL_OFFSET, record.offset));
    }
}

pub(super) fn retry_copy(
    record: &Record,
    s: &Settings,
    delay: Duration,
    attempt: u32,
) -> OutgoingRecord {
    let mut hs = carried_headers(record);
    // The copy keeps the message's identity even when it was derived (offset ids).
    if let Some(id) = record.message_id(&s.message_id_header) {
        if !has_header(&hs, &s.message_id_header) {
            hs.push(text(&s.message_id_header, &id));
        }
    }
    let due = unix_millis().saturating_add(i64::try_from(delay.as_millis()).unwrap_or(i64::MAX));
    hs.push(text(headers::ATTEMPT, attempt));
    hs.push(text(headers::DUE_AT, due));
    hs.push(text(headers::RETRY_GROUP, &s.group_id));
    add_origin(&mut hs, record);
    inject_trace(&mut hs);
    OutgoingRecord {
        key: record.key.as_deref().map(<[u8]>::to_vec),
        payload: (!record.null_payload).then(|| record.payload.to_vec()),
        headers: hs,
    }
}

pub(super) fn dead_letter_copy(record: &Record, dl: &DeadLetter) -> OutgoingRecord {
    let mut hs = record.original_headers();
    hs.retain(|(k, _)| {
        (!headers::MANAGED.contains(&k.as_str()) || k.as_str() == headers::ATTEMPT)
            && trusted_origin(record, k)
    });
    inject_trace(&mut hs);
    hs.push(text(headers::DEAD_LETTER_REASON, dl.reason.as_str()));
    hs.push(text(headers::HANDLER, &dl.handler));
    if let Some(key) = &dl.key {
        hs.push(text(headers::KEY, key));
    }
    hs.push(text(headers::ATTEMPTS, dl.attempts));
    hs.push(text(
        headers::ERROR,
        headers::truncate(&dl.error, headers::MAX_ERROR_LEN),
    ));
    add_origin(&mut hs, record);
    OutgoingRecord {
        key: record.key.as_deref().map(<[u8]>::to_vec),
        payload: (!record.null_payload).then(|| record.payload.to_vec()),
        headers: hs,
    }
}

/// The dead letter written when [`dead_letter_copy`] is too large: reason `copy_too_large`,
/// the first reason and error in its error text, the origin and the message id in its
/// headers, and as its body a JSON reference to the record (`topic`, `partition`,
/// `offset`) instead of the record's own key, body and headers.
pub(super) fn reference_letter(record: &Record, dl: &DeadLetter, s: &Settings) -> OutgoingRecord {
    let mut hs = Vec::new();
    if let Some(id) = record.message_id(&s.message_id_header) {
        hs.push(text(&s.message_id_header, headers::truncate(&id, 1024)));
    }
    hs.push(text(
        headers::DEAD_LETTER_REASON,
        DeadLetterReason::CopyTooLarge.as_str(),
    ));
    hs.push(text(headers::HANDLER, &dl.handler));
    if let Some(key) = &dl.key {
        hs.push(text(headers::KEY, headers::truncate(key, 1024)));
    }
    hs.push(text(headers::ATTEMPTS, dl.attempts));
    let error = format!(
        "{}: {} (the record, {} bytes with key and headers, is too large to copy; it is still at {})",
        dl.reason.as_str(),
        dl.error,
        record.bytes,
        record.location()
    );
    hs.push(text(
        headers::ERROR,
        headers::truncate(&error, headers::MAX_ERROR_LEN),
    ));
    if record.own_copy {
        // A retry copy says where the message first came from; the reference is to the
        // copy itself, the record that exists.
        for name in [
            headers::ORIGINAL_TOPIC,
            headers::ORIGINAL_PARTITION,
            headers::ORIGINAL_OFFSET,
        ] {
            if let Some(v) = record.headers.get(name) {
                hs.push(text(name, v));
            }
        }
    }
    add_origin(&mut hs, record);
    // Topic names are `[A-Za-z0-9._-]`: nothing to escape.
    let reference = format!(
        r#"{{"topic":"{}","partition":{},"offset":{}}}"#,
        record.topic(),
        record.partition(),
        record.offset
    );
    OutgoingRecord {
        key: None,
        payload: Some(reference.into_bytes()),
        headers: hs,
    }
}
