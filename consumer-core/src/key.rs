//! Idempotency keys: from the message id, a template over the message's fields, or a hash of
//! the canonical payload.

use consumer_options::Segment;
use serde_json::Value;
use sha2::{Digest, Sha256};

use crate::Error;

/// The longest key the inbox accepts, in bytes (UTF-8).
///
/// Far below PostgreSQL's limit on a btree index entry (about 2,700 bytes, shared with the
/// handler name in the primary key) and within any SQLite page. A message whose key is
/// longer is dead-lettered [`invalid_key`](crate::DeadLetterReason::InvalidKey).
pub const MAX_KEY_BYTES: usize = 512;

/// Checks that a derived key can be stored in the inbox: not empty, at most
/// [`MAX_KEY_BYTES`] bytes, and no control character (PostgreSQL refuses a NUL in text; the
/// other control characters make keys no log or header shows faithfully). `Err` is the reason,
/// with the start of the key escaped.
pub(crate) fn check_key(key: &str) -> Result<(), String> {
    if key.is_empty() {
        return Err("the key is empty".to_owned());
    }
    if key.len() > MAX_KEY_BYTES {
        return Err(format!(
            "the key is {} bytes, over the limit of {MAX_KEY_BYTES} bytes; it starts {}",
            key.len(),
            preview(key)
        ));
    }
    if let Some((at, c)) = key.char_indices().find(|(_, c)| c.is_control()) {
        return Err(format!(
            "the key holds the control character U+{:04X} at byte {at}: {}",
            u32::from(c),
            preview(key)
        ));
    }
    Ok(())
}

/// The first characters of a key, escaped, for an error message.
fn preview(key: &str) -> String {
    const CHARS: usize = 64;
    match key.char_indices().nth(CHARS) {
        Some((end, _)) => format!("{:?}…", &key[..end]),
        None => format!("{key:?}"),
    }
}

/// Whether the inbox database refused a statement for its input rather than failed: on
/// PostgreSQL a data exception (SQLSTATE class 22, e.g. `22021`, a NUL in text) or a program
/// limit (class 54, e.g. `54000`, an index entry too large); on SQLite `SQLITE_TOOBIG`. Such
/// an error repeats on every retry, so it is permanent. The inbox statements take no input
/// from a message but its key (the payload hash is hex, the numbers are bounded), so the
/// refusal is the key's. `Some` is the reason, naming the SQLSTATE or code.
pub(crate) fn refused_by_database(e: &sqlx::Error) -> Option<String> {
    let db = e.as_database_error()?;
    if let Some(pg) = db.try_downcast_ref::<sqlx::postgres::PgDatabaseError>() {
        let code = pg.code();
        return (code.starts_with("22") || code.starts_with("54")).then(|| {
            format!(
                "the inbox database refused the key: SQLSTATE {code}: {}",
                pg.message()
            )
        });
    }
    if db.try_downcast_ref::<sqlx::sqlite::SqliteError>().is_some() {
        // SQLITE_TOOBIG: a string or blob over the build's length limit.
        return (db.code().as_deref() == Some("18"))
            .then(|| format!("the inbox database refused the key: {}", db.message()));
    }
    None
}

/// A deterministic task key built from a message's fields, e.g. `invoice-{order_id}`.
///
/// `{field}` takes a top-level field, `{a.b}` a nested one. Strings are inserted as they are,
/// numbers and booleans in their JSON form; `{{` and `}}` are literal braces. The grammar is
/// `consumer-options`', which the `#[handler]` macro checks too: a template the macro accepts
/// always parses here.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KeyTemplate {
    source: String,
    segments: Vec<Segment>,
}

impl KeyTemplate {
    /// Parses a template; the error names the `key` option.
    pub fn parse(template: &str) -> Result<Self, Error> {
        Self::parse_inner(template).map_err(|reason| Error::config("key", reason))
    }

    /// [`KeyTemplate::parse`] with the reason as plain text, for a caller that reports it in
    /// its own error.
    #[doc(hidden)]
    pub fn parse_inner(template: &str) -> Result<Self, String> {
        let segments = consumer_options::parse_key_template(template).map_err(|e| e.to_string())?;
        Ok(KeyTemplate {
            source: template.to_owned(),
            segments,
        })
    }

    /// The template as written.
    pub fn as_str(&self) -> &str {
        &self.source
    }

