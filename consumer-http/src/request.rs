//! What the layer reads from a request: the `Idempotency-Key` (checked), the record's scope
//! (caller and route) and the request's fingerprint.

use http::request::Parts;
use sha2::{Digest, Sha256};

use crate::config::{KeyFormat, MAX_IDEMPOTENCY_KEY_BYTES};

/// The request header that carries the key.
pub const IDEMPOTENCY_KEY: &str = "idempotency-key";

/// Why a request's key was refused (a 400).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct InvalidKey(pub(crate) String);

/// The request's `Idempotency-Key`: `Ok(None)` if it has none; refused if it is repeated,
/// empty, longer than [`MAX_IDEMPOTENCY_KEY_BYTES`], or holds anything but printable
/// ASCII (space to `~`).
///
/// The key is a Structured Field string (RFC 9651), `"8e03…"`, as the IETF draft
/// `draft-ietf-httpapi-idempotency-key-header` writes it: its contents are the key
/// (parameters after it are ignored, escapes undone). A value that does not start with a
/// double quote is the key as it stands (the bare form many clients send): `"k"` and `k`
/// are one key. A value that starts with a double quote and is not a string is refused.
/// Last, the key must have the service's `format`.
pub(crate) fn idempotency_key(
    parts: &Parts,
    format: &KeyFormat,
) -> Result<Option<String>, InvalidKey> {
    let mut values = parts.headers.get_all(IDEMPOTENCY_KEY).iter();
    let Some(value) = values.next() else {
        return Ok(None);
    };
    if values.next().is_some() {
        return Err(InvalidKey(
            "the request has more than one Idempotency-Key header".to_owned(),
        ));
    }
    let raw = value.as_bytes();
    let quoted = raw.iter().find(|b| **b != b' ') == Some(&b'"');
    let string;
    let bytes = if quoted {
        string = structured_string(raw)?;
        string.as_bytes()
    } else {
        raw
    };
    if bytes.is_empty() {
        return Err(InvalidKey("the Idempotency-Key is empty".to_owned()));
    }
    if bytes.len() > MAX_IDEMPOTENCY_KEY_BYTES {
        return Err(InvalidKey(format!(
            "the Idempotency-Key is {} bytes, over the limit of {MAX_IDEMPOTENCY_KEY_BYTES}",
            bytes.len()
        )));
    }
    if let Some(at) = bytes.iter().position(|b| !(0x20..=0x7e).contains(b)) {
        return Err(InvalidKey(format!(
            "the Idempotency-Key holds a byte that is not printable ASCII at {at}"
        )));
    }
    // Checked above: every byte is printable ASCII.
    let key = String::from_utf8_lossy(bytes).into_owned();
    if !format.accepts(&key) {
        return Err(InvalidKey(format!(
            "the Idempotency-Key is not {}",
            format.description()
        )));
    }
    Ok(Some(key))
}

/// The contents of a header value that is a Structured Field string item (its parameters
/// ignored).
fn structured_string(raw: &[u8]) -> Result<String, InvalidKey> {
    let item: sfv::Item = sfv::Parser::new(raw).parse().map_err(|e| {
        InvalidKey(format!(
            "the Idempotency-Key starts with a double quote but is not a Structured Field string: {e}"
        ))
    })?;
    item.bare_item
        .as_string()
        .map(|s| s.as_str().to_owned())
        .ok_or_else(|| {
            InvalidKey("the Idempotency-Key is a Structured Field item but not a string".to_owned())
        })
}

/// The record's scope: the caller, if the layer scopes by caller (the hash
/// [`Callers`](crate::Callers) derives from its name: 64 hex digits, so it cannot spell a
/// route), and the route (method and path). A shared scope starts with `-`, a caller's with
/// `c:`.
pub(crate) fn scope(parts: &Parts, caller: Option<&str>) -> String {
    format!(
        "{}|{} {}",
        caller_part(caller),
        parts.method,
        parts.uri.path()
    )
}

