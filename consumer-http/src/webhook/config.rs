//! [`WebhookIngressBuilder`]: the route, the secrets, where the event id is, the limits;
//! checked into the ingress's settings by [`WebhookIngressBuilder::build`].

use std::time::Duration;

use http::HeaderName;

use super::signature::Secret;
use crate::Error;

/// The default signature header: `Webhook-Signature: t=<unix seconds>,v1=<hex>`.
pub const DEFAULT_SIGNATURE_HEADER: &str = "webhook-signature";

/// The default top-level JSON field that holds the event id (`{"id": "evt_…", …}`).
pub const DEFAULT_EVENT_ID_FIELD: &str = "id";

/// Where a request's event id is read from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum EventIdSource {
    /// A request header (exactly one).
    Header(HeaderName),
    /// A top-level field of the JSON body: a string or an integer.
    Field(String),
}

/// The checked settings the route works with.
#[derive(Debug)]
pub(crate) struct Settings {
    pub(crate) route: String,
    pub(crate) secrets: Vec<Secret>,
    pub(crate) signature_header: HeaderName,
    pub(crate) tolerance: Duration,
    pub(crate) event_id: EventIdSource,
    /// An event without an id is keyed by the canonical hash of its body.
    pub(crate) payload_hash_ids: bool,
    pub(crate) max_body_bytes: usize,
    pub(crate) buffer: usize,
    pub(crate) answer_within: Duration,
}

/// Where the event id is to be read, as given to the builder (checked by `build`).
#[derive(Debug, Clone)]
enum EventIdFrom {
    Header(String),
    Field(String),
}

/// Builds a [`WebhookIngress`](super::WebhookIngress); start with
/// [`WebhookIngress::builder`](super::WebhookIngress::builder). Nothing is checked
/// until [`WebhookIngressBuilder::build`], whose error names the field. `Debug` shows no
/// secret.
#[derive(Debug, Clone)]
#[must_use]
pub struct WebhookIngressBuilder {
    route: String,
    secrets: Vec<Secret>,
    signature_header: String,
    tolerance: Duration,
    event_id: EventIdFrom,
    payload_hash_ids: bool,
    max_body_bytes: usize,
    buffer: usize,
    answer_within: Duration,
}

impl WebhookIngressBuilder {
    pub(super) fn new(route: impl Into<String>) -> Self {
        WebhookIngressBuilder {
            route: route.into(),
            secrets: Vec::new(),
            signature_header: DEFAULT_SIGNATURE_HEADER.to_owned(),
            tolerance: Duration::from_secs(300),
            event_id: EventIdFrom::Field(DEFAULT_EVENT_ID_FIELD.to_owned()),
            payload_hash_ids: false,
            max_body_bytes: consumer_core::WorkerConfig::DEFAULT_MAX_PAYLOAD_BYTES,
            buffer: 64,
            answer_within: Duration::from_secs(10),
        }
    }

    /// Adds a signing secret (its bytes as given, e.g. the whole `whsec_…` string). At least
    /// one is required; call it again to accept several, as while a provider rotates its
    /// secret: a request passes if any secret signed it.
    pub fn secret(mut self, secret: impl AsRef<[u8]>) -> Self {
        self.secrets.push(Secret::new(secret.as_ref()));
        self
    }

    /// The header that carries the signature (default [`DEFAULT_SIGNATURE_HEADER`]).
    pub fn signature_header(mut self, name: impl Into<String>) -> Self {
        self.signature_header = name.into();
        self
    }

    /// How far the signature's timestamp may lie from this server's clock, in the past or
    /// the future (default 5 min; whole seconds, at least 1 s). It bounds how long a
    /// captured request can be replayed; keep the handler's inbox retention well above it,
    /// so that a replay inside the window always finds its key.
    pub fn tolerance(mut self, tolerance: Duration) -> Self {
        self.tolerance = tolerance;
        self
    }

    /// Reads the event id from the request header `name` (which the signature does not
    /// cover: prefer a body field where the provider has one).
    pub fn event_id_header(mut self, name: impl Into<String>) -> Self {
        self.event_id = EventIdFrom::Header(name.into());
        self
    }

    /// Reads the event id from the top-level JSON field `name`, a string or an integer
    /// (default [`DEFAULT_EVENT_ID_FIELD`]).
    pub fn event_id_field(mut self, name: impl Into<String>) -> Self {
        self.event_id = EventIdFrom::Field(name.into());
        self
    }

    /// Keys an event that has no id (its field or header missing) by the canonical hash of
    /// its JSON body, `payload-` and 64 hex digits, instead of refusing it with 400: a
    /// resend of the same body deduplicates, whatever its key order and white space. Off by
    /// default, as two distinct events with the same body would be taken for one: use it
    /// for a provider whose events carry no id but differ in content (a timestamp, a
    /// sequence number). An id that is there but malformed is still a 400.
    pub fn payload_hash_ids(mut self) -> Self {
        self.payload_hash_ids = true;
        self
    }

    /// The largest body accepted (default 1 MiB, the worker's default
    /// `max_payload_bytes`); a larger one is answered 413. Keep it at most the worker's
    /// `max_payload_bytes`, or the worker dead-letters what this lets through.
    pub fn max_body_bytes(mut self, bytes: usize) -> Self {
        self.max_body_bytes = bytes;
        self
    }

