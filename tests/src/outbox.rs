//! The outbox scenarios both brokers run (`tests/tests/outbox_{amqp,kafka}.rs`): what a
//! transaction writes is published once it commits and never if it rolls back; two relays on
//! one table publish every row, each key's rows in order. Each broker supplies its publisher
//! and a way to read back what reached the destination.

use std::collections::{BTreeMap, HashSet};
use std::future::Future;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use consumer_core::outbox::{OutboxMessage, PublishError, Publisher, Relay, RelayConfig};
use consumer_core::{handler, Context, HandlerError, Inbox};
use futures::future::BoxFuture;
use serde_json::json;
use sqlx::Postgres;
use tokio::sync::Semaphore;

use crate::common::{wait_until, DEADLINE};

/// A message as read back from the broker.
#[derive(Debug, Clone)]
pub struct Received {
    /// Its message id.
    pub message_id: Option<String>,
    /// Its body.
    pub body: Vec<u8>,
}

/// Holds the publish of each message id in `held` until released; records what it began
/// to publish and what it published, in order.
#[derive(Clone)]
pub struct Gate {
    held: Arc<HashSet<String>>,
    /// One permit releases one held publish.
    pub release: Arc<Semaphore>,
    /// The ids whose publish began, in order.
    pub begun: Arc<Mutex<Vec<String>>>,
    published: Arc<Mutex<Vec<String>>>,
}

impl Gate {
    /// A gate holding the publish of `ids`.
    pub fn holding(ids: &[&str]) -> Self {
        Gate {
            held: Arc::new(ids.iter().map(|&id| id.to_owned()).collect()),
            release: Arc::new(Semaphore::new(0)),
            begun: Arc::default(),
            published: Arc::default(),
        }
    }

    /// The ids published, in order.
    pub fn published(&self) -> Vec<String> {
        self.published.lock().expect("not poisoned").clone()
    }
}

impl Publisher for Gate {
    fn publish<'a>(&'a self, m: &'a OutboxMessage) -> BoxFuture<'a, Result<(), PublishError>> {
        Box::pin(async move {
            let id = m.message_id.clone().expect("the relay sets the id");
            self.begun.lock().expect("not poisoned").push(id.clone());
            if self.held.contains(&id) {
                self.release.acquire().await.expect("open").forget();
            }
            self.published.lock().expect("not poisoned").push(id);
            Ok(())
        })
    }
}

/// Writes `message` in a transaction of its own on the inbox's pool and commits (or rolls
/// back); returns its id.
pub async fn write(inbox: &Inbox<Postgres>, message: OutboxMessage, commit: bool) -> String {
    let mut tx = inbox.pool().begin().await.expect("begin");
    let id = inbox
        .outbox()
        .enqueue(&mut tx, &message)
        .await
        .expect("enqueue");
    if commit {
        tx.commit().await.expect("commit");
    } else {
        tx.rollback().await.expect("rollback");
    }
    id
}

/// Runs rounds of `relay` until the outbox has no unpublished row.
pub async fn relay_all(inbox: &Inbox<Postgres>, relay: &Relay<Postgres>) {
    wait_until("the outbox is published", || async {
        relay.run_once().await.expect("relay round");
        inbox.outbox().stats().await.expect("stats").pending == 0
    })
    .await;
}

