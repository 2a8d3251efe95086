//! The webhook ingress's dead letters are kept whole in the inbox's dead-letter table
//! (PostgreSQL, a fresh schema per test): for each reason that used to leave no row at all
//! (`undecodable`, `payload_too_large`, `invalid_key`) and for `max_attempts_exceeded`,
//! whose resends used to turn an outage into a drop. The event is answered 200 with its
//! reason only once its letter is kept: body bytes, headers, event id, route, handler,
//! reason, error and attempts. A resend of a kept letter is answered 200 the same way, is
//! not run again, and counts one more delivery on the same row.

// A scenario's setup failing is the test failing.
#![allow(clippy::unwrap_used)]

mod common;

use std::str::FromStr;
use std::time::{Duration, SystemTime};

use common::{database_url, unique, Answer};
use consumer_core::inbox::StoredDeadLetter;
use consumer_core::{handler, Context, HandlerError, Inbox, InboxConfig, Worker, WorkerConfig};
use consumer_http::webhook::DEFAULT_SIGNATURE_HEADER;
use consumer_http::WebhookIngress;
use hmac::{Hmac, Mac};
use serde_json::json;
use sha2::Sha256;
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::{PgPool, Postgres};

const SECRET: &str = "whsec_dead_letters";
const ROUTE: &str = "/webhooks/provider";
/// The worker's payload limit: an event above it is dead-lettered `payload_too_large`
/// (the ingress itself takes bodies up to 1 MiB).
const MAX_PAYLOAD: usize = 512;

/// An event: its key is `<account>:<id>`.
#[derive(Debug, serde::Deserialize)]
struct Event {
    id: String,
    account: String,
}

/// Records the event as an effect, unless its account is in `outages` (its downstream is
/// down): then it fails, transiently.
#[handler(
    name = "provider_events",
    max_attempts = 2,
    backoff = "10ms..20ms",
    key = "{account}:{id}"
)]
async fn on_event(ctx: &mut Context<'_, Postgres>, event: Event) -> Result<(), HandlerError> {
    let down: Option<i32> = sqlx::query_scalar("SELECT 1 FROM outages WHERE account = $1")
        .bind(&event.account)
        .fetch_optional(ctx.db())
        .await?;
    if down.is_some() {
        return Err(HandlerError::transient("the ledger is unavailable"));
    }
    sqlx::query("INSERT INTO effects (event_id) VALUES ($1)")
        .bind(&event.id)
        .execute(ctx.db())
        .await?;
    Ok(())
}

/// The ingress's router on `127.0.0.1:0`, a worker on its transport, and the database.
struct Ingress {
    url: String,
    client: reqwest::Client,
    pool: PgPool,
    inbox: Inbox<Postgres>,
}

impl Ingress {
    async fn start() -> Self {
        let schema = unique("webhook_dlq");
        let options = PgConnectOptions::from_str(&database_url())
            .unwrap()
            .options([("search_path", schema.as_str())]);
        let pool = PgPoolOptions::new()
            .max_connections(8)
            .acquire_timeout(Duration::from_secs(30))
            .connect_with(options)
            .await
            .unwrap();
        sqlx::raw_sql(&format!(
            "CREATE SCHEMA \"{schema}\"; \
             CREATE TABLE \"{schema}\".effects (event_id TEXT NOT NULL); \
             CREATE TABLE \"{schema}\".outages (account TEXT PRIMARY KEY);"
        ))
        .execute(&pool)
        .await
        .unwrap();
        let inbox = Inbox::new(pool.clone(), InboxConfig::in_schema(schema))
            .await
            .unwrap();
        let (router, transport) = WebhookIngress::builder(ROUTE)
            .secret(SECRET)
            .answer_within(Duration::from_secs(60))
            .build()
            .unwrap()
            .into_parts();
        let config = WorkerConfig::default().with_max_payload_bytes(MAX_PAYLOAD);
        let worker = Worker::with_config(inbox.clone(), on_event, config).unwrap();
        tokio::spawn(async move { worker.run(transport, std::future::pending()).await });
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(async move { axum::serve(listener, router).await });
        Ingress {
            url: format!("http://{addr}{ROUTE}"),
            client: reqwest::Client::new(),
            pool,
            inbox,
        }
    }

