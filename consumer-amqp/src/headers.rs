//! The message headers this crate reads and writes.
//!
//! A retry copy carries [`ATTEMPT`], [`RETRY_DUE`], [`FIRST_FAILURE`],
//! [`ORIGINAL_EXCHANGE`] and [`ORIGINAL_ROUTING_KEY`] (and [`ORIGIN_SIGNATURE`] with an
//! origin secret). A dead-lettered message carries all of them but [`RETRY_DUE`], plus [`DEAD_LETTER_REASON`], [`HANDLER`],
//! [`KEY`], [`ATTEMPTS`], [`ERROR`] and [`LAST_FAILURE`]. Times are RFC 3339 UTC strings with milliseconds
//! (`2024-05-01T12:00:00.123Z`).

use std::borrow::Cow;
use std::time::{SystemTime, UNIX_EPOCH};

use consumer_core::transport::Headers;
use lapin::types::{AMQPValue, FieldTable, LongString, ShortString};
use lapin::BasicProperties;

/// The framework's own headers, the same on every transport.
pub use consumer_core::header_names::{
    ATTEMPT, ATTEMPTS, DEAD_LETTER_REASON, ERROR, FIRST_FAILURE, HANDLER, KEY, MAX_ERROR_LEN,
};

/// When the message failed for the last time (dead letters).
pub const LAST_FAILURE: &str = "x-last-failure";
/// The exchange the message was first published to (`""` is the default exchange).
pub const ORIGINAL_EXCHANGE: &str = "x-original-exchange";
/// The routing key the message was first published with.
pub const ORIGINAL_ROUTING_KEY: &str = "x-original-routing-key";

/// When a retry copy is due back in the work queue, in milliseconds since the Unix epoch:
/// the time it was published plus its retry queue's delay. The worker that takes the copy
/// from its retry queue holds it until then (see the crate docs, "Retries").
pub const RETRY_DUE: &str = "x-retry-due";

/// The signature over a copy's origin ([`crate::OriginSecret`]): the hex HMAC-SHA256 that
/// proves the framework wrote [`ORIGINAL_EXCHANGE`], [`ORIGINAL_ROUTING_KEY`] and
/// [`FIRST_FAILURE`]. Only with an origin secret configured.
pub const ORIGIN_SIGNATURE: &str = "x-origin-signature";

/// Where and when a message first came in, and the proof of it: written by the framework
/// on the first copy and kept only from its own retry copies, those whose
/// [`ORIGIN_SIGNATURE`] verifies (a producer's values are replaced).
pub(crate) const ORIGIN: &[&str] = &[
    ORIGINAL_EXCHANGE,
    ORIGINAL_ROUTING_KEY,
    FIRST_FAILURE,
    ORIGIN_SIGNATURE,
];

/// The headers of a dead letter: written by the framework, never carried from the message.
pub(crate) const DEAD_LETTER: &[&str] = &[
    DEAD_LETTER_REASON,
    HANDLER,
    KEY,
    ATTEMPTS,
    ERROR,
    LAST_FAILURE,
];

/// A delivery's headers as text: its header table (strings as they are, numbers in
/// decimal, booleans as `true`/`false`, timestamps as seconds, arrays and tables, e.g.
/// RabbitMQ's `x-death`, as JSON), plus the request's reply address and correlation id from
/// the `reply_to` and `correlation_id` properties, under the names a handler's reply reads
/// ([`consumer_core::header_names::REPLY_TO`], [`consumer_core::header_names::CORRELATION_ID`]);
/// those two win over headers of the same name.
///
/// Text values are borrowed from the table, not copied: the one block of the [`Headers`] is
/// the only lasting allocation.
pub(crate) fn to_headers(
    table: Option<&FieldTable>,
    properties: &lapin::BasicProperties,
) -> Headers {
    let mut text: Vec<(&str, Cow<'_, str>)> = table
        .map(|t| {
            t.inner()
                .iter()
                .map(|(k, v)| (k.as_str(), value_text(v)))
                .collect()
        })
        .unwrap_or_default();
    if let Some(to) = properties.reply_to() {
        text.push((
            consumer_core::header_names::REPLY_TO,
            Cow::Borrowed(to.as_str()),
        ));
    }
    if let Some(id) = properties.correlation_id() {
        text.push((
            consumer_core::header_names::CORRELATION_ID,
            Cow::Borrowed(id.as_str()),
        ));
    }
    Headers::from_pairs(text.iter().map(|(k, v)| (*k, v.as_ref())))
}

fn value_text(v: &AMQPValue) -> Cow<'_, str> {
    match v {
        AMQPValue::ShortString(s) => Cow::Borrowed(s.as_str()),
        AMQPValue::LongString(s) => String::from_utf8_lossy(s.as_bytes()),
        AMQPValue::ByteArray(b) => String::from_utf8_lossy(b.as_slice()),
        AMQPValue::Void => Cow::Borrowed(""),
        other => Cow::Owned(match value_to_json(other) {
            serde_json::Value::String(s) => s,
            json => json.to_string(),
        }),
    }
}

