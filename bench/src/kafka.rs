//! Kafka arms: raw rdkafka consume + store offset, and the framework in both modes.
//!
//! The clock of every Kafka arm starts at the first record, so the consumer-group join
//! (seconds, on any broker) is not counted as processing time.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use anyhow::Context as _;
use consumer_core::{BatchConfig, Inbox, Settlement};
use consumer_kafka::{KafkaConfig, KafkaConsumer, KafkaPublisher, ProcessingOrder};
use futures::StreamExt;
use rdkafka::consumer::{Consumer, StreamConsumer};
use rdkafka::{ClientConfig, Message as _};
use sqlx::Postgres;

use crate::{
    bench_worker, cpu_time, figures, hand_batch, payload, timed, Figures, Job, Options, Rss,
};

const PARTITIONS: i32 = 4;

fn config(brokers: &str, group: &str, topic: &str) -> KafkaConfig {
    let mut c = KafkaConfig::new(brokers, group, [topic]);
    c.consumer_properties.set("session.timeout.ms", "6000");
    c
}

/// A fresh topic of 4 partitions holding `o.messages` records (keyed by id).
pub(crate) async fn fill(
    brokers: &str,
    topic: &str,
    first: u64,
    o: &Options,
) -> anyhow::Result<()> {
    consumer_kafka::create_topics(&config(brokers, "fill", topic), PARTITIONS, 1).await?;
    let publisher = KafkaPublisher::new(&config(brokers, "fill", topic))?;
    let sends = futures::stream::iter(first..first + o.messages as u64).map(|id| {
        let publisher = &publisher;
        async move {
            let key = id.to_string();
            let body = payload(id, o.size);
            publisher
                .publish(
                    topic,
                    Some(key.as_bytes()),
                    Some(&format!("m-{id}")),
                    body.as_bytes(),
                    &[],
                )
                .await
        }
    });
    let results: Vec<_> = sends.buffer_unordered(512).collect().await;
    for r in results {
        r?;
    }
    Ok(())
}

/// A plain rdkafka consumer subscribed to `topic`: offsets stored by hand, committed by the
/// auto-committer (at-least-once), as a hand-written consumer does.
fn raw_consumer(brokers: &str, topic: &str, group: &str) -> anyhow::Result<StreamConsumer> {
    let consumer: StreamConsumer = ClientConfig::new()
        .set("bootstrap.servers", brokers)
        .set("group.id", group)
        .set("enable.auto.commit", "true")
        .set("enable.auto.offset.store", "false")
        .set("auto.offset.reset", "earliest")
        .set("session.timeout.ms", "6000")
        .create()?;
    consumer.subscribe(&[topic])?;
    Ok(consumer)
}

/// Raw rdkafka: consume, store each offset for the auto-committer (at-least-once).
pub(crate) async fn raw(
    brokers: &str,
    topic: &str,
    group: &str,
    o: &Options,
) -> anyhow::Result<Figures> {
    let consumer = raw_consumer(brokers, topic, group)?;
    let mut stream = consumer.stream();
    let mut latencies = Vec::with_capacity(o.messages);
    let first = stream.next().await.context("consumer ended")??;
    let rss = Rss::start();
    let cpu0 = cpu_time();
    let start = Instant::now();
    consumer.store_offset_from_message(&first)?;
    drop(first);
    for _ in 1..o.messages {
        let m = stream.next().await.context("consumer ended")??;
        let at = Instant::now();
        std::hint::black_box(m.payload());
        consumer.store_offset_from_message(&m)?;
        latencies.push(at.elapsed().as_micros() as u64);
    }
    Ok(figures(
        o.messages,
        start.elapsed(),
        cpu_time() - cpu0,
        &mut latencies,
        rss,
    ))
}