    /// Posts `body` signed now, as the provider does, with a header of the provider's own.
    async fn deliver(&self, body: &str) -> Answer {
        let request = self
            .client
            .post(&self.url)
            .header("content-type", "application/json")
            .header("user-agent", "provider/1.0")
            .header(DEFAULT_SIGNATURE_HEADER, signature(body))
            .body(body.to_owned());
        Answer::read(request.send().await.unwrap()).await.unwrap()
    }

    /// The one letter kept, after checking there is exactly one.
    async fn only_letter(&self) -> StoredDeadLetter {
        let mut letters = self.inbox.dead_letters().await.unwrap();
        assert_eq!(letters.len(), 1, "{letters:#?}");
        letters.remove(0)
    }

    async fn effects(&self) -> i64 {
        sqlx::query_scalar("SELECT count(*) FROM effects")
            .fetch_one(&self.pool)
            .await
            .unwrap()
    }
}

/// The signature header a provider sends: `t=<t>,v1=<hex HMAC-SHA256 of "<t>.<body>">`.
fn signature(body: &str) -> String {
    let t = SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .unwrap()
        .as_secs();
    let mut mac = Hmac::<Sha256>::new_from_slice(SECRET.as_bytes()).unwrap();
    mac.update(format!("{t}.{body}").as_bytes());
    format!("t={t},v1={}", hex::encode(mac.finalize().into_bytes()))
}

/// 200, `{"received": true, "dead_lettered": reason}`.
fn assert_dead_lettered(answer: &Answer, reason: &str) {
    assert_eq!(answer.status, 200, "{answer:?}");
    assert_eq!(
        answer.json(),
        json!({"received": true, "dead_lettered": reason}),
        "{answer:?}"
    );
}

/// The letter keeps the whole message: the body byte for byte, the event id, the route, the
/// provider's headers, and why.
fn assert_kept_whole(letter: &StoredDeadLetter, body: &str, id: &str, reason: &str) {
    assert_eq!(letter.payload.as_ref(), body.as_bytes(), "{letter:#?}");
    assert_eq!(letter.message_id.as_deref(), Some(id));
    assert_eq!(letter.reason, reason);
    assert_eq!(letter.handler, "provider_events");
    assert_eq!(
        (letter.transport.as_str(), letter.location.as_str()),
        ("webhook", ROUTE)
    );
    let header = |name: &str| letter.headers.get(name).map(String::as_str);
    assert_eq!(header("content-type"), Some("application/json"));
    assert_eq!(header("user-agent"), Some("provider/1.0"));
    assert!(header("webhook-timestamp").is_some(), "{letter:#?}");
    assert!(!letter.error.is_empty(), "{letter:#?}");
    assert_eq!(letter.deliveries, 1);
}

#[tokio::test]
async fn an_undecodable_webhook_event_is_kept_whole_in_the_dead_letter_table() {
    let ingress = Ingress::start().await;
    // JSON with an id, so the ingress takes it; no `account`, so the handler cannot.
    let body = json!({"id": "evt_undecodable", "amount": 5}).to_string();
    assert_dead_lettered(&ingress.deliver(&body).await, "undecodable");
    let letter = ingress.only_letter().await;
    assert_kept_whole(&letter, &body, "evt_undecodable", "undecodable");
    assert!(letter.error.contains("account"), "{}", letter.error);
    assert_eq!(letter.attempts, 0);
}

#[tokio::test]
async fn a_webhook_event_over_the_payload_limit_is_kept_whole_in_the_dead_letter_table() {
    let ingress = Ingress::start().await;
    let padding = "x".repeat(MAX_PAYLOAD);
    let body = json!({"id": "evt_large", "account": "acct_1", "note": padding}).to_string();
    assert_dead_lettered(&ingress.deliver(&body).await, "payload_too_large");
    let letter = ingress.only_letter().await;
    assert_kept_whole(&letter, &body, "evt_large", "payload_too_large");
    assert_eq!(ingress.effects().await, 0);
}

