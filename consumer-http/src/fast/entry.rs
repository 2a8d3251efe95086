//! A completed record's answer as Redis holds it: the fingerprint it belongs to and the
//! stored answer, in one binary value.

use bytes::Bytes;

use crate::stored::StoredResponse;

/// The first byte of every value: a layout change bumps it, and an old value then reads
/// as a miss (the database answers) instead of as a wrong answer.
const VERSION: u8 = 1;

/// A cached answer: the request fingerprint it answers, and the answer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct CachedAnswer {
    pub(crate) fingerprint: String,
    pub(crate) stored: StoredResponse,
}

/// The value: the version, the fingerprint's length (u16) and bytes, the status (u16), the
/// headers' length (u32) and [`StoredResponse::encode_headers`], then the body, big-endian.
pub(crate) fn encode(fingerprint: &str, stored: &StoredResponse) -> Vec<u8> {
    let headers = stored.encode_headers();
    let mut out =
        Vec::with_capacity(1 + 2 + fingerprint.len() + 2 + 4 + headers.len() + stored.body.len());
    out.push(VERSION);
    out.extend_from_slice(&(fingerprint.len() as u16).to_be_bytes());
    out.extend_from_slice(fingerprint.as_bytes());
    out.extend_from_slice(&stored.status.to_be_bytes());
    out.extend_from_slice(&(headers.len() as u32).to_be_bytes());
    out.extend_from_slice(&headers);
    out.extend_from_slice(&stored.body);
    out
}

/// Reads [`encode`]'s value back; `None` if it is of another version or malformed.
pub(crate) fn decode(value: &[u8]) -> Option<CachedAnswer> {
    let (&version, rest) = value.split_first()?;
    if version != VERSION {
        return None;
    }
    let (n, rest) = split_u16(rest)?;
    let (fingerprint, rest) = split(rest, n.into())?;
    let fingerprint = std::str::from_utf8(fingerprint).ok()?.to_owned();
    let (status, rest) = split_u16(rest)?;
    let (n, rest) = split(rest, 4)?;
    let n = u32::from_be_bytes(n.try_into().ok()?) as usize;
    let (headers, body) = split(rest, n)?;
    Some(CachedAnswer {
        fingerprint,
        stored: StoredResponse {
            status,
            headers: StoredResponse::decode_headers(headers)?,
            body: Bytes::copy_from_slice(body),
        },
    })
}

fn split(bytes: &[u8], n: usize) -> Option<(&[u8], &[u8])> {
    (bytes.len() >= n).then(|| bytes.split_at(n))
}

fn split_u16(bytes: &[u8]) -> Option<(u16, &[u8])> {
    let (n, rest) = split(bytes, 2)?;
    Some((u16::from_be_bytes(n.try_into().ok()?), rest))
}

#[cfg(test)]
mod tests {
    use super::*;
    use http::{HeaderName, HeaderValue};

    #[test]
    fn an_answer_round_trips_and_a_damaged_value_is_a_miss() {
        let stored = StoredResponse {
            status: 201,
            headers: vec![
                (
                    http::header::CONTENT_TYPE,
                    HeaderValue::from_static("application/json"),
                ),
                (
                    HeaderName::from_static("location"),
                    HeaderValue::from_bytes(b"/p/\xff").unwrap_or_else(|_| unreachable!()),
                ),
            ],
            body: Bytes::from_static(b"{\"id\":1}"),
        };
        let value = encode("abc123", &stored);
        let cached = decode(&value).unwrap_or_else(|| unreachable!("it decodes"));
        assert_eq!(cached.fingerprint, "abc123");
        assert_eq!(cached.stored, stored);
        let mut other_version = value.clone();
        other_version[0] = VERSION + 1;
        assert_eq!(decode(&other_version), None);
        assert_eq!(decode(&value[..5]), None);
        assert_eq!(decode(&[]), None);
    }
}
