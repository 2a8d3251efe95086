//! RabbitMQ arms: raw lapin consume + ack, hand-written lapin + sqlx, and the framework.

use std::sync::{Arc, Mutex};
use std::time::Instant;

use anyhow::Context as _;
use consumer_amqp::{AmqpConfig, AmqpConsumer, AmqpPublisher};
use consumer_core::{Handler, Inbox};
use futures::StreamExt;
use lapin::options::{
    BasicAckOptions, BasicConsumeOptions, BasicPublishOptions, BasicQosOptions,
    ConfirmSelectOptions, QueueDeclareOptions, QueueDeleteOptions,
};
use lapin::types::{FieldTable, ShortString};
use lapin::{BasicProperties, Channel, Connection, ConnectionProperties};
use sqlx::{PgPool, Postgres};

use crate::arrivals::Received;
use crate::framework::{bench_worker, framework_figures, Fw};
use crate::measure::{Clock, Figures};
use crate::outbox::OutboxArm;
use crate::postgres::{hand_batch, hand_one, payload, Job, BATCH_WAIT};
use crate::relay::{check_events, End};
use crate::timing::{timed, Acks};
use crate::Options;

fn short(s: &str) -> anyhow::Result<ShortString> {
    ShortString::try_new(s).map_err(|e| anyhow::anyhow!("{s:?}: {e}"))
}

/// A fresh durable queue holding `o.messages` persistent messages, published with confirms.
pub(crate) async fn fill(url: &str, queue: &str, first: u64, o: &Options) -> anyhow::Result<()> {
    let conn = Connection::connect(url, ConnectionProperties::default()).await?;
    let ch = conn.create_channel().await?;
    ch.confirm_select(ConfirmSelectOptions::default()).await?;
    let _ = ch
        .queue_delete(short(queue)?, QueueDeleteOptions::default())
        .await;
    // Every arm consumes the queue exactly as the framework declares it.
    let publisher = AmqpPublisher::connect(AmqpConfig::new(url, queue)).await?;
    publisher.close().await;
    let mut confirms = Vec::with_capacity(1000);
    for id in first..first + o.messages as u64 {
        let props = BasicProperties::default()
            .with_delivery_mode(2)
            .with_message_id(format!("m-{id}").into());
        let body = payload(id, o.size);
        confirms.push(
            ch.basic_publish(
                short("")?,
                short(queue)?,
                BasicPublishOptions::default(),
                body.as_bytes(),
                props,
            )
            .await?,
        );
        if confirms.len() == 1000 {
            for c in confirms.drain(..) {
                c.await?;
            }
        }
    }
    for c in confirms {
        c.await?;
    }
    conn.close(200, "filled".into()).await?;
    Ok(())
}

/// A connection, a channel and a consumer of `queue` tagged `tag`, with the bench's prefetch.
/// The caller keeps the channel until it is done: lapin closes a channel when its last handle
/// is dropped, and an ack on a closing channel fails.
async fn consume(
    url: &str,
    queue: &str,
    tag: &str,
    o: &Options,
) -> anyhow::Result<(Connection, Channel, lapin::Consumer)> {
    let conn = Connection::connect(url, ConnectionProperties::default()).await?;
    let ch = conn.create_channel().await?;
    ch.basic_qos(o.prefetch, BasicQosOptions::default()).await?;
    let consumer = ch
        .basic_consume(
            short(queue)?,
            short(tag)?,
            BasicConsumeOptions::default(),
            FieldTable::default(),
        )
        .await?;
    Ok((conn, ch, consumer))
}

/// Raw lapin: consume, ack with `multiple` every 64 deliveries, as a tuned hand-written
/// consumer with nothing to do per message would; with `each`, one ack per delivery (what
/// the framework sends), to price the per-delivery acks.
pub(crate) async fn raw(
    url: &str,
    queue: &str,
    o: &Options,
    each: bool,
) -> anyhow::Result<Figures> {
    let (conn, _ch, mut consumer) = consume(url, queue, "raw", o).await?;
    let clock = Clock::start();
    let mut latencies = Vec::with_capacity(o.messages);
    let mut pending: Vec<Instant> = Vec::with_capacity(64);
    let mut seen = 0;
    while seen < o.messages {
        let delivery = consumer.next().await.context("consumer ended")??;
        pending.push(Instant::now());
        seen += 1;
        if each || pending.len() == 64 || seen == o.messages {
            delivery
                .acker
                .ack(BasicAckOptions { multiple: !each })
                .await?;
            for t in pending.drain(..) {
                latencies.push(t.elapsed().as_micros() as u64);
            }
        }
    }
    let f = clock.figures(o.messages, &mut latencies);
    conn.close(200, "done".into()).await?;
    Ok(f)
}

