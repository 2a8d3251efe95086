//! The outbox on SQLite and the in-memory broker: a handler's message commits with its
//! effects or not at all; the relay publishes each committed message, again after a crash
//! between its publish and its mark (and the receiving inbox runs it once); one key's
//! messages go out in order, a failed one holding back the rest of its key and no other
//! key, however many rows it holds back, and a slow confirm holds back its own key only;
//! with no retention a round deletes what it published; a relay waiting for the broker holds
//! no write lock; a commit wakes the relay of its process. Replies are in `replies.rs`; the
//! PostgreSQL and broker variants in `tests/tests/outbox_*.rs`.

// Test code may panic: a panic is how a test fails.
#![allow(clippy::unwrap_used)]

mod common;

use std::collections::HashSet;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use consumer_core::fault::{CrashOnce, FaultAction, FaultPoint};
use consumer_core::memory::{MemoryBroker, Message};
use consumer_core::outbox::{OutboxMessage, PublishError, Publisher, Relay, RelayConfig};
use consumer_core::Error;
use consumer_scenarios::env::{wait_until, SqliteEnv};
use futures::future::BoxFuture;
use serde_json::json;

use common::{count_event, drain, place_order};

async fn outbox_rows(env: &SqliteEnv) -> Vec<(String, Option<i64>)> {
    sqlx::query_as(&format!(
        "SELECT message_id, published_at FROM {} ORDER BY id",
        env.inbox.outbox().table()
    ))
    .fetch_all(env.inbox.pool())
    .await
    .unwrap()
}

async fn ledger_count(env: &SqliteEnv, job: &str) -> i64 {
    sqlx::query_scalar("SELECT count(*) FROM ledger WHERE job_id = ?1")
        .bind(job)
        .fetch_one(env.inbox.pool())
        .await
        .unwrap()
}

#[tokio::test]
async fn a_rolled_back_handler_publishes_nothing_and_a_committed_one_publishes_once() {
    let env = SqliteEnv::new().await;
    let broker = MemoryBroker::new();
    broker.publish("orders", Message::json("o-1", &json!({"id": 1})));
    broker.publish(
        "orders",
        Message::json("o-2", &json!({"id": 2, "fail": true})),
    );
    drain(&env, &broker, place_order, "orders").await;
    assert_eq!(broker.dead_letters("orders").len(), 1);

    // Only the committed order's message is in the outbox.
    let rows = outbox_rows(&env).await;
    assert_eq!(rows.len(), 1, "{rows:?}");
    assert_eq!(rows[0].1, None, "not published before a relay ran");

    let relay = Relay::new(env.inbox.outbox(), broker.clone());
    let round = relay.run_once().await.unwrap();
    assert_eq!((round.taken, round.published, round.failed), (1, 1, 0));
    assert_eq!(relay.run_once().await.unwrap().taken, 0, "published once");
    assert_eq!(broker.depth("events").ready, 1);
    let rows = outbox_rows(&env).await;
    assert!(rows[0].1.is_some(), "marked published");
    // The id derives from the handler and the key: every attempt writes the same one.
    assert_eq!(
        rows[0].0,
        consumer_core::idempotency_key("place_order", "o-1", "outbox/0")
    );
}

#[tokio::test]
async fn a_relay_killed_between_publish_and_mark_publishes_again_and_the_consumer_runs_once() {
    let env = SqliteEnv::new().await;
    let broker = MemoryBroker::new();
    let outbox = env.inbox.outbox();
    let mut tx = env.inbox.pool().begin().await.unwrap();
    let id = outbox
        .enqueue(
            &mut tx,
            &OutboxMessage::json("events", &json!({"order": 7})).unwrap(),
        )
        .await
        .unwrap();
    tx.commit().await.unwrap();

    let faults = Arc::new(CrashOnce::new(
        FaultAction::StopWorker,
        [(FaultPoint::OutboxAfterPublish, id.clone())],
    ));
    let crashing = Relay::new(outbox.clone(), broker.clone())
        .with_config(RelayConfig::default().with_faults(faults.clone()))
        .unwrap();
    assert!(matches!(crashing.run_once().await, Err(Error::Crashed(_))));
    assert_eq!(faults.fired(), 1);
    assert_eq!(
        broker.depth("events").ready,
        1,
        "published before the crash"
    );
    assert_eq!(outbox.stats().await.unwrap().pending, 1, "but not marked");

    let relay = Relay::new(outbox.clone(), broker.clone());
    assert_eq!(relay.run_once().await.unwrap().published, 1);
    assert_eq!(broker.depth("events").ready, 2, "published twice");
    assert_eq!(outbox.stats().await.unwrap().pending, 0);

    let consumer = drain(&env, &broker, count_event, "events").await;
    assert_eq!(ledger_count(&env, "event-7").await, 1, "consumed once");
    assert_eq!(consumer.snapshot().duplicates, 1);
}

