//! A Kafka dead letter with reason `copy_too_large`: the transport could not copy the record
//! (too large), so the letter's body is a reference to where the record is,
//! `{"topic":…,"partition":…,"offset":…}`, and its headers carry the record's message id.
//! A replay republishes the record the reference points to, read at its offset: the
//! reference itself is not the message.
//!
//! The record may be gone (deleted by retention or compaction, or a topic recreated since):
//! then reading fails naming the topic, partition and offset, and nothing is republished.
//! A record found there whose message id differs from the letter's is not the one the
//! letter refers to, and is refused the same way.

use std::fmt;
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Context as _};
use consumer_core::DeadLetterReason;
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::error::KafkaError;
use rdkafka::message::{Headers, Message, OwnedMessage};
use rdkafka::{ClientConfig, Offset, TopicPartitionList};
use serde::Deserialize;

use super::letter::DeadLetter;
use crate::settings;

/// How long finding the referenced record may take.
const READ_LIMIT: Duration = Duration::from_secs(30);

/// Where a `copy_too_large` letter says its record is.
#[derive(Debug, Deserialize)]
pub(super) struct Reference {
    topic: String,
    partition: i32,
    offset: i64,
}

impl fmt::Display for Reference {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "topic {:?}, partition {}, offset {}",
            self.topic, self.partition, self.offset
        )
    }
}

impl Reference {
    /// The reference a letter holds in place of its record; `None` for a letter that holds
    /// its record.
    pub(super) fn of(letter: &DeadLetter, m: &OwnedMessage) -> anyhow::Result<Option<Self>> {
        if letter.reason != DeadLetterReason::CopyTooLarge.as_str() {
            return Ok(None);
        }
        let body = m.payload().unwrap_or_default();
        let reference: Reference = serde_json::from_slice(body).map_err(|e| {
            anyhow!(
                "a copy_too_large letter's body must be a reference \
                 {{\"topic\",\"partition\",\"offset\"}}: {e}"
            )
        })?;
        settings::check_name("the reference's topic", &reference.topic)?;
        if reference.partition < 0 || reference.offset < 0 {
            bail!("the reference names no record: {reference}");
        }
        Ok(Some(reference))
    }

    /// Reads the record at the reference (a blocking client, on a blocking thread), and
    /// checks that it is the letter's: every header the letter carries besides the
    /// transport's own (`framework`; that leaves its message id) has the same value on the
    /// record.
    pub(super) async fn read(
        self,
        client: ClientConfig,
        letter: &DeadLetter,
        framework: &[&str],
    ) -> anyhow::Result<OwnedMessage> {
        let shown = self.to_string();
        let record = tokio::task::spawn_blocking(move || self.read_blocking(client))
            .await
            .context("the reading task")??;
        for (name, value) in &letter.headers {
            if framework.contains(&name.as_str()) {
                continue;
            }
            let found = record
                .headers()
                .and_then(|hs| hs.iter().find(|h| h.key == name))
                .and_then(|h| h.value)
                .map(String::from_utf8_lossy);
            // The transport cuts a long message id in the letter, marked with `…`.
            let same = found.as_deref().is_some_and(|f| {
                f == value
                    || value
                        .strip_suffix('…')
                        .is_some_and(|cut| f.starts_with(cut))
            });
            if !same {
                bail!(
                    "the record at {shown} is not the one the letter refers to: its {name:?} \
                     header is {found:?}, the letter's {value:?}"
                );
            }
        }
        Ok(record)
    }

    fn read_blocking(&self, mut client: ClientConfig) -> anyhow::Result<OwnedMessage> {
        client
            .set("group.id", format!("consumer-cli-{}", std::process::id()))
            .set("enable.auto.commit", "false")
            .set("enable.partition.eof", "true")
            // An offset the partition no longer has is an error, not a jump elsewhere.
            .set("auto.offset.reset", "error");
        let consumer: BaseConsumer = client
            .create()
            .map_err(|e| anyhow!("KAFKA_BROKERS (--kafka-brokers): cannot create a client: {e}"))?;
        let gone = |why: String| {
            anyhow!(
                "the record at {self} is not there ({why}): it may have been deleted (retention, \
                 compaction) or the topic recreated; nothing was republished"
            )
        };
        let (_, end) = consumer
            .fetch_watermarks(&self.topic, self.partition, Duration::from_secs(10))
            .map_err(|e| anyhow!("cannot read {self}: {e}"))?;
        if self.offset >= end {
            return Err(gone(format!("the partition ends at offset {end}")));
        }
        let mut tpl = TopicPartitionList::new();
        tpl.add_partition_offset(&self.topic, self.partition, Offset::Offset(self.offset))
            .context("assign")?;
        consumer.assign(&tpl).context("assign the partition")?;
        let start = Instant::now();
        while start.elapsed() < READ_LIMIT {
            match consumer.poll(Duration::from_millis(200)) {
                None => {}
                Some(Ok(m)) if m.offset() == self.offset => return Ok(m.detach()),
                // Records before it may come in the same batch.
                Some(Ok(m)) if m.offset() < self.offset => {}
                Some(Ok(m)) => {
                    return Err(gone(format!(
                        "the partition's next record is at offset {}",
                        m.offset()
                    )))
                }
                Some(Err(KafkaError::PartitionEOF(_))) => {
                    return Err(gone("the partition ends before it".to_owned()))
                }
                Some(Err(e)) => bail!("cannot read the record at {self}: {e}"),
            }
        }
        bail!("the record at {self} was not read within {READ_LIMIT:?}")
    }
}
