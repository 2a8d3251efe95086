//! The binaries' spans over OTLP, with the `opentelemetry` feature: a collector (Jaeger,
//! Tempo, an OpenTelemetry Collector) shows a job's `delivery` span, and its handler's
//! work inside it, in the trace of whoever published the job with a `traceparent`.
//!
//! Export starts when `OTEL_EXPORTER_OTLP_ENDPOINT` (or `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`)
//! is set, e.g. to `http://127.0.0.1:4318`: spans go over OTLP/HTTP with protobuf bodies to
//! `<endpoint>/v1/traces`, in batches, under the service name `OTEL_SERVICE_NAME` (default:
//! the binary's name). The SDK reads the other standard variables itself
//! (`OTEL_EXPORTER_OTLP_HEADERS`, `OTEL_EXPORTER_OTLP_TIMEOUT`, `OTEL_RESOURCE_ATTRIBUTES`,
//! `OTEL_BSP_*`). The client speaks plain HTTP only: an `https` collector is reached through
//! a local collector or sidecar. The exporter is flushed and shut down when the [`Telemetry`]
//! guard that [`init_tracing`](crate::app::init_tracing) returns is dropped.
//!
//! Without the feature nothing is exported, and a set endpoint is reported with a warning.

#[cfg(feature = "opentelemetry")]
use consumer_amqp::RedactedUrl;
use tracing::Subscriber;
use tracing_subscriber::layer::SubscriberExt as _;
use tracing_subscriber::registry::LookupSpan;
use tracing_subscriber::util::SubscriberInitExt as _;
use tracing_subscriber::Layer;

/// The variables that turn the export on: the OTLP endpoint, for every signal or for traces.
const ENDPOINT_VARS: [&str; 2] = [
    "OTEL_EXPORTER_OTLP_ENDPOINT",
    "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
];

/// The span export of this process: hold it until `main` returns. Dropping it exports the
/// spans still buffered and shuts the exporter down (the standard OTel timeouts bound the
/// wait); with no export running it does nothing.
#[must_use = "dropping it at once shuts the span export down"]
#[derive(Debug, Default)]
pub struct Telemetry {
    #[cfg(feature = "opentelemetry")]
    provider: Option<opentelemetry_sdk::trace::SdkTracerProvider>,
    /// What to log once the subscriber is installed (nothing is logged before it is).
    note: Option<Note>,
}