#[tokio::test]
async fn a_webhook_event_with_an_invalid_key_is_kept_whole_in_the_dead_letter_table() {
    let ingress = Ingress::start().await;
    // The key `<account>:<id>` holds a control character: the inbox cannot hold it.
    let body = json!({"id": "evt_bad_key", "account": "acct\u{1}2"}).to_string();
    assert_dead_lettered(&ingress.deliver(&body).await, "invalid_key");
    let letter = ingress.only_letter().await;
    assert_kept_whole(&letter, &body, "evt_bad_key", "invalid_key");
    assert_eq!(ingress.effects().await, 0);
}

/// A downstream outage outlasts the event's attempts: the resend that uses up the last one
/// is dead-lettered `max_attempts_exceeded` and kept; a later resend is answered 200 with
/// the same reason, runs nothing and counts one more delivery on the same letter. Once
/// the key is released and the outage is over, the kept body replays and runs once.
#[tokio::test]
async fn a_webhook_dead_letter_is_kept_whole_and_replayable() {
    let ingress = Ingress::start().await;
    sqlx::query("INSERT INTO outages (account) VALUES ('acct_down')")
        .execute(&ingress.pool)
        .await
        .unwrap();
    let body = json!({"id": "evt_outage", "account": "acct_down"}).to_string();
    let first = ingress.deliver(&body).await;
    assert_eq!(first.status, 503, "the first attempt fails: {first:?}");
    assert!(ingress.inbox.dead_letters().await.unwrap().is_empty());
    assert_dead_lettered(&ingress.deliver(&body).await, "max_attempts_exceeded");
    let letter = ingress.only_letter().await;
    assert_kept_whole(&letter, &body, "evt_outage", "max_attempts_exceeded");
    assert_eq!(letter.key.as_deref(), Some("acct_down:evt_outage"));
    assert_eq!(letter.attempts, 2);
    assert!(
        letter.error.contains("ledger is unavailable"),
        "{letter:#?}"
    );

    // The provider resends: answered as before, not run, the same letter counted twice.
    sqlx::query("DELETE FROM outages")
        .execute(&ingress.pool)
        .await
        .unwrap();
    assert_dead_lettered(&ingress.deliver(&body).await, "max_attempts_exceeded");
    let again = ingress.only_letter().await;
    assert_eq!((again.id, again.deliveries), (letter.id, 2), "{again:#?}");
    assert_eq!(ingress.effects().await, 0, "a dead key does not run again");

    // The operator's replay: release the key, send the kept body again, discard the letter.
    let key = letter.key.as_deref().unwrap();
    assert!(ingress.inbox.release(&letter.handler, key).await.unwrap());
    let body = String::from_utf8(letter.payload.to_vec()).unwrap();
    let replayed = ingress.deliver(&body).await;
    assert_eq!(replayed.status, 200, "{replayed:?}");
    assert_eq!(replayed.json(), json!({"received": true}));
    assert_eq!(ingress.effects().await, 1);
    assert!(ingress.inbox.discard_dead_letter(letter.id).await.unwrap());
    assert!(ingress
        .inbox
        .dead_letter(letter.id)
        .await
        .unwrap()
        .is_none());
}

/// A letter the inbox cannot keep (its table is out of reach) is not answered 200: the
/// provider gets a 503 and resends, and the resend is kept.
#[tokio::test]
async fn a_dead_letter_that_cannot_be_kept_is_answered_503_and_kept_on_the_resend() {
    let ingress = Ingress::start().await;
    let table = "consumer_inbox_dead_letters";
    let rename = |from: &str, to: &str| format!("ALTER TABLE \"{from}\" RENAME TO \"{to}\"");
    sqlx::query(&rename(table, "away"))
        .execute(&ingress.pool)
        .await
        .unwrap();
    let body = json!({"id": "evt_unkept", "amount": 5}).to_string();
    let refused = ingress.deliver(&body).await;
    assert_eq!(refused.status, 503, "{refused:?}");

    sqlx::query(&rename("away", table))
        .execute(&ingress.pool)
        .await
        .unwrap();
    assert_dead_lettered(&ingress.deliver(&body).await, "undecodable");
    let letter = ingress.only_letter().await;
    assert_kept_whole(&letter, &body, "evt_unkept", "undecodable");
}
