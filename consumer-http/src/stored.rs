//! A stored response: status, selected headers and body, and the replay built from it.

use axum::body::Body;
use axum::response::Response;
use bytes::Bytes;
use http::{HeaderMap, HeaderName, HeaderValue, StatusCode};

/// The header a replayed answer carries.
pub const IDEMPOTENT_REPLAYED: &str = "idempotent-replayed";

/// A completed request's answer as the store holds it.
#[derive(Debug, Clone, PartialEq, Eq)]
#[doc(hidden)]
pub struct StoredResponse {
    pub(crate) status: u16,
    pub(crate) headers: Vec<(HeaderName, HeaderValue)>,
    pub(crate) body: Bytes,
}

impl StoredResponse {
    /// The parts of an answer the store keeps: its status, the `selected` headers it has
    /// (every value of each), and its body.
    pub(crate) fn capture(
        status: StatusCode,
        headers: &HeaderMap,
        selected: &[HeaderName],
        body: Bytes,
    ) -> Self {
        let mut kept = Vec::new();
        for name in selected {
            for value in headers.get_all(name) {
                kept.push((name.clone(), value.clone()));
            }
        }
        StoredResponse {
            status: status.as_u16(),
            headers: kept,
            body,
        }
    }

    /// The replay: the stored status, headers and body, and `Idempotent-Replayed: true`.
    pub(crate) fn replay(&self) -> Response {
        let mut response = Response::new(Body::from(self.body.clone()));
        *response.status_mut() =
            StatusCode::from_u16(self.status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
        let headers = response.headers_mut();
        for (name, value) in &self.headers {
            headers.append(name.clone(), value.clone());
        }
        headers.insert(IDEMPOTENT_REPLAYED, HeaderValue::from_static("true"));
        response
    }

    /// The headers as one column: for each, the name's length (u16), the name, the value's
    /// length (u32) and the value, big-endian. Values are kept as bytes, so any value
    /// replays exactly.
    pub(crate) fn encode_headers(&self) -> Vec<u8> {
        let mut out = Vec::new();
        for (name, value) in &self.headers {
            let (n, v) = (name.as_str().as_bytes(), value.as_bytes());
            out.extend_from_slice(&(n.len() as u16).to_be_bytes());
            out.extend_from_slice(n);
            out.extend_from_slice(&(v.len() as u32).to_be_bytes());
            out.extend_from_slice(v);
        }
        out
    }

    /// Reads [`StoredResponse::encode_headers`]' column back; `None` if it is malformed.
    pub(crate) fn decode_headers(mut bytes: &[u8]) -> Option<Vec<(HeaderName, HeaderValue)>> {
        fn take<'a>(bytes: &mut &'a [u8], n: usize) -> Option<&'a [u8]> {
            if bytes.len() < n {
                return None;
            }
            let (head, rest) = bytes.split_at(n);
            *bytes = rest;
            Some(head)
        }
        let mut headers = Vec::new();
        while !bytes.is_empty() {
            let n = u16::from_be_bytes(take(&mut bytes, 2)?.try_into().ok()?);
            let name = HeaderName::from_bytes(take(&mut bytes, n.into())?).ok()?;
            let v = u32::from_be_bytes(take(&mut bytes, 4)?.try_into().ok()?);
            let value = HeaderValue::from_bytes(take(&mut bytes, v as usize)?).ok()?;
            headers.push((name, value));
        }
        Some(headers)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn headers_round_trip_byte_for_byte() {
        let mut map = HeaderMap::new();
        map.insert("content-type", HeaderValue::from_static("application/json"));
        map.append("x-a", HeaderValue::from_static("1"));
        map.append("x-a", HeaderValue::from_bytes(b"\xff2").unwrap());
        map.insert("x-not-kept", HeaderValue::from_static("n"));
        let selected = [http::header::CONTENT_TYPE, HeaderName::from_static("x-a")];
        let stored = StoredResponse::capture(StatusCode::CREATED, &map, &selected, Bytes::new());
        assert_eq!(stored.headers.len(), 3);
        let decoded = StoredResponse::decode_headers(&stored.encode_headers()).unwrap();
        assert_eq!(decoded, stored.headers);
        assert_eq!(StoredResponse::decode_headers(&[0, 5, b'a']), None);
        let replay = stored.replay();
        assert_eq!(replay.status(), StatusCode::CREATED);
        assert_eq!(replay.headers()[IDEMPOTENT_REPLAYED], "true");
        assert!(replay.headers().get("x-not-kept").is_none());
    }
}