/// Writes one message to `events` for each `(key, n)`, its id `<key><n>`, in one transaction.
async fn enqueue_keyed<'a>(env: &SqliteEnv, keyed: impl IntoIterator<Item = (&'a str, u32)>) {
    let outbox = env.inbox.outbox();
    let mut tx = env.inbox.pool().begin().await.unwrap();
    for (key, n) in keyed {
        let m = OutboxMessage::new("events", "x")
            .key(key)
            .message_id(format!("{key}{n}"));
        outbox.enqueue(&mut tx, &m).await.unwrap();
    }
    tx.commit().await.unwrap();
}

/// Records what it published, in order; refuses each message id in `refuse` once.
#[derive(Default, Clone)]
struct Recording {
    published: Arc<Mutex<Vec<String>>>,
    refuse: Arc<Mutex<HashSet<String>>>,
}

impl Publisher for Recording {
    fn publish<'a>(&'a self, m: &'a OutboxMessage) -> BoxFuture<'a, Result<(), PublishError>> {
        Box::pin(async move {
            let id = m.message_id.clone().unwrap();
            if self.refuse.lock().unwrap().remove(&id) {
                return Err(PublishError::refused(format!("no route for {id}")));
            }
            self.published.lock().unwrap().push(id);
            Ok(())
        })
    }
}

#[tokio::test]
async fn one_keys_messages_go_out_in_order_and_a_failed_one_holds_back_the_rest_of_its_key() {
    let env = SqliteEnv::new().await;
    let outbox = env.inbox.outbox();
    enqueue_keyed(
        &env,
        [("a", 1), ("b", 1), ("a", 2), ("b", 2), ("a", 3), ("c", 1)],
    )
    .await;

    let publisher = Recording::default();
    publisher.refuse.lock().unwrap().insert("a2".to_owned());
    let relay = Relay::new(outbox.clone(), publisher.clone())
        .with_config(
            RelayConfig::default().with_backoff(Duration::from_millis(1), Duration::from_millis(1)),
        )
        .unwrap();
    let round = relay.run_once().await.unwrap();
    assert_eq!((round.taken, round.published, round.failed), (6, 4, 1));
    let stats = outbox.stats().await.unwrap();
    assert_eq!(
        (stats.pending, stats.failing),
        (2, 1),
        "a2 failed, a3 held back"
    );
    let ids = |p: &Recording| p.published.lock().unwrap().clone();
    let of_key = |k: &str| -> Vec<String> {
        let ids = ids(&publisher);
        ids.into_iter().filter(|id| id.starts_with(k)).collect()
    };
    assert_eq!(
        (of_key("a"), of_key("b"), of_key("c")),
        (
            vec!["a1".to_owned()],
            vec!["b1".to_owned(), "b2".to_owned()],
            vec!["c1".to_owned()]
        )
    );

    wait_until("a2 and a3 are published", || async {
        relay.run_once().await.unwrap();
        outbox.stats().await.unwrap().pending == 0
    })
    .await;
    let published = ids(&publisher);
    assert_eq!(published[4..], ["a2", "a3"], "{published:?}");
}

