//! The webhook ingress under test: its router served on `127.0.0.1:0`, a `Worker` with a
//! `#[handler]` on its transport, a reqwest client signing like a provider (with the `hmac`
//! crate directly, not the crate's own `sign`), and PostgreSQL (a fresh schema per test).
//! The handler writes one `effects` row per run that commits.

use std::str::FromStr;
use std::time::{Duration, SystemTime};

use consumer_core::inbox::EntryStatus;
use consumer_core::{handler, Context, HandlerError, Inbox, InboxConfig, Worker, WorkerConfig};
use consumer_http::webhook::DEFAULT_SIGNATURE_HEADER;
use consumer_http::{WebhookIngress, WebhookIngressBuilder};
use hmac::{Hmac, Mac};
use serde_json::{json, Value};
use sha2::Sha256;
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::{PgPool, Postgres};

use super::{database_url, unique, Answer};

pub const SECRET: &str = "whsec_current";
pub const OLD_SECRET: &str = "whsec_rotated_out";
pub const HANDLER: &str = "provider_events";

/// Records the event as an effect in the key's transaction. `"permanent": true` fails for
/// good; `"fail_before_attempt": n` fails (after its write, which rolls back) until the
/// inbox counts attempt `n`; `"hold_ms": n` takes that long first.
#[handler(name = "provider_events", max_attempts = 3, backoff = "10ms..50ms")]
pub async fn on_event(ctx: &mut Context<'_, Postgres>, event: Value) -> Result<(), HandlerError> {
    if let Some(ms) = event["hold_ms"].as_u64() {
        // A slow call to the provider's API, before the write.
        tokio::time::sleep(Duration::from_millis(ms)).await;
    }
    if event["permanent"] == json!(true) {
        return Err(HandlerError::permanent("the event names no known account"));
    }
    sqlx::query("INSERT INTO effects (event_id, body) VALUES ($1, $2)")
        .bind(ctx.key().to_owned())
        .bind(event.to_string())
        .execute(ctx.db())
        .await?;
    if let Some(n) = event["fail_before_attempt"].as_u64() {
        if u64::from(ctx.attempt()) < n {
            return Err(HandlerError::transient("the provider's API is unavailable"));
        }
    }
    Ok(())
}

/// The ingress's router on `127.0.0.1:0`, a worker on its transport, and the database.
pub struct Ingress {
    pub base: String,
    pub client: reqwest::Client,
    pub pool: PgPool,
    pub inbox: Inbox<Postgres>,
    pub worker: Worker<Postgres, on_event>,
    pub stop: Option<tokio::sync::oneshot::Sender<()>>,
    pub running: Option<tokio::task::JoinHandle<Result<(), consumer_core::Error>>>,
}

impl Ingress {
    /// The ingress at `/webhooks/provider` with the current and the rotated-out secret,
    /// changed by `configure`.
    pub async fn start(
        configure: impl FnOnce(WebhookIngressBuilder) -> WebhookIngressBuilder,
    ) -> Self {
        let schema = unique("webhook");
        let options = PgConnectOptions::from_str(&database_url())
            .expect("DATABASE_URL")
            .options([("search_path", schema.as_str())]);
        let pool = PgPoolOptions::new()
            .max_connections(16)
            .acquire_timeout(Duration::from_secs(30))
            .connect_with(options)
            .await
            .expect("connect to PostgreSQL");
        sqlx::raw_sql(&format!(
            "CREATE SCHEMA \"{schema}\"; \
             CREATE TABLE \"{schema}\".effects (event_id TEXT NOT NULL, body TEXT NOT NULL);"
        ))
        .execute(&pool)
        .await
        .expect("create the test schema");
        let inbox = Inbox::new(pool.clone(), InboxConfig::in_schema(schema))
            .await
            .expect("inbox");
        let builder = WebhookIngress::builder("/webhooks/provider")
            .secret(OLD_SECRET)
            .secret(SECRET)
            .answer_within(Duration::from_secs(60));
        let (router, transport) = configure(builder).build().expect("ingress").into_parts();
        let config = WorkerConfig::default().with_concurrency(8);
        let worker = Worker::with_config(inbox.clone(), on_event, config).expect("worker");
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let running = tokio::spawn({
            let worker = worker.clone();
            async move {
                worker
                    .run(transport, async {
                        let _ = stopped.await;
                    })
                    .await
            }
        });
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let addr = listener.local_addr().expect("address");
        tokio::spawn(async move { axum::serve(listener, router).await });
        Ingress {
            base: format!("http://{addr}/webhooks/provider"),
            client: reqwest::Client::new(),
            pool,
            inbox,
            worker,
            stop: Some(stop),
            running: Some(running),
        }
    }

    /// Posts `body` with the signature header `signature` (none if `None`) and `headers`.
    pub async fn post(
        &self,
        body: &str,
        signature: Option<&str>,
        headers: &[(&str, &str)],
    ) -> Answer {
        let mut request = self
            .client
            .post(&self.base)
            .header("content-type", "application/json")
            .body(body.to_owned());
        if let Some(signature) = signature {
            request = request.header(DEFAULT_SIGNATURE_HEADER, signature);
        }
        for (name, value) in headers {
            request = request.header(*name, *value);
        }
        Answer::read(request.send().await.expect("send"))
            .await
            .expect("body")
    }

    /// Posts `body` signed now with the current secret, as the provider does.
    pub async fn deliver(&self, body: &Value) -> Answer {
        let body = body.to_string();
        self.post(&body, Some(&signature(SECRET, now(), &body)), &[])
            .await
    }

    /// The effect rows, and the distinct event ids among them.
    pub async fn effects(&self) -> (i64, i64) {
        sqlx::query_as("SELECT count(*), count(DISTINCT event_id) FROM effects")
            .fetch_one(&self.pool)
            .await
            .expect("count effects")
    }

    /// Every row of the inbox table, of any handler.
    pub async fn inbox_rows(&self) -> i64 {
        let sql = format!("SELECT count(*) FROM {}", self.inbox.table());
        sqlx::query_scalar(&sql)
            .fetch_one(&self.pool)
            .await
            .expect("count inbox rows")
    }

    pub async fn entry_status(&self, key: &str) -> Option<(EntryStatus, u32)> {
        self.inbox
            .entry(HANDLER, key)
            .await
            .expect("inbox entry")
            .map(|e| (e.status, e.attempts))
    }

    /// Stops the worker gracefully.
    pub async fn stop_worker(&mut self) {
        if let Some(stop) = self.stop.take() {
            stop.send(()).expect("the worker is still running");
        }
        if let Some(running) = self.running.take() {
            running
                .await
                .expect("the worker task")
                .expect("the worker stopped cleanly");
        }
    }
}

/// The signature header a provider sends: `t=<t>,v1=<hex HMAC-SHA256 of "<t>.<body>">`.
pub fn signature(secret: &str, t: i64, body: &str) -> String {
    let mut mac = Hmac::<Sha256>::new_from_slice(secret.as_bytes()).unwrap();
    mac.update(format!("{t}.{body}").as_bytes());
    format!("t={t},v1={}", hex::encode(mac.finalize().into_bytes()))
}

pub fn now() -> i64 {
    let secs = SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .unwrap()
        .as_secs();
    i64::try_from(secs).unwrap()
}

pub fn assert_problem(answer: &Answer, status: u16) {
    assert_eq!(answer.status, status, "{answer:?}");
    assert_eq!(
        answer.header("content-type"),
        Some("application/problem+json"),
        "{answer:?}"
    );
}
