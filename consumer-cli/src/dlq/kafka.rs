//! Dead letters on Kafka.
//!
//! **Reading.** A throwaway consumer (no group offsets committed) is assigned every
//! partition of the dead-letter topic from offset 0 and reads until each partition reports
//! its end (`enable.partition.eof`). From offset 0: a topic whose head was deleted by
//! retention starts past 0, which Kafka resolves through `auto.offset.reset=earliest`.
//!
//! **Settling.** A record cannot be deleted from a topic, so a replayed or purged record is
//! recorded in `<inbox table>_dlq_settled` (topic, partition, offset), next to the inbox,
//! and every command skips the recorded ones. A replay, per record, in one transaction:
//! record it (a record someone else recorded meanwhile is skipped), release its inbox key
//! ([`consumer_core::Inbox::release`]), republish it to [`headers::ORIGINAL_TOPIC`] (and
//! its [`headers::ORIGINAL_PARTITION`]) with its key, value and headers minus the
//! framework's attempt, retry, error, dead-letter and origin headers, wait for the delivery
//! report, commit. A failed republish rolls the record back: the dead letter stays. A
//! `copy_too_large` letter is a reference to its record: the record it points to is read
//! first and republished in its place (see `reference`); if it is not there, nothing is
//! recorded or republished.
//!
//! **Expiring.** Each command that reads the topic deletes the marks of records that have
//! left it (deleted by the topic's retention) and were settled longer ago than
//! `--settled-retention`: such a mark can never match a record again, since Kafka never
//! reuses an offset. A mark whose record is still in the topic is kept whatever its age, so
//! a replayed record is never shown, or replayed, twice.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Context as _};
use consumer_core::Inbox;
use consumer_kafka::headers;
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::error::KafkaError;
use rdkafka::message::{Header, Headers, Message, OwnedHeaders, OwnedMessage};
use rdkafka::producer::{FutureProducer, FutureRecord};
use rdkafka::{Offset, TopicPartitionList};
use sqlx::{PgPool, Postgres};

use super::letter::DeadLetter;
use super::reference::Reference;
use super::report::{Done, Fate, Report};
use crate::output::Output;
use crate::settings;
use crate::{DbArgs, DlqArgs, Selection};

/// How long reading the topic to its end may take.
const READ_LIMIT: Duration = Duration::from_secs(60);

/// The largest record a replay republishes (librdkafka's `message.max.bytes`, of which
/// this is the default `receive.message.max.bytes`).
const REPLAY_MAX_BYTES: usize = 100_000_000;

/// Headers a replay strips: the transport's own, on retry copies and dead letters.
const STRIPPED: &[&str] = &[
    headers::ATTEMPT,
    headers::DUE_AT,
    headers::RETRY_GROUP,
    headers::DEAD_LETTER_REASON,
    headers::HANDLER,
    headers::KEY,
    headers::ATTEMPTS,
    headers::ERROR,
    headers::ORIGINAL_TOPIC,
    headers::ORIGINAL_PARTITION,
    headers::ORIGINAL_OFFSET,
    headers::FIRST_FAILURE,
];

/// The quoted name of the table of settled records beside `inbox`'s table.
pub(crate) fn settled_table_name(inbox: &Inbox<Postgres>) -> anyhow::Result<String> {
    // `inbox.table()` is validated and quoted, `"schema"."table"`: the name gains a suffix
    // inside its last quotes.
    inbox
        .table()
        .strip_suffix('"')
        .map(|t| format!("{t}_dlq_settled\""))
        .ok_or_else(|| anyhow!("unexpected inbox table name {}", inbox.table()))
}

/// The table of settled records, created if missing; its quoted name.
async fn settled_table(db: &DbArgs) -> anyhow::Result<(PgPool, String)> {
    let inbox = settings::inbox(db).await?;
    let table = settled_table_name(&inbox)?;
    sqlx::query(&format!(
        "CREATE TABLE IF NOT EXISTS {table} (topic TEXT NOT NULL, part INTEGER NOT NULL, \
         record_offset BIGINT NOT NULL, fate TEXT NOT NULL, \
         settled_at TIMESTAMPTZ NOT NULL DEFAULT now(), \
         PRIMARY KEY (topic, part, record_offset))"
    ))
    .execute(inbox.pool())
    .await
    .with_context(|| format!("create {table}"))?;
    Ok((inbox.pool().clone(), table))
}

