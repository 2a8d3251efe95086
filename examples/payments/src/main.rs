//! Run with: `eval "$(scripts/servers.sh env postgres)"; cargo run -p payments`
//!
//! An HTTP service whose effects happen once however often a request is retried:
//!
//! - `POST /payments` and `POST /refunds` take an API key (`Authorization: Bearer <key>`,
//!   from `PAYMENTS_API_KEYS`; an unknown or missing one is 401) naming the caller's account.
//!   The `Idempotency-Key` layer keeps each account's answers apart: another account
//!   sending the same key and body gets its own run, never the first account's answer.
//! - `POST /payments` with an `Idempotency-Key` header and `{"order_id", "amount"}` charges
//!   the order through the provider stand-in (a row in `charges`) in the request's
//!   transaction, which also stores the answer: a retry gets the same answer, byte for byte,
//!   and charges nothing; the same key with another body is 422.
//! - `POST /refunds` (a long operation) with an `Idempotency-Key` and `{"order_id",
//!   "amount"}` records the refund as an operation in the request's transaction and answers
//!   `202 Accepted` with its `operation_id` and `Location: /operations/<id>` at once
//!   (`IdempotentTx::start_operation`); a retry gets the same 202 and id.
//!   `GET /operations/<id>` (the layer's status route) tells the account that started it
//!   how it went: a background task stands in for the provider, refunding each pending
//!   operation in the transaction that finishes it (`Operations::succeed`).
//! - `POST /webhooks/provider` takes the provider's signed events (`Webhook-Signature:
//!   t=<unix seconds>,v1=<hex HMAC-SHA256 of "t.body">`, secret `WEBHOOK_SECRET`) and runs
//!   `on_provider_event` once per event id through the consumer's inbox: a resend is answered
//!   200 and runs nothing.
//!
//! Settings from the environment (a value that does not parse, or that the layer refuses,
//! stops the process with an error naming the variable):
//!
//! - `DATABASE_URL`; `DB_SCHEMA` (the connection's default schema);
//! - `PAYMENTS_ADDR` (`127.0.0.1:8080`; port 0 picks a free one);
//! - `WEBHOOK_SECRET` (`whsec_example`);
//! - `PAYMENTS_API_KEYS` (`sk_example=acct_example`): the API keys and their accounts, as
//!   `key=account` entries separated by commas (an error names the entry, never a key);
//! - `IDEMPOTENCY_LEASE_MS` (1000): how long the Redis fast path's lease holds a key if the
//!   process dies mid-request (a running request renews it; the database's hold on the key
//!   ends with the process);
//! - `IDEMPOTENCY_TTL_MS` (86400000, 24 h, at least the lease): how long a completed answer
//!   is replayed; after it the key runs again. The layer purges expired records every TTL
//!   (at least every second, at most every hour);
//! - `REDIS_URL` (unset or empty: none): puts the Redis fast path in front of the database
//!   (replays and concurrent duplicates answered from Redis; the database still decides);
//! - `METRICS_ADDR` (unset: none): serves the layer's and the webhook worker's metrics at
//!   `GET /metrics` there (port 0 picks a free one, logged as `serving /metrics bound=ADDR`);
//! - `IDEMPOTENCY_GAUGE_MS` (30000): how often the layer sets its gauges (records by status,
//!   the oldest request in progress).
//!
//! The address it listens on is logged as `listening on ADDR`; SIGTERM or Ctrl-C stops it
//! after the requests in flight.
//!
//! Three settings show the provider failing or slow, all off by default:
//!
//! - `PAYMENTS_PROVIDER_OUTAGE=N`: the payment provider is down for the first N charges
//!   the process makes. Each answers `502 Bad Gateway` after its `INSERT`, which rolls back;
//!   the layer does not store a 5xx and frees the key, so the client's retry with the
//!   same `Idempotency-Key` runs the charge again, and charges once.
//! - `PAYMENTS_PROVIDER_LATENCY_MS=MS`: each charge takes that long at the provider (after
//!   its `INSERT`, before its answer): a retry sent meanwhile waits for the first request
//!   and gets its answer.
//! - `PAYMENTS_ABORT_AFTER_CHARGE=ORDER` makes the process abort right after charging that
//!   order, before its transaction commits and before it answers: the charge rolls back
//!   with the stored answer and the claim, and the client's retry charges once.

use std::str::FromStr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

mod auth;

use anyhow::Context as _;
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::IntoResponse;
use axum::routing::post;
use axum::{Json, Router};
use consumer_core::{handler, Context, HandlerError, Inbox, InboxConfig, Worker};
use consumer_http::{
    IdempotencyConfig, IdempotencyLayer, IdempotencyStore, IdempotentTx, Operations, RedisFastPath,
    StoreConfig, WebhookIngress,
};
use serde::Deserialize;
use serde_json::json;
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::{PgPool, Postgres};