fn value_to_json(v: &AMQPValue) -> serde_json::Value {
    use serde_json::Value;
    match v {
        AMQPValue::Boolean(b) => Value::Bool(*b),
        AMQPValue::ShortShortInt(n) => (*n).into(),
        AMQPValue::ShortShortUInt(n) => (*n).into(),
        AMQPValue::ShortInt(n) => (*n).into(),
        AMQPValue::ShortUInt(n) => (*n).into(),
        AMQPValue::LongInt(n) => (*n).into(),
        AMQPValue::LongUInt(n) => (*n).into(),
        AMQPValue::LongLongInt(n) => (*n).into(),
        AMQPValue::Timestamp(n) => (*n).into(),
        AMQPValue::Float(n) => serde_json::Number::from_f64(f64::from(*n))
            .map(Value::Number)
            .unwrap_or(Value::Null),
        AMQPValue::Double(n) => serde_json::Number::from_f64(*n)
            .map(Value::Number)
            .unwrap_or(Value::Null),
        AMQPValue::DecimalValue(d) => {
            let scale = u32::from(d.scale);
            let value = f64::from(d.value) / 10f64.powi(scale.min(30) as i32);
            Value::String(format!("{value:.*}", scale as usize))
        }
        AMQPValue::ShortString(s) => Value::String(s.to_string()),
        AMQPValue::LongString(s) => Value::String(s.to_string()),
        AMQPValue::ByteArray(b) => Value::String(String::from_utf8_lossy(b.as_slice()).into()),
        AMQPValue::FieldArray(a) => Value::Array(a.as_slice().iter().map(value_to_json).collect()),
        AMQPValue::FieldTable(t) => Value::Object(
            t.inner()
                .iter()
                .map(|(k, v)| (k.to_string(), value_to_json(v)))
                .collect(),
        ),
        AMQPValue::Void => Value::Null,
    }
}

/// The attempt number from [`ATTEMPT`]: any integer type or a decimal string; 1 when absent
/// or unusable.
pub(crate) fn attempt(table: Option<&FieldTable>) -> u32 {
    integer(table, ATTEMPT)
        .and_then(|n| u32::try_from(n).ok())
        .filter(|n| *n >= 1)
        .unwrap_or(1)
}

/// The header `name` as an integer: any integer type or a decimal string.
fn integer(table: Option<&FieldTable>, name: &str) -> Option<i128> {
    match table?.inner().get(name)? {
        AMQPValue::ShortShortInt(n) => Some((*n).into()),
        AMQPValue::ShortShortUInt(n) => Some((*n).into()),
        AMQPValue::ShortInt(n) => Some((*n).into()),
        AMQPValue::ShortUInt(n) => Some((*n).into()),
        AMQPValue::LongInt(n) => Some((*n).into()),
        AMQPValue::LongUInt(n) => Some((*n).into()),
        AMQPValue::LongLongInt(n) => Some((*n).into()),
        AMQPValue::ShortString(s) => s.as_str().trim().parse().ok(),
        AMQPValue::LongString(s) => s.to_string().trim().parse().ok(),
        _ => None,
    }
}

/// Sets a string header.
pub(crate) fn set_string(table: &mut FieldTable, name: &'static str, value: &str) {
    table.insert(
        ShortString::from(name),
        AMQPValue::LongString(LongString::from(value)),
    );
}

/// Sets an integer header.
pub(crate) fn set_int(table: &mut FieldTable, name: &'static str, value: u32) {
    table.insert(
        ShortString::from(name),
        AMQPValue::LongLongInt(i64::from(value)),
    );
}

