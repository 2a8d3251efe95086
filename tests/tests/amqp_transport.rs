//! The RabbitMQ transport on its own, without a worker: deliveries of a lost connection are
//! never settled on the new one, a retry copy comes back once when due even if the consumer
//! holding it goes away, a consumer cancelled by the broker comes back, refused
//! credentials fail at once without showing the password, and the publisher waits out a
//! confirm that never comes and a message the broker refuses.

use std::time::{Duration, Instant};

use consumer_amqp::{AmqpConfig, AmqpConsumer, AmqpPublisher, RedactedUrl};
use consumer_core::transport::{Incoming, Settlement};
use consumer_tests::amqp::{
    self, close_connections_matching, config, init_tracing, wait_for, Rabbit, LONG,
};
use futures::StreamExt;
use serde_json::json;

/// Receives deliveries until each of `ids` has been received and acked once; every one of
/// them must arrive flagged `redelivered` with `attempt` 1. An ack refused because yet
/// another reconnection happened (a parallel test restarting the broker) just waits for
/// the next redelivery. Returns how many loss reports the stream yielded.
async fn ack_redelivered(consumer: &mut AmqpConsumer, ids: &[&str]) -> usize {
    let mut pending: Vec<String> = ids.iter().map(|s| (*s).to_owned()).collect();
    let mut losses = 0;
    while !pending.is_empty() {
        let (incoming, errors) = next_delivery(consumer).await;
        losses += errors;
        let id = incoming
            .delivery
            .message_id
            .as_deref()
            .unwrap_or_default()
            .to_owned();
        assert!(pending.contains(&id), "unexpected delivery {id:?}");
        assert!(incoming.delivery.redelivered, "{id} is flagged redelivered");
        assert_eq!(incoming.delivery.attempt, 1);
        match incoming.acker.settle(Settlement::Ack).await {
            Ok(()) => pending.retain(|p| p != &id),
            Err(e) => tracing::info!(error = %e, "ack refused after another reconnection"),
        }
    }
    losses
}

/// The next delivery, skipping the `Err` items that report a lost connection; returns how
/// many of those it skipped.
async fn next_delivery(consumer: &mut AmqpConsumer) -> (Incoming, usize) {
    let mut errors = 0;
    loop {
        let item = tokio::time::timeout(LONG, consumer.next())
            .await
            .expect("a delivery in time")
            .expect("the stream does not end");
        match item {
            Ok(incoming) => return (incoming, errors),
            Err(e) => {
                tracing::info!(error = %e, "the transport reported a loss");
                errors += 1;
            }
        }
    }
}

