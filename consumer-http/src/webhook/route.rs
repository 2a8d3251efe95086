//! The HTTP side of the ingress: one request checked (size, signature and timestamp, JSON
//! and event id, in that order, before anything reaches the worker), then handed to the
//! worker as a delivery, and answered by its settlement.

use std::sync::Arc;
use std::time::{Duration, SystemTime};

use axum::body::Body;
use axum::extract::State;
use axum::response::Response;
use bytes::Bytes;
use consumer_core::key::MAX_KEY_BYTES;
use consumer_core::transport::{Delivery, Incoming, Origin, Settlement, Source};
use http::request::Parts;
use http::{header, HeaderMap, HeaderName, HeaderValue, Request, StatusCode};
use serde_json::Value;
use tokio::sync::{mpsc, oneshot};

use super::config::{EventIdSource, Settings};
use super::signature::{self, Refused};
use super::transport::{Reply, WEBHOOK_TRANSPORT};
use crate::flow::read_body;
use crate::problem;

/// The delivery header that carries the signature's timestamp (unix seconds), for a
/// handler that wants to know when the provider signed the event.
pub const WEBHOOK_TIMESTAMP: &str = "webhook-timestamp";

/// The request headers copied onto the delivery, besides the event id header (when the id
/// is read from one): what a handler or the trace context may want.
const COPIED_HEADERS: [HeaderName; 4] = [
    header::CONTENT_TYPE,
    header::USER_AGENT,
    HeaderName::from_static(consumer_core::trace::TRACEPARENT),
    HeaderName::from_static(consumer_core::trace::TRACESTATE),
];

/// What every clone of the ingress's router shares.
pub(super) struct Shared {
    pub(super) settings: Settings,
    pub(super) events: mpsc::Sender<Incoming>,
}

/// The route's handler: every answer of the ingress comes from here.
pub(super) async fn receive(State(shared): State<Arc<Shared>>, request: Request<Body>) -> Response {
    let s = &shared.settings;
    let (parts, body) = request.into_parts();
    let body = match read_body(&parts, body, s.max_body_bytes).await {
        Ok(body) => body,
        Err(answer) => return answer,
    };
    let timestamp = match check_signature(s, &parts.headers, &body) {
        Ok(t) => t,
        Err(refused) => {
            tracing::debug!(route = %s.route, reason = %refused, "webhook signature refused");
            return problem::problem(
                StatusCode::UNAUTHORIZED,
                "Invalid webhook signature",
                &refused.to_string(),
            );
        }
    };
    let event_id = match serde_json::from_slice::<Value>(&body) {
        Err(_) => Err("the body is not JSON".to_owned()),
        Ok(value) => event_id(&s.event_id, &parts, &value).and_then(|id| match id {
            Some(id) => Ok(id),
            None if s.payload_hash_ids => Ok(payload_id(&value)),
            None => Err(missing_id(&s.event_id)),
        }),
    };
    let event_id = match event_id {
        Ok(id) => id,
        Err(detail) => {
            return problem::problem(StatusCode::BAD_REQUEST, "Unparsable webhook event", &detail)
        }
    };
    let delivery = delivery(s, &parts, event_id, body, timestamp);
    answer(deliver(&shared, delivery).await)
}

/// The signature header's timestamp, if the header is there once, a `v1` entry is the
/// HMAC of the timestamp and body under a secret, and the timestamp is within the tolerance.
fn check_signature(s: &Settings, headers: &HeaderMap, body: &[u8]) -> Result<i64, Refused> {
    let mut values = headers.get_all(&s.signature_header).iter();
    let (Some(header), None) = (values.next(), values.next()) else {
        return Err(Refused::Missing);
    };
    signature::verify(&s.secrets, header.as_bytes(), body, s.tolerance, unix_now())
}

/// Seconds since the Unix epoch by this server's clock (negative before it).
fn unix_now() -> i64 {
    match SystemTime::now().duration_since(SystemTime::UNIX_EPOCH) {
        Ok(d) => i64::try_from(d.as_secs()).unwrap_or(i64::MAX),
        Err(e) => -i64::try_from(e.duration().as_secs()).unwrap_or(i64::MAX),
    }
}