/// Sets a time header, in milliseconds since the Unix epoch.
pub(crate) fn set_millis(table: &mut FieldTable, name: &'static str, value: SystemTime) {
    let millis = value
        .duration_since(UNIX_EPOCH)
        .map(|d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX))
        .unwrap_or(0);
    table.insert(ShortString::from(name), AMQPValue::LongLongInt(millis));
}

/// A time header in milliseconds since the Unix epoch (an integer of any type or a decimal
/// string); `None` when absent, unusable or negative.
pub(crate) fn millis(table: Option<&FieldTable>, name: &str) -> Option<SystemTime> {
    let n = u64::try_from(integer(table, name)?).ok()?;
    UNIX_EPOCH.checked_add(std::time::Duration::from_millis(n))
}

/// `s` cut to at most `max` bytes at a character boundary, marked with `…` when cut.
pub(crate) fn truncate(s: &str, max: usize) -> String {
    if s.len() <= max {
        return s.to_owned();
    }
    let mut end = max.saturating_sub('…'.len_utf8());
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}…", &s[..end])
}

/// RFC 3339 UTC with milliseconds, e.g. `2024-05-01T12:00:00.123Z`.
pub(crate) fn rfc3339(t: SystemTime) -> String {
    let since = t.duration_since(UNIX_EPOCH).unwrap_or_default();
    let secs = since.as_secs();
    let (days, rem) = (secs / 86_400, secs % 86_400);
    let (y, m, d) = civil_from_days(days as i64);
    format!(
        "{y:04}-{m:02}-{d:02}T{:02}:{:02}:{:02}.{:03}Z",
        rem / 3600,
        rem % 3600 / 60,
        rem % 60,
        since.subsec_millis()
    )
}

/// Days since 1970-01-01 to (year, month, day), proleptic Gregorian (H. Hinnant's algorithm).
fn civil_from_days(z: i64) -> (i64, u32, u32) {
    let z = z + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let m = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    let y = yoe + era * 400 + i64::from(m <= 2);
    (y, m, d)
}

