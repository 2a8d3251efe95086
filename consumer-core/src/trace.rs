//! W3C trace context across brokers: the `traceparent` (and `tracestate`) header a
//! producer put on a message is read into the delivery's span, and a copy the transport
//! writes (a retry copy, a dead letter) carries the context on.
//!
//! - Always: the delivery span records the message's trace id as its field `trace_id`, so
//!   the logs of every attempt of one message share it; the headers are carried onto the
//!   message's copies as they are.
//! - With the `opentelemetry` feature: the delivery span's parent is the message's remote
//!   span context (a batch's span gets a link to each member's instead), so an
//!   OpenTelemetry exporter (through `tracing-opentelemetry`) shows one trace from the
//!   publish to the effect; and [`current_traceparent`] gives the transports the delivery
//!   span's own context to write on the copies, so the next attempt is a child of this one.
//!
//! The delivery and batch spans carry OpenTelemetry's messaging attributes where they fit:
//! `otel.kind = consumer` (tracing-opentelemetry's span kind), `messaging.system`
//! ([`messaging_system`]: `rabbitmq`, `kafka`, or the transport's own name),
//! `messaging.operation.type = process`, and `messaging.message.id` on a delivery span,
//! `messaging.batch.message_count` on a batch's.

use tracing::Span;

use crate::delivery::Delivery;

/// The W3C trace context header.
pub const TRACEPARENT: &str = "traceparent";
/// The W3C vendor trace state header, carried with [`TRACEPARENT`].
pub const TRACESTATE: &str = "tracestate";

/// The OpenTelemetry `messaging.system` of a transport ([`crate::transport::Source::transport`]):
/// `amqp` is `rabbitmq`, the others keep their name (`kafka`, `memory`).
pub fn messaging_system(transport: &'static str) -> &'static str {
    match transport {
        "amqp" => "rabbitmq",
        other => other,
    }
}

/// A parsed `traceparent` (version 00): `00-<trace id>-<parent span id>-<flags>`, lowercase
/// hex.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TraceParent {
    /// The trace id (16 bytes, not all zero).
    pub trace_id: [u8; 16],
    /// The id of the span that sent the message (8 bytes, not all zero).
    pub span_id: [u8; 8],
    /// The trace flags (bit 0: sampled).
    pub flags: u8,
}

impl TraceParent {
    /// Parses a `traceparent` value; `None` if it is not a valid version-00 one (an invalid
    /// header is ignored, as the W3C recommendation asks, not an error).
    pub fn parse(value: &str) -> Option<Self> {
        let mut parts = value.trim().split('-');
        let (version, trace, span, flags) =
            (parts.next()?, parts.next()?, parts.next()?, parts.next()?);
        if version != "00" || parts.next().is_some() {
            return None;
        }
        let mut trace_id = [0u8; 16];
        let mut span_id = [0u8; 8];
        let mut flag = [0u8; 1];
        decode(trace, &mut trace_id)?;
        decode(span, &mut span_id)?;
        decode(flags, &mut flag)?;
        if trace_id == [0; 16] || span_id == [0; 8] {
            return None;
        }
        Some(TraceParent {
            trace_id,
            span_id,
            flags: flag[0],
        })
    }

    /// The message's `traceparent`, if it has a valid one.
    pub fn of(delivery: &Delivery) -> Option<Self> {
        delivery.headers.get(TRACEPARENT).and_then(Self::parse)
    }

    /// The trace id in lowercase hex.
    pub fn trace_id_hex(&self) -> String {
        hex::encode(self.trace_id)
    }
}

impl std::fmt::Display for TraceParent {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "00-{}-{}-{:02x}",
            hex::encode(self.trace_id),
            hex::encode(self.span_id),
            self.flags
        )
    }
}

