//! Replies through the outbox on SQLite and the in-memory broker: a request's reply goes to
//! its reply address with its correlation id, a duplicate of the request is answered with
//! the same reply (at its own address, with its own correlation id), and a request without a
//! reply address is dead-lettered.

// Test code may panic: a panic is how a test fails.
#![allow(clippy::unwrap_used)]

mod common;

use std::collections::BTreeMap;
use std::sync::Mutex;

use consumer_core::header_names::{CORRELATION_ID, REPLY_TO};
use consumer_core::memory::{MemoryBroker, Message};
use consumer_core::outbox::Relay;
use consumer_core::{handler, Context, HandlerError};
use consumer_scenarios::env::{wait_until, SqliteEnv};
use futures::StreamExt;
use serde_json::json;
use sqlx::Sqlite;

use common::drain;

/// Runs of `quote` by key: a second run of a key would answer with another number. Kept
/// by key, as the tests of this file run at once.
static QUOTES: Mutex<BTreeMap<String, u64>> = Mutex::new(BTreeMap::new());

/// How many times `quote` ran for `key`.
fn quote_runs(key: &str) -> u64 {
    QUOTES.lock().unwrap().get(key).copied().unwrap_or(0)
}

/// Answers a quote request with a price and its run's number.
#[handler(name = "quote")]
async fn quote(
    ctx: &mut Context<'_, Sqlite>,
    request: serde_json::Value,
) -> Result<(), HandlerError> {
    let run = {
        let mut runs = QUOTES.lock().unwrap();
        let runs = runs.entry(ctx.key().to_owned()).or_default();
        *runs += 1;
        *runs - 1
    };
    let body = json!({"item": request["item"], "price": 42, "run": run});
    // A request without a reply address will never get one: no retry can help.
    ctx.reply(body.to_string())
        .await
        .map_err(HandlerError::permanent)?;
    Ok(())
}

fn request(id: &str, correlation: &str) -> Message {
    request_to(id, correlation, "replies")
}

fn request_to(id: &str, correlation: &str, to: &str) -> Message {
    let mut m = Message::json(id, &json!({"item": "lamp"}));
    m.headers.insert(REPLY_TO.to_owned(), to.to_owned());
    m.headers
        .insert(CORRELATION_ID.to_owned(), correlation.to_owned());
    m
}

#[tokio::test]
async fn a_duplicate_request_is_answered_with_the_same_reply() {
    let env = SqliteEnv::new().await;
    let broker = MemoryBroker::new();
    broker.publish("quotes", request("q-1", "c-1"));
    broker.publish("quotes", request("q-1", "c-1"));
    let worker = drain(&env, &broker, quote, "quotes").await;
    let stats = worker.snapshot();
    assert_eq!((stats.completed, stats.duplicates), (1, 1));
    assert_eq!(quote_runs("q-1"), 1, "the handler ran once");

    let relay = Relay::new(env.inbox.outbox(), broker.clone());
    wait_until("both replies are relayed", || async {
        relay.run_once().await.unwrap();
        broker.depth("replies").ready == 2
    })
    .await;
    let replies = [
        the_reply(&broker, "replies").await,
        the_reply(&broker, "replies").await,
    ];
    assert_eq!(replies[0].payload, replies[1].payload, "byte-identical");
    assert_eq!(replies[0].id, replies[1].id);
    for r in &replies {
        assert_eq!(r.headers[CORRELATION_ID], "c-1");
    }
}

/// The next reply waiting in `queue`, acked.
async fn the_reply(broker: &MemoryBroker, queue: &str) -> Message {
    let mut consumer = broker.consume(queue);
    let incoming = consumer.next().await.unwrap().unwrap();
    let d = &incoming.delivery;
    let reply = Message {
        id: d.message_id.clone().map(String::from),
        payload: d.payload.clone(),
        headers: d.headers.to_map(),
        published_at: d.published_at,
    };
    incoming
        .acker
        .settle(consumer_core::transport::Settlement::Ack)
        .await
        .unwrap();
    reply
}

/// A duplicate of a request, sent again by another requester (or the same one after a
/// restart) with a correlation id and a reply address of its own, is answered there and
/// with its own correlation id: the requester matches replies by it.
#[tokio::test]
async fn a_resent_reply_carries_the_duplicates_correlation_id_and_address() {
    let env = SqliteEnv::new().await;
    let broker = MemoryBroker::new();
    broker.publish("quotes-2", request_to("q-2", "corr-A", "replies-a"));
    broker.publish("quotes-2", request_to("q-2", "corr-B", "replies-b"));
    let worker = drain(&env, &broker, quote, "quotes-2").await;
    let stats = worker.snapshot();
    assert_eq!((stats.completed, stats.duplicates), (1, 1));

    let relay = Relay::new(env.inbox.outbox(), broker.clone());
    wait_until("both replies are relayed", || async {
        relay.run_once().await.unwrap();
        broker.depth("replies-a").ready == 1 && broker.depth("replies-b").ready == 1
    })
    .await;
    let (first, resent) = (
        the_reply(&broker, "replies-a").await,
        the_reply(&broker, "replies-b").await,
    );
    assert_eq!(first.headers[CORRELATION_ID], "corr-A");
    assert_eq!(resent.headers[CORRELATION_ID], "corr-B");
    assert_eq!(first.payload, resent.payload, "the same answer");
}

#[tokio::test]
async fn a_reply_needs_a_reply_address() {
    let env = SqliteEnv::new().await;
    let broker = MemoryBroker::new();
    broker.publish("quotes", Message::json("q-3", &json!({"item": "lamp"})));
    drain(&env, &broker, quote, "quotes").await;
    let dead = broker.dead_letters("quotes");
    assert_eq!(dead.len(), 1);
    let error = &dead[0].dead_letter.error;
    assert!(error.contains("no reply address"), "{error}");
}
