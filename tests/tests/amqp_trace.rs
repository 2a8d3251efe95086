//! RabbitMQ: a message published with a W3C `traceparent` fails once and then succeeds. Both
//! delivery spans belong to the message's trace (the first one's parent is the publisher's
//! span, the retry's is the first attempt's span), and the retry copy carries the first
//! attempt's span as its `traceparent`. The spans are read from OpenTelemetry's in-memory
//! exporter behind `tracing-opentelemetry` (core's `opentelemetry` feature).

use std::collections::BTreeMap;
use std::sync::Mutex;

use consumer_amqp::AmqpPublisher;
use consumer_core::trace::{current_traceparent, TraceParent, TRACEPARENT};
use consumer_core::{handler, Context, HandlerError, Worker};
use consumer_tests::amqp::{self, config, wait_for, worker_config, Db, Rabbit, Running, LONG};
use opentelemetry::trace::TracerProvider as _;
use opentelemetry_sdk::trace::{InMemorySpanExporter, SdkTracerProvider};
use sqlx::Postgres;
use tracing_subscriber::layer::SubscriberExt;

/// What one attempt saw.
#[derive(Debug, Clone)]
struct Seen {
    attempt: u32,
    /// Its delivery's `traceparent` header.
    header: Option<String>,
    /// Its own span's.
    span: Option<String>,
}

static SEEN: Mutex<Vec<Seen>> = Mutex::new(Vec::new());

#[handler(name = "traced", max_attempts = 3, backoff = "100ms..200ms")]
async fn traced(
    ctx: &mut Context<'_, Postgres>,
    _job: serde_json::Value,
) -> Result<(), HandlerError> {
    let header = ctx.delivery().headers.get(TRACEPARENT).cloned();
    SEEN.lock().expect("seen").push(Seen {
        attempt: ctx.attempt(),
        header,
        span: current_traceparent(),
    });
    if ctx.attempt() == 1 {
        return Err(HandlerError::transient("fails once"));
    }
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_trace_goes_from_the_publisher_through_the_retry() {
    let exporter = InMemorySpanExporter::default();
    let provider = SdkTracerProvider::builder()
        .with_simple_exporter(exporter.clone())
        .build();
    let subscriber = tracing_subscriber::registry()
        .with(tracing_opentelemetry::layer().with_tracer(provider.tracer("test")));
    tracing::subscriber::set_global_default(subscriber).expect("the only subscriber");

    let db = Db::new().await;
    let queue = amqp::unique_name("trace");
    let cfg = config(&queue);
    let worker = Worker::with_config(db.inbox(4).await, traced, worker_config(1)).unwrap();
    let running = Running::start(worker, cfg.clone()).await;
    let published = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
    let publisher = AmqpPublisher::connect(cfg.clone()).await.unwrap();
    let headers = BTreeMap::from([(TRACEPARENT.to_owned(), published.to_owned())]);
    publisher
        .publish(&cfg.queue, "traced-1", b"{}", &headers)
        .await
        .unwrap();
    publisher.close().await;
    wait_for("the second attempt", LONG, || async {
        SEEN.lock().unwrap().len() >= 2
    })
    .await;
    let stats = running.stop().await;
    assert_eq!(stats.completed, 1);

    let seen = SEEN.lock().unwrap().clone();
    let published = TraceParent::parse(published).unwrap();
    let (first, second) = (&seen[0], &seen[1]);
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

    provider.force_flush().unwrap();
    let spans = exporter.get_finished_spans().unwrap();
    let delivery = |id: [u8; 8]| {
        spans
            .iter()
            .find(|s| s.name == "delivery" && s.span_context.span_id().to_bytes() == id)
            .unwrap_or_else(|| panic!("an exported delivery span {id:?}: {spans:?}"))
    };
    let (one, two) = (delivery(first_span.span_id), delivery(second_span.span_id));
    for s in [one, two] {
        assert_eq!(s.span_context.trace_id().to_bytes(), published.trace_id);
    }
    assert_eq!(one.parent_span_id.to_bytes(), published.span_id);
    assert_eq!(two.parent_span_id.to_bytes(), first_span.span_id);
    Rabbit::delete_topology(&cfg).await;
}