#[derive(Debug, Deserialize)]
struct Payment {
    order_id: i64,
    amount: i64,
}

/// The payment provider stand-in: a row in `charges`, an outage of a number of charges
/// (`PAYMENTS_PROVIDER_OUTAGE`) and a latency (`PAYMENTS_PROVIDER_LATENCY_MS`).
#[derive(Debug, Default)]
struct Provider {
    /// How many more charges find the provider down.
    outage_left: AtomicU64,
    /// How long each charge takes.
    latency: Duration,
}

impl Provider {
    /// Whether the provider is down for this charge (and one charge less of the outage).
    fn is_down(&self) -> bool {
        self.outage_left
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
            .is_ok()
    }
}

/// Charges the order: the provider stand-in's row commits with the stored answer, or not at
/// all. While the provider is down the charge answers 502, which rolls the row back and
/// releases the key.
async fn charge(
    State(provider): State<Arc<Provider>>,
    mut tx: IdempotentTx<Postgres>,
    Json(p): Json<Payment>,
) -> Result<impl IntoResponse, StatusCode> {
    let id: i64 =
        sqlx::query_scalar("INSERT INTO charges (order_id, amount) VALUES ($1, $2) RETURNING id")
            .bind(p.order_id)
            .bind(p.amount)
            .fetch_one(&mut *tx)
            .await
            .map_err(|_| StatusCode::INTERNAL_SERVER_ERROR)?;
    tokio::time::sleep(provider.latency).await;
    if provider.is_down() {
        tracing::warn!(order_id = p.order_id, "the payment provider is down");
        let answer =
            json!({"error": "the payment provider is unavailable", "order_id": p.order_id});
        return Ok((StatusCode::BAD_GATEWAY, Json(answer)));
    }
    if std::env::var("PAYMENTS_ABORT_AFTER_CHARGE").ok() == Some(p.order_id.to_string()) {
        tracing::error!(order_id = p.order_id, "aborting after the charge, as asked");
        std::process::abort();
    }
    Ok((
        StatusCode::CREATED,
        Json(json!({"charge_id": id, "order_id": p.order_id, "amount": p.amount})),
    ))
}

/// Starts the refund as a long operation in the request's transaction and answers 202 with
/// its id and where its status is: the work is done later (by [`settle_refunds`]), and the
/// stored answer makes a retry get the same id.
async fn refund(
    mut tx: IdempotentTx<Postgres>,
    Json(p): Json<Payment>,
) -> Result<impl IntoResponse, StatusCode> {
    let input = json!({"order_id": p.order_id, "amount": p.amount});
    let started = tx
        .start_operation("refund", &input)
        .await
        .map_err(|_| StatusCode::INTERNAL_SERVER_ERROR)?;
    Ok(started.accepted())
}