/// Hand-written lapin + sqlx: per message, a transaction with the inbox insert and the effect,
/// commit, then ack that delivery.
pub(crate) async fn hand_written(
    url: &str,
    queue: &str,
    pool: &PgPool,
    o: &Options,
) -> anyhow::Result<Figures> {
    let (conn, _ch, consumer) = consume(url, queue, "hand", o).await?;
    let latencies = Arc::new(Mutex::new(Vec::with_capacity(o.messages)));
    let clock = Clock::start();
    let work = consumer.take(o.messages).map(|delivery| {
        let pool = pool.clone();
        let latencies = latencies.clone();
        async move {
            let at = Instant::now();
            let delivery = delivery?;
            let job: Job = serde_json::from_slice(&delivery.data)?;
            let key = delivery
                .properties
                .message_id()
                .as_ref()
                .map(|m| m.to_string())
                .unwrap_or_default();
            hand_one(&pool, &key, &job).await?;
            delivery.acker.ack(BasicAckOptions::default()).await?;
            if let Ok(mut l) = latencies.lock() {
                l.push(at.elapsed().as_micros() as u64);
            }
            anyhow::Ok(())
        }
    });
    let results: Vec<anyhow::Result<()>> = work.buffer_unordered(o.concurrency).collect().await;
    results.into_iter().collect::<anyhow::Result<()>>()?;
    let stopped = clock.stop();
    let mut l = latencies.lock().map(|l| l.clone()).unwrap_or_default();
    conn.close(200, "done".into()).await?;
    Ok(stopped.figures(o.messages, &mut l))
}

/// Hand-written lapin + sqlx, batched as a good hand-written consumer would: the deliveries
/// that arrive within the batch window (up to the batch size) share one transaction (one
/// inbox insert, one effect insert), up to `concurrency` transactions run at once and
/// complete in delivery order, and each batch is acked with one `multiple` ack of its last
/// tag.
pub(crate) async fn hand_batched(
    url: &str,
    queue: &str,
    pool: &PgPool,
    o: &Options,
) -> anyhow::Result<Figures> {
    let (conn, _ch, consumer) = consume(url, queue, "hand-batched", o).await?;
    let mut latencies = Vec::with_capacity(o.messages);
    let clock = Clock::start();
    let chunks =
        tokio_stream::StreamExt::chunks_timeout(consumer.take(o.messages), o.batch, BATCH_WAIT);
    let batches = chunks
        .map(|chunk| {
            let pool = pool.clone();
            async move {
                let mut jobs = Vec::with_capacity(chunk.len());
                let mut last = None;
                for delivery in chunk {
                    let delivery = delivery?;
                    let key = delivery
                        .properties
                        .message_id()
                        .as_ref()
                        .map(|m| m.to_string())
                        .unwrap_or_default();
                    jobs.push((key, serde_json::from_slice::<Job>(&delivery.data)?));
                    last = Some(delivery.acker);
                }
                let at = Instant::now();
                let n = jobs.len();
                hand_batch(&pool, jobs).await?;
                anyhow::Ok((last, n, at))
            }
        })
        .buffered(o.concurrency);
    futures::pin_mut!(batches);
    while let Some(done) = batches.next().await {
        let (last, n, at) = done?;
        if let Some(acker) = last {
            acker.ack(BasicAckOptions { multiple: true }).await?;
        }
        let us = at.elapsed().as_micros() as u64;
        latencies.extend(std::iter::repeat_n(us, n));
    }
    let f = clock.figures(o.messages, &mut latencies);
    conn.close(200, "done".into()).await?;
    Ok(f)
}