/// Drops the consumer and checks that nothing was left unacked: closing its connection
/// returns nothing to the queue. Then deletes the test's queues.
async fn close_with_nothing_unacked(consumer: AmqpConsumer, cfg: &AmqpConfig) {
    let health = consumer.health();
    drop(consumer);
    tokio::time::timeout(Duration::from_secs(10), health.closed())
        .await
        .expect("the consumer closes its connection");
    assert_eq!(Rabbit::ready(&cfg.queue).await, 0);
    Rabbit::delete_topology(cfg).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deliveries_of_a_lost_connection_are_never_settled_on_the_new_one() {
    init_tracing();
    let mut cfg = config(&amqp::unique_name("stale"));
    cfg.prefetch = 2;
    let publisher = AmqpPublisher::connect(cfg.clone()).await.unwrap();
    for id in ["a", "b"] {
        publisher
            .publish_json(&cfg.queue, id, &json!({"id": id}))
            .await
            .unwrap();
    }
    publisher.close().await;

    let mut consumer = AmqpConsumer::connect(cfg.clone()).await.unwrap();
    let health = consumer.health();
    let (a, _) = next_delivery(&mut consumer).await;
    let (b, _) = next_delivery(&mut consumer).await;
    assert_eq!(a.delivery.message_id.as_deref(), Some("a"));
    assert_eq!(b.delivery.message_id.as_deref(), Some("b"));
    assert!(!a.delivery.redelivered);
    assert_eq!(a.delivery.attempt, 1);
    assert_eq!(a.delivery.source.transport, "amqp");
    assert!(
        a.delivery
            .source
            .location
            .to_string()
            .starts_with(&cfg.queue),
        "{}",
        a.delivery.source
    );

    // Only this consumer's connection is closed, from the broker's side.
    let closed = close_connections_matching(&format!("{} (consumer)", cfg.queue)).await;
    assert_eq!(closed, 1);
    wait_for("the consumer to reconnect", LONG, || async {
        health.sessions() >= 2 && health.is_connected()
    })
    .await;

    // Settling the old deliveries fails: their channel is gone, and their tags must not be
    // used on the new channel (tag 1 there is another delivery).
    let ack = a.acker.settle(Settlement::Ack).await.unwrap_err();
    assert!(ack.to_string().contains("closed"), "{ack}");
    let retry = b
        .acker
        .settle(Settlement::Retry {
            delay: Duration::from_millis(200),
            attempt: 2,
        })
        .await
        .unwrap_err();
    println!("stale settlements refused: {ack}; {retry}");

    // The broker redelivers both, flagged; acking them on the new channel works.
    let losses = ack_redelivered(&mut consumer, &["a", "b"]).await;
    assert!(losses >= 1, "the loss was reported on the stream");
    assert_eq!(
        Rabbit::ready(&cfg.retry_queue_name(cfg.retry_delays[0])).await,
        0,
        "the stale retry published nothing"
    );

    close_with_nothing_unacked(consumer, &cfg).await;
}

/// A busy worker takes nothing from the stream for a while; the connection is lost meanwhile.
/// The consumer must see the loss and reconnect then, not when the worker next asks: the
/// deliveries it holds are of the lost connection and could never be acked.
/// A retry copy waits in its retry queue, taken and held by a consumer of the work queue
/// until it is due, and only then comes back to the work queue, with its attempt. A
/// consumer that goes away while it holds the copy gives it back to the retry queue (it was
/// not acked), and another consumer returns it: it arrives once, not before its delay.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_retry_copy_held_by_a_consumer_that_goes_away_is_returned_by_another() {
    init_tracing();
    let mut cfg = config(&amqp::unique_name("held_copy"));
    cfg.retry_delays = vec![Duration::from_secs(3)];
    let retry_queue = cfg.retry_queue_name(cfg.retry_delays[0]);
    let publisher = AmqpPublisher::connect(cfg.clone()).await.unwrap();
    publisher
        .publish_json(&cfg.queue, "m", &json!({"id": "m"}))
        .await
        .unwrap();
    publisher.close().await;

    let mut first = AmqpConsumer::connect(cfg.clone()).await.unwrap();
    let (m, _) = next_delivery(&mut first).await;
    let failed = Instant::now();
    m.acker
        .settle(Settlement::Retry {
            delay: Duration::from_millis(100),
            attempt: 2,
        })
        .await
        .unwrap();
    // The copy was confirmed into the retry queue; the first consumer takes it and holds it
    // (unacked) until it is due.
    wait_for("the first consumer to hold the copy", LONG, || async {
        Rabbit::ready(&retry_queue).await == 0
    })
    .await;
    let health = first.health();
    drop(first);
    tokio::time::timeout(Duration::from_secs(10), health.closed())
        .await
        .expect("the first consumer closes its connection");
    // Given back with the connection: no consumer is left to return it.
    wait_for("the copy back in its retry queue", LONG, || async {
        Rabbit::ready(&retry_queue).await == 1
    })
    .await;
    assert_eq!(
        Rabbit::ready(&cfg.queue).await,
        0,
        "returned before it was due"
    );

    let mut second = AmqpConsumer::connect(cfg.clone()).await.unwrap();
    let (again, _) = next_delivery(&mut second).await;
    let waited = failed.elapsed();
    assert_eq!(again.delivery.message_id.as_deref(), Some("m"));
    assert_eq!(again.delivery.attempt, 2);
    assert!(waited >= cfg.retry_delays[0], "back after {waited:?}");
    again.acker.settle(Settlement::Ack).await.unwrap();
    assert_eq!(Rabbit::ready(&retry_queue).await, 0);
    close_with_nothing_unacked(second, &cfg).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lost_connection_is_seen_while_nothing_takes_deliveries() {
    init_tracing();
    let mut cfg = config(&amqp::unique_name("idle"));
    cfg.prefetch = 8;
    let ids: Vec<String> = (0..8).map(|i| format!("m{i}")).collect();
    let mut consumer = AmqpConsumer::connect(cfg.clone()).await.unwrap();
    let health = consumer.health();
    // Published one by one after the consumer started, so they reach it one by one.
    let publisher = AmqpPublisher::connect(cfg.clone()).await.unwrap();
    for id in &ids {
        publisher
            .publish_json(&cfg.queue, id, &json!({ "id": id }))
            .await
            .unwrap();
    }
    publisher.close().await;
    wait_for("all 8 to be delivered to the consumer", LONG, || async {
        Rabbit::ready(&cfg.queue).await == 0
    })
    .await;

    // Nothing has taken a delivery from the stream, and nothing does until the reconnection.
    let closed = close_connections_matching(&format!("{} (consumer)", cfg.queue)).await;
    assert_eq!(closed, 1);
    wait_for(
        "the consumer to reconnect while its stream is not polled",
        LONG,
        || async { health.sessions() >= 2 && health.is_connected() },
    )
    .await;

    // What it held is dropped as stale; the broker redelivers all 8.
    let refs: Vec<&str> = ids.iter().map(String::as_str).collect();
    ack_redelivered(&mut consumer, &refs).await;
    assert!(
        health.stale_deliveries_dropped() >= 1,
        "deliveries of the lost connection were dropped"
    );
    close_with_nothing_unacked(consumer, &cfg).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_consumer_cancelled_by_a_deleted_queue_is_re_established() {
    init_tracing();
    let cfg = config(&amqp::unique_name("cancel"));
    let mut consumer = AmqpConsumer::connect(cfg.clone()).await.unwrap();
    let health = consumer.health();

    Rabbit::delete_queue(&cfg.queue).await;
    wait_for(
        "the consumer to re-declare its queue and resume",
        LONG,
        || async { health.sessions() >= 2 && health.is_connected() },
    )
    .await;

    let publisher = AmqpPublisher::connect(cfg.clone()).await.unwrap();
    publisher
        .publish_json(&cfg.queue, "after", &json!({"id": "after"}))
        .await
        .unwrap();
    publisher.close().await;
    let (after, errors) = next_delivery(&mut consumer).await;
    assert_eq!(after.delivery.message_id.as_deref(), Some("after"));
    assert!(errors >= 1, "the cancellation was reported");
    if let Err(e) = after.acker.settle(Settlement::Ack).await {
        // Only if a parallel test restarted the broker in between.
        assert!(health.sessions() > 2, "{e}");
    }
    drop(consumer);
    Rabbit::delete_topology(&cfg).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn refused_credentials_fail_at_once_without_the_password() {
    init_tracing();
    let url = amqp::amqp_url();
    let (scheme, rest) = url.split_once("://").unwrap();
    let host = rest.rsplit_once('@').map(|(_, h)| h).unwrap_or(rest);
    let mut cfg = config(&amqp::unique_name("auth"));
    cfg.url = RedactedUrl::new(format!("{scheme}://consumer:Wr0ng-s3cret@{host}"));
    cfg.startup_timeout = Duration::from_secs(60);

    let start = Instant::now();
    let e = AmqpConsumer::connect(cfg.clone()).await.unwrap_err();
    let mut text = e.to_string();
    let mut source = std::error::Error::source(&e);
    while let Some(s) = source {
        text.push_str(&format!(": {s}"));
        source = s.source();
    }
    println!("refused after {:?}: {text}", start.elapsed());
    assert!(!e.is_transient(), "{text}");
    // Not retried for the startup timeout (a broker restart by a parallel test may still
    // delay the first answer by a few seconds).
    assert!(start.elapsed() < Duration::from_secs(30), "not retried");
    assert!(!text.contains("Wr0ng-s3cret"), "{text}");
    assert!(text.contains("***@"), "{text}");
    let p = AmqpPublisher::connect(cfg).await.unwrap_err();
    assert!(!format!("{p:?}").contains("Wr0ng-s3cret"), "{p:?}");
}

/// A TCP relay to the broker that can be frozen: once frozen it stops passing bytes either
/// way, keeping both connections open, as a broker that stopped answering does.
struct FreezableRelay {
    addr: std::net::SocketAddr,
    frozen: tokio::sync::watch::Sender<bool>,
}

impl FreezableRelay {
    async fn start(upstream: String) -> Self {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind the relay");
        let addr = listener.local_addr().expect("the relay address");
        let (frozen, _) = tokio::sync::watch::channel(false);
        let watch = frozen.clone();
        tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                let Ok(server) = tokio::net::TcpStream::connect(&upstream).await else {
                    continue;
                };
                let (cr, cw) = client.into_split();
                let (sr, sw) = server.into_split();
                tokio::spawn(Self::pipe(cr, sw, watch.subscribe()));
                tokio::spawn(Self::pipe(sr, cw, watch.subscribe()));
            }
        });
        FreezableRelay { addr, frozen }
    }

    async fn pipe(
        mut from: tokio::net::tcp::OwnedReadHalf,
        mut to: tokio::net::tcp::OwnedWriteHalf,
        mut frozen: tokio::sync::watch::Receiver<bool>,
    ) {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let mut buf = vec![0u8; 16 * 1024];
        loop {
            let read = tokio::select! {
                read = from.read(&mut buf) => read,
                _ = frozen.wait_for(|f| *f) => break,
            };
            match read {
                Ok(0) | Err(_) => return,
                Ok(_) if *frozen.borrow() => break,
                Ok(n) => {
                    if to.write_all(&buf[..n]).await.is_err() {
                        return;
                    }
                }
            }
        }
        // Frozen: hold both halves open and pass nothing, until the test ends.
        let _ = frozen.wait_for(|f| !*f).await;
        drop((from, to));
    }

    fn freeze(&self) {
        self.frozen.send_replace(true);
    }
}