/// Hand-written rdkafka + sqlx, batched: the records that arrive within the batch window (up
/// to the batch size) share one transaction (one inbox insert, one effect insert), up to
/// `concurrency` transactions run at once and complete in fetch order, and then the batch's
/// offsets are stored for the auto-committer (so none is stored past an unfinished batch).
pub(crate) async fn hand_batched(
    brokers: &str,
    topic: &str,
    group: &str,
    pool: &sqlx::PgPool,
    o: &Options,
) -> anyhow::Result<Figures> {
    let consumer = raw_consumer(brokers, topic, group)?;
    let mut records = consumer.stream().take(o.messages).peekable();
    // The clock starts at the first record, as in the other Kafka arms.
    std::pin::Pin::new(&mut records)
        .peek()
        .await
        .context("consumer ended")?;
    let rss = Rss::start();
    let cpu0 = cpu_time();
    let start = Instant::now();
    let mut latencies = Vec::with_capacity(o.messages);
    let chunks = tokio_stream::StreamExt::chunks_timeout(records, o.batch, crate::BATCH_WAIT);
    let batches = chunks
        .map(|chunk| {
            let pool = pool.clone();
            async move {
                let at = Instant::now();
                let mut jobs = Vec::with_capacity(chunk.len());
                let mut offsets = Vec::with_capacity(chunk.len());
                for m in chunk {
                    let m = m?;
                    let key = String::from_utf8_lossy(m.key().unwrap_or_default());
                    let job: Job = serde_json::from_slice(m.payload().unwrap_or_default())?;
                    jobs.push((format!("m-{key}"), job));
                    offsets.push((m.partition(), m.offset()));
                }
                hand_batch(&pool, jobs).await?;
                anyhow::Ok((offsets, at))
            }
        })
        .buffered(o.concurrency);
    futures::pin_mut!(batches);
    while let Some(done) = batches.next().await {
        let (offsets, at) = done?;
        for &(partition, offset) in &offsets {
            consumer.store_offset(topic, partition, offset)?;
        }
        let us = at.elapsed().as_micros() as u64;
        latencies.extend(std::iter::repeat_n(us, offsets.len()));
    }
    Ok(figures(
        o.messages,
        start.elapsed(),
        cpu_time() - cpu0,
        &mut latencies,
        rss,
    ))
}

/// The framework's Kafka transport alone: every record acked as it arrives (up to 512 at
/// once), no worker and no database: what the transport costs over librdkafka.
pub(crate) async fn transport_only(
    brokers: &str,
    topic: &str,
    group: &str,
    o: &Options,
) -> anyhow::Result<Figures> {
    let mut c = config(brokers, group, topic);
    c.order = ProcessingOrder::Key;
    let mut consumer = KafkaConsumer::new(c)?;
    let first = consumer.next().await.context("consumer ended")??;
    let rss = Rss::start();
    let cpu0 = cpu_time();
    let start = Instant::now();
    first.acker.settle(Settlement::Ack).await?;
    let acks: Vec<anyhow::Result<()>> = consumer
        .take(o.messages - 1)
        .map(|incoming| async move {
            let incoming = incoming?;
            std::hint::black_box(&incoming.delivery.payload);
            incoming.acker.settle(Settlement::Ack).await?;
            anyhow::Ok(())
        })
        .buffer_unordered(512)
        .collect()
        .await;
    acks.into_iter().collect::<anyhow::Result<()>>()?;
    Ok(figures(
        o.messages,
        start.elapsed(),
        cpu_time() - cpu0,
        &mut [],
        rss,
    ))
}

/// The framework on Kafka, records ordered per key (so a batch can hold several records of
/// one partition).
pub(crate) async fn framework(
    brokers: &str,
    topic: &str,
    group: &str,
    inbox: &Inbox<Postgres>,
    o: &Options,
    batch: Option<BatchConfig>,
) -> anyhow::Result<Figures> {
    let mut c = config(brokers, group, topic);
    c.order = ProcessingOrder::Key;
    let consumer = KafkaConsumer::new(c)?;
    let closed = consumer.closed();
    let worker = bench_worker(inbox, crate::record, o, batch)?;
    let latencies = Arc::new(Mutex::new(Vec::with_capacity(o.messages)));
    let (done_tx, done_rx) = tokio::sync::oneshot::channel::<()>();
    let done_tx = Arc::new(Mutex::new(Some(done_tx)));
    let acked = Arc::new(AtomicUsize::new(0));
    let started: Arc<OnceLock<(Instant, Duration, Rss)>> = Arc::new(OnceLock::new());
    let (l2, n, acked2, started2) = (
        latencies.clone(),
        o.messages,
        acked.clone(),
        started.clone(),
    );
    let stream = consumer.map(move |r| {
        r.map(|i| {
            started2.get_or_init(|| (Instant::now(), cpu_time(), Rss::start()));
            let done = done_tx.clone();
            let acked = acked2.clone();
            timed(i, &l2, move |_s: &Settlement| {
                if acked.fetch_add(1, Ordering::SeqCst) + 1 == n {
                    if let Some(tx) = done.lock().ok().and_then(|mut d| d.take()) {
                        let _ = tx.send(());
                    }
                }
            })
        })
    });
    worker
        .run(stream, async {
            let _ = done_rx.await;
        })
        .await?;
    let (start, cpu0, rss) = *started.get().context("no record arrived")?;
    let wall = start.elapsed();
    let cpu = cpu_time() - cpu0;
    closed.await;
    let s = worker.snapshot();
    anyhow::ensure!(
        s.completed == o.messages as u64,
        "framework arm completed {} of {}",
        s.completed,
        o.messages
    );
    let mut l = latencies.lock().map(|l| l.clone()).unwrap_or_default();
    Ok(figures(o.messages, wall, cpu, &mut l, rss))
}