/// The original properties with `headers`, made persistent, minus two that would defeat the
/// copy: `expiration` (a per-message TTL would expire it from the retry or dead-letter
/// queue) and `user_id` (RabbitMQ refuses a publish whose `user_id` is not the connection's
/// user, closing the channel).
pub(crate) fn copy_properties(original: &BasicProperties, headers: FieldTable) -> BasicProperties {
    let mut p = BasicProperties::default()
        .with_headers(headers)
        .with_delivery_mode(2);
    if let Some(v) = original.content_type() {
        p = p.with_content_type(v.clone());
    }
    if let Some(v) = original.content_encoding() {
        p = p.with_content_encoding(v.clone());
    }
    if let Some(v) = original.priority() {
        p = p.with_priority(*v);
    }
    if let Some(v) = original.correlation_id() {
        p = p.with_correlation_id(v.clone());
    }
    if let Some(v) = original.reply_to() {
        p = p.with_reply_to(v.clone());
    }
    if let Some(v) = original.message_id() {
        p = p.with_message_id(v.clone());
    }
    if let Some(v) = original.timestamp() {
        p = p.with_timestamp(*v);
    }
    if let Some(v) = original.kind() {
        p = p.with_type(v.clone());
    }
    if let Some(v) = original.app_id() {
        p = p.with_app_id(v.clone());
    }
    if let Some(v) = original.cluster_id() {
        p = p.with_cluster_id(v.clone());
    }
    p
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn formats_rfc3339() {
        assert_eq!(rfc3339(UNIX_EPOCH), "1970-01-01T00:00:00.000Z");
        let t = UNIX_EPOCH + Duration::from_millis(1_714_564_800_123);
        assert_eq!(rfc3339(t), "2024-05-01T12:00:00.123Z");
        // A leap day and the end of a century.
        let t = UNIX_EPOCH + Duration::from_secs(951_782_400);
        assert_eq!(rfc3339(t), "2000-02-29T00:00:00.000Z");
        let t = UNIX_EPOCH + Duration::from_secs(4_102_444_799);
        assert_eq!(rfc3339(t), "2099-12-31T23:59:59.000Z");
    }

    #[test]
    fn a_retry_copy_due_time_is_written_and_read_back_in_milliseconds() {
        let mut t = FieldTable::default();
        let due = UNIX_EPOCH + Duration::from_millis(1_714_564_800_123);
        set_millis(&mut t, RETRY_DUE, due);
        assert_eq!(millis(Some(&t), RETRY_DUE), Some(due));
        // A producer's decimal string is read too; nonsense is no time.
        t.insert(RETRY_DUE.into(), AMQPValue::LongString("1000".into()));
        assert_eq!(
            millis(Some(&t), RETRY_DUE),
            Some(UNIX_EPOCH + Duration::from_secs(1))
        );
        for bad in [
            AMQPValue::LongLongInt(-1),
            AMQPValue::LongString("soon".into()),
            AMQPValue::Boolean(true),
        ] {
            t.insert(RETRY_DUE.into(), bad);
            assert_eq!(millis(Some(&t), RETRY_DUE), None);
        }
        assert_eq!(millis(None, RETRY_DUE), None);
    }

    #[test]
    fn reads_the_attempt_from_any_integer_or_string() {
        let mut t = FieldTable::default();
        assert_eq!(attempt(None), 1);
        assert_eq!(attempt(Some(&t)), 1);
        for (v, want) in [
            (AMQPValue::LongLongInt(3), 3),
            (AMQPValue::ShortShortUInt(2), 2),
            (AMQPValue::LongString("7".into()), 7),
            (AMQPValue::LongInt(0), 1),
            (AMQPValue::LongInt(-4), 1),
            (AMQPValue::LongString("x".into()), 1),
            (AMQPValue::Boolean(true), 1),
        ] {
            t.insert(ATTEMPT.into(), v);
            assert_eq!(attempt(Some(&t)), want);
        }
    }

    #[test]
    fn converts_headers_to_strings() {
        let mut death = FieldTable::default();
        death.insert("count".into(), AMQPValue::LongLongInt(2));
        death.insert("queue".into(), AMQPValue::LongString("q".into()));
        let mut t = FieldTable::default();
        t.insert("s".into(), AMQPValue::LongString("text".into()));
        t.insert("n".into(), AMQPValue::LongInt(-5));
        t.insert("b".into(), AMQPValue::Boolean(false));
        t.insert(
            "x-death".into(),
            AMQPValue::FieldArray(vec![AMQPValue::FieldTable(death)].into()),
        );
        t.insert("reply-to".into(), AMQPValue::LongString("forged".into()));
        let properties = lapin::BasicProperties::default()
            .with_reply_to("replies".into())
            .with_correlation_id("c-1".into());
        let h = to_headers(Some(&t), &properties);
        assert_eq!(h.get("s"), Some("text"));
        assert_eq!(h.get("n"), Some("-5"));
        assert_eq!(h.get("b"), Some("false"));
        assert_eq!(h.get("x-death"), Some(r#"[{"count":2,"queue":"q"}]"#));
        // The properties win over a header of the same name.
        assert_eq!(
            h.get(consumer_core::header_names::REPLY_TO),
            Some("replies")
        );
        assert_eq!(
            h.get(consumer_core::header_names::CORRELATION_ID),
            Some("c-1")
        );
        assert_eq!(h.len(), 6);
        assert_eq!(
            to_headers(None, &lapin::BasicProperties::default()),
            Headers::new()
        );
    }

    #[test]
    fn truncates_at_a_char_boundary() {
        assert_eq!(truncate("short", 10), "short");
        let cut = truncate(&"é".repeat(100), 11);
        assert!(cut.len() <= 11 && cut.ends_with('…'), "{cut}");
    }

    #[test]
    fn copies_keep_properties_but_expiration_and_user_id() {
        let original = BasicProperties::default()
            .with_message_id("m-1".into())
            .with_content_type("application/json".into())
            .with_correlation_id("c".into())
            .with_expiration("1000".into())
            .with_user_id("alice".into())
            .with_delivery_mode(1)
            .with_priority(3);
        let copy = copy_properties(&original, FieldTable::default());
        assert_eq!(copy.message_id().as_ref().map(|s| s.as_str()), Some("m-1"));
        assert_eq!(
            copy.content_type().as_ref().map(|s| s.as_str()),
            Some("application/json")
        );
        assert_eq!(
            copy.correlation_id().as_ref().map(|s| s.as_str()),
            Some("c")
        );
        assert_eq!(*copy.priority(), Some(3));
        assert_eq!(*copy.delivery_mode(), Some(2));
        assert!(copy.expiration().is_none());
        assert!(copy.user_id().is_none());
    }
}