    /// How many verified events may wait for the worker to take them (default 64). A
    /// request that finds the buffer full waits for room, within
    /// [`WebhookIngressBuilder::answer_within`].
    pub fn buffer(mut self, events: usize) -> Self {
        self.buffer = events;
        self
    }

    /// How long a request waits for its event's outcome (default 10 s, below the usual
    /// provider timeouts) before it is answered 503 with `Retry-After`. The event is not
    /// abandoned: if the worker has it, it still runs and commits, and the provider's
    /// resend is then a duplicate.
    pub fn answer_within(mut self, wait: Duration) -> Self {
        self.answer_within = wait;
        self
    }

    /// Checks the settings ([`WebhookIngressBuilder::build`] builds the ingress on them);
    /// the error names the field.
    pub(super) fn check(self) -> Result<Settings, Error> {
        let literal = |b: u8| b.is_ascii_alphanumeric() || b"-._~/".contains(&b);
        if !self.route.starts_with('/') || !self.route.bytes().all(literal) {
            return Err(Error::config(
                "route",
                "must be a literal path: `/`, then letters, digits and `-._~/`",
            ));
        }
        if self.secrets.is_empty() {
            return Err(Error::config("secrets", "give at least one secret"));
        }
        if let Some(i) = self.secrets.iter().position(Secret::is_empty) {
            return Err(Error::config("secrets", format!("secret {i} is empty")));
        }
        let signature_header = HeaderName::try_from(self.signature_header.as_str())
            .map_err(|_| Error::config("signature_header", "not a valid header name"))?;
        if self.tolerance < Duration::from_secs(1) {
            return Err(Error::config("tolerance", "must be at least 1 s"));
        }
        let event_id = match self.event_id {
            EventIdFrom::Header(name) => EventIdSource::Header(
                HeaderName::try_from(name.as_str())
                    .map_err(|_| Error::config("event_id_header", "not a valid header name"))?,
            ),
            EventIdFrom::Field(name) if name.is_empty() => {
                return Err(Error::config("event_id_field", "must not be empty"))
            }
            EventIdFrom::Field(name) => EventIdSource::Field(name),
        };
        if self.max_body_bytes == 0 {
            return Err(Error::config("max_body_bytes", "must be above 0"));
        }
        if self.buffer == 0 {
            return Err(Error::config("buffer", "must be above 0"));
        }
        if self.answer_within.is_zero() {
            return Err(Error::config("answer_within", "must be above 0"));
        }
        Ok(Settings {
            route: self.route,
            secrets: self.secrets,
            signature_header,
            tolerance: self.tolerance,
            event_id,
            payload_hash_ids: self.payload_hash_ids,
            max_body_bytes: self.max_body_bytes,
            buffer: self.buffer,
            answer_within: self.answer_within,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::WebhookIngress;

    fn field(b: WebhookIngressBuilder) -> &'static str {
        match b.check() {
            Err(Error::Config { field, .. }) => field,
            other => panic!("expected a config error, got {other:?}"),
        }
    }

    #[test]
    fn defaults_with_a_secret_build_and_bad_values_name_the_field() {
        let ok = || WebhookIngress::builder("/hooks").secret("s");
        let settings = ok().check().unwrap();
        assert_eq!(settings.signature_header, DEFAULT_SIGNATURE_HEADER);
        assert_eq!(
            settings.event_id,
            EventIdSource::Field(DEFAULT_EVENT_ID_FIELD.into())
        );
        assert_eq!(field(WebhookIngress::builder("/hooks")), "secrets");
        assert_eq!(field(ok().secret("")), "secrets");
        assert_eq!(field(WebhookIngress::builder("hooks").secret("s")), "route");
        assert_eq!(field(WebhookIngress::builder("/{id}").secret("s")), "route");
        assert_eq!(
            field(ok().signature_header("bad header")),
            "signature_header"
        );
        assert_eq!(field(ok().tolerance(Duration::ZERO)), "tolerance");
        assert_eq!(
            field(ok().tolerance(Duration::from_millis(500))),
            "tolerance"
        );
        assert_eq!(field(ok().event_id_header("a:b")), "event_id_header");
        assert_eq!(field(ok().event_id_field("")), "event_id_field");
        assert_eq!(field(ok().max_body_bytes(0)), "max_body_bytes");
        assert_eq!(field(ok().buffer(0)), "buffer");
        assert_eq!(field(ok().answer_within(Duration::ZERO)), "answer_within");
    }

    #[test]
    fn no_secret_appears_in_debug_output_or_errors() {
        let b = WebhookIngress::builder("/hooks")
            .secret("whsec_one")
            .secret("whsec_two")
            .tolerance(Duration::ZERO);
        let shown = format!("{b:?}");
        assert!(!shown.contains("whsec"), "{shown}");
        let error = b.check().unwrap_err().to_string();
        assert!(!error.contains("whsec"), "{error}");
        let ingress = WebhookIngress::builder("/hooks")
            .secret("whsec_one")
            .build()
            .unwrap();
        let shown = format!("{ingress:?}");
        assert!(!shown.contains("whsec"), "{shown}");
    }
}