/// The framework on RabbitMQ.
pub(crate) async fn framework<H: Handler<Postgres>>(
    url: &str,
    queue: &str,
    inbox: &Inbox<Postgres>,
    o: &Options,
    fw: Fw<'_, H>,
) -> anyhow::Result<Figures> {
    let mut config = AmqpConfig::new(url, queue);
    config.prefetch = o.prefetch;
    let consumer = AmqpConsumer::connect(config).await?;
    let worker = bench_worker(inbox, fw.handler, o, fw.batch)?;
    let acks = Acks::new(o.messages);
    let clock = Clock::start();
    let a2 = acks.clone();
    // The stream ends with the arm's last message: the worker then settles what it has in
    // flight and returns, as the hand-written arms end with their stream.
    let stream = consumer
        .take(o.messages)
        .map(move |r| r.map(|i| timed(i, &a2)));
    worker.run(stream, std::future::pending()).await?;
    let end = End::after(fw.relay, o.messages, clock.start).await?;
    let cpu = clock.cpu();
    framework_figures(o, &worker.snapshot(), &end, cpu, &acks, clock.base)
}

/// A durable queue `name` holding nothing: deleted (with what it held) and declared again.
async fn fresh_queue(ch: &Channel, name: &str, options: QueueDeclareOptions) -> anyhow::Result<()> {
    let _ = ch
        .queue_delete(short(name)?, QueueDeleteOptions::default())
        .await;
    ch.queue_declare(short(name)?, options, FieldTable::default())
        .await?;
    Ok(())
}

/// The relay's publisher: the bench's work queue's topology (declared as every arm declares
/// it), publishing to the default exchange, so a destination is a queue's name.
async fn relay_publisher(url: &str, queue: &str) -> anyhow::Result<Arc<AmqpPublisher>> {
    Ok(Arc::new(
        AmqpPublisher::connect(AmqpConfig::new(url, queue)).await?,
    ))
}

/// An outbox arm ([`OutboxArm`]): the events go to the queue `<queue>_events` (fresh,
/// durable) through an [`AmqpPublisher`]; the clock runs until the last one is confirmed.
/// Then checks that the queue holds every event once, and deletes it.
pub(crate) async fn outbox(
    url: &str,
    queue: &str,
    inbox: &Inbox<Postgres>,
    o: &Options,
    arm: OutboxArm,
) -> anyhow::Result<Figures> {
    let events = format!("{queue}_events");
    let conn = Connection::connect(url, ConnectionProperties::default()).await?;
    let ch = conn.create_channel().await?;
    fresh_queue(&ch, &events, QueueDeclareOptions::durable()).await?;
    let publisher = relay_publisher(url, queue).await?;
    let (f, relay) = arm
        .run(inbox, publisher.clone(), &events, o, async |fw| {
            framework(url, queue, inbox, o, fw).await
        })
        .await?;
    let published = relay.stop().await?;
    publisher.close().await;
    let passive = QueueDeclareOptions {
        passive: true,
        ..QueueDeclareOptions::default()
    };
    let held = ch
        .queue_declare(short(&events)?, passive, FieldTable::default())
        .await?
        .message_count();
    ch.queue_delete(short(&events)?, QueueDeleteOptions::default())
        .await?;
    conn.close(200, "done".into()).await?;
    check_events(o.messages, published, u64::from(held))?;
    Ok(f)
}

/// The `--outbox-latency` destination on RabbitMQ: a queue `name` that is deleted when its
/// consumer goes (auto-delete), that consumer, and a relay publisher.
pub(crate) async fn latency_events(
    url: &str,
    queue: &str,
    name: &str,
    o: &Options,
) -> anyhow::Result<(Arc<AmqpPublisher>, Received)> {
    let conn = Connection::connect(url, ConnectionProperties::default()).await?;
    let ch = conn.create_channel().await?;
    let auto_delete = QueueDeclareOptions {
        auto_delete: true,
        ..QueueDeclareOptions::default()
    };
    fresh_queue(&ch, name, auto_delete).await?;
    conn.close(200, "declared".into()).await?;
    let (conn, ch, mut consumer) = consume(url, name, "latency", o).await?;
    let received = Received::spawn(|arrived| async move {
        // Owned here: the channel lives as long as the consumer.
        let _link = (conn, ch);
        while let Some(delivery) = consumer.next().await {
            let delivery = delivery?;
            let at = Instant::now();
            delivery.acker.ack(BasicAckOptions::default()).await?;
            if arrived.send((delivery.data, at)).is_err() {
                break;
            }
        }
        anyhow::Ok(())
    });
    Ok((relay_publisher(url, queue).await?, received))
}
