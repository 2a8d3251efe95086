//! `--outbox-latency N`: how soon a relay publishes a message that the application committed
//! to the outbox from a connection of its own, woken by PostgreSQL's `LISTEN/NOTIFY`.
//!
//! On each broker configured, a relay runs on the bench's inbox with the default
//! [`RelayConfig`](consumer_core::RelayConfig) (a poll every 1 s), and the application, on
//! a pool and an [`Inbox`] handle of its own, commits one message at a time with
//! [`Outbox::enqueue`](consumer_core::Outbox::enqueue). Nothing in this process tells the
//! relay about the commit (the handle's in-process wake-up is another one than the relay's),
//! so only the trigger's `NOTIFY` at commit, or the poll, can wake it. Each sample is timed
//! from the commit's return to the broker's confirm of the relay's publish (a RabbitMQ
//! publisher confirm, a Kafka delivery report) and to the message's arrival at a consumer of
//! the destination. The samples are 50 to 99 ms apart, so a relay woken only by its poll
//! would show a median near 500 ms.

use std::time::{Duration, Instant};

use consumer_core::{Inbox, InboxConfig, Outbox, OutboxMessage, Publisher};
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::{PgPool, Postgres};

use crate::arrivals::Received;
use crate::measure::percentile_ms;
use crate::relay::Relaying;
use crate::{amqp, kafka, Options};

/// The samples of one broker: from a commit to the confirm and to the arrival, in µs.
#[derive(Default)]
struct Samples {
    confirmed: Vec<u64>,
    consumed: Vec<u64>,
}

/// The application's side: its own pool and outbox handle.
struct App {
    pool: PgPool,
    outbox: Outbox<Postgres>,
}

/// Runs `o.outbox_latency` samples on every broker configured and prints them.
pub(crate) async fn run(
    inbox: &Inbox<Postgres>,
    app: PgConnectOptions,
    o: &Options,
    server: &str,
) -> anyhow::Result<()> {
    let pool = PgPoolOptions::new()
        .max_connections(1)
        .connect_with(app)
        .await?;
    let outbox = Inbox::new(pool.clone(), InboxConfig::in_schema("bench"))
        .await?
        .outbox();
    let app = App { pool, outbox };
    let name = format!("bench_{}_latency", std::process::id());
    let mut results = Vec::new();
    if let Some(url) = &o.amqp_url {
        let queue = format!("bench_{}", std::process::id());
        let (publisher, received) = amqp::latency_events(url, &queue, &name, o).await?;
        let samples = sample(inbox, &app, publisher.clone(), received, &name, o).await?;
        publisher.close().await;
        results.push(("amqp", samples));
    }
    if let Some(brokers) = &o.kafka_brokers {
        let (publisher, received) = kafka::latency_events(brokers, &name).await?;
        results.push((
            "kafka",
            sample(inbox, &app, publisher, received, &name, o).await?,
        ));
    }
    println!(
        "\noutbox wake-up: {} samples a broker, 50-99 ms apart, each committed from another pool \
         (the relay woken by LISTEN/NOTIFY; its poll interval {:?}); {server}\n",
        o.outbox_latency,
        o.relay_config().poll_interval
    );
    println!(
        "{:<8} {:>26} {:>26}",
        "broker", "commit→confirm ms", "commit→consumed ms"
    );
    println!(
        "{:<8} {:>26} {:>26}",
        "", "p50 / p99 / max", "p50 / p99 / max"
    );
    for (broker, mut s) in results {
        println!(
            "{broker:<8} {:>26} {:>26}",
            quantiles(&mut s.confirmed),
            quantiles(&mut s.consumed)
        );
    }
    Ok(())
}

/// `p50 / p99 / max` of `us`, in ms.
fn quantiles(us: &mut [u64]) -> String {
    us.sort_unstable();
    let q = |p| percentile_ms(us, p);
    format!("{:.1} / {:.1} / {:.1}", q(0.5), q(0.99), q(1.0))
}

/// One warm-up message (the consumer joining, the relay listening), then `o.outbox_latency`
/// samples through a relay publishing with `publisher` to `destination`.
async fn sample(
    inbox: &Inbox<Postgres>,
    app: &App,
    publisher: impl Publisher,
    mut received: Received,
    destination: &str,
    o: &Options,
) -> anyhow::Result<Samples> {
    let relay = Relaying::start(inbox.outbox(), publisher, o.relay_config())?;
    let mut samples = Samples::default();
    for i in 0..=o.outbox_latency {
        if i > 0 {
            // Apart, and not in step with the poll.
            let gap = 50 + (i * 37) % 50;
            tokio::time::sleep(Duration::from_millis(gap as u64)).await;
        }
        let id = format!("lat-{i}");
        let message = OutboxMessage::new(destination, id.clone().into_bytes()).key(id.clone());
        let mut tx = app.pool.begin().await?;
        app.outbox.enqueue(&mut tx, &message).await?;
        tx.commit().await?;
        let committed = Instant::now();
        let confirmed = relay.confirmed(i + 1).await?;
        let consumed = received.arrival(id.as_bytes()).await?;
        if i > 0 {
            let us = |t: Instant| t.saturating_duration_since(committed).as_micros() as u64;
            samples.confirmed.push(us(confirmed));
            samples.consumed.push(us(consumed));
        }
    }
    relay.stop().await?;
    Ok(samples)
}