/// The provider stand-in: refunds the pending refund operations, a batch at a time, each
/// refund row written in the transaction that finishes its operation (so a refund is made
/// once, however many processes settle).
async fn settle_refunds(pool: PgPool, operations: Operations<Postgres>) {
    loop {
        if let Err(e) = settle_pending(&pool, &operations).await {
            tracing::warn!(error = %e, "settling refunds failed");
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

async fn settle_pending(pool: &PgPool, operations: &Operations<Postgres>) -> anyhow::Result<()> {
    for op in operations.pending("refund", 100).await? {
        let mut tx = pool.begin().await?;
        let refund_id: i64 = sqlx::query_scalar(
            "INSERT INTO refunds (operation_id, order_id, amount) VALUES ($1, $2, $3) \
             ON CONFLICT (operation_id) DO NOTHING RETURNING id",
        )
        .bind(&op.id)
        .bind(op.input["order_id"].as_i64())
        .bind(op.input["amount"].as_i64())
        .fetch_optional(&mut *tx)
        .await?
        .unwrap_or_default();
        // Another process finished it meanwhile: its refund stands, this one rolls back.
        if operations
            .succeed(&mut tx, &op.id, &json!({"refund_id": refund_id}))
            .await?
        {
            tx.commit().await?;
        }
    }
    Ok(())
}

/// A provider event: its id keys it in the inbox.
#[derive(Debug, Deserialize)]
struct ProviderEvent {
    id: String,
    #[serde(rename = "type")]
    kind: String,
}

/// Records the event once, in the inbox key's transaction.
#[handler(name = "on_provider_event")]
async fn on_provider_event(
    ctx: &mut Context<'_, Postgres>,
    event: ProviderEvent,
) -> Result<(), HandlerError> {
    sqlx::query("INSERT INTO provider_events (event_id, kind) VALUES ($1, $2)")
        .bind(&event.id)
        .bind(&event.kind)
        .execute(ctx.db())
        .await?;
    Ok(())
}

/// The setting `name`, `what` it holds, or `default` if it is unset; an error names it.
fn setting<T: FromStr>(name: &str, what: &str, default: T) -> anyhow::Result<T> {
    match std::env::var(name) {
        Ok(value) => value
            .trim()
            .parse()
            .map_err(|_| anyhow::anyhow!("the setting {name}: expected {what}, got {value:?}")),
        Err(std::env::VarError::NotPresent) => Ok(default),
        Err(e) => Err(e).with_context(|| format!("the setting {name}")),
    }
}

/// The setting `name` in milliseconds, or `default`.
fn millis(name: &str, default: Duration) -> anyhow::Result<Duration> {
    let ms = setting(
        name,
        "whole milliseconds",
        u64::try_from(default.as_millis())?,
    )?;
    Ok(Duration::from_millis(ms))
}

/// Installs the Prometheus recorder (before the layer and the worker register their
/// metrics) and serves its text at `GET /metrics` on `addr`; the address it bound.
async fn serve_metrics(addr: &str) -> anyhow::Result<std::net::SocketAddr> {
    let handle = metrics_exporter_prometheus::PrometheusBuilder::new()
        .install_recorder()
        .context("install the metrics recorder")?;
    let listener = tokio::net::TcpListener::bind(addr)
        .await
        .with_context(|| format!("listen on METRICS_ADDR {addr}"))?;
    let bound = listener.local_addr()?;
    let metrics = Router::new().route(
        "/metrics",
        axum::routing::get(move || std::future::ready(handle.render())),
    );
    tokio::spawn(async move {
        if let Err(e) = axum::serve(listener, metrics).await {
            tracing::warn!(error = %e, "the metrics endpoint stopped");
        }
    });
    Ok(bound)
}

/// A pool on `url`, its connections in `schema` (validated, created if missing) when given,
/// and the example's tables.
async fn connect(url: &str, schema: Option<&str>) -> anyhow::Result<PgPool> {
    let schema = schema
        .map(|s| consumer_core::ident::Identifier::parse("DB_SCHEMA", s))
        .transpose()?;
    let mut options = PgConnectOptions::from_str(url).context("DATABASE_URL is not a valid URL")?;
    if let Some(schema) = &schema {
        options = options.options([("search_path", schema.as_str())]);
    }
    let pool = PgPoolOptions::new()
        .max_connections(16)
        .connect_with(options)
        .await
        .context("connect to DATABASE_URL")?;
    // The schema first, if there is one and it is missing: the tables go in it (the
    // connections' `search_path`). Processes starting together take turns.
    let create_schema = schema
        .map(|s| format!("CREATE SCHEMA IF NOT EXISTS {};", s.quoted()))
        .unwrap_or_default();
    let mut tx = pool.begin().await?;
    sqlx::query("SELECT pg_advisory_xact_lock(hashtext('payments example schema'))")
        .execute(&mut *tx)
        .await?;
    sqlx::raw_sql(&format!(
        "{create_schema}
         CREATE TABLE IF NOT EXISTS charges (id BIGSERIAL PRIMARY KEY, order_id BIGINT NOT NULL, amount BIGINT NOT NULL);
         CREATE TABLE IF NOT EXISTS provider_events (event_id TEXT PRIMARY KEY, kind TEXT NOT NULL);
         CREATE TABLE IF NOT EXISTS refunds (id BIGSERIAL PRIMARY KEY, operation_id TEXT NOT NULL UNIQUE, order_id BIGINT, amount BIGINT);"
    ))
    .execute(&mut *tx)
    .await
    .context("create the example's schema and tables")?;
    tx.commit().await?;
    Ok(pool)
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| "info,sqlx=warn".into()),
        )
        .with_writer(std::io::stderr)
        .init();
    let url = std::env::var("DATABASE_URL").context("DATABASE_URL is not set")?;
    let schema = std::env::var("DB_SCHEMA").ok();
    let addr = std::env::var("PAYMENTS_ADDR").unwrap_or_else(|_| "127.0.0.1:8080".to_owned());
    let secret = std::env::var("WEBHOOK_SECRET").unwrap_or_else(|_| "whsec_example".to_owned());
    let api_keys =
        std::env::var("PAYMENTS_API_KEYS").unwrap_or_else(|_| "sk_example=acct_example".to_owned());
    let api_keys = auth::ApiKeys::parse(&api_keys)
        .map_err(|e| anyhow::anyhow!("the setting PAYMENTS_API_KEYS: {e}"))?;
    if let Ok(addr) = std::env::var("METRICS_ADDR") {
        let bound = serve_metrics(&addr).await?;
        tracing::info!(%bound, "serving /metrics");
    }
    let lease = millis("IDEMPOTENCY_LEASE_MS", Duration::from_secs(1))?;
    let gauges = millis("IDEMPOTENCY_GAUGE_MS", Duration::from_secs(30))?;
    let ttl = millis("IDEMPOTENCY_TTL_MS", consumer_http::DEFAULT_TTL)?;
    let config = IdempotencyConfig::builder()
        .lease(lease)
        .ttl(ttl)
        .gauge_interval(gauges)
        .build()
        .map_err(|e| match &e {
            consumer_http::Error::Config { field: "lease", .. } => {
                anyhow::Error::new(e).context("the setting IDEMPOTENCY_LEASE_MS")
            }
            consumer_http::Error::Config { field: "ttl", .. } => {
                anyhow::Error::new(e).context("the setting IDEMPOTENCY_TTL_MS")
            }
            consumer_http::Error::Config {
                field: "gauge_interval",
                ..
            } => anyhow::Error::new(e).context("the setting IDEMPOTENCY_GAUGE_MS"),
            _ => e.into(),
        })?;
    let redis = match std::env::var("REDIS_URL") {
        // Connects lazily; the error names the setting, never the URL's credentials.
        Ok(url) if !url.is_empty() => Some(
            RedisFastPath::builder(url)
                .build()
                .context("the setting REDIS_URL")?,
        ),
        _ => None,
    };
    let provider = Arc::new(Provider {
        outage_left: AtomicU64::new(setting(
            "PAYMENTS_PROVIDER_OUTAGE",
            "a number of charges",
            0,
        )?),
        latency: millis("PAYMENTS_PROVIDER_LATENCY_MS", Duration::ZERO)?,
    });
    let pool = connect(&url, schema.as_deref()).await?;

    let mut store_config = StoreConfig::builder();
    let mut inbox_config = InboxConfig::default();
    if let Some(schema) = &schema {
        store_config = store_config.schema(schema.clone());
        inbox_config = inbox_config.with_schema(schema.clone());
    }
    let store = IdempotencyStore::new(pool.clone(), store_config.build()?).await?;
    // A finished refund outlives every replay of the 202 that points at it.
    let operations = store.operations().keep_finished(ttl);
    tokio::spawn(settle_refunds(pool.clone(), operations));
    // Each account's answers are its own: the caller is the account `authenticate` found.
    let mut idempotency = IdempotencyLayer::builder(store, config)
        .caller(|parts| parts.extensions.get::<auth::Account>().map(|a| a.0.clone()));
    if let Some(fast) = redis {
        tracing::info!(?fast, "the Redis fast path is on");
        idempotency = idempotency.redis(fast);
    }
    let idempotency = idempotency.build();
    let operations = idempotency.operations_router();
    let inbox = Inbox::new(pool.clone(), inbox_config).await?;
    let (webhooks, events) = WebhookIngress::builder("/webhooks/provider")
        .secret(secret)
        .build()?
        .into_parts();
    let worker = Worker::new(inbox, on_provider_event)?;

    let app = Router::new()
        .route("/payments", post(charge))
        .route("/refunds", post(refund))
        .with_state(provider)
        .layer(idempotency)
        // `GET /operations/{id}`, to the account that started the operation.
        .merge(operations)
        // Outside the idempotency layer, so a request is authenticated before it.
        .layer(axum::middleware::from_fn_with_state(
            api_keys,
            auth::authenticate,
        ))
        .merge(webhooks);
    let listener = tokio::net::TcpListener::bind(&addr)
        .await
        .with_context(|| format!("listen on PAYMENTS_ADDR {addr}"))?;
    tracing::info!("listening on {}", listener.local_addr()?);

    let (stop, stopped) = tokio::sync::watch::channel(false);
    let until_stopped = |mut rx: tokio::sync::watch::Receiver<bool>| async move {
        let _ = rx.wait_for(|s| *s).await;
    };
    let events = tokio::spawn({
        let stopped = stopped.clone();
        async move { worker.run(events, until_stopped(stopped)).await }
    });
    let serve = axum::serve(listener, app).with_graceful_shutdown(until_stopped(stopped));
    let signal = async move {
        #[cfg(unix)]
        {
            use tokio::signal::unix::{signal, SignalKind};
            match signal(SignalKind::terminate()) {
                Ok(mut term) => {
                    tokio::select! {
                        _ = term.recv() => {}
                        _ = tokio::signal::ctrl_c() => {}
                    }
                }
                Err(_) => {
                    let _ = tokio::signal::ctrl_c().await;
                }
            }
        }
        #[cfg(not(unix))]
        let _ = tokio::signal::ctrl_c().await;
        tracing::info!("stopping: in-flight requests finish");
        let _ = stop.send(true);
    };
    tokio::spawn(signal);
    serve.await.context("serve")?;
    events.await.context("the webhook worker")??;
    Ok(())
}