/// Every dead letter of the topic not yet replayed or purged, with its record.
async fn read(dlq: &DlqArgs, db: &DbArgs, out: &Output) -> anyhow::Result<Read> {
    let topic = settings::required(&dlq.topic, "DLQ_TOPIC (--topic)")?.to_owned();
    settings::check_name("DLQ_TOPIC (--topic)", &topic)?;
    let (pool, table) = settled_table(db).await?;
    let mut client = settings::kafka(&dlq.kafka_brokers)?;
    client
        .set("group.id", format!("consumer-cli-{}", std::process::id()))
        .set("enable.auto.commit", "false")
        .set("enable.partition.eof", "true")
        .set("auto.offset.reset", "earliest");
    let records = {
        let topic = topic.clone();
        let out = *out;
        tokio::task::spawn_blocking(move || read_topic(client, &topic, &out))
            .await
            .context("the reading task")??
    };
    let settled: Vec<(i32, i64)> = sqlx::query_as(&format!(
        "SELECT part, record_offset FROM {table} WHERE topic = $1"
    ))
    .bind(&topic)
    .fetch_all(&pool)
    .await
    .context("read the settled records")?;
    expire_settled(&pool, &table, &topic, &records, dlq.settled_retention).await?;
    let total = records.len();
    let records: Vec<(DeadLetter, OwnedMessage)> = records
        .into_iter()
        .filter(|m| !settled.contains(&(m.partition(), m.offset())))
        .map(|m| (letter(&m), m))
        .collect();
    Ok(Read {
        topic,
        pool,
        table,
        settled: total - records.len(),
        records,
    })
}

/// Deletes the marks of `topic`'s records that are no longer in it (`present`: every record
/// a read to the end found) and were settled longer ago than `retention`.
async fn expire_settled(
    pool: &PgPool,
    table: &str,
    topic: &str,
    present: &[OwnedMessage],
    retention: Duration,
) -> anyhow::Result<()> {
    let (parts, offsets): (Vec<i32>, Vec<i64>) =
        present.iter().map(|m| (m.partition(), m.offset())).unzip();
    let ms = i64::try_from(retention.as_millis()).unwrap_or(i64::MAX);
    sqlx::query(&format!(
        "DELETE FROM {table} WHERE topic = $1 \
         AND settled_at < now() - $2 * interval '1 millisecond' \
         AND (part, record_offset) NOT IN (SELECT * FROM unnest($3::int[], $4::bigint[]))"
    ))
    .bind(topic)
    .bind(ms)
    .bind(&parts)
    .bind(&offsets)
    .execute(pool)
    .await
    .context("expire the marks of records gone from the topic")?;
    Ok(())
}

struct Read {
    topic: String,
    pool: PgPool,
    table: String,
    /// Records skipped because they were replayed or purged before.
    settled: usize,
    records: Vec<(DeadLetter, OwnedMessage)>,
}

