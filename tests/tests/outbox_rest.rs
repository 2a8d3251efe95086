//! The relay's rest on PostgreSQL: a commit that writes an outbox row notifies only while a
//! relay of that outbox rests (so that under load commits do not serialize on the server's
//! notification lock), a resting relay is woken by another process's commit, and a writer
//! that did not notify (its row written before the relay came to rest, committed after) is
//! found when the relay comes to rest.

use std::time::Duration;

use consumer_core::outbox::{OutboxMessage, Relay, RelayConfig};
use consumer_core::{Inbox, InboxConfig};
use consumer_tests::common::{wait_until, PgEnv, DEADLINE};
use consumer_tests::outbox::{write, Gate};
use sqlx::postgres::PgListener;
use sqlx::Postgres;
use tokio::sync::oneshot;

/// Runs a relay of `inbox` through `publisher` with no poll within the test: only a
/// notification, or its own rounds, make it look. Returns its shutdown and the task.
fn run(
    inbox: &Inbox<Postgres>,
    publisher: &Gate,
) -> (oneshot::Sender<()>, tokio::task::JoinHandle<()>) {
    let config = RelayConfig::default().with_poll_interval(Duration::from_secs(3600));
    let relay = Relay::new(inbox.outbox(), publisher.clone())
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

/// How many sessions hold (`granted`) or wait for the rest lock of `inbox`'s outbox.
async fn rest_locks(inbox: &Inbox<Postgres>, granted: bool) -> i64 {
    sqlx::query_scalar(
        "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' \
         AND objid = to_regclass($1)::oid AND mode = 'ExclusiveLock' AND granted = $2",
    )
    .bind(inbox.outbox().table())
    .bind(granted)
    .fetch_one(inbox.pool())
    .await
    .expect("read pg_locks")
}

/// Waits until a relay of `inbox`'s outbox rests.
async fn wait_until_resting(inbox: &Inbox<Postgres>) {
    wait_until("the relay rests", || async {
        rest_locks(inbox, true).await == 1
    })
    .await;
}

fn message(id: &str) -> OutboxMessage {
    OutboxMessage::new("events", "x").message_id(id)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_commit_notifies_only_while_a_relay_of_its_outbox_rests() {
    let env = PgEnv::new().await;
    let quiet = env
        .inbox_with(InboxConfig::table("quiet").with_schema(env.schema.clone()))
        .await;
    let relayed = env
        .inbox_with(InboxConfig::table("relayed").with_schema(env.schema.clone()))
        .await;
    let mut listener = PgListener::connect_with(quiet.pool())
        .await
        .expect("listen");
    listener.listen("consumer_outbox").await.expect("listen");

    // No relay of this outbox rests: the commit does not notify.
    write(&quiet, message("q1"), true).await;
    let recorder = Gate::holding(&[]);
    let (stop, task) = run(&relayed, &recorder);
    wait_until_resting(&relayed).await;
    // The relay rests: the commit notifies, and wakes it (its poll is an hour away).
    write(&relayed, message("r1"), true).await;
    wait_until("r1 is published", || async {
        recorder.published() == ["r1"]
    })
    .await;

    // Notifications arrive in commit order: had q1's commit notified, its would be first.
    let first = tokio::time::timeout(DEADLINE, listener.recv())
        .await
        .expect("a notification within the deadline")
        .expect("the listener");
    assert_eq!(
        first.payload(),
        format!("{}.relayed_outbox", env.schema),
        "the first notification is the resting relay's outbox"
    );
    stop.send(()).expect("the relay runs");
    task.await.expect("the relay ends");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_row_written_before_the_relay_rests_and_committed_after_is_published() {
    let env = PgEnv::new().await;
    let inbox = env.inbox().await;
    write(&inbox, message("a1"), true).await;
    let recorder = Gate::holding(&["a1"]);
    let (stop, task) = run(&inbox, &recorder);

    // The relay's round holds a1 (it does not rest): a writer now takes the rest lock
    // shared, and does not notify.
    wait_until("a1's publish has begun", || async {
        !recorder.begun.lock().expect("not poisoned").is_empty()
    })
    .await;
    assert_eq!(
        rest_locks(&inbox, true).await,
        0,
        "a relay in a round does not rest"
    );
    let mut tx = inbox.pool().begin().await.expect("begin");
    inbox
        .outbox()
        .enqueue(&mut tx, &message("a2"))
        .await
        .expect("enqueue");
    recorder.release.add_permits(1);
    // Its round over, the relay comes to rest: it waits for the writer.
    wait_until("the relay waits to rest", || async {
        rest_locks(&inbox, false).await == 1
    })
    .await;
    tx.commit().await.expect("commit");
    // Nothing notified a2's commit: the relay looks once more when it has come to rest.
    wait_until("a2 is published", || async {
        recorder.published() == ["a1", "a2"]
    })
    .await;
    wait_until_resting(&inbox).await;
    stop.send(()).expect("the relay runs");
    task.await.expect("the relay ends");
}
