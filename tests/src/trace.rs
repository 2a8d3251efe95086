//! The trace-context tests' shared parts: OpenTelemetry's in-memory exporter behind
//! `tracing-opentelemetry` as the process's subscriber, a handler that fails its first
//! attempt and notes what each attempt saw, and the checks that the message's trace runs
//! from the publisher through the retry to the outbox message it causes, whichever broker
//! carried it.

use std::sync::Mutex;

use consumer_core::trace::{current_traceparent, TraceParent, TRACEPARENT};
use consumer_core::{handler, Context, HandlerError, Inbox, OutboxMessage};
use opentelemetry::trace::{SpanKind, TracerProvider as _};
use opentelemetry_sdk::trace::{InMemorySpanExporter, SdkTracerProvider};
use sqlx::Postgres;
use tracing_subscriber::layer::SubscriberExt;

/// The `traceparent` the tests publish with: the publisher's span.
pub const PUBLISHED: &str = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";

/// What one attempt of [`traced`] saw.
#[derive(Debug, Clone)]
pub struct Seen {
    /// Its attempt number.
    pub attempt: u32,
    /// Its delivery's `traceparent` header.
    pub header: Option<String>,
    /// Its own span's.
    pub span: Option<String>,
}

static SEEN: Mutex<Vec<Seen>> = Mutex::new(Vec::new());

/// The attempts of [`traced`] so far, in order.
pub fn seen() -> Vec<Seen> {
    SEEN.lock().unwrap_or_else(|e| e.into_inner()).clone()
}

/// Notes what the attempt saw, fails the first attempt (a transient error: it is retried)
/// and succeeds after.
#[handler(name = "traced", max_attempts = 3, backoff = "100ms..200ms")]
pub async fn traced(
    ctx: &mut Context<'_, Postgres>,
    _job: serde_json::Value,
) -> Result<(), HandlerError> {
    let header = ctx.delivery().headers.get(TRACEPARENT).map(str::to_owned);
    SEEN.lock().unwrap_or_else(|e| e.into_inner()).push(Seen {
        attempt: ctx.attempt(),
        header,
        span: current_traceparent(),
    });
    // The event this job causes, through the outbox: the first attempt's rolls back with it.
    ctx.publish(OutboxMessage::new("traced-events", "{}"))
        .await?;
    if ctx.attempt() == 1 {
        return Err(HandlerError::transient("fails once"));
    }
    Ok(())
}

/// Checks the outbox message [`traced`] committed (on its second attempt): it is in the
/// trace of [`PUBLISHED`], its parent the second attempt's delivery span.
pub async fn assert_outbox_in_trace(inbox: &Inbox<Postgres>) {
    let rows: Vec<String> =
        sqlx::query_scalar(&format!("SELECT headers FROM {}", inbox.outbox().table()))
            .fetch_all(inbox.pool())
            .await
            .expect("read the outbox");
    let [headers] = &rows[..] else {
        panic!("one outbox message, the committed attempt's: {rows:?}");
    };
    let headers: serde_json::Value = serde_json::from_str(headers).expect("headers as JSON");
    let carried = headers[TRACEPARENT].as_str().map(TraceParent::parse);
    let carried = carried.flatten().expect("the outbox message's traceparent");
    let published = TraceParent::parse(PUBLISHED).expect("a valid traceparent");
    assert_eq!(
        carried.trace_id, published.trace_id,
        "the outbox message is in the trace"
    );
    let second = seen()
        .get(1)
        .and_then(|s| s.span.as_deref().and_then(TraceParent::parse))
        .expect("the second attempt's span");
    assert_eq!(
        carried.span_id, second.span_id,
        "its parent is the committed attempt's span"
    );
}

/// The process's spans, exported in memory.
pub struct Spans {
    exporter: InMemorySpanExporter,
    provider: SdkTracerProvider,
}

impl Spans {
    /// Installs the exporter as the process's global subscriber (once per test process).
    pub fn install() -> Spans {
        let exporter = InMemorySpanExporter::default();
        let provider = SdkTracerProvider::builder()
            .with_simple_exporter(exporter.clone())
            .build();
        let subscriber = tracing_subscriber::registry()
            .with(tracing_opentelemetry::layer().with_tracer(provider.tracer("test")));
        tracing::subscriber::set_global_default(subscriber).expect("the only subscriber");
        Spans { exporter, provider }
    }

    /// Checks the two attempts [`traced`] saw, and the spans exported for them: both delivery
    /// spans are in the trace of [`PUBLISHED`], the first one's parent is the publisher's
    /// span, the retry copy carries the first attempt's span as its `traceparent`, and the
    /// second attempt's span is that span's child. Both are consumer spans with the
    /// messaging attributes of `system` (`rabbitmq`, `kafka`).
    pub fn assert_one_trace(&self, system: &str) {
        let seen = seen();
        let published = TraceParent::parse(PUBLISHED).expect("a valid traceparent");
        let [first, second] = &seen[..] else {
            panic!("two attempts, saw {seen:?}");
        };
        assert_eq!((first.attempt, second.attempt), (1, 2), "{seen:?}");
        let parse = |tp: &Option<String>| TraceParent::parse(tp.as_deref().expect("a traceparent"));
        let first_span = parse(&first.span).expect("the first attempt's span");
        assert_eq!(
            parse(&first.header),
            Some(published),
            "the message as published"
        );
        assert_eq!(
            first_span.trace_id, published.trace_id,
            "the first attempt is in the trace"
        );
        // The retry copy carries the first attempt's span: the second attempt is its child.
        assert_eq!(
            parse(&second.header),
            Some(first_span),
            "the retry copy's traceparent"
        );
        let second_span = parse(&second.span).expect("the second attempt's span");
        assert_eq!(second_span.trace_id, published.trace_id);

        self.provider.force_flush().expect("flush the spans");
        let spans = self
            .exporter
            .get_finished_spans()
            .expect("the exported spans");
        let delivery = |id: [u8; 8]| {
            spans
                .iter()
                .find(|s| s.name == "delivery" && s.span_context.span_id().to_bytes() == id)
                .unwrap_or_else(|| panic!("an exported delivery span {id:?}: {spans:?}"))
        };
        let (one, two) = (delivery(first_span.span_id), delivery(second_span.span_id));
        for s in [one, two] {
            assert_eq!(s.span_context.trace_id().to_bytes(), published.trace_id);
            assert_eq!(s.span_kind, SpanKind::Consumer, "{s:?}");
            let attribute = |name: &str| {
                s.attributes
                    .iter()
                    .find(|kv| kv.key.as_str() == name)
                    .map(|kv| kv.value.to_string())
            };
            assert_eq!(attribute("messaging.system").as_deref(), Some(system));
            assert_eq!(
                attribute("messaging.operation.type").as_deref(),
                Some("process")
            );
            assert_eq!(
                attribute("messaging.message.id").as_deref(),
                Some("traced-1")
            );
        }
        assert_eq!(one.parent_span_id.to_bytes(), published.span_id);
        assert_eq!(two.parent_span_id.to_bytes(), first_span.span_id);
    }
}