/// The caller's part of `scope` (what [`caller_part`] gave it).
pub(crate) fn caller_part_of(scope: &str) -> &str {
    scope.split_once('|').map_or(scope, |(caller, _)| caller)
}

/// The caller's part of a scope (`c:` and the caller's hash, or `-` when shared): also the
/// owner of the operations its requests start, which the status route matches.
pub(crate) fn caller_part(caller: Option<&str>) -> String {
    match caller {
        Some(c) => format!("c:{c}"),
        None => "-".to_owned(),
    }
}

/// The request's fingerprint, SHA-256 (hex) of the length-prefixed method, path and query,
/// and body. A JSON body (`application/json` or `+json`, and parsable) counts by its
/// canonical form ([`consumer_core::key::canonical_hash`]: key order and white space do not
/// matter); any other body by its bytes.
pub(crate) fn fingerprint(parts: &Parts, body: &[u8]) -> String {
    let target = parts
        .uri
        .path_and_query()
        .map(|p| p.as_str())
        .unwrap_or("/");
    let body_form = match json_body(parts, body) {
        Some(value) => format!("json:{}", consumer_core::key::canonical_hash(&value)),
        None => format!("raw:{}", hex::encode(Sha256::digest(body))),
    };
    let mut h = Sha256::new();
    for part in [parts.method.as_str(), target, &body_form] {
        h.update((part.len() as u64).to_be_bytes());
        h.update(part.as_bytes());
    }
    hex::encode(h.finalize())
}

