//! The `consumer dlq` commands on the inbox's dead-letter table (`--broker inbox`), with a
//! webhook ingress served on `127.0.0.1:0` and PostgreSQL: an event whose downstream is
//! down past its attempts and an undecodable one are kept; `list` groups them, `show`
//! prints the kept body; once the outage is over, `replay` posts the first to the route,
//! signed with the ingress's secret, and it runs once; a replay of the undecodable one is
//! dead-lettered again, reported failed, and its letter stays; `discard` drops it.

use std::time::{Duration, SystemTime};

use consumer_core::{handler, Context, HandlerError, Inbox, Worker};
use consumer_http::webhook::{sign, DEFAULT_SIGNATURE_HEADER};
use consumer_http::WebhookIngress;
use consumer_tests::common::PgEnv;
use serde::Deserialize;
use serde_json::json;
use sqlx::Postgres;
use support::{consumer, json_of};

mod support;

const SECRET: &str = "whsec_cli_replay";

#[derive(Debug, Deserialize)]
struct Event {
    id: String,
    account: String,
}

/// Records the event, unless its account is in `outages`: then it fails, transiently.
#[handler(name = "cli_webhook_events", max_attempts = 2, backoff = "10ms..20ms")]
async fn on_event(ctx: &mut Context<'_, Postgres>, event: Event) -> Result<(), HandlerError> {
    let down: Option<i32> = sqlx::query_scalar("SELECT 1 FROM outages WHERE account = $1")
        .bind(&event.account)
        .fetch_optional(ctx.db())
        .await?;
    if down.is_some() {
        return Err(HandlerError::transient("the ledger is unavailable"));
    }
    sqlx::query("INSERT INTO ledger (job_id, attempt) VALUES ($1, 1)")
        .bind(&event.id)
        .execute(ctx.db())
        .await?;
    Ok(())
}

/// Posts `body` to `url`, signed now; the status and the JSON answer.
async fn deliver(url: &str, body: &str) -> (u16, serde_json::Value) {
    let t = SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .expect("after 1970")
        .as_secs();
    let t = i64::try_from(t).expect("in range");
    let answer = reqwest::Client::new()
        .post(url)
        .header("content-type", "application/json")
        .header(
            DEFAULT_SIGNATURE_HEADER,
            sign(SECRET.as_bytes(), t, body.as_bytes()),
        )
        .body(body.to_owned())
        .send()
        .await
        .expect("an answer");
    let status = answer.status().as_u16();
    (status, answer.json().await.unwrap_or_default())
}

async fn ledger(inbox: &Inbox<Postgres>) -> i64 {
    sqlx::query_scalar("SELECT count(*) FROM ledger")
        .fetch_one(inbox.pool())
        .await
        .expect("count the ledger")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn inbox_dead_letters_are_listed_shown_replayed_to_the_route_and_discarded() {
    let pg = PgEnv::new().await;
    let inbox = pg.inbox().await;
    sqlx::raw_sql(
        "CREATE TABLE outages (account TEXT PRIMARY KEY); INSERT INTO outages VALUES ('down')",
    )
    .execute(inbox.pool())
    .await
    .expect("the outages table");
    let (router, transport) = WebhookIngress::builder("/webhooks/provider")
        .secret(SECRET)
        .answer_within(Duration::from_secs(60))
        .build()
        .expect("ingress")
        .into_parts();
    let worker = Worker::new(inbox.clone(), on_event).expect("worker");
    tokio::spawn(async move { worker.run(transport, std::future::pending()).await });
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let url = format!(
        "http://{}/webhooks/provider",
        listener.local_addr().expect("addr")
    );
    tokio::spawn(async move { axum::serve(listener, router).await });

    let outage = json!({"id": "evt_outage", "account": "down"}).to_string();
    assert_eq!(deliver(&url, &outage).await.0, 503);
    let (status, answer) = deliver(&url, &outage).await;
    assert_eq!(
        (status, &answer["dead_lettered"]),
        (200, &json!("max_attempts_exceeded"))
    );
    let garbled = json!({"id": "evt_garbled"}).to_string();
    let (status, answer) = deliver(&url, &garbled).await;
    assert_eq!(
        (status, &answer["dead_lettered"]),
        (200, &json!("undecodable"))
    );

    let env = [
        ("DB_SCHEMA", pg.schema.as_str()),
        ("DLQ_BROKER", "inbox"),
        ("DLQ_REPLAY_URL", url.as_str()),
        ("WEBHOOK_SECRET", SECRET),
    ];
    let listed = json_of(&["dlq", "list"], &env).await;
    assert_eq!(listed["total"], 2, "{listed}");
    let letters = inbox.dead_letters().await.expect("letters");
    let id_of = |reason: &str| {
        let letter = letters.iter().find(|l| l.reason == reason).expect("kept");
        letter.id.to_string()
    };
    let (outage_id, garbled_id) = (id_of("max_attempts_exceeded"), id_of("undecodable"));
    let shown = json_of(&["dlq", "show", &outage_id], &env).await;
    assert_eq!(shown[0]["payload"], outage, "{shown}");
    assert_eq!(shown[0]["key"], "evt_outage");
    assert_eq!(shown[0]["properties"]["transport"], "webhook");

    sqlx::query("DELETE FROM outages")
        .execute(inbox.pool())
        .await
        .expect("the outage is over");
    let replayed = json_of(
        &["dlq", "replay", "--reason", "max_attempts_exceeded"],
        &env,
    )
    .await;
    assert_eq!(replayed["replayed"], 1, "{replayed}");
    assert_eq!(replayed["messages"][0]["key_released"], true, "{replayed}");
    assert_eq!(ledger(&inbox).await, 1);
    let left = inbox.dead_letters().await.expect("letters");
    assert_eq!(left.len(), 1, "{left:#?}");

    // The undecodable one cannot run: replayed, it is dead-lettered again and stays.
    let out = consumer(&["dlq", "replay", &garbled_id, "--json"], &env).await;
    assert!(
        !out.status.success(),
        "a replay that was dead-lettered again is a failure"
    );
    let again = inbox.dead_letters().await.expect("letters");
    assert_eq!((again.len(), again[0].deliveries), (1, 2), "{again:#?}");

    let discarded = json_of(&["dlq", "discard", "--all"], &env).await;
    assert_eq!(discarded["purged"], 1, "{discarded}");
    assert!(inbox.dead_letters().await.expect("letters").is_empty());
    assert_eq!(ledger(&inbox).await, 1, "nothing ran twice");
}
