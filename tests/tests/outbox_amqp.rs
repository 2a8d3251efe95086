//! The outbox on PostgreSQL, relayed to RabbitMQ: a rolled-back transaction publishes
//! nothing and a committed one publishes once; a relay killed between the broker's confirm
//! and its mark publishes the message again, and the consuming worker runs it once; two
//! relays on one table publish every row, each key's in order; an unroutable message stays
//! in the outbox, counted, and holds back its key and no other; a duplicate request is
//! answered with the stored reply; a relay whose listening connection is reset listens
//! again.

use std::str::FromStr;
use std::sync::atomic::{AtomicI32, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use consumer_amqp::AmqpPublisher;
use consumer_core::fault::{CrashOnce, FaultAction, FaultPoint};
use consumer_core::outbox::{OutboxMessage, Publisher, Relay, RelayConfig};
use consumer_core::{handler, Context, Error, HandlerError, Inbox, InboxConfig, Worker};
use consumer_tests::amqp::{config, init_tracing, unique_name, worker_config, Rabbit, Running};
use consumer_tests::common::{database_url, wait_until, PgEnv};
use consumer_tests::outbox::{self, count_event, events_run, relay_all, write, Received};
use serde_json::json;
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::Postgres;

/// Publishes to `queue` (declared): the relay's publisher.
async fn publisher(queue: &str) -> AmqpPublisher {
    AmqpPublisher::connect(config(queue))
        .await
        .expect("connect the publisher")
}

/// Waits until `queue` holds `n` messages, then takes them all.
async fn read(queue: &str, n: usize) -> Vec<Received> {
    wait_until("the messages reach the queue", || async {
        Rabbit::ready(queue).await as usize >= n
    })
    .await;
    Rabbit::take_all(queue)
        .await
        .into_iter()
        .map(|g| Received {
            message_id: g.message_id,
            body: g.body,
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rolled_back_transaction_publishes_nothing_and_a_committed_one_publishes_once() {
    init_tracing();
    let env = PgEnv::new().await;
    let queue = unique_name("outbox-events");
    let p = publisher(&queue).await;
    outbox::rollback_and_commit(env.inbox().await, p, &queue, |n| read(&queue, n)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_relays_on_one_table_publish_every_row_in_key_order() {
    init_tracing();
    let env = PgEnv::new().await;
    let queue = unique_name("outbox-order");
    let publishers: [Arc<dyn Publisher>; 2] = [
        Arc::new(publisher(&queue).await),
        Arc::new(publisher(&queue).await),
    ];
    let inboxes = [env.inbox().await, env.inbox().await];
    outbox::two_relays_keep_key_order(inboxes, publishers, &queue, 300, 5, |n| read(&queue, n))
        .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_relay_killed_between_confirm_and_mark_publishes_twice_and_the_consumer_runs_once() {
    init_tracing();
    let env = PgEnv::new().await;
    let inbox = env.inbox().await;
    let queue = unique_name("outbox-crash");
    let message = OutboxMessage::json(&queue, &json!({"n": 1})).expect("json");
    let id = write(&inbox, message, true).await;

    let faults = Arc::new(CrashOnce::new(
        FaultAction::StopWorker,
        [(FaultPoint::OutboxAfterPublish, id)],
    ));
    let crashing = Relay::new(inbox.outbox(), publisher(&queue).await)
        .with_config(RelayConfig::default().with_faults(faults.clone()))
        .expect("relay");
    assert!(matches!(crashing.run_once().await, Err(Error::Crashed(_))));
    assert_eq!(faults.fired(), 1);
    assert_eq!(inbox.outbox().stats().await.expect("stats").pending, 1);
    drop(crashing);

    let relay = Relay::new(inbox.outbox(), publisher(&queue).await);
    relay_all(&inbox, &relay).await;
    wait_until("both copies are in the queue", || async {
        Rabbit::ready(&queue).await == 2
    })
    .await;

    let worker =
        Worker::with_config(env.inbox().await, count_event, worker_config(2)).expect("worker");
    let running = Running::start(worker, config(&queue)).await;
    wait_until("the consumer settled both copies", || async {
        let s = running.worker.snapshot();
        s.completed + s.duplicates == 2
    })
    .await;
    let stats = running.stop().await;
    assert_eq!((stats.completed, stats.duplicates), (1, 1));
    assert_eq!(events_run(&inbox).await, 1, "consumed once");
}

/// A test's outbox and two destinations: `queue` (declared) and `nowhere` (no queue: the
/// broker refuses what is published there).
struct Routes {
    env: PgEnv,
    inbox: Inbox<Postgres>,
    queue: String,
    nowhere: String,
}

impl Routes {
    async fn new() -> Routes {
        init_tracing();
        let env = PgEnv::new().await;
        let inbox = env.inbox().await;
        Routes {
            env,
            inbox,
            queue: unique_name("outbox-routable"),
            nowhere: unique_name("outbox-nowhere"),
        }
    }

    /// Writes a message to each `(destination, id)`, keyed by the id's first letter, in one
    /// transaction.
    async fn enqueue<'a>(&self, rows: impl IntoIterator<Item = (&'a String, String)>) {
        let mut tx = self.inbox.pool().begin().await.expect("begin");
        for (dest, id) in rows {
            let m = OutboxMessage::new(dest.as_str(), "x")
                .key(&id[..1])
                .message_id(id.clone());
            self.inbox
                .outbox()
                .enqueue(&mut tx, &m)
                .await
                .expect("enqueue");
        }
        tx.commit().await.expect("commit");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unroutable_message_stays_in_the_outbox_counted_and_holds_back_its_key() {
    let t = Routes::new().await;
    let (inbox, queue) = (&t.inbox, &t.queue);
    t.enqueue([
        (&t.nowhere, "a1".to_owned()),
        (queue, "a2".into()),
        (queue, "b1".into()),
    ])
    .await;

    let relay = Relay::new(inbox.outbox(), publisher(queue).await);
    let round = relay.run_once().await.expect("round");
    assert_eq!((round.taken, round.published, round.failed), (3, 1, 1));
    let stats = inbox.outbox().stats().await.expect("stats");
    assert_eq!(
        (stats.pending, stats.failing),
        (2, 1),
        "a1 failed, a2 waits behind it"
    );
    let got = read(queue, 1).await;
    let ids: Vec<_> = got.iter().filter_map(|r| r.message_id.as_deref()).collect();
    assert_eq!(ids, ["b1"]);
    let (attempts, error): (i32, Option<String>) = sqlx::query_as(&format!(
        "SELECT attempts, last_error FROM {} WHERE message_id = 'a1'",
        inbox.outbox().table()
    ))
    .fetch_one(inbox.pool())
    .await
    .expect("row");
    assert_eq!(attempts, 1);
    let error = error.expect("the error is recorded");
    assert!(error.contains("refused"), "{error}");
}

/// More rows behind an unroutable row of their key than a round takes: the next round still
/// publishes the other keys' rows (the held-back rows are not taken at all).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rows_held_back_behind_an_unroutable_row_do_not_hold_back_other_keys() {
    let t = Routes::new().await;
    let (inbox, queue) = (&t.inbox, &t.queue);
    let behind = (1..=12).map(|n| (queue, format!("a{n}")));
    t.enqueue(
        std::iter::once((&t.nowhere, "a0".to_owned()))
            .chain(behind)
            .chain([(queue, "b0".to_owned())]),
    )
    .await;

    let hour = Duration::from_secs(3600);
    let relay = Relay::new(inbox.outbox(), publisher(queue).await)
        .with_config(
            RelayConfig::default()
                .with_batch(10)
                .with_backoff(hour, hour),
        )
        .expect("config");
    let first = relay.run_once().await.expect("round");
    assert_eq!((first.taken, first.published, first.failed), (10, 0, 1));
    let second = relay.run_once().await.expect("round");
    assert_eq!(
        (second.taken, second.published),
        (1, 1),
        "the round takes b0 alone"
    );
    let got = read(queue, 1).await;
    let ids: Vec<_> = got.iter().filter_map(|r| r.message_id.as_deref()).collect();
    assert_eq!(ids, ["b0"]);
}

/// A TCP proxy to PostgreSQL that can reset (RST) every connection through it at once, as a
/// network failure does.
struct ResettingProxy {
    port: u16,
    reset: tokio::sync::watch::Sender<u64>,
}

impl ResettingProxy {
    async fn start() -> ResettingProxy {
        let server = PgConnectOptions::from_str(&database_url()).expect("DATABASE_URL");
        let to = format!("{}:{}", server.get_host(), server.get_port());
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind the proxy");
        let port = listener.local_addr().expect("the proxy's address").port();
        let (reset, resets) = tokio::sync::watch::channel(0);
        tokio::spawn(async move {
            while let Ok((mut client, _)) = listener.accept().await {
                let (to, mut resets) = (to.clone(), resets.clone());
                // Only the resets from now on.
                resets.borrow_and_update();
                tokio::spawn(async move {
                    let Ok(mut server) = tokio::net::TcpStream::connect(&to).await else {
                        return;
                    };
                    let was_reset = tokio::select! {
                        _ = tokio::io::copy_bidirectional(&mut client, &mut server) => false,
                        _ = resets.changed() => true,
                    };
                    if was_reset {
                        // Closed with SO_LINGER 0: the client reads ECONNRESET.
                        let _ = client.set_zero_linger();
                    }
                });
            }
        });
        ResettingProxy { port, reset }
    }

    /// Resets every connection open through the proxy; new ones go through.
    fn reset_all(&self) {
        self.reset.send_modify(|n| *n += 1);
    }

    /// A pool of `env`'s schema (its connections named after it) through the proxy.
    async fn pool(&self, env: &PgEnv) -> sqlx::PgPool {
        let options = PgConnectOptions::from_str(&database_url())
            .expect("DATABASE_URL")
            .host("127.0.0.1")
            .port(self.port)
            .options([("search_path", env.schema.as_str())])
            .application_name(&env.schema);
        PgPoolOptions::new()
            .max_connections(4)
            .connect_with(options)
            .await
            .expect("connect through the proxy")
    }
}

/// The server process listening for the outbox's notifications on `schema`'s connections.
async fn listener_pid(pool: &sqlx::PgPool, schema: &str) -> Option<i32> {
    sqlx::query_scalar(
        "SELECT pid FROM pg_stat_activity WHERE application_name = $1 AND query ILIKE 'LISTEN%'",
    )
    .bind(schema)
    .fetch_optional(pool)
    .await
    .expect("read pg_stat_activity")
}

/// The relay's connections are reset (the listener's read fails with ECONNRESET, which ends
/// its notifications): the relay listens again on a new connection, and a commit still
/// wakes it at once (its poll interval is an hour).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_relay_whose_listening_connection_is_reset_listens_again() {
    let t = Routes::new().await;
    let (queue, schema) = (&t.queue, t.env.schema.as_str());
    let proxy = ResettingProxy::start().await;
    let relayed = Inbox::new(proxy.pool(&t.env).await, InboxConfig::in_schema(schema))
        .await
        .expect("inbox through the proxy");
    let relay = Relay::new(relayed.outbox(), publisher(queue).await)
        .with_config(RelayConfig::default().with_poll_interval(Duration::from_secs(3600)))
        .expect("config");
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let running = tokio::spawn(relay.run(async {
        let _ = stopped.await;
    }));

    let first = AtomicI32::new(0);
    wait_until("the relay listens", || async {
        let pid = listener_pid(t.inbox.pool(), schema).await;
        pid.inspect(|&p| first.store(p, Ordering::SeqCst)).is_some()
    })
    .await;
    let first = first.into_inner();
    proxy.reset_all();
    wait_until("the relay listens again, on another connection", || async {
        listener_pid(t.inbox.pool(), schema)
            .await
            .is_some_and(|p| p != first)
    })
    .await;

    t.enqueue([(queue, "a1".to_owned())]).await;
    let got = read(queue, 1).await;
    let ids: Vec<_> = got.iter().filter_map(|r| r.message_id.as_deref()).collect();
    assert_eq!(ids, ["a1"]);
    let _ = stop.send(());
    running.await.expect("the relay's task").expect("the relay");
}

/// Runs of `quote`: a second run would answer with another number.
static QUOTES: AtomicU64 = AtomicU64::new(0);

/// Answers a quote request with a price and its run's number.
#[handler(name = "quote")]
async fn quote(
    ctx: &mut Context<'_, Postgres>,
    request: serde_json::Value,
) -> Result<(), HandlerError> {
    let run = QUOTES.fetch_add(1, Ordering::Relaxed);
    let body = json!({"item": request["item"], "price": 42, "run": run});
    ctx.reply(body.to_string())
        .await
        .map_err(HandlerError::permanent)?;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_duplicate_rpc_request_gets_the_stored_reply_byte_identical_with_its_correlation_id() {
    init_tracing();
    let env = PgEnv::new().await;
    let requests = unique_name("outbox-rpc");
    let replies = unique_name("outbox-replies");
    // Declares the request queue before the requests arrive.
    publisher(&requests).await.close().await;
    let reply_publisher = publisher(&replies).await;
    // The duplicate comes with a correlation id of its own (a requester's retry after a
    // restart): its reply must carry it, or the requester cannot match it.
    let correlations = ["c-1", "c-2"];
    for correlation in correlations {
        let body = br#"{"item":"lamp"}"#;
        Rabbit::publish_request(&requests, "q-1", body, &replies, correlation).await;
    }
    let inbox = env.inbox().await;
    let worker = Worker::with_config(inbox.clone(), quote, worker_config(1)).expect("worker");
    let running = Running::start(worker, config(&requests)).await;
    wait_until("both requests are settled", || async {
        let s = running.worker.snapshot();
        s.completed + s.duplicates == 2
    })
    .await;
    let stats = running.stop().await;
    assert_eq!((stats.completed, stats.duplicates), (1, 1));
    assert_eq!(QUOTES.load(Ordering::Relaxed), 1, "the handler ran once");

    relay_all(&inbox, &Relay::new(inbox.outbox(), reply_publisher)).await;
    wait_until("both replies are in the reply queue", || async {
        Rabbit::ready(&replies).await == 2
    })
    .await;
    let got = Rabbit::take_all(&replies).await;
    assert_eq!(got.len(), 2);
    assert_eq!(got[0].body, got[1].body, "byte-identical");
    assert_eq!(got[0].message_id, got[1].message_id);
    for (g, correlation) in got.iter().zip(correlations) {
        assert_eq!(g.correlation_id.as_deref(), Some(correlation));
    }
}