    /// Renders the key from a decoded payload. `Err` names the missing field.
    pub fn render(&self, payload: &Value) -> Result<String, String> {
        let mut out = String::new();
        for segment in &self.segments {
            match segment {
                Segment::Literal(s) => out.push_str(s),
                Segment::Field(path) => {
                    let mut v = payload;
                    for name in path {
                        v = v
                            .get(name)
                            .ok_or_else(|| format!("field `{}` is missing", path.join(".")))?;
                    }
                    match v {
                        Value::String(s) => out.push_str(s),
                        Value::Number(n) => out.push_str(&n.to_string()),
                        Value::Bool(b) => out.push_str(if *b { "true" } else { "false" }),
                        _ => {
                            return Err(format!(
                                "field `{}` is not a string, number or boolean",
                                path.join(".")
                            ))
                        }
                    }
                }
            }
        }
        Ok(out)
    }
}

/// SHA-256 (hex) of the payload's canonical JSON: object keys sorted, no insignificant
/// white space. Two payloads that differ only in key order or spacing hash the same.
///
/// The one owner of the canonical form: the inbox's payload hash of a message, and the
/// request fingerprint of `consumer-http`, are both this function. Stored hashes depend on
/// its exact bytes, so it never changes.
pub fn canonical_hash(payload: &Value) -> String {
    PayloadHash::of(payload).as_str().to_owned()
}

/// [`canonical_hash`] held inline, as a job carries it through the pipeline: 64 lowercase
/// hex characters, without an allocation a delivery.
pub(crate) struct PayloadHash([u8; 64]);

impl PayloadHash {
    /// The canonical hash of `payload`.
    pub(crate) fn of(payload: &Value) -> Self {
        // Serialised straight into the hasher: no sorted copy of the payload, no byte
        // buffer. serde_json's `Map` is a BTreeMap unless `preserve_order` is on;
        // `Canonical` sorts the keys itself, so the bytes do not depend on that feature.
        let mut hasher = HashWriter(Sha256::new());
        let digest: [u8; 32] = if serde_json::to_writer(&mut hasher, &Canonical(payload)).is_ok() {
            hasher.0.finalize().into()
        } else {
            // Unreachable: a `Value` always serialises and the writer never fails.
            Sha256::digest(b"").into()
        };
        PayloadHash::hex(digest)
    }

    /// The canonical hash of a payload whose bytes are already its canonical form (see
    /// [`crate::canonical::is_canonical`]): the hash of the bytes as they are.
    pub(crate) fn of_canonical(payload: &[u8]) -> Self {
        PayloadHash::hex(Sha256::digest(payload).into())
    }

    /// The digest's 64 hex digits, a byte's two at a time (the hot path: once a delivery).
    fn hex(digest: [u8; 32]) -> Self {
        let mut hex = [0; 64];
        for (digits, byte) in hex.chunks_exact_mut(2).zip(digest) {
            digits.copy_from_slice(&HEX_PAIRS[usize::from(byte)]);
        }
        PayloadHash(hex)
    }

    /// The 64 hex characters.
    pub(crate) fn as_str(&self) -> &str {
        // Always ASCII hex digits.
        std::str::from_utf8(&self.0).unwrap_or_default()
    }
}

/// Every byte's two lowercase hex digits, by the byte.
const HEX_PAIRS: [[u8; 2]; 256] = {
    const DIGITS: &[u8; 16] = b"0123456789abcdef";
    let mut pairs = [[0; 2]; 256];
    let mut byte = 0;
    while byte < 256 {
        pairs[byte] = [DIGITS[byte >> 4], DIGITS[byte & 0xf]];
        byte += 1;
    }
    pairs
};

/// A `Value` serialised with object keys in sorted order.
struct Canonical<'a>(&'a Value);

impl serde::Serialize for Canonical<'_> {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        use serde::ser::{SerializeMap, SerializeSeq};
        match self.0 {
            Value::Object(map) => {
                let mut m = s.serialize_map(Some(map.len()))?;
                // Without `preserve_order` the map iterates in key order already.
                if map.keys().is_sorted() {
                    for (k, v) in map {
                        m.serialize_entry(k, &Canonical(v))?;
                    }
                } else {
                    let mut entries: Vec<(&String, &Value)> = map.iter().collect();
                    entries.sort_by(|a, b| a.0.cmp(b.0));
                    for (k, v) in entries {
                        m.serialize_entry(k, &Canonical(v))?;
                    }
                }
                m.end()
            }
            Value::Array(items) => {
                let mut seq = s.serialize_seq(Some(items.len()))?;
                for v in items {
                    seq.serialize_element(&Canonical(v))?;
                }
                seq.end()
            }
            other => other.serialize(s),
        }
    }
}