fn read_topic(
    client: rdkafka::ClientConfig,
    topic: &str,
    out: &crate::output::Output,
) -> anyhow::Result<Vec<OwnedMessage>> {
    let brokers = "KAFKA_BROKERS (--kafka-brokers)";
    let consumer: BaseConsumer = client
        .create()
        .map_err(|e| anyhow!("{brokers}: cannot create a client: {e}"))?;
    let metadata = consumer
        .fetch_metadata(Some(topic), Duration::from_secs(10))
        .map_err(|e| anyhow!("{brokers}: cannot read the topic's metadata: {e}"))?;
    let partitions: Vec<i32> = metadata
        .topics()
        .iter()
        .filter(|t| t.name() == topic && t.error().is_none())
        .flat_map(|t| t.partitions().iter().map(|p| p.id()))
        .collect();
    if partitions.is_empty() {
        bail!("DLQ_TOPIC (--topic) {topic:?}: no such topic");
    }
    let mut tpl = TopicPartitionList::new();
    for p in &partitions {
        tpl.add_partition_offset(topic, *p, Offset::Offset(0))
            .context("assign")?;
    }
    consumer.assign(&tpl).context("assign the partitions")?;
    let mut open: Vec<i32> = partitions.clone();
    let mut records = Vec::new();
    let start = Instant::now();
    while !open.is_empty() {
        if start.elapsed() > READ_LIMIT {
            bail!("{brokers}: the topic {topic:?} was not read to its end within {READ_LIMIT:?}");
        }
        match consumer.poll(Duration::from_millis(200)) {
            None => {}
            Some(Ok(m)) => {
                records.push(m.detach());
                if records.len() % 500 == 0 {
                    out.progress(&format!(
                        "read {} dead letters from {topic}…",
                        records.len()
                    ));
                }
            }
            Some(Err(KafkaError::PartitionEOF(p))) => open.retain(|o| *o != p),
            Some(Err(e)) => bail!("read the topic {topic:?}: {e}"),
        }
    }
    Ok(records)
}

/// Every dead letter of the topic not yet replayed or purged.
pub(super) async fn browse(
    dlq: &DlqArgs,
    db: &DbArgs,
    out: &Output,
) -> anyhow::Result<Vec<DeadLetter>> {
    let read = read(dlq, db, out).await?;
    if read.settled > 0 {
        out.progress(&format!(
            "{} records of {} were replayed or purged before and are not shown",
            read.settled, read.topic
        ));
    }
    Ok(read.records.into_iter().map(|(l, _)| l).collect())
}

/// Replays (`replay`) or purges the selected dead letters.
pub(super) async fn settle(
    dlq: &DlqArgs,
    db: &DbArgs,
    selection: &Selection,
    replay: bool,
    out: &Output,
) -> anyhow::Result<Report> {
    let dead = read(dlq, db, out).await?;
    let inbox = settings::inbox(db).await?;
    let producer: FutureProducer = {
        let mut client = settings::kafka(&dlq.kafka_brokers)?;
        // The record of a `copy_too_large` letter is larger than the transport's copies:
        // the broker's own limit is the one that counts.
        client
            .set("enable.idempotence", "true")
            .set("message.max.bytes", REPLAY_MAX_BYTES.to_string());
        client.create().map_err(|e| {
            anyhow!("KAFKA_BROKERS (--kafka-brokers): cannot create a producer: {e}")
        })?
    };
    let selected: Vec<&(DeadLetter, OwnedMessage)> = dead
        .records
        .iter()
        .filter(|(l, _)| selection.takes(l))
        .collect();
    let total = selected.len();
    let mut done = Vec::new();
    for (i, (l, m)) in selected.into_iter().enumerate() {
        let mut line = Done {
            id: l.id.clone(),
            reason: l.reason.clone(),
            fate: Fate::WouldDo,
            key_released: false,
            error: None,
        };
        if replay && l.origin.is_none() {
            line.fate = Fate::NoOrigin;
        } else if !selection.dry_run {
            let fate = if replay { Fate::Replayed } else { Fate::Purged };
            let outcome = async {
                // A `copy_too_large` letter holds a reference: the record it points to is
                // the one replayed, read before anything is recorded.
                let referenced = match replay.then(|| Reference::of(l, m)).transpose()? {
                    Some(Some(reference)) => {
                        let client = settings::kafka(&dlq.kafka_brokers)?;
                        Some(reference.read(client, l, STRIPPED).await?)
                    }
                    _ => None,
                };
                let mut tx = dead.pool.begin().await.context("begin")?;
                let recorded = sqlx::query(&format!(
                    "INSERT INTO {} (topic, part, record_offset, fate) VALUES ($1, $2, $3, $4) \
                     ON CONFLICT DO NOTHING",
                    dead.table
                ))
                .bind(&dead.topic)
                .bind(m.partition())
                .bind(m.offset())
                .bind(if replay { "replayed" } else { "purged" })
                .execute(&mut *tx)
                .await
                .context("record the settlement")?
                .rows_affected();
                if recorded == 0 {
                    bail!("settled meanwhile by another command");
                }
                if replay {
                    if let (Some(handler), Some(key)) = (&l.handler, &l.key) {
                        line.key_released = inbox
                            .release(handler, key)
                            .await
                            .context("release the inbox key")?;
                    }
                    republish(&producer, l, referenced.as_ref().unwrap_or(m)).await?;
                }
                tx.commit().await.context("commit the settlement")?;
                anyhow::Ok(())
            };
            let outcome = outcome.await;
            line.settle(outcome, fate);
        }
        if total > 20 && (i + 1) % 100 == 0 {
            out.progress(&format!("{}/{total}…", i + 1));
        }
        done.push(line);
    }
    Ok(Report::new(selection.dry_run, dead.records.len(), done))
}