/// A rolled-back transaction's message is never published; a committed one is published
/// once, with its id, headers and body.
pub async fn rollback_and_commit<R, Fut>(
    inbox: Inbox<Postgres>,
    publisher: impl Publisher,
    destination: &str,
    read: R,
) where
    R: Fn(usize) -> Fut,
    Fut: Future<Output = Vec<Received>>,
{
    let m = |n: u32| {
        OutboxMessage::json(destination, &json!({"n": n}))
            .expect("json")
            .header("x-test", "outbox")
    };
    write(&inbox, m(1), false).await;
    let committed = write(&inbox, m(2), true).await;
    let relay = Relay::new(inbox.outbox(), publisher);
    relay_all(&inbox, &relay).await;
    assert_eq!(
        relay.run_once().await.expect("round").taken,
        0,
        "nothing left after one publish"
    );
    let got = read(1).await;
    assert_eq!(got.len(), 1, "only the committed message: {got:?}");
    assert_eq!(got[0].message_id.as_deref(), Some(committed.as_str()));
    assert_eq!(got[0].body, br#"{"n":2}"#);
}

/// `count` messages over `keys` keys, written in transactions of 7, relayed by two relays
/// (each on its own pool, as two processes) at once, each running three rounds at once of
/// small batches: every message arrives, once in this normal case, and each key's arrive in
/// the order they were written.
pub async fn two_relays_keep_key_order<R, Fut>(
    inboxes: [Inbox<Postgres>; 2],
    publishers: [Arc<dyn Publisher>; 2],
    destination: &str,
    count: usize,
    keys: usize,
    read: R,
) where
    R: Fn(usize) -> Fut,
    Fut: Future<Output = Vec<Received>>,
{
    let inbox = inboxes[0].clone();
    let mut written = Vec::new();
    for chunk in (0..count).collect::<Vec<_>>().chunks(7) {
        let mut tx = inbox.pool().begin().await.expect("begin");
        for &n in chunk {
            let key = format!("k{}", n % keys);
            let m = OutboxMessage::json(destination, &json!({"key": key, "n": n}))
                .expect("json")
                .key(key.clone())
                .message_id(format!("{key}-{n}"));
            inbox.outbox().enqueue(&mut tx, &m).await.expect("enqueue");
            written.push(n);
        }
        tx.commit().await.expect("commit");
    }
    let config = RelayConfig::default()
        .with_batch(10)
        .with_rounds(3)
        .with_backoff(Duration::from_millis(10), Duration::from_millis(100));
    let [a, b] = inboxes;
    let [pa, pb] = publishers;
    let ra = Relay::new(a.outbox(), pa)
        .with_config(config.clone())
        .expect("relay");
    let rb = Relay::new(b.outbox(), pb)
        .with_config(config)
        .expect("relay");
    let (stop, stopped) = tokio::sync::watch::channel(false);
    let until_stopped = move || {
        let mut stopped = stopped.clone();
        async move {
            let _ = stopped.wait_for(|s| *s).await;
        }
    };
    let relays = tokio::spawn(async move {
        let (one, two) = tokio::join!(ra.run(until_stopped()), rb.run(until_stopped()));
        one.and(two)
    });
    wait_until("the outbox is published", || async {
        inbox.outbox().stats().await.expect("stats").pending == 0
    })
    .await;
    stop.send(true).expect("the relays run");
    relays
        .await
        .expect("the relays end")
        .expect("the relays run");

    let got = read(count).await;
    let mut seen = HashSet::new();
    let mut last: BTreeMap<String, i64> = BTreeMap::new();
    for r in &got {
        let v: serde_json::Value = serde_json::from_slice(&r.body).expect("json body");
        let key = v["key"].as_str().expect("key").to_owned();
        let n = v["n"].as_i64().expect("n");
        assert!(
            seen.insert(n),
            "message {n} published twice by two relays: {:?}",
            r.message_id
        );
        if let Some(before) = last.insert(key.clone(), n) {
            assert!(before < n, "key {key}: {n} arrived after {before}");
        }
    }
    assert_eq!(seen.len(), count, "every message arrived");
}

/// The consumer of the relayed events: records each event's `n` in the `ledger` table, in
/// its transaction.
#[handler(name = "outbox_event")]
pub async fn count_event(
    ctx: &mut Context<'_, Postgres>,
    event: serde_json::Value,
) -> Result<(), HandlerError> {
    sqlx::query("INSERT INTO ledger (job_id, attempt) VALUES ($1, $2)")
        .bind(event["n"].to_string())
        .bind(i32::try_from(ctx.attempt()).unwrap_or(i32::MAX))
        .execute(ctx.db())
        .await?;
    Ok(())
}

/// How many events the consumer ran (rows of `ledger`).
pub async fn events_run(inbox: &Inbox<Postgres>) -> i64 {
    sqlx::query_scalar("SELECT count(*) FROM ledger")
        .fetch_one(inbox.pool())
        .await
        .expect("count the ledger")
}

/// How long a test waits for a broker to hand back what it expects.
pub const READ_LIMIT: Duration = DEADLINE;
