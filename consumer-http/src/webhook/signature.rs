//! The signature check: a Stripe-style header `t=<unix seconds>,v1=<hex HMAC-SHA256>`,
//! the HMAC taken over `<t>.<body>` with one of the configured secrets, and the timestamp
//! within the tolerance of the receiver's clock. Pure: the clock is an argument.

use std::fmt;
use std::time::Duration;

use hmac::{Hmac, Mac};
use sha2::Sha256;

type HmacSha256 = Hmac<Sha256>;

/// The longest signature header read, in bytes: a timestamp and a handful of `v1` entries
/// fit with room to spare; anything longer is refused before any HMAC is computed.
const MAX_HEADER_BYTES: usize = 4096;

/// The most `v1` entries compared: enough for a provider that signs with every secret it
/// is rotating through, few enough that a crafted header cannot buy many HMAC checks.
const MAX_SIGNATURES: usize = 8;

/// An HMAC key. Its bytes never appear in `Debug` output, logs or errors.
#[derive(Clone)]
pub(crate) struct Secret(Vec<u8>);

impl Secret {
    pub(crate) fn new(bytes: &[u8]) -> Self {
        Secret(bytes.to_vec())
    }

    pub(crate) fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    fn mac(&self) -> HmacSha256 {
        // An HMAC takes a key of any length; the error type exists for other MACs.
        <HmacSha256 as Mac>::new_from_slice(&self.0).unwrap_or_else(|_| unreachable!())
    }
}

impl fmt::Debug for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Secret(<redacted>)")
    }
}

/// Why a request's signature was refused (a 401). The text is safe to send back: it
/// names what was wrong, never a secret or an expected tag.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Refused {
    /// No signature header, or more than one.
    Missing,
    /// The header is not `t=<unix seconds>,v1=<hex>[,v1=<hex>…]`.
    Malformed(&'static str),
    /// No `v1` entry is the HMAC of the timestamp and body under any secret.
    NoMatch,
    /// The signature is valid but its timestamp is further from now than the tolerance.
    OutsideTolerance,
}

impl fmt::Display for Refused {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Refused::Missing => {
                f.write_str("the request has no signature header, or more than one")
            }
            Refused::Malformed(why) => write!(f, "the signature header is malformed: {why}"),
            Refused::NoMatch => f.write_str("no signature matches the timestamp and body"),
            Refused::OutsideTolerance => {
                f.write_str("the signature's timestamp is outside the tolerance window")
            }
        }
    }
}

/// A parsed signature header: the timestamp and the `v1` tags (decoded from hex).
#[derive(Debug, PartialEq, Eq)]
struct Header {
    timestamp: i64,
    tags: Vec<Vec<u8>>,
}

/// Parses `t=<unix seconds>,v1=<hex>[,v1=<hex>…]`. Entries of other schemes (`v0=…`) are
/// ignored, as a provider may send them beside `v1`; a `v1` entry that is not hex is
/// refused, since no secret could match it.
fn parse(header: &[u8]) -> Result<Header, Refused> {
    if header.len() > MAX_HEADER_BYTES {
        return Err(Refused::Malformed("longer than 4096 bytes"));
    }
    let header = std::str::from_utf8(header).map_err(|_| Refused::Malformed("not UTF-8"))?;
    let mut timestamp = None;
    let mut tags = Vec::new();
    for entry in header.split(',') {
        let Some((name, value)) = entry.trim().split_once('=') else {
            return Err(Refused::Malformed("an entry is not `name=value`"));
        };
        match name.trim() {
            "t" => {
                if timestamp.is_some() {
                    return Err(Refused::Malformed("more than one `t`"));
                }
                let t = value
                    .trim()
                    .parse::<i64>()
                    .map_err(|_| Refused::Malformed("`t` is not a whole number of seconds"))?;
                timestamp = Some(t);
            }
            "v1" => {
                if tags.len() == MAX_SIGNATURES {
                    return Err(Refused::Malformed("more than 8 `v1` entries"));
                }
                let tag = hex::decode(value.trim())
                    .map_err(|_| Refused::Malformed("a `v1` entry is not hex"))?;
                tags.push(tag);
            }
            _ => {}
        }
    }
    let timestamp = timestamp.ok_or(Refused::Malformed("no `t` entry"))?;
    if tags.is_empty() {
        return Err(Refused::Malformed("no `v1` entry"));
    }
    Ok(Header { timestamp, tags })
}

/// Checks `header` against `body`: some `v1` tag must be the HMAC-SHA256 of `<t>.<body>`
/// under one of `secrets`, compared in constant time, and `t` must lie within `tolerance`
/// of `now` (unix seconds), in the past or the future. Returns the timestamp.
///
/// The tags are checked before the timestamp, so a forged request is told its signature is
/// wrong rather than that its clock is; both are 401.
pub(crate) fn verify(
    secrets: &[Secret],
    header: &[u8],
    body: &[u8],
    tolerance: Duration,
    now: i64,
) -> Result<i64, Refused> {
    let Header { timestamp, tags } = parse(header)?;
    let signed = |secret: &Secret| {
        let mut mac = secret.mac();
        mac.update(timestamp.to_string().as_bytes());
        mac.update(b".");
        mac.update(body);
        mac
    };
    // Every secret against every tag, without stopping at the first match, so the time
    // taken says nothing about which secret or which tag matched.
    let mut matched = false;
    for secret in secrets {
        let mac = signed(secret);
        for tag in &tags {
            matched |= mac.clone().verify_slice(tag).is_ok();
        }
    }
    if !matched {
        return Err(Refused::NoMatch);
    }
    if now.abs_diff(timestamp) > tolerance.as_secs() {
        return Err(Refused::OutsideTolerance);
    }
    Ok(timestamp)
}