/// With no retention a round deletes the rows it published, in its transaction; a refused
/// row stays (counted, held back by its backoff, its key's later rows behind it) until a
/// round publishes it. With a retention, published rows stay, marked.
#[tokio::test]
async fn with_no_retention_a_round_deletes_what_it_published_and_keeps_what_failed() {
    let env = SqliteEnv::new().await;
    let outbox = env.inbox.outbox();
    enqueue_keyed(&env, [("a", 1), ("a", 2), ("a", 3), ("b", 1)]).await;
    let publisher = Recording::default();
    publisher.refuse.lock().unwrap().insert("a2".to_owned());
    let config = RelayConfig::default()
        .with_backoff(Duration::from_millis(1), Duration::from_millis(1))
        .with_retention(Duration::ZERO);
    let relay = Relay::new(outbox.clone(), publisher.clone())
        .with_config(config)
        .unwrap();

    let round = relay.run_once().await.unwrap();
    assert_eq!((round.published, round.failed), (2, 1));
    let rows = outbox_rows(&env).await;
    let left: Vec<&str> = rows.iter().map(|(id, _)| id.as_str()).collect();
    assert_eq!(
        left,
        ["a2", "a3"],
        "a1 and b1 deleted, a2 refused, a3 behind it"
    );
    assert!(rows.iter().all(|(_, published)| published.is_none()));
    let stats = outbox.stats().await.unwrap();
    assert_eq!((stats.pending, stats.failing, stats.published), (2, 1, 0));

    wait_until("a2 and a3 are published", || async {
        relay.run_once().await.unwrap();
        outbox.stats().await.unwrap().pending == 0
    })
    .await;
    assert!(outbox_rows(&env).await.is_empty());
    assert_eq!(
        *publisher.published.lock().unwrap(),
        ["a1", "b1", "a2", "a3"]
    );

    // A relay with a retention keeps what it publishes, marked.
    enqueue_keyed(&env, [("c", 1)]).await;
    let keeping = Relay::new(outbox.clone(), publisher.clone());
    assert_eq!(keeping.run_once().await.unwrap().published, 1);
    let rows = outbox_rows(&env).await;
    assert_eq!(rows.len(), 1);
    assert!(rows[0].1.is_some(), "marked published");
}

/// More rows held back behind a failed row of their key than a round takes: the next round
/// still takes the other keys' rows (the held-back rows are not taken at all).
#[tokio::test]
async fn rows_held_back_behind_a_failed_row_do_not_hold_back_other_keys() {
    let env = SqliteEnv::new().await;
    let outbox = env.inbox.outbox();
    enqueue_keyed(&env, (0..=12).map(|n| ("a", n)).chain([("b", 0)])).await;

    let publisher = Recording::default();
    publisher.refuse.lock().unwrap().insert("a0".to_owned());
    let hour = Duration::from_secs(3600);
    let relay = Relay::new(outbox.clone(), publisher.clone())
        .with_config(
            RelayConfig::default()
                .with_batch(10)
                .with_backoff(hour, hour),
        )
        .unwrap();
    let first = relay.run_once().await.unwrap();
    assert_eq!((first.taken, first.published, first.failed), (10, 0, 1));
    let second = relay.run_once().await.unwrap();
    assert_eq!(
        (second.taken, second.published),
        (1, 1),
        "the round takes b0 alone"
    );
    assert_eq!(*publisher.published.lock().unwrap(), ["b0"]);
    assert_eq!(outbox.stats().await.unwrap().pending, 13, "a0 to a12 wait");
}

/// Holds every publish until released; tells when one has begun.
#[derive(Clone)]
struct Held {
    begun: Arc<tokio::sync::Notify>,
    release: Arc<tokio::sync::Semaphore>,
}

impl Default for Held {
    fn default() -> Self {
        Held {
            begun: Arc::default(),
            release: Arc::new(tokio::sync::Semaphore::new(0)),
        }
    }
}

impl Publisher for Held {
    fn publish<'a>(&'a self, _: &'a OutboxMessage) -> BoxFuture<'a, Result<(), PublishError>> {
        Box::pin(async move {
            self.begun.notify_one();
            self.release.acquire().await.unwrap().forget();
            Ok(())
        })
    }
}

/// Holds the publish of each message id in `held` until released; records what it
/// published, in order.
#[derive(Clone)]
struct Gate {
    held: Arc<Mutex<HashSet<String>>>,
    release: Arc<tokio::sync::Semaphore>,
    published: Arc<Mutex<Vec<String>>>,
}

impl Gate {
    fn holding(ids: &[&str]) -> Self {
        Gate {
            held: Arc::new(Mutex::new(ids.iter().map(|&id| id.to_owned()).collect())),
            release: Arc::new(tokio::sync::Semaphore::new(0)),
            published: Arc::default(),
        }
    }

    fn published(&self) -> Vec<String> {
        self.published.lock().unwrap().clone()
    }
}

impl Publisher for Gate {
    fn publish<'a>(&'a self, m: &'a OutboxMessage) -> BoxFuture<'a, Result<(), PublishError>> {
        Box::pin(async move {
            let id = m.message_id.clone().unwrap();
            if self.held.lock().unwrap().contains(&id) {
                self.release.acquire().await.unwrap().forget();
            }
            self.published.lock().unwrap().push(id);
            Ok(())
        })
    }
}