/// The event id, from its header or its top-level JSON field (a string, or an integer
/// written in decimal), checked to be a key the inbox can hold; `Ok(None)` when the header
/// or field is not there; `Err` is the 400's detail.
fn event_id(source: &EventIdSource, parts: &Parts, body: &Value) -> Result<Option<String>, String> {
    let id = match source {
        EventIdSource::Header(name) => {
            let mut values = parts.headers.get_all(name).iter();
            match (values.next(), values.next()) {
                (Some(v), None) => v
                    .to_str()
                    .map_err(|_| format!("the `{name}` header is not visible ASCII"))?
                    .to_owned(),
                (None, _) => return Ok(None),
                (Some(_), Some(_)) => {
                    return Err(format!("the request has more than one `{name}` header"))
                }
            }
        }
        EventIdSource::Field(field) => {
            let Some(object) = body.as_object() else {
                return Err("the body is not a JSON object".to_owned());
            };
            match object.get(field) {
                Some(Value::String(s)) => s.clone(),
                Some(Value::Number(n)) if n.is_i64() || n.is_u64() => n.to_string(),
                Some(_) => return Err(format!("the field `{field}` is not a string or integer")),
                None => return Ok(None),
            }
        }
    };
    if id.is_empty() {
        return Err("the event id is empty".to_owned());
    }
    if id.len() > MAX_KEY_BYTES {
        return Err(format!(
            "the event id is {} bytes, over the limit of {MAX_KEY_BYTES}",
            id.len()
        ));
    }
    if id.chars().any(char::is_control) {
        return Err("the event id holds a control character".to_owned());
    }
    Ok(Some(id))
}

/// The 400's detail for an event whose id is not there.
fn missing_id(source: &EventIdSource) -> String {
    match source {
        EventIdSource::Header(name) => format!("the request has no `{name}` header"),
        EventIdSource::Field(field) => format!("the body has no field `{field}`"),
    }
}

/// The id of an event that has none, with [`payload_hash_ids`](super::WebhookIngressBuilder::payload_hash_ids):
/// the canonical hash of its body (the inbox's payload hash).
fn payload_id(body: &Value) -> String {
    format!("payload-{}", consumer_core::key::canonical_hash(body))
}

/// The delivery of a verified event: the event id as its message id, the body as its
/// payload, a few headers, and nothing that would claim it is a first delivery (any
/// request may be a provider's resend).
fn delivery(s: &Settings, parts: &Parts, event_id: String, body: Bytes, t: i64) -> Delivery {
    let id_header = match &s.event_id {
        EventIdSource::Header(name) => Some(name),
        EventIdSource::Field(_) => None,
    };
    let timestamp = t.to_string();
    let names = COPIED_HEADERS;
    let copied = names.iter().chain(id_header).filter_map(|name| {
        let value = parts.headers.get(name)?.to_str().ok()?;
        Some((name.as_str(), value))
    });
    let headers = copied
        .chain(std::iter::once((WEBHOOK_TIMESTAMP, timestamp.as_str())))
        .collect();
    Delivery {
        message_id: Some(event_id.into()),
        payload: body,
        headers,
        redelivered: false,
        attempt: 1,
        origin: Origin::Unknown,
        source: Source {
            transport: WEBHOOK_TRANSPORT,
            location: s.route.as_str().into(),
        },
        // The signature's timestamp is when this send was signed, not when the event was
        // first sent: a provider's resend is signed anew.
        published_at: None,
    }
}

/// How the hand-over to the worker ended.
#[derive(Debug)]
enum Handed {
    /// The worker settled the event.
    Settled(Settlement),
    /// The worker is gone: the transport was dropped, or the event was dropped unsettled
    /// (the worker stopped, or crashed, with it).
    WorkerGone,
    /// No settlement within `answer_within`: the buffer stayed full, or the handler is
    /// still running (then it still commits, and the resend is a duplicate).
    TimedOut,
}

/// Hands `delivery` to the worker and waits, up to `answer_within`, for its settlement.
/// If this future is dropped (the client hung up) after the worker took the event, the
/// worker still runs and settles it; before, the event is simply not handed over.
async fn deliver(shared: &Shared, delivery: Delivery) -> Handed {
    let (to, settled) = oneshot::channel();
    let incoming = Incoming {
        delivery,
        acker: Box::new(Reply { to }),
    };
    let handed = async {
        if shared.events.send(incoming).await.is_err() {
            return Handed::WorkerGone;
        }
        match settled.await {
            Ok(settlement) => Handed::Settled(settlement),
            Err(_) => Handed::WorkerGone,
        }
    };
    tokio::time::timeout(shared.settings.answer_within, handed)
        .await
        .unwrap_or(Handed::TimedOut)
}