/// The body as JSON, if the request says it is JSON and it parses.
fn json_body(parts: &Parts, body: &[u8]) -> Option<serde_json::Value> {
    let content_type = parts
        .headers
        .get(http::header::CONTENT_TYPE)?
        .to_str()
        .ok()?;
    let essence = content_type.split(';').next()?.trim().to_ascii_lowercase();
    let is_json = essence == "application/json" || essence.ends_with("+json");
    if !is_json {
        return None;
    }
    serde_json::from_slice(body).ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parts(method: &str, uri: &str, headers: &[(&str, &str)]) -> Parts {
        let mut b = http::Request::builder().method(method).uri(uri);
        for (k, v) in headers {
            b = b.header(*k, *v);
        }
        b.body(()).unwrap().into_parts().0
    }

    #[test]
    fn keys_are_checked() {
        assert_eq!(
            idempotency_key(&parts("POST", "/", &[]), &KeyFormat::any()),
            Ok(None)
        );
        let ok = parts("POST", "/", &[("Idempotency-Key", "abc-123 x")]);
        assert_eq!(
            idempotency_key(&ok, &KeyFormat::any()),
            Ok(Some("abc-123 x".to_owned()))
        );
        let long = "k".repeat(MAX_IDEMPOTENCY_KEY_BYTES + 1);
        let too_long = parts("POST", "/", &[("Idempotency-Key", &long)]);
        assert!(matches!(
            idempotency_key(&too_long, &KeyFormat::any()),
            Err(InvalidKey(_))
        ));
        let max = "k".repeat(MAX_IDEMPOTENCY_KEY_BYTES);
        assert!(idempotency_key(
            &parts("POST", "/", &[("Idempotency-Key", &max)]),
            &KeyFormat::any()
        )
        .is_ok());
        let mut tab = parts("POST", "/", &[]);
        tab.headers.insert(
            IDEMPOTENCY_KEY,
            http::HeaderValue::from_bytes(b"a\tb").unwrap(),
        );
        assert!(matches!(
            idempotency_key(&tab, &KeyFormat::any()),
            Err(InvalidKey(_))
        ));
        let mut high = parts("POST", "/", &[]);
        high.headers.insert(
            IDEMPOTENCY_KEY,
            http::HeaderValue::from_bytes("é".as_bytes()).unwrap(),
        );
        assert!(matches!(
            idempotency_key(&high, &KeyFormat::any()),
            Err(InvalidKey(_))
        ));
    }

    fn key_of(value: &str) -> Result<Option<String>, InvalidKey> {
        idempotency_key(
            &parts("POST", "/", &[("Idempotency-Key", value)]),
            &KeyFormat::any(),
        )
    }

    #[test]
    fn a_key_of_another_format_than_the_services_is_refused() {
        let uuid = KeyFormat::uuid();
        let key = |v: &str| idempotency_key(&parts("POST", "/", &[("Idempotency-Key", v)]), &uuid);
        let id = "8e03978e-40d5-43e8-bc93-6894a57f9324";
        assert_eq!(key(id), Ok(Some(id.to_owned())));
        assert_eq!(key(&format!("\"{id}\"")), Ok(Some(id.to_owned())));
        match key("order-7") {
            Err(InvalidKey(detail)) => assert!(detail.contains("UUID"), "{detail}"),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn a_structured_field_string_is_the_key_it_holds() {
        assert_eq!(key_of(r#""abc-123""#), Ok(Some("abc-123".to_owned())));
        assert_eq!(key_of(r#""abc-123""#), key_of("abc-123"));
        // Escapes undone, parameters ignored, white space around the item dropped.
        assert_eq!(key_of(r#""a\"b\\c""#), Ok(Some(r#"a"b\c"#.to_owned())));
        assert_eq!(key_of(r#""abc";v=1;x"#), Ok(Some("abc".to_owned())));
        assert_eq!(key_of(r#" "abc" "#), Ok(Some("abc".to_owned())));
        // A quote inside a bare key is part of it.
        assert_eq!(key_of(r#"a"b"#), Ok(Some(r#"a"b"#.to_owned())));
        // Not a string: refused, not taken as it stands.
        for bad in [r#""abc"#, r#""abc" x"#, r#""a\qb""#, r#""""#] {
            assert!(matches!(key_of(bad), Err(InvalidKey(_))), "{bad}");
        }
        let long = format!("\"{}\"", "k".repeat(MAX_IDEMPOTENCY_KEY_BYTES + 1));
        assert!(matches!(key_of(&long), Err(InvalidKey(_))));
        let max = format!("\"{}\"", "k".repeat(MAX_IDEMPOTENCY_KEY_BYTES));
        assert!(key_of(&max).is_ok());
    }

    #[test]
    fn scopes_of_callers_and_routes_differ() {
        let p = parts("POST", "/a/b?x=1", &[]);
        assert_eq!(scope(&p, None), "-|POST /a/b");
        assert_ne!(scope(&p, Some("c1")), scope(&p, Some("c2")));
        assert_ne!(scope(&p, Some("c1")), scope(&p, None));
        assert_ne!(
            scope(&p, Some("c1")),
            scope(&parts("POST", "/a", &[]), Some("c1"))
        );
    }

    #[test]
    fn json_bodies_count_by_canonical_form() {
        let json = parts("POST", "/p", &[("content-type", "application/json")]);
        assert_eq!(
            fingerprint(&json, br#"{"a":1,"b":[1,2]}"#),
            fingerprint(&json, br#"{ "b": [1, 2], "a": 1 }"#)
        );
        assert_ne!(
            fingerprint(&json, br#"{"a":1}"#),
            fingerprint(&json, br#"{"a":2}"#)
        );
        let text = parts("POST", "/p", &[("content-type", "text/plain")]);
        assert_ne!(
            fingerprint(&text, b"{\"a\":1}"),
            fingerprint(&text, b"{ \"a\":1}")
        );
        assert_ne!(
            fingerprint(&parts("POST", "/p?x=1", &[]), b""),
            fingerprint(&parts("POST", "/p?x=2", &[]), b"")
        );
        assert_ne!(
            fingerprint(&parts("POST", "/p", &[]), b""),
            fingerprint(&parts("PATCH", "/p", &[]), b"")
        );
    }
}