/// A publisher confirm that never comes (the broker stops answering, the connection stays
/// up) ends the publish with an error after the confirm timeout, instead of holding the
/// caller (and, for a retry copy, its delivery) for good.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_publisher_confirm_that_never_comes_times_out() {
    init_tracing();
    let mut cfg = config(&amqp::unique_name("noconfirm"));
    let url = cfg.url.expose().to_owned();
    let at = url.rfind('@').expect("the test URL has credentials") + 1;
    let end = url[at..].find('/').map_or(url.len(), |e| at + e);
    let relay = FreezableRelay::start(url[at..end].to_owned()).await;
    cfg.url = RedactedUrl::new(format!("{}{}{}", &url[..at], relay.addr, &url[end..]));
    cfg.confirm_timeout = Duration::from_secs(1);
    cfg.publish_timeout = Duration::from_secs(2);
    cfg.connect_timeout = Duration::from_secs(1);
    let publisher = AmqpPublisher::connect(cfg.clone()).await.unwrap();
    publisher
        .publish_json(&cfg.queue, "before", &json!({"n": 1}))
        .await
        .expect("a publish through the live relay is confirmed");

    relay.freeze();
    let started = Instant::now();
    let published = tokio::time::timeout(
        Duration::from_secs(20),
        publisher.publish_json(&cfg.queue, "frozen", &json!({"n": 2})),
    )
    .await
    .expect("the publish ends (with an error) instead of waiting for the confirm for good");
    let e = published.expect_err("no confirm came");
    println!("publish ended after {:?}: {}", started.elapsed(), e);
    assert!(e.is_transient(), "{e}");
    assert!(!e.to_string().contains(cfg.url.expose()), "{e}");
    Rabbit::delete_topology(&cfg).await;
}