/// A key whose confirm is slow holds back its own later messages only: the other keys'
/// messages of the round go out one after another meanwhile, not a message per key at a
/// time behind the slowest confirm.
#[tokio::test]
async fn a_slow_confirm_holds_back_its_own_key_only() {
    let env = SqliteEnv::new().await;
    enqueue_keyed(&env, [("a", 1), ("b", 1), ("a", 2), ("b", 2), ("b", 3)]).await;
    let publisher = Gate::holding(&["a1"]);
    let relay = Relay::new(env.inbox.outbox(), publisher.clone());
    let round = tokio::spawn(async move { relay.run_once().await });

    wait_until("b3 is published while a1 waits for its confirm", || async {
        publisher.published().contains(&"b3".to_owned())
    })
    .await;
    assert_eq!(publisher.published(), ["b1", "b2", "b3"], "a1 and a2 wait");
    publisher.release.add_permits(1);
    let round = round.await.unwrap().unwrap();
    assert_eq!((round.taken, round.published), (5, 5));
    assert_eq!(publisher.published(), ["b1", "b2", "b3", "a1", "a2"]);
}

/// While the relay waits for the broker it holds no write lock: SQLite has one writer at a
/// time, and a handler's commit must not wait for a publish.
#[tokio::test]
async fn a_relay_waiting_for_the_broker_holds_no_write_lock() {
    let env = SqliteEnv::new().await;
    enqueue_keyed(&env, [("a", 1)]).await;
    let publisher = Held::default();
    let relay = Relay::new(env.inbox.outbox(), publisher.clone());
    let round = tokio::spawn(async move { relay.run_once().await });
    publisher.begun.notified().await;

    tokio::time::timeout(Duration::from_secs(10), enqueue_keyed(&env, [("b", 1)]))
        .await
        .expect("a write waited for the relay's publish");
    publisher.release.add_permits(1);
    let round = round.await.unwrap().unwrap();
    assert_eq!((round.taken, round.published), (1, 1));
    let stats = env.inbox.outbox().stats().await.unwrap();
    assert_eq!(
        (stats.pending, stats.published),
        (1, 1),
        "b1 waits, a1 is out"
    );
}

#[tokio::test]
async fn a_commit_that_published_wakes_the_relay_of_its_process() {
    let env = SqliteEnv::new().await;
    let broker = MemoryBroker::new();
    // A poll too slow to be what publishes the message within the deadline.
    let relay = Relay::new(env.inbox.outbox(), broker.clone())
        .with_config(RelayConfig::default().with_poll_interval(Duration::from_secs(3600)))
        .unwrap();
    // A message written outside a handler before the relay starts: once it is published,
    // the relay's first round is over and it waits.
    let mut tx = env.inbox.pool().begin().await.unwrap();
    let first = OutboxMessage::json("events", &json!({"order": 0})).unwrap();
    env.inbox.outbox().enqueue(&mut tx, &first).await.unwrap();
    tx.commit().await.unwrap();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let relay = tokio::spawn(relay.run(async {
        let _ = stopped.await;
    }));
    wait_until("the relay's first round", || async {
        broker.depth("events").ready == 1
    })
    .await;
    broker.publish("orders", Message::json("o-9", &json!({"id": 9})));
    drain(&env, &broker, place_order, "orders").await;
    wait_until("the relay published the handler's event", || async {
        broker.depth("events").ready == 2
    })
    .await;
    stop.send(()).unwrap();
    relay.await.unwrap().unwrap();
}

#[tokio::test]
async fn a_handlers_message_carries_the_trace_context_of_its_request() {
    let env = SqliteEnv::new().await;
    let broker = MemoryBroker::new();
    let parent = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01";
    let mut order = Message::json("o-5", &json!({"id": 5}));
    order.headers.insert(
        consumer_core::trace::TRACEPARENT.to_owned(),
        parent.to_owned(),
    );
    broker.publish("orders", order);
    drain(&env, &broker, place_order, "orders").await;
    let headers: String = sqlx::query_scalar(&format!(
        "SELECT headers FROM {}",
        env.inbox.outbox().table()
    ))
    .fetch_one(env.inbox.pool())
    .await
    .unwrap();
    let headers: serde_json::Value = serde_json::from_str(&headers).unwrap();
    assert_eq!(headers[consumer_core::trace::TRACEPARENT], parent);
}
