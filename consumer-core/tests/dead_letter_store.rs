//! The in-memory broker keeps its dead letters only as long as its process lives: the
//! runtime also keeps each one whole in the inbox's dead-letter table (here SQLite), before
//! the broker settles it, and the broker's own `dead_letters()` still lists it. The
//! webhook ingress's letters on PostgreSQL are in `consumer-http/tests/webhook_dead_letters.rs`.

use std::collections::BTreeMap;

use bytes::Bytes;
use consumer_core::memory::{MemoryBroker, Message};
use consumer_core::{handler, Context, DeadLetterReason, HandlerError, Worker};
use consumer_scenarios::env::{unique, wait_until, SqliteEnv};
use sqlx::Sqlite;

/// A job: its key is its message id.
#[derive(Debug, serde::Deserialize)]
struct Job {
    #[allow(dead_code)]
    n: u64,
}

#[handler(name = "memory_jobs", max_attempts = 1)]
async fn run_job(_ctx: &mut Context<'_, Sqlite>, _job: Job) -> Result<(), HandlerError> {
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_undecodable_memory_message_is_kept_whole_in_the_sqlite_dead_letter_table() {
    let env = SqliteEnv::new().await;
    let broker = MemoryBroker::new();
    let queue = unique("jobs");
    let headers = BTreeMap::from([("x-tenant".to_owned(), "t-1".to_owned())]);
    broker.publish(
        &queue,
        Message {
            id: Some("job-1".to_owned()),
            payload: Bytes::from_static(b"{\"n\": \"not a number\"}"),
            headers,
            published_at: None,
        },
    );
    let worker = Worker::new(env.inbox.clone(), run_job).expect("worker");
    let consumer = broker.consume(&queue);
    tokio::spawn(async move { worker.run(consumer, std::future::pending()).await });
    wait_until("the broker dead-lettered it", || {
        let dead = broker.depth(&queue).dead;
        async move { dead == 1 }
    })
    .await;

    // The in-process list still has it.
    let in_memory = broker.dead_letters(&queue);
    assert_eq!(
        in_memory[0].dead_letter.reason,
        DeadLetterReason::Undecodable
    );
    // And the inbox kept it whole, before the broker settled it.
    let letters = env.inbox.dead_letters().await.expect("dead letters");
    assert_eq!(letters.len(), 1, "{letters:#?}");
    let letter = &letters[0];
    assert_eq!(letter.payload.as_ref(), b"{\"n\": \"not a number\"}");
    assert_eq!(letter.message_id.as_deref(), Some("job-1"));
    assert_eq!(letter.reason, "undecodable");
    assert_eq!(letter.handler, "memory_jobs");
    assert_eq!(
        (letter.transport.as_str(), letter.location.as_str()),
        ("memory", queue.as_str())
    );
    assert_eq!(
        letter.headers.get("x-tenant").map(String::as_str),
        Some("t-1")
    );
    assert_eq!((letter.attempts, letter.deliveries), (0, 1));
    let fetched = env.inbox.dead_letter(letter.id).await.expect("fetch");
    assert_eq!(fetched.as_ref(), Some(letter));
    assert!(env
        .inbox
        .discard_dead_letter(letter.id)
        .await
        .expect("discard"));
    assert!(env.inbox.dead_letters().await.expect("list").is_empty());
}