/// A message the broker refuses (a negative confirm; here a full queue with
/// `overflow: reject-publish`, as a quorum queue also answers while it elects a new leader
/// after its node died) is published again until the queue takes it, within the publish
/// timeout; past it, the refusal is returned.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_message_is_published_again_until_the_queue_takes_it() {
    init_tracing();
    let mut cfg = config(&amqp::unique_name("refused_publish"));
    let policy = format!("{}-full", cfg.queue);
    // The queue's name is letters, digits and `_` (unique_name): it is its own pattern.
    let pattern = format!("^{}$", cfg.queue);
    amqp::set_queue_policy(
        &policy,
        &pattern,
        r#"{"max-length":1,"overflow":"reject-publish"}"#,
    )
    .await;
    cfg.publish_timeout = Duration::from_secs(1);
    let short = AmqpPublisher::connect(cfg.clone()).await.unwrap();
    wait_for("the policy to apply to the queue", LONG, || async {
        short
            .publish_json(&cfg.queue, "filler", &json!({"n": 0}))
            .await
            .unwrap();
        // A second message is refused only once the queue is full under the policy.
        let started = Instant::now();
        match short
            .publish_json(&cfg.queue, "probe", &json!({"n": 1}))
            .await
        {
            Ok(()) => {
                let _ = Rabbit::take_all(&cfg.queue).await;
                false
            }
            Err(e) => {
                // Refused on every try for the whole publish timeout, not on the first.
                let took = started.elapsed();
                println!("refused after {took:?}: {e}");
                assert!(matches!(e, consumer_amqp::Error::Nacked { .. }), "{e}");
                assert!(
                    took >= Duration::from_millis(500),
                    "refused at once: {took:?}"
                );
                true
            }
        }
    })
    .await;
    short.close().await;

    // With time to wait, the refused message gets in once the queue has room.
    cfg.publish_timeout = Duration::from_secs(60);
    let patient = AmqpPublisher::connect(cfg.clone()).await.unwrap();
    let publishing = tokio::spawn({
        let queue = cfg.queue.clone();
        async move {
            let published = patient
                .publish_json(&queue, "waits", &json!({"n": 2}))
                .await;
            patient.close().await;
            published
        }
    });
    let taken: Vec<Option<String>> = Rabbit::take_all(&cfg.queue)
        .await
        .into_iter()
        .map(|m| m.message_id)
        .collect();
    assert_eq!(taken.first(), Some(&Some("filler".to_owned())), "{taken:?}");
    tokio::time::timeout(LONG, publishing)
        .await
        .expect("the publish ends")
        .unwrap()
        .expect("the refused message is taken once the queue has room");
    // Taken with the filler if it got in while the queue was being read, else still there.
    let with_filler = u32::from(taken.len() == 2);
    assert!(taken.len() <= 2, "{taken:?}");
    assert_eq!(
        Rabbit::ready(&cfg.queue).await + with_filler,
        1,
        "{taken:?}"
    );
    amqp::rabbitmq_sh(&["ctl", "clear_policy", &policy]).await;
    Rabbit::delete_topology(&cfg).await;
}