/// Lowercase hex of exactly `out.len()` bytes.
fn decode(s: &str, out: &mut [u8]) -> Option<()> {
    if s.len() != out.len() * 2 || s.bytes().any(|b| b.is_ascii_uppercase()) {
        return None;
    }
    hex::decode_to_slice(s, out).ok()
}

/// Joins the span of one delivery to the message's trace: its `trace_id` field, and (with
/// the `opentelemetry` feature) its parent.
pub(crate) fn join(span: &Span, delivery: &Delivery) {
    let Some(parent) = TraceParent::of(delivery) else {
        return;
    };
    span.record("trace_id", parent.trace_id_hex().as_str());
    #[cfg(feature = "opentelemetry")]
    otel::set_parent(span, &parent, delivery.headers.get(TRACESTATE));
}

/// Links the span of a batch to each member's trace (with the `opentelemetry` feature;
/// nothing without it).
pub(crate) fn link<'a>(span: &Span, deliveries: impl Iterator<Item = &'a Delivery>) {
    #[cfg(feature = "opentelemetry")]
    for delivery in deliveries {
        if let Some(parent) = TraceParent::of(delivery) {
            otel::add_link(span, &parent, delivery.headers.get(TRACESTATE));
        }
    }
    #[cfg(not(feature = "opentelemetry"))]
    let _ = (span, deliveries);
}

/// The `traceparent` of the current span, for a transport to write on the copy of a
/// message it settles (inside the delivery's span): with the `opentelemetry` feature and a
/// valid current span, its context; otherwise `None`, and the copy carries the message's
/// own header.
pub fn current_traceparent() -> Option<String> {
    #[cfg(feature = "opentelemetry")]
    return otel::current();
    #[cfg(not(feature = "opentelemetry"))]
    None
}

#[cfg(feature = "opentelemetry")]
mod otel {
    use opentelemetry::trace::{
        SpanContext, SpanId, TraceContextExt, TraceFlags, TraceId, TraceState,
    };
    use opentelemetry::Context;
    use tracing_opentelemetry::OpenTelemetrySpanExt;

    use super::TraceParent;

    fn remote(parent: &TraceParent, state: Option<&str>) -> SpanContext {
        let state = state
            .and_then(|s| s.parse::<TraceState>().ok())
            .unwrap_or_default();
        SpanContext::new(
            TraceId::from_bytes(parent.trace_id),
            SpanId::from_bytes(parent.span_id),
            TraceFlags::new(parent.flags),
            true,
            state,
        )
    }

    pub(super) fn set_parent(span: &tracing::Span, parent: &TraceParent, state: Option<&str>) {
        let cx = Context::new().with_remote_span_context(remote(parent, state));
        let _ = span.set_parent(cx);
    }

    pub(super) fn add_link(span: &tracing::Span, parent: &TraceParent, state: Option<&str>) {
        span.add_link(remote(parent, state));
    }

    pub(super) fn current() -> Option<String> {
        let cx = tracing::Span::current().context();
        let sc = cx.span().span_context().clone();
        if !sc.is_valid() {
            return None;
        }
        let parent = TraceParent {
            trace_id: sc.trace_id().to_bytes(),
            span_id: sc.span_id().to_bytes(),
            flags: sc.trace_flags().to_u8(),
        };
        Some(parent.to_string())
    }
}

#[cfg(test)]
mod tests {
    use super::TraceParent;

    #[test]
    fn a_traceparent_is_parsed_and_printed_back() {
        let v = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
        let p = TraceParent::parse(v).expect("valid");
        assert_eq!(p.trace_id_hex(), "4bf92f3577b34da6a3ce929d0e0e4736");
        assert_eq!(p.flags, 1);
        assert_eq!(p.to_string(), v);
    }

    #[test]
    fn an_invalid_traceparent_is_ignored() {
        for v in [
            "",
            "01-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            "00-00000000000000000000000000000000-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",
            "00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e473-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-x",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7",
        ] {
            assert_eq!(TraceParent::parse(v), None, "{v:?}");
        }
    }
}
