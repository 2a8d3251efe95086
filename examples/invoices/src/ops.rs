//! The operator's endpoints on `METRICS_ADDR`: `/metrics` (Prometheus text format),
//! `/healthz` (the process answers) and `/readyz` (the worker is consuming).
//!
//! [`Ops::install`] installs the process's Prometheus recorder; it must run before the
//! worker is built, because the worker registers its metric handles when it is built.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context as _;
use axum::extract::State;
use axum::http::{header, StatusCode};
use axum::response::IntoResponse;
use axum::routing::get;
use axum::Router;
use metrics_exporter_prometheus::{Matcher, PrometheusBuilder, PrometheusHandle};

/// Handler durations, in seconds: 1 ms to 30 s.
const DURATION_BUCKETS: &[f64] = &[
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
];

/// Batch sizes: 1 to 1024 deliveries.
const BATCH_BUCKETS: &[f64] = &[1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0, 1024.0];

/// How often the recorder's histograms are compacted (the exporter's upkeep).
const UPKEEP: Duration = Duration::from_secs(5);

/// The installed recorder, and whether the worker is ready.
#[derive(Clone)]
pub struct Ops {
    handle: PrometheusHandle,
    ready: Arc<AtomicBool>,
}

impl Ops {
    /// Installs the process's Prometheus recorder (once per process).
    pub fn install() -> anyhow::Result<Self> {
        let handle = PrometheusBuilder::new()
            .set_buckets_for_metric(
                Matcher::Full("consumer_handler_duration_seconds".into()),
                DURATION_BUCKETS,
            )
            .and_then(|b| {
                b.set_buckets_for_metric(Matcher::Full("consumer_batch_size".into()), BATCH_BUCKETS)
            })
            .context("histogram buckets")?
            .install_recorder()
            .context("installing the Prometheus recorder")?;
        Ok(Ops {
            handle,
            ready: Arc::new(AtomicBool::new(false)),
        })
    }

    /// Marks the worker ready (consuming) or not (starting, draining).
    pub fn set_ready(&self, ready: bool) {
        self.ready.store(ready, Ordering::Relaxed);
    }

    /// Binds `addr` (failing at once, naming `METRICS_ADDR`, if it cannot) and serves the
    /// endpoints in the background until the process exits. Returns the bound address.
    pub async fn serve(&self, addr: SocketAddr) -> anyhow::Result<SocketAddr> {
        let listener = tokio::net::TcpListener::bind(addr)
            .await
            .with_context(|| format!("METRICS_ADDR={addr}: cannot listen"))?;
        let bound = listener
            .local_addr()
            .context("METRICS_ADDR: local address")?;
        let app = Router::new()
            .route("/metrics", get(metrics))
            .route("/healthz", get(|| async { "ok\n" }))
            .route("/readyz", get(readyz))
            .with_state(self.clone());
        tokio::spawn(async move {
            if let Err(e) = axum::serve(listener, app).await {
                tracing::warn!(error = %e, "the metrics endpoint stopped");
            }
        });
        let handle = self.handle.clone();
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(UPKEEP);
            loop {
                tick.tick().await;
                handle.run_upkeep();
            }
        });
        Ok(bound)
    }
}

async fn metrics(State(ops): State<Ops>) -> impl IntoResponse {
    (
        [(header::CONTENT_TYPE, "text/plain; version=0.0.4")],
        ops.handle.render(),
    )
}

async fn readyz(State(ops): State<Ops>) -> impl IntoResponse {
    if ops.ready.load(Ordering::Relaxed) {
        (StatusCode::OK, "ready\n")
    } else {
        (StatusCode::SERVICE_UNAVAILABLE, "not ready\n")
    }
}