/// The answer for how the hand-over ended.
fn answer(handed: Handed) -> Response {
    match handed {
        Handed::Settled(Settlement::Ack) => received(None),
        Handed::Settled(Settlement::DeadLetter(dead)) => received(Some(dead.reason.as_str())),
        Handed::Settled(Settlement::Retry { delay, .. }) => problem::retry_later(
            StatusCode::SERVICE_UNAVAILABLE,
            "Webhook event failed",
            "the event's handler failed and will run again when the event is resent",
            delay,
        ),
        Handed::WorkerGone => problem::retry_later(
            StatusCode::SERVICE_UNAVAILABLE,
            "Webhook worker unavailable",
            "no worker is taking events; resend the event later",
            Duration::from_secs(1),
        ),
        Handed::TimedOut => problem::retry_later(
            StatusCode::SERVICE_UNAVAILABLE,
            "Webhook event not settled in time",
            "the event was not settled in time; a resend is answered with its outcome",
            Duration::from_secs(1),
        ),
    }
}

/// 200 with `{"received": true}`, and the dead letter's reason for an event that was
/// dead-lettered.
fn received(dead_lettered: Option<&str>) -> Response {
    let body = match dead_lettered {
        None => serde_json::json!({ "received": true }),
        Some(reason) => serde_json::json!({ "received": true, "dead_lettered": reason }),
    };
    let mut response = Response::new(Body::from(body.to_string()));
    response.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    response
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parts(headers: &[(&str, &str)]) -> Parts {
        let mut b = Request::builder().method("POST").uri("/hooks");
        for (k, v) in headers {
            b = b.header(*k, *v);
        }
        b.body(()).unwrap().into_parts().0
    }

    #[test]
    fn an_event_without_an_id_is_keyed_by_its_canonical_payload() {
        let a = payload_id(&serde_json::json!({"kind": "paid", "amount": 5}));
        let b = payload_id(
            &serde_json::from_str::<Value>(r#"{ "amount": 5,  "kind": "paid" }"#).unwrap(),
        );
        assert_eq!(a, b);
        assert_ne!(
            a,
            payload_id(&serde_json::json!({"kind": "paid", "amount": 6}))
        );
        assert!(a.starts_with("payload-") && a.len() == 8 + 64, "{a}");
        assert!(a.len() <= MAX_KEY_BYTES);
    }

    #[test]
    fn the_event_id_comes_from_its_field_or_header_and_is_checked() {
        let field = EventIdSource::Field("id".into());
        let none = parts(&[]);
        let id = |body: Value| event_id(&field, &none, &body);
        assert_eq!(
            id(serde_json::json!({"id": "evt_1"})),
            Ok(Some("evt_1".into()))
        );
        assert_eq!(id(serde_json::json!({"id": 42})), Ok(Some("42".into())));
        assert!(id(serde_json::json!({"id": 4.2})).is_err());
        assert!(id(serde_json::json!({"id": null})).is_err());
        assert_eq!(id(serde_json::json!({"other": "x"})), Ok(None));
        assert!(id(serde_json::json!(["id"])).is_err());
        assert!(id(serde_json::json!({"id": ""})).is_err());
        assert!(id(serde_json::json!({"id": "a\nb"})).is_err());
        assert!(id(serde_json::json!({"id": "k".repeat(MAX_KEY_BYTES + 1)})).is_err());

        let header = EventIdSource::Header(HeaderName::from_static("webhook-id"));
        let body = serde_json::json!({});
        let with = parts(&[("webhook-id", "msg_1")]);
        assert_eq!(event_id(&header, &with, &body), Ok(Some("msg_1".into())));
        assert_eq!(event_id(&header, &none, &body), Ok(None));
        let twice = parts(&[("webhook-id", "a"), ("webhook-id", "b")]);
        assert!(event_id(&header, &twice, &body).is_err());
    }
}
