//! Kafka arms: raw rdkafka consume + store offset, and the framework in both modes.
//!
//! The clock of every Kafka arm starts at the first record, so the consumer-group join
//! (seconds, on any broker) is not counted as processing time.

use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use anyhow::Context as _;
use consumer_core::transport::Settlement;
use consumer_core::{Handler, Inbox};
use consumer_kafka::{KafkaConfig, KafkaConsumer, KafkaPublisher, ProcessingOrder};
use futures::StreamExt;
use rdkafka::admin::{AdminClient, AdminOptions};
use rdkafka::client::DefaultClientContext;
use rdkafka::consumer::{Consumer, DefaultConsumerContext, MessageStream, StreamConsumer};
use rdkafka::{ClientConfig, Message as _};
use sqlx::Postgres;

use crate::arrivals::Received;
use crate::framework::{bench_worker, framework_figures, Fw};
use crate::measure::{Clock, Figures};
use crate::outbox::OutboxArm;
use crate::postgres::{hand_batch, hand_one, payload, Job, BATCH_WAIT};
use crate::relay::{check_events, End};
use crate::timing::{timed, Acks};
use crate::Options;

/// Partitions of a relay's destination topic.
const RELAY_PARTITIONS: i32 = 4;

fn config(brokers: &str, group: &str, topic: &str) -> KafkaConfig {
    let mut c = KafkaConfig::new(brokers, group, [topic]);
    c.consumer_properties.set("session.timeout.ms", "6000");
    c
}

/// The framework's consumer of `topic` in the framework's arms: records ordered per key,
/// each partition buffering `--kafka-max-buffered` records at most if given.
fn framework_consumer(
    brokers: &str,
    topic: &str,
    group: &str,
    o: &Options,
) -> anyhow::Result<KafkaConsumer> {
    let mut c = config(brokers, group, topic);
    c.order = ProcessingOrder::Key;
    if let Some(records) = o.kafka_max_buffered {
        c.max_buffered_per_partition = records.get();
    }
    Ok(KafkaConsumer::new(c)?)
}

/// A fresh topic of `o.partitions` partitions holding `o.messages` records (keyed by id).
pub(crate) async fn fill(
    brokers: &str,
    topic: &str,
    first: u64,
    o: &Options,
) -> anyhow::Result<()> {
    consumer_kafka::create_topics(&config(brokers, "fill", topic), o.partitions, 1).await?;
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
fn raw_consumer(
    brokers: &str,
    topic: &str,
    group: &str,
    extra: &[(&str, &str)],
) -> anyhow::Result<StreamConsumer> {
    let mut c = ClientConfig::new();
    c.set("bootstrap.servers", brokers)
        .set("group.id", group)
        .set("enable.auto.commit", "true")
        .set("enable.auto.offset.store", "false")
        .set("auto.offset.reset", "earliest")
        .set("session.timeout.ms", "6000");
    for (name, value) in extra {
        c.set(*name, *value);
    }
    let consumer: StreamConsumer = c.create()?;
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
    let consumer = raw_consumer(brokers, topic, group, &[])?;
    let mut stream = consumer.stream();
    let mut latencies = Vec::with_capacity(o.messages);
    let first = stream.next().await.context("consumer ended")??;
    let clock = Clock::start();
    consumer.store_offset_from_message(&first)?;
    drop(first);
    for _ in 1..o.messages {
        let m = stream.next().await.context("consumer ended")??;
        let at = Instant::now();
        std::hint::black_box(m.payload());
        consumer.store_offset_from_message(&m)?;
        latencies.push(at.elapsed().as_micros() as u64);
    }
    Ok(clock.figures(o.messages, &mut latencies))
}

/// A hand-written arm's records (the arm's number of them), once the first has arrived, and
/// the arm's clock, started then as in the other Kafka arms.
async fn first_record<'c>(
    consumer: &'c StreamConsumer,
    o: &Options,
) -> anyhow::Result<(
    futures::stream::Peekable<futures::stream::Take<MessageStream<'c, DefaultConsumerContext>>>,
    Clock,
)> {
    let mut records = consumer.stream().take(o.messages).peekable();
    std::pin::Pin::new(&mut records)
        .peek()
        .await
        .context("consumer ended")?;
    Ok((records, Clock::start()))
}

