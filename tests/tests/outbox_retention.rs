//! What a relay on PostgreSQL leaves of the rows it published: with no retention, nothing
//! (the round that publishes a row deletes it); with a retention, the rows, marked.

use std::time::Duration;

use consumer_core::outbox::{OutboxMessage, Relay, RelayConfig};
use consumer_core::Inbox;
use consumer_tests::common::PgEnv;
use consumer_tests::outbox::{relay_all, write, Gate};
use sqlx::Postgres;

/// The message ids in the outbox table, in order, and whether each is marked published.
async fn rows(inbox: &Inbox<Postgres>) -> Vec<(String, bool)> {
    sqlx::query_as(&format!(
        "SELECT message_id, published_at IS NOT NULL FROM {} ORDER BY id",
        inbox.outbox().table()
    ))
    .fetch_all(inbox.pool())
    .await
    .expect("rows")
}

/// Writes `ids`, one row of key `k` each, and relays them all through a gate that holds
/// nothing, with `config`; returns what the gate published.
async fn relay_ids(inbox: &Inbox<Postgres>, ids: &[&str], config: RelayConfig) -> Vec<String> {
    for id in ids {
        let m = OutboxMessage::new("events", "x").key("k").message_id(*id);
        write(inbox, m, true).await;
    }
    let gate = Gate::holding(&[]);
    let relay = Relay::new(inbox.outbox(), gate.clone())
        .with_config(config)
        .expect("relay");
    relay_all(inbox, &relay).await;
    gate.published()
}

#[tokio::test]
async fn with_no_retention_the_round_that_publishes_a_row_deletes_it() {
    let env = PgEnv::new().await;
    let inbox = env.inbox().await;
    let config = RelayConfig::default()
        .with_batch(2)
        .with_retention(Duration::ZERO);
    let published = relay_ids(&inbox, &["m1", "m2", "m3"], config).await;
    assert_eq!(published, ["m1", "m2", "m3"]);
    assert_eq!(rows(&inbox).await, []);
    let stats = inbox.outbox().stats().await.expect("stats");
    assert_eq!((stats.pending, stats.published), (0, 0));
}

#[tokio::test]
async fn with_a_retention_published_rows_stay_marked() {
    let env = PgEnv::new().await;
    let inbox = env.inbox().await;
    let published = relay_ids(&inbox, &["m1", "m2"], RelayConfig::default()).await;
    assert_eq!(published, ["m1", "m2"]);
    let kept = vec![("m1".to_owned(), true), ("m2".to_owned(), true)];
    assert_eq!(rows(&inbox).await, kept);
    assert_eq!(inbox.outbox().stats().await.expect("stats").published, 2);
}
