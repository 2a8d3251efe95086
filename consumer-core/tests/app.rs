//! An `App` of several handlers and the relay, on SQLite and the in-memory broker: two
//! handlers on two queues, linked by the outbox, run and stop under one shutdown and each
//! event is processed once; a misconfigured or twice-named handler starts nothing and is
//! named; a worker that fails or whose transport ends stops the whole app with its error.

// Test code may panic: a panic is how a test fails.
#![allow(clippy::unwrap_used)]

mod common;

use std::sync::Arc;

use consumer_core::app::PartState;
use consumer_core::fault::{CrashOnce, FaultAction, FaultPoint};
use consumer_core::memory::{MemoryBroker, Message};
use consumer_core::{App, AppHealth, Error, WorkerConfig};
use consumer_scenarios::env::{wait_until, SqliteEnv, DEADLINE};
use serde_json::json;
use sqlx::Sqlite;
use tokio::sync::oneshot;

use common::{config, count_event, place_order};

/// `place_order` on `orders` and `count_event` on `events`, with these configurations, and
/// the relay.
fn shop(
    env: &SqliteEnv,
    broker: &MemoryBroker,
    orders: WorkerConfig,
    events: WorkerConfig,
) -> App<Sqlite> {
    App::new(env.inbox.clone())
        .handler_with(place_order, broker.consume("orders"), orders)
        .handler_with(count_event, broker.consume("events"), events)
        .relay(broker.clone())
}

/// Every job of the ledger with its number of rows, by job.
async fn ledger(env: &SqliteEnv) -> Vec<(String, i64)> {
    sqlx::query_as("SELECT job_id, count(*) FROM ledger GROUP BY job_id ORDER BY job_id")
        .fetch_all(env.inbox.pool())
        .await
        .unwrap()
}

/// The jobs of `count_event` (`event-<order>`) with their numbers of rows.
async fn events(env: &SqliteEnv) -> Vec<(String, i64)> {
    let mut jobs = ledger(env).await;
    jobs.retain(|(job, _)| job.starts_with("event-"));
    jobs
}

/// Asserts that `err` is the configuration error of `field`, naming `handler`.
fn assert_config_error(err: &Error, field: &str, handler: &str) {
    match err {
        Error::Config { field: f, reason } => {
            assert_eq!(*f, field, "{reason}");
            assert!(
                reason.contains(&format!("`{handler}`")),
                "names the handler: {reason}"
            );
        }
        other => panic!("expected a configuration error of `{field}`, got {other:?}"),
    }
}

fn state(health: &AppHealth, handler: &str) -> PartState {
    health.handler(handler).unwrap().state
}

#[tokio::test]
async fn two_handlers_and_the_relay_run_under_one_shutdown_and_each_event_is_processed_once() {
    let env = SqliteEnv::new().await;
    let broker = MemoryBroker::new();
    let app = shop(&env, &broker, config(), config().with_concurrency(2));
    let health = app.health();
    assert!(!health.is_ready(), "not ready before it runs");
    assert_eq!(state(&health, "place_order"), PartState::Idle);

    let (stop, stopped) = oneshot::channel::<()>();
    let running = tokio::spawn(app.run(async {
        let _ = stopped.await;
    }));
    wait_until("the app is ready", || async { health.is_ready() }).await;
    const ORDERS: i64 = 20;
    for id in 1..=ORDERS {
        broker.publish(
            "orders",
            Message::json(format!("o-{id}"), &json!({"id": id})),
        );
    }
    wait_until("count_event processed every event", || async {
        health.handler("count_event").unwrap().stats.completed == ORDERS as u64
    })
    .await;
    stop.send(()).unwrap();
    tokio::time::timeout(DEADLINE, running)
        .await
        .expect("the app drained in time")
        .unwrap()
        .unwrap();

    let events = events(&env).await;
    assert_eq!(events.len(), ORDERS as usize, "{events:?}");
    assert!(
        events.iter().all(|(_, n)| *n == 1),
        "one effect per event: {events:?}"
    );
    assert_eq!(
        ledger(&env).await.len(),
        2 * ORDERS as usize,
        "orders and events"
    );
    assert!(broker.depth("orders").is_drained() && broker.depth("events").is_drained());
    assert_eq!(env.inbox.outbox().stats().await.unwrap().pending, 0);
    let handlers = health.handlers();
    let names: Vec<_> = handlers.iter().map(|h| h.name.as_str()).collect();
    assert_eq!(names, ["place_order", "count_event"]);
    assert!(
        handlers.iter().all(|h| h.state == PartState::Stopped),
        "{handlers:?}"
    );
    assert_eq!(health.relay(), Some(PartState::Stopped));
    assert!(!health.is_ready(), "not ready once stopped");
}

