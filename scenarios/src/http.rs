//! An HTTP answer read whole, for the tests that call an `Idempotency-Key` route or a
//! webhook route over a real connection (consumer-http's own tests, and the workspace tests
//! of `examples/payments`). With the `http` feature.

use bytes::Bytes;
use reqwest::header::HeaderMap;
use serde_json::{json, Value};

/// A response, read whole.
#[derive(Debug, Clone)]
pub struct Answer {
    /// The status code.
    pub status: u16,
    /// The response headers.
    pub headers: HeaderMap,
    /// The body, byte for byte (what a replay must reproduce).
    pub body: Bytes,
}

impl Answer {
    /// Reads `response` to its end.
    pub async fn read(response: reqwest::Response) -> reqwest::Result<Answer> {
        let status = response.status().as_u16();
        let headers = response.headers().clone();
        Ok(Answer {
            status,
            headers,
            body: response.bytes().await?,
        })
    }

    /// Whether the layer replayed a stored answer (`Idempotent-Replayed: true`).
    pub fn replayed(&self) -> bool {
        self.headers
            .get("idempotent-replayed")
            .is_some_and(|v| v == "true")
    }

    /// The header `name`, if it is there and text.
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.get(name).and_then(|v| v.to_str().ok())
    }

    /// The body as JSON.
    pub fn json(&self) -> Value {
        serde_json::from_slice(&self.body).unwrap_or_else(|e| panic!("a JSON body ({e}): {self:?}"))
    }

    /// An `application/problem+json` answer with `status`.
    pub fn assert_problem(&self, status: u16) {
        assert_eq!(self.status, status, "{self:?}");
        assert_eq!(
            self.header("content-type"),
            Some("application/problem+json"),
            "{self:?}"
        );
        assert_eq!(self.json()["status"], json!(status), "{self:?}");
    }
}