/// Hand-written rdkafka + sqlx, one transaction a record or, `batched`, one a batch: the
/// records that arrive within the batch window (up to the batch size). Either way the
/// transaction makes one inbox insert and one effect insert, up to `concurrency`
/// transactions run at once and complete in fetch order, and then their records' offsets are
/// stored for the auto-committer (so none is stored past an unfinished transaction).
pub(crate) async fn hand_written(
    brokers: &str,
    topic: &str,
    group: &str,
    pool: &sqlx::PgPool,
    o: &Options,
    batched: bool,
) -> anyhow::Result<Figures> {
    let consumer = raw_consumer(brokers, topic, group, &[])?;
    let (records, clock) = first_record(&consumer, o).await?;
    let mut latencies = Vec::with_capacity(o.messages);
    let done = &mut latencies;
    if batched {
        let chunks = tokio_stream::StreamExt::chunks_timeout(records, o.batch, BATCH_WAIT);
        let batches = chunks.map(|chunk| async move {
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
            hand_batch(pool, jobs).await?;
            anyhow::Ok((offsets, at))
        });
        store_in_order(&consumer, topic, batches.buffered(o.concurrency), done).await?;
    } else {
        let each = records.map(|m| async move {
            let at = Instant::now();
            let m = m?;
            let key = format!("m-{}", String::from_utf8_lossy(m.key().unwrap_or_default()));
            let job: Job = serde_json::from_slice(m.payload().unwrap_or_default())?;
            hand_one(pool, &key, &job).await?;
            anyhow::Ok(([(m.partition(), m.offset())], at))
        });
        store_in_order(&consumer, topic, each.buffered(o.concurrency), done).await?;
    }
    Ok(clock.figures(o.messages, &mut latencies))
}

/// Stores the offsets of each finished transaction's records, in the order they finish, and
/// their latency from the transaction's start.
async fn store_in_order<O: AsRef<[(i32, i64)]>>(
    consumer: &StreamConsumer,
    topic: &str,
    done: impl futures::Stream<Item = anyhow::Result<(O, Instant)>>,
    latencies: &mut Vec<u64>,
) -> anyhow::Result<()> {
    futures::pin_mut!(done);
    while let Some(finished) = done.next().await {
        let (offsets, at) = finished?;
        for &(partition, offset) in offsets.as_ref() {
            consumer.store_offset(topic, partition, offset)?;
        }
        let us = at.elapsed().as_micros() as u64;
        latencies.extend(std::iter::repeat_n(us, offsets.as_ref().len()));
    }
    Ok(())
}

/// The framework's Kafka transport alone: every record acked as it arrives (up to 512 at
/// once), no worker and no database: what the transport costs over librdkafka.
pub(crate) async fn transport_only(
    brokers: &str,
    topic: &str,
    group: &str,
    o: &Options,
) -> anyhow::Result<Figures> {
    let mut consumer = framework_consumer(brokers, topic, group, o)?;
    let first = consumer.next().await.context("consumer ended")??;
    let clock = Clock::start();
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
    Ok(clock.figures(o.messages, &mut []))
}

/// The framework on Kafka, records ordered per key (so a batch can hold several records of
/// one partition).
pub(crate) async fn framework<H: Handler<Postgres>>(
    brokers: &str,
    topic: &str,
    group: &str,
    inbox: &Inbox<Postgres>,
    o: &Options,
    fw: Fw<'_, H>,
) -> anyhow::Result<Figures> {
    let consumer = framework_consumer(brokers, topic, group, o)?;
    let closed = consumer.closed();
    let worker = bench_worker(inbox, fw.handler, o, fw.batch)?;
    let acks = Acks::new(o.messages);
    let started: Arc<OnceLock<Clock>> = Arc::new(OnceLock::new());
    let (a2, started2) = (acks.clone(), started.clone());
    // The stream ends with the arm's last record: the worker then settles what it has in
    // flight and returns, as the hand-written arm ends with its stream.
    let stream = consumer.take(o.messages).map(move |r| {
        r.map(|i| {
            started2.get_or_init(Clock::start);
            timed(i, &a2)
        })
    });
    worker.run(stream, std::future::pending()).await?;
    let clock = *started.get().context("no record arrived")?;
    let end = End::after(fw.relay, o.messages, clock.start).await?;
    let cpu = clock.cpu();
    closed.await;
    framework_figures(o, &worker.snapshot(), &end, cpu, &acks, clock.base)
}

/// A fresh topic `name` of [`RELAY_PARTITIONS`], and a publisher (an idempotent producer) for
/// the relay.
async fn relay_destination(brokers: &str, name: &str) -> anyhow::Result<KafkaPublisher> {
    let c = config(brokers, "relay", name);
    consumer_kafka::create_topics(&c, RELAY_PARTITIONS, 1).await?;
    Ok(KafkaPublisher::new(&c)?)
}