#[tokio::test]
async fn a_misconfigured_handler_starts_nothing_and_the_error_names_the_field_and_the_handler() {
    let env = SqliteEnv::new().await;
    let broker = MemoryBroker::new();
    broker.publish("orders", Message::json("o-1", &json!({"id": 1})));
    let app = shop(&env, &broker, config(), config().with_concurrency(0));
    let health = app.health();
    let err = tokio::time::timeout(DEADLINE, app.run(std::future::pending()))
        .await
        .expect("a misconfigured app returns at once")
        .unwrap_err();
    assert_config_error(&err, "concurrency", "count_event");
    assert_eq!(
        broker.depth("orders").ready,
        1,
        "the valid handler never ran"
    );
    assert!(ledger(&env).await.is_empty());
    assert_eq!(state(&health, "place_order"), PartState::Idle);
}

#[tokio::test]
async fn two_handlers_of_one_name_are_refused_naming_it() {
    let env = SqliteEnv::new().await;
    let broker = MemoryBroker::new();
    // A shutdown that has already fired: an app that started anyway returns `Ok` at once.
    let err = App::new(env.inbox.clone())
        .handler(place_order, broker.consume("orders"))
        .handler(place_order, broker.consume("more_orders"))
        .run(async {})
        .await
        .expect_err("refused");
    assert_config_error(&err, "name", "place_order");
    let err = App::new(env.inbox.clone())
        .relay(broker.clone())
        .relay(broker.clone())
        .run(async {})
        .await
        .expect_err("refused");
    assert!(
        matches!(err, Error::Config { field: "relay", .. }),
        "{err:?}"
    );
}

#[tokio::test]
async fn a_worker_that_crashes_stops_the_app_with_its_error_and_the_other_handler_drains() {
    let env = SqliteEnv::new().await;
    let broker = MemoryBroker::new();
    // place_order commits order 2 and then crashes before acking it.
    let faults = Arc::new(CrashOnce::new(
        FaultAction::StopWorker,
        [(FaultPoint::AfterCommit, "o-2".to_owned())],
    ));
    let orders = config().with_concurrency(1).with_faults(faults.clone());
    let app = shop(&env, &broker, orders, config());
    let health = app.health();
    broker.publish("orders", Message::json("o-1", &json!({"id": 1})));
    let running = tokio::spawn(app.run(std::future::pending()));
    wait_until("order 1's event was processed", || async {
        events(&env).await.iter().any(|(job, _)| job == "event-1")
    })
    .await;
    assert!(health.is_ready(), "everything runs before the crash");
    broker.publish("orders", Message::json("o-2", &json!({"id": 2})));
    let err = tokio::time::timeout(DEADLINE, running)
        .await
        .expect("the crash ends the app")
        .unwrap()
        .unwrap_err();
    assert!(matches!(err, Error::Crashed("after_commit")), "{err:?}");
    assert_eq!(faults.fired(), 1);
    assert_eq!(state(&health, "place_order"), PartState::Failed);
    assert_eq!(state(&health, "count_event"), PartState::Stopped);
    assert_eq!(health.relay(), Some(PartState::Stopped));
    assert_eq!(
        broker.depth("orders").ready,
        1,
        "order 2 unacked, back in the queue"
    );
}

#[tokio::test]
async fn a_transport_that_ends_stops_the_app_naming_the_handler() {
    let env = SqliteEnv::new().await;
    let broker = MemoryBroker::new();
    let app = App::new(env.inbox.clone())
        .handler_with(count_event, broker.consume("events"), config())
        .handler_with(place_order, futures::stream::empty(), config())
        .relay(broker.clone());
    let health = app.health();
    let err = tokio::time::timeout(DEADLINE, app.run(std::future::pending()))
        .await
        .expect("an ended transport ends the app")
        .unwrap_err();
    match &err {
        Error::Transport(e) => assert!(e.to_string().contains("`place_order`"), "{e}"),
        other => panic!("expected a transport error, got {other:?}"),
    }
    assert_eq!(state(&health, "place_order"), PartState::Failed);
    assert_eq!(state(&health, "count_event"), PartState::Stopped);
}