/// The state of the export, logged once logging works.
#[derive(Debug)]
enum Note {
    /// Spans go to this endpoint, under this service name.
    #[cfg(feature = "opentelemetry")]
    Exporting {
        endpoint: RedactedUrl,
        service: String,
    },
    /// The exporter could not be built: the process runs without it.
    #[cfg(feature = "opentelemetry")]
    Failed(String),
    /// This variable sets an endpoint, but this build has no exporter.
    #[cfg(not(feature = "opentelemetry"))]
    NoFeature(&'static str),
}

/// Installs `subscriber` as the global one, with the OTLP layer on top when the export is
/// on, and returns the export's guard.
pub(crate) fn init<S>(subscriber: S) -> Telemetry
where
    S: Subscriber + for<'a> LookupSpan<'a> + Send + Sync + 'static,
{
    let (layer, telemetry) = layer::<S>();
    subscriber.with(layer).init();
    telemetry.log_start();
    telemetry
}

impl Telemetry {
    /// Logs how the export started, once the subscriber is installed.
    fn log_start(&self) {
        match &self.note {
            None => {}
            #[cfg(feature = "opentelemetry")]
            Some(Note::Exporting { endpoint, service }) => {
                tracing::info!(%endpoint, %service, "exporting spans over OTLP/HTTP");
            }
            #[cfg(feature = "opentelemetry")]
            Some(Note::Failed(error)) => {
                tracing::warn!(%error, "cannot export spans over OTLP; running without");
            }
            #[cfg(not(feature = "opentelemetry"))]
            Some(Note::NoFeature(var)) => tracing::warn!(
                "{var} is set, but this build has no OTLP exporter: rebuild with \
                 `--features opentelemetry` to export spans"
            ),
        }
    }
}

impl Drop for Telemetry {
    fn drop(&mut self) {
        #[cfg(feature = "opentelemetry")]
        if let Some(provider) = self.provider.take() {
            if let Err(e) = provider.shutdown() {
                tracing::warn!(error = %e, "the span exporter did not shut down cleanly");
            }
        }
    }
}

/// The first of [`ENDPOINT_VARS`] that is set and not empty, with its value.
fn endpoint() -> Option<(&'static str, String)> {
    ENDPOINT_VARS.into_iter().find_map(|var| {
        let value = std::env::var(var).ok()?;
        (!value.trim().is_empty()).then_some((var, value))
    })
}

/// The layer that hands spans to the OTLP exporter (none when no endpoint is set, or
/// without the feature), and the guard of the export.
fn layer<S>() -> (Option<impl Layer<S>>, Telemetry)
where
    S: Subscriber + for<'a> LookupSpan<'a>,
{
    let Some((var, endpoint)) = endpoint() else {
        return (None, Telemetry::default());
    };
    #[cfg(feature = "opentelemetry")]
    return start::<S>(var, endpoint);
    #[cfg(not(feature = "opentelemetry"))]
    return start(var, endpoint);
}

#[cfg(not(feature = "opentelemetry"))]
fn start(
    var: &'static str,
    _endpoint: String,
) -> (Option<tracing_subscriber::layer::Identity>, Telemetry) {
    let telemetry = Telemetry {
        note: Some(Note::NoFeature(var)),
    };
    (None, telemetry)
}

#[cfg(feature = "opentelemetry")]
fn start<S>(
    _var: &'static str,
    endpoint: String,
) -> (
    Option<tracing_opentelemetry::OpenTelemetryLayer<S, opentelemetry_sdk::trace::SdkTracer>>,
    Telemetry,
)
where
    S: Subscriber + for<'a> LookupSpan<'a>,
{
    use opentelemetry::trace::TracerProvider as _;
    use opentelemetry_sdk::trace::SdkTracerProvider;
    use opentelemetry_sdk::Resource;

    // The exporter reads the endpoint, headers and timeout from the standard variables.
    let exporter = match opentelemetry_otlp::SpanExporter::builder()
        .with_http()
        .build()
    {
        Ok(exporter) => exporter,
        Err(e) => {
            let telemetry = Telemetry {
                provider: None,
                note: Some(Note::Failed(e.to_string())),
            };
            return (None, telemetry);
        }
    };
    let service = service_name();
    let provider = SdkTracerProvider::builder()
        .with_batch_exporter(exporter)
        .with_resource(
            Resource::builder()
                .with_service_name(service.clone())
                .build(),
        )
        .build();
    let layer = tracing_opentelemetry::layer().with_tracer(provider.tracer("invoices"));
    let telemetry = Telemetry {
        provider: Some(provider),
        note: Some(Note::Exporting {
            endpoint: RedactedUrl::new(endpoint),
            service,
        }),
    };
    (Some(layer), telemetry)
}

/// `OTEL_SERVICE_NAME`, else the binary's file name (`invoice_worker`, `email_worker`,
/// `publish_jobs`).
#[cfg(feature = "opentelemetry")]
fn service_name() -> String {
    if let Ok(name) = std::env::var("OTEL_SERVICE_NAME") {
        if !name.trim().is_empty() {
            return name;
        }
    }
    std::env::args_os()
        .next()
        .and_then(|arg0| {
            let path = std::path::PathBuf::from(arg0);
            Some(path.file_stem()?.to_string_lossy().into_owned())
        })
        .unwrap_or_else(|| "invoices".to_owned())
}