/// Feeds serialised bytes to the hash.
struct HashWriter(Sha256);

impl std::io::Write for HashWriter {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.update(buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// SHA-256 of length-prefixed parts.
pub(crate) fn sha256(parts: &[&[u8]]) -> [u8; 32] {
    let mut h = Sha256::new();
    for p in parts {
        h.update((p.len() as u64).to_be_bytes());
        h.update(p);
    }
    h.finalize().into()
}

/// SHA-256 (hex) of raw bytes: the payload fingerprint for non-JSON-equal comparisons.
pub(crate) fn sha256_hex(parts: &[&[u8]]) -> String {
    hex::encode(sha256(parts))
}

/// The key [`idempotency_key`](crate::guard::idempotency_key) returns: SHA-256 of the
/// length-prefixed parts, in hex, after `ik-`.
pub(crate) fn idempotency_key(handler: &str, key: &str, effect: &str) -> String {
    format!(
        "ik-{}",
        sha256_hex(&[handler.as_bytes(), key.as_bytes(), effect.as_bytes()])
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn idempotency_keys_are_stable_and_distinct() {
        let a = idempotency_key("send_email", "invoice-1", "email");
        assert_eq!(a, idempotency_key("send_email", "invoice-1", "email"));
        assert_eq!(a.len(), 3 + 64);
        assert_ne!(a, idempotency_key("send_email", "invoice-1", "sms"));
        // Length-prefixed parts: moving a boundary changes the key.
        assert_ne!(
            idempotency_key("ab", "c", "e"),
            idempotency_key("a", "bc", "e")
        );
    }

    #[test]
    fn renders_fields_and_nested_fields() {
        let t = KeyTemplate::parse("invoice-{order_id}-{customer.id}").unwrap();
        let key = t
            .render(&json!({"order_id": 42, "customer": {"id": "c7"}}))
            .unwrap();
        assert_eq!(key, "invoice-42-c7");
    }

    #[test]
    fn missing_field_is_an_error_naming_it() {
        let t = KeyTemplate::parse("invoice-{order_id}").unwrap();
        let err = t.render(&json!({"amount": 1})).unwrap_err();
        assert!(err.contains("order_id"), "{err}");
    }

    #[test]
    fn rejects_bad_templates() {
        for bad in ["invoice", "a-{", "a-}", "{}", "{a..b}", "{a b}"] {
            assert!(KeyTemplate::parse(bad).is_err(), "{bad}");
        }
        assert_eq!(
            KeyTemplate::parse("{{x}}-{id}")
                .unwrap()
                .render(&json!({"id": 1}))
                .unwrap(),
            "{x}-1"
        );
    }

    #[test]
    fn a_bad_template_names_the_option_and_the_reason() {
        let err = KeyTemplate::parse("invoice-{order_id").unwrap_err();
        assert_eq!(
            err.to_string(),
            "invalid configuration `key`: unclosed `{` in key template \"invoice-{order_id\" \
             (write `{{` for a literal brace)"
        );
    }

    #[test]
    fn keys_the_inbox_cannot_hold_are_refused_with_the_reason() {
        assert_eq!(check_key("invoice-42"), Ok(()));
        assert_eq!(check_key(&"é".repeat(MAX_KEY_BYTES / 2)), Ok(()));
        assert_eq!(check_key(""), Err("the key is empty".to_owned()));
        let nul = check_key("a\0b").unwrap_err();
        assert!(
            nul.contains("U+0000 at byte 1") && nul.contains(r#""a\0b""#),
            "{nul}"
        );
        let tab = check_key("a\tb").unwrap_err();
        assert!(tab.contains("U+0009"), "{tab}");
        let long = check_key(&"x".repeat(MAX_KEY_BYTES + 1)).unwrap_err();
        assert!(long.contains("513 bytes") && long.contains("…"), "{long}");
        // Counted in bytes, not characters.
        assert!(check_key(&"é".repeat(MAX_KEY_BYTES / 2 + 1)).is_err());
    }

    #[test]
    fn canonical_hash_is_sha256_of_sorted_compact_json() {
        // The stored hashes of earlier versions must still match: pin the exact bytes hashed.
        let v: Value = serde_json::from_str(r#"{ "b": [ {"y": 1, "x": "é\n"} ], "a": null }"#)
            .expect("valid json");
        let bytes = r#"{"a":null,"b":[{"x":"é\n","y":1}]}"#;
        assert_eq!(
            canonical_hash(&v),
            hex::encode(Sha256::digest(bytes.as_bytes()))
        );
    }

    #[test]
    fn a_hash_spells_every_byte_in_two_lowercase_hex_digits() {
        // Eight digests that hold every byte value between them.
        for first in (0..=255u8).step_by(32) {
            let digest: [u8; 32] = std::array::from_fn(|i| first + i as u8);
            assert_eq!(PayloadHash::hex(digest).as_str(), hex::encode(digest));
        }
    }

    /// A JSON text of random shape and spelling: keys in any order and sometimes repeated,
    /// numbers in every spelling, strings with and without escapes, white space now and
    /// then. Some are canonical, most are not; a few are not JSON.
    fn random_json(seed: &mut u64, depth: u32, out: &mut String) {
        fn roll(seed: &mut u64, n: u64) -> u64 {
            *seed ^= *seed << 13;
            *seed ^= *seed >> 7;
            *seed ^= *seed << 17;
            *seed % n
        }
        const SCALARS: [&str; 22] = [
            "0",
            "7",
            "-3",
            "-0",
            "01",
            "1.0",
            "1e2",
            "2E-1",
            "18446744073709551615",
            "18446744073709551616",
            "-9223372036854775808",
            "-9223372036854775809",
            "true",
            "false",
            "null",
            r#""x""#,
            "\"é/\u{7f}\"",
            r#""a\"b""#,
            r#""\u00e9""#,
            r#""\n""#,
            r#""\/""#,
            r#""""#,
        ];
        const KEYS: [&str; 6] = ["a", "b", "ab", "", "é", "B"];
        let shape = if depth > 3 { 2 } else { roll(seed, 4) };
        match shape {
            0 => {
                out.push('{');
                for i in 0..roll(seed, 4) {
                    if i > 0 {
                        out.push(',');
                    }
                    out.push_str(&format!("{:?}", KEYS[roll(seed, 6) as usize]));
                    if roll(seed, 20) == 0 {
                        out.push(' ');
                    }
                    out.push(':');
                    random_json(seed, depth + 1, out);
                }
                out.push('}');
            }
            1 => {
                out.push('[');
                for i in 0..roll(seed, 4) {
                    if i > 0 {
                        out.push(',');
                    }
                    random_json(seed, depth + 1, out);
                }
                out.push(']');
            }
            _ => out.push_str(SCALARS[roll(seed, 22) as usize]),
        }
        if roll(seed, 30) == 0 {
            out.push(' ');
        }
    }

    #[test]
    fn a_payload_taken_as_canonical_hashes_as_its_tree_does() {
        let (mut seed, mut canonical, mut json) = (0x9e37_79b9_7f4a_7c15_u64, 0, 0);
        for _ in 0..20_000 {
            let mut text = String::new();
            random_json(&mut seed, 0, &mut text);
            let tree = serde_json::from_str::<Value>(&text);
            json += usize::from(tree.is_ok());
            if !crate::canonical::is_canonical(text.as_bytes()) {
                continue;
            }
            canonical += 1;
            let tree =
                tree.unwrap_or_else(|e| panic!("taken as canonical, not JSON: {text} ({e})"));
            assert_eq!(
                PayloadHash::of_canonical(text.as_bytes()).as_str(),
                PayloadHash::of(&tree).as_str(),
                "{text}"
            );
        }
        // Both kinds came up often enough for the check to mean something.
        assert!(
            canonical > 2_000 && json - canonical > 2_000,
            "{canonical} of {json}"
        );
    }

    #[test]
    fn canonical_hash_ignores_key_order_and_spacing() {
        let a: Value = serde_json::from_str(r#"{"b":1,"a":{"y":2,"x":[1,2]}}"#).unwrap();
        let b: Value = serde_json::from_str(r#"{ "a": {"x": [1, 2], "y": 2}, "b": 1 }"#).unwrap();
        assert_eq!(canonical_hash(&a), canonical_hash(&b));
        let c: Value = serde_json::from_str(r#"{"b":2,"a":{"y":2,"x":[1,2]}}"#).unwrap();
        assert_ne!(canonical_hash(&a), canonical_hash(&c));
    }
}