/// An outbox arm ([`OutboxArm`]): the events go to the topic `<topic>_events` (fresh, of
/// [`RELAY_PARTITIONS`]) through a [`KafkaPublisher`]; the clock runs until the last one's delivery
/// report. Then checks that the topic holds every event once, and deletes it.
pub(crate) async fn outbox(
    brokers: &str,
    topic: &str,
    group: &str,
    inbox: &Inbox<Postgres>,
    o: &Options,
    arm: OutboxArm,
) -> anyhow::Result<Figures> {
    let events = format!("{topic}_events");
    let publisher = relay_destination(brokers, &events).await?;
    let (f, relay) = arm
        .run(inbox, publisher, &events, o, async |fw| {
            framework(brokers, topic, group, inbox, o, fw).await
        })
        .await?;
    let published = relay.stop().await?;
    let held = events_in(brokers, &events, o.messages).await?;
    delete_topic(brokers, &events).await;
    check_events(o.messages, published, held)?;
    Ok(f)
}

/// Raw rdkafka producing what `kafka: relay alone` publishes (the same keys and JSON
/// bodies, to a fresh topic of [`RELAY_PARTITIONS`], idempotent as the framework's producer
/// is), every record in flight at once; the clock runs until the last delivery report. What
/// the relay's publishing costs at best, without the outbox's reads and writes. Deletes
/// the topic after.
pub(crate) async fn raw_produce(
    brokers: &str,
    topic: &str,
    o: &Options,
) -> anyhow::Result<Figures> {
    use rdkafka::producer::{FutureProducer, FutureRecord};
    let events = format!("{topic}_events");
    consumer_kafka::create_topics(&config(brokers, "relay", &events), RELAY_PARTITIONS, 1).await?;
    let producer: FutureProducer = ClientConfig::new()
        .set("bootstrap.servers", brokers)
        .set("enable.idempotence", "true")
        .create()?;
    let records: Vec<(String, String)> = (0..o.messages)
        .map(|id| {
            (
                format!("job-{id}"),
                serde_json::json!({ "job_id": id }).to_string(),
            )
        })
        .collect();
    let clock = Clock::start();
    let sends = records.iter().map(|(key, body)| {
        producer.send(
            FutureRecord::to(&events).key(key).payload(body),
            Duration::from_secs(30),
        )
    });
    let reports = futures::future::join_all(sends).await;
    let f = clock.figures(o.messages, &mut []);
    for report in reports {
        report.map_err(|(e, _)| anyhow::anyhow!("{events}: {e}"))?;
    }
    delete_topic(brokers, &events).await;
    Ok(f)
}

/// How many distinct events `topic` holds, read back from the start (by a consumer of its own
/// group) until `n` have been read and no more come for 2 s; fails on a duplicate.
async fn events_in(brokers: &str, topic: &str, n: usize) -> anyhow::Result<u64> {
    let consumer = raw_consumer(brokers, topic, &format!("{topic}_check"), &[])?;
    let mut seen = std::collections::HashSet::with_capacity(n);
    let mut read = 0usize;
    loop {
        // The first record waits for the group to form.
        let wait = Duration::from_secs(if read < n { 60 } else { 2 });
        let Ok(m) = tokio::time::timeout(wait, consumer.recv()).await else {
            break;
        };
        seen.insert(m?.payload().unwrap_or_default().to_vec());
        read += 1;
    }
    anyhow::ensure!(
        read == seen.len(),
        "{topic}: {read} records read, {} distinct",
        seen.len()
    );
    Ok(seen.len() as u64)
}

/// Deletes `topic`; a broker that cannot is only reported (the topic's name is this run's).
async fn delete_topic(brokers: &str, topic: &str) {
    let deleted = async {
        let admin: AdminClient<DefaultClientContext> = ClientConfig::new()
            .set("bootstrap.servers", brokers)
            .create()?;
        for result in admin.delete_topics(&[topic], &AdminOptions::new()).await? {
            result.map_err(|(t, e)| anyhow::anyhow!("{t}: {e}"))?;
        }
        anyhow::Ok(())
    };
    if let Err(e) = deleted.await {
        eprintln!("could not delete the topic {topic}: {e}");
    }
}

/// The `--outbox-latency` destination on Kafka: a fresh topic `name`, a relay publisher, and
/// a plain consumer of the topic whose fetch waits at most 10 ms at the broker (the default
/// 500 ms would be the figure otherwise).
pub(crate) async fn latency_events(
    brokers: &str,
    name: &str,
) -> anyhow::Result<(KafkaPublisher, Received)> {
    let publisher = relay_destination(brokers, name).await?;
    let consumer = raw_consumer(
        brokers,
        name,
        &format!("{name}_g"),
        &[("fetch.wait.max.ms", "10")],
    )?;
    let received = Received::spawn(|arrived| async move {
        loop {
            let m = consumer.recv().await?;
            let at = Instant::now();
            if arrived
                .send((m.payload().unwrap_or_default().to_vec(), at))
                .is_err()
            {
                return anyhow::Ok(());
            }
        }
    });
    Ok((publisher, received))
}
