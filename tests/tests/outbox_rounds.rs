//! A relay's rounds on PostgreSQL, through a publisher that holds chosen messages until
//! released: while a round waits for a confirm, the next round takes and publishes other
//! keys' rows; a key's later row, left by a take because an earlier round holds the key's
//! earlier row, goes out once that round has marked it, in order, without waiting for a
//! poll.

use std::time::Duration;

use consumer_core::outbox::{OutboxMessage, Relay, RelayConfig};
use consumer_core::Inbox;
use consumer_tests::common::{wait_until, PgEnv};
use consumer_tests::outbox::{write, Gate};
use sqlx::Postgres;
use tokio::sync::oneshot;

/// Writes one message a `(key, id)`, each in a transaction of its own, in this order.
async fn write_keyed(inbox: &Inbox<Postgres>, rows: &[(&str, &str)]) {
    for (key, id) in rows {
        let m = OutboxMessage::new("events", "x").key(*key).message_id(*id);
        write(inbox, m, true).await;
    }
}

/// Runs a relay of `inbox` through `gate`, a round taking one row, two rounds at once and no
/// poll within the test; returns its shutdown and the task.
fn run(inbox: &Inbox<Postgres>, gate: &Gate) -> (oneshot::Sender<()>, tokio::task::JoinHandle<()>) {
    let config = RelayConfig::default()
        .with_batch(1)
        .with_rounds(2)
        .with_poll_interval(Duration::from_secs(3600));
    let relay = Relay::new(inbox.outbox(), gate.clone())
        .with_config(config)
        .expect("relay");
    let (stop, stopped) = oneshot::channel::<()>();
    let task = tokio::spawn(async move {
        relay
            .run(async {
                let _ = stopped.await;
            })
            .await
            .expect("the relay runs");
    });
    (stop, task)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_round_waiting_for_a_confirm_does_not_hold_back_the_next_round() {
    let env = PgEnv::new().await;
    let inbox = env.inbox().await;
    write_keyed(&inbox, &[("a", "a1"), ("b", "b1")]).await;
    let gate = Gate::holding(&["a1"]);
    let (stop, task) = run(&inbox, &gate);

    wait_until("b1 is published while a1 waits for its confirm", || async {
        gate.published() == ["b1"]
    })
    .await;
    gate.release.add_permits(1);
    wait_until("a1 is published", || async {
        inbox.outbox().stats().await.expect("stats").pending == 0
    })
    .await;
    assert_eq!(gate.published(), ["b1", "a1"]);
    stop.send(()).expect("the relay runs");
    task.await.expect("the relay ends");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_row_left_behind_a_round_goes_out_once_that_round_has_marked_its_key() {
    let env = PgEnv::new().await;
    let inbox = env.inbox().await;
    write_keyed(&inbox, &[("a", "a1"), ("a", "a2")]).await;
    let gate = Gate::holding(&["a1"]);
    let (stop, task) = run(&inbox, &gate);

    // The first round holds a1 (locked, unconfirmed); the second finds a2 behind it.
    wait_until("a1's publish has begun", || async {
        gate.begun
            .lock()
            .expect("not poisoned")
            .contains(&"a1".to_owned())
    })
    .await;
    gate.release.add_permits(1);
    // The poll is an hour away: only the first round's end can make the relay look again.
    wait_until("a2 is published after a1", || async {
        inbox.outbox().stats().await.expect("stats").pending == 0
    })
    .await;
    assert_eq!(gate.published(), ["a1", "a2"]);
    stop.send(()).expect("the relay runs");
    task.await.expect("the relay ends");
}