/// Publishes `m` (the letter's record, or the record its reference points to) to the
/// letter's origin, with its key, value and headers minus [`STRIPPED`]; `Ok` once the
/// delivery report came.
async fn republish(
    producer: &FutureProducer,
    l: &DeadLetter,
    m: &OwnedMessage,
) -> anyhow::Result<()> {
    let topic = l
        .headers
        .get(headers::ORIGINAL_TOPIC)
        .ok_or_else(|| anyhow!("no {} header", headers::ORIGINAL_TOPIC))?;
    let partition = l
        .headers
        .get(headers::ORIGINAL_PARTITION)
        .and_then(|p| p.parse::<i32>().ok());
    let mut kept = OwnedHeaders::new();
    if let Some(hs) = m.headers() {
        for h in hs.iter() {
            if !STRIPPED.contains(&h.key) {
                kept = kept.insert(Header {
                    key: h.key,
                    value: h.value,
                });
            }
        }
    }
    let mut record: FutureRecord<'_, [u8], [u8]> = FutureRecord::to(topic).headers(kept);
    if let Some(k) = m.key() {
        record = record.key(k);
    }
    if let Some(p) = m.payload() {
        record = record.payload(p);
    }
    if let Some(p) = partition {
        record = record.partition(p);
    }
    producer
        .send(record, Duration::from_secs(30))
        .await
        .map_err(|(e, _)| anyhow!("republish to {topic:?}: {e}"))?;
    Ok(())
}

fn letter(m: &OwnedMessage) -> DeadLetter {
    let mut hs = BTreeMap::new();
    if let Some(headers) = m.headers() {
        for h in headers.iter() {
            let v = h.value.map(String::from_utf8_lossy).unwrap_or_default();
            hs.insert(h.key.to_owned(), v.into_owned());
        }
    }
    let mut properties = BTreeMap::new();
    properties.insert("partition".to_owned(), m.partition().to_string());
    properties.insert("offset".to_owned(), m.offset().to_string());
    if let Some(k) = m.key() {
        properties.insert("key".to_owned(), String::from_utf8_lossy(k).into_owned());
    }
    if let Some(t) = m.timestamp().to_millis() {
        properties.insert("timestamp_ms".to_owned(), t.to_string());
    }
    DeadLetter {
        id: format!("{}/{}", m.partition(), m.offset()),
        reason: hs
            .get(headers::DEAD_LETTER_REASON)
            .cloned()
            .unwrap_or_else(|| "unknown".to_owned()),
        handler: hs.get(headers::HANDLER).cloned(),
        key: hs.get(headers::KEY).cloned(),
        error: hs.get(headers::ERROR).cloned(),
        origin: hs.get(headers::ORIGINAL_TOPIC).cloned(),
        headers: hs,
        properties,
        payload: m
            .payload()
            .map(|p| String::from_utf8_lossy(p).into_owned())
            .unwrap_or_default(),
    }
}