/// The signature header value a provider sends for `body` at `timestamp` (unix seconds):
/// `t=<timestamp>,v1=<hex HMAC-SHA256 of "<timestamp>.<body>" under secret>`.
///
/// For tests of a webhook handler and for a sender inside your own system; the ingress
/// accepts what this makes (within the tolerance of `timestamp`).
pub fn sign(secret: &[u8], timestamp: i64, body: &[u8]) -> String {
    let mut mac = Secret::new(secret).mac();
    mac.update(timestamp.to_string().as_bytes());
    mac.update(b".");
    mac.update(body);
    format!(
        "t={timestamp},v1={}",
        hex::encode(mac.finalize().into_bytes())
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    const NOW: i64 = 1_700_000_000;
    const FIVE_MIN: Duration = Duration::from_secs(300);

    fn secrets(keys: &[&str]) -> Vec<Secret> {
        keys.iter().map(|k| Secret::new(k.as_bytes())).collect()
    }

    #[test]
    fn sign_matches_an_independent_hmac() {
        // Computed with Python's hmac module:
        // hmac.new(b"whsec_test", b"1700000000.{\"id\":\"evt_1\"}", sha256).hexdigest()
        let header = sign(b"whsec_test", NOW, br#"{"id":"evt_1"}"#);
        assert_eq!(
            header,
            "t=1700000000,v1=c89214b5b5da833daed6f0b8c5bb6bd58cea9022bd80ccc78230f3942d632925"
        );
    }

    #[test]
    fn a_signature_under_any_secret_within_the_tolerance_passes() {
        let body = br#"{"id":"evt_1"}"#;
        let header = sign(b"new", NOW - 299, body);
        let keys = secrets(&["old", "new"]);
        assert_eq!(
            verify(&keys, header.as_bytes(), body, FIVE_MIN, NOW),
            Ok(NOW - 299)
        );
        // A future timestamp within the tolerance too (the sender's clock runs ahead).
        let ahead = sign(b"old", NOW + 300, body);
        assert!(verify(&keys, ahead.as_bytes(), body, FIVE_MIN, NOW).is_ok());
        // Several v1 entries, one of them right, and another scheme's entry beside them.
        let right = sign(b"new", NOW, body);
        let tag = right.split_once(",v1=").unwrap().1;
        let several = format!("t={NOW}, v0=zz, v1={}, v1={tag}", "00".repeat(32));
        assert!(verify(&keys, several.as_bytes(), body, FIVE_MIN, NOW).is_ok());
    }

    #[test]
    fn a_wrong_secret_body_or_timestamp_is_no_match() {
        let body = br#"{"id":"evt_1"}"#;
        let keys = secrets(&["right"]);
        let wrong_secret = sign(b"wrong", NOW, body);
        assert_eq!(
            verify(&keys, wrong_secret.as_bytes(), body, FIVE_MIN, NOW),
            Err(Refused::NoMatch)
        );
        let header = sign(b"right", NOW, body);
        assert_eq!(
            verify(
                &keys,
                header.as_bytes(),
                br#"{"id":"evt_2"}"#,
                FIVE_MIN,
                NOW
            ),
            Err(Refused::NoMatch)
        );
        // The tag of one timestamp under another: the timestamp is signed too.
        let moved = header.replacen(&format!("t={NOW}"), &format!("t={}", NOW + 1), 1);
        assert_eq!(
            verify(&keys, moved.as_bytes(), body, FIVE_MIN, NOW),
            Err(Refused::NoMatch)
        );
        // A truncated tag never matches.
        let short = &header[..header.len() - 2];
        assert_eq!(
            verify(&keys, short.as_bytes(), body, FIVE_MIN, NOW),
            Err(Refused::NoMatch)
        );
    }

    #[test]
    fn a_valid_signature_outside_the_tolerance_is_refused() {
        let body = b"{}";
        let keys = secrets(&["k"]);
        for t in [NOW - 301, NOW + 301, 0, i64::MIN, i64::MAX] {
            let header = sign(b"k", t, body);
            assert_eq!(
                verify(&keys, header.as_bytes(), body, FIVE_MIN, NOW),
                Err(Refused::OutsideTolerance),
                "t = {t}"
            );
        }
    }

    #[test]
    fn malformed_headers_are_refused_before_any_hmac() {
        let keys = secrets(&["k"]);
        for header in [
            "",
            "v1=00",
            "t=1700000000",
            "t=abc,v1=00",
            "t=1,t=2,v1=00",
            "t=1700000000,v1=xyz",
            "t=1700000000;v1=00",
            "garbage",
        ] {
            assert!(
                matches!(
                    verify(&keys, header.as_bytes(), b"{}", FIVE_MIN, NOW),
                    Err(Refused::Malformed(_))
                ),
                "{header:?}"
            );
        }
        let many = format!("t={NOW}{}", ",v1=00".repeat(MAX_SIGNATURES + 1));
        assert!(matches!(
            verify(&keys, many.as_bytes(), b"{}", FIVE_MIN, NOW),
            Err(Refused::Malformed(_))
        ));
        let long = format!("t={NOW},v1={}", "0".repeat(MAX_HEADER_BYTES));
        assert!(matches!(
            verify(&keys, long.as_bytes(), b"{}", FIVE_MIN, NOW),
            Err(Refused::Malformed(_))
        ));
    }

    #[test]
    fn secrets_stay_out_of_debug_output() {
        let shown = format!("{:?}", secrets(&["whsec_do_not_print"]));
        assert!(!shown.contains("whsec"), "{shown}");
    }
}
