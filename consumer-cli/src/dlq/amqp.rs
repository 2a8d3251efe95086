//! Dead letters on RabbitMQ.
//!
//! **Reading without consuming.** A queue cannot be browsed in AMQP 0-9-1, so the CLI takes
//! every message with `basic.get` *without* auto-ack, on one channel, and holds them all
//! unacked (the broker does not hand an unacked message out again on that channel, so the
//! loop ends when the queue looks empty). Then it settles: messages it replayed or purged
//! are acked, the rest are returned with one `basic.nack` (`multiple`, `requeue`). If the
//! CLI dies first, the broker requeues the unacked messages itself when the connection
//! closes: nothing is lost. A requeued message keeps its place in a classic queue; it is
//! marked redelivered, and a quorum queue counts the delivery (mind a `delivery-limit`
//! on a quorum dead-letter queue). While a command holds the messages, another command
//! sees the queue empty: run one at a time.
//!
//! **Replay.** For each selected message: its inbox key is released
//! ([`consumer_core::Inbox::release`]); it is republished, mandatory and confirmed, to
//! [`headers::ORIGINAL_EXCHANGE`] with [`headers::ORIGINAL_ROUTING_KEY`], with its body and
//! properties but without the attempt, dead-letter, error and origin headers nor the
//! broker's `x-death`; once the broker confirmed the copy, the dead letter is acked.
//!
//! **Whose origin.** A producer can write `x-original-*` itself, so the origin is used only
//! when the dead letter's [`headers::ORIGIN_SIGNATURE`] verifies under the workers' secret
//! ([`consumer_amqp::OriginSecret`], read from the same `AMQP_ORIGIN_SECRET`) for this
//! dead-letter queue. Any other message (or every message, without the secret) is left in
//! the queue with fate `unverified_origin`, until the operator names the destination with
//! `--to EXCHANGE/ROUTING_KEY`, which then applies to every selected message.

use std::collections::BTreeMap;

use anyhow::{bail, Context as _};
use consumer_amqp::headers;
use lapin::options::{
    BasicAckOptions, BasicGetOptions, BasicNackOptions, BasicPublishOptions, ConfirmSelectOptions,
    QueueDeclareOptions,
};
use lapin::types::{AMQPValue, FieldTable, ShortString};
use lapin::{BasicProperties, Channel, Confirmation, Connection};

use super::letter::DeadLetter;
use super::origin::{string_header, Destination, Replay};
use super::report::{Done, Fate, Report};
use crate::output::Output;
use crate::settings;
use crate::{DbArgs, DlqArgs, Selection};

/// Headers a replay strips: the framework's attempt, origin, error and dead-letter headers,
/// and what RabbitMQ itself adds when it dead-letters.
const STRIPPED: &[&str] = &[
    headers::ATTEMPT,
    headers::FIRST_FAILURE,
    headers::LAST_FAILURE,
    headers::DEAD_LETTER_REASON,
    headers::HANDLER,
    headers::KEY,
    headers::ATTEMPTS,
    headers::ERROR,
    headers::ORIGINAL_EXCHANGE,
    headers::ORIGINAL_ROUTING_KEY,
    headers::ORIGIN_SIGNATURE,
    "x-death",
    "x-first-death-exchange",
    "x-first-death-queue",
    "x-first-death-reason",
    "x-last-death-exchange",
    "x-last-death-queue",
    "x-last-death-reason",
    "x-delivery-count",
];

/// One message taken from the DLQ and held unacked.
struct Held {
    tag: u64,
    letter: DeadLetter,
    body: Vec<u8>,
    properties: BasicProperties,
}

/// A channel holding every message of the DLQ unacked.
struct Session {
    /// The dead-letter queue.
    queue: String,
    connection: Connection,
    channel: Channel,
    held: Vec<Held>,
}

impl Session {
    async fn open(dlq: &DlqArgs, out: &Output) -> anyhow::Result<Self> {
        let queue = settings::required(&dlq.queue, "DLQ_QUEUE (--queue)")?.to_owned();
        settings::check_name("DLQ_QUEUE (--queue)", &queue)?;
        let connection = settings::amqp(&dlq.amqp_url).await?;
        let channel = connection
            .create_channel()
            .await
            .context("open a channel")?;
        // Passive: a queue that does not exist is a wrong name, not one to create.
        let declared = channel
            .queue_declare(
                ShortString::from(queue.as_str()),
                QueueDeclareOptions {
                    passive: true,
                    ..QueueDeclareOptions::default()
                },
                FieldTable::default(),
            )
            .await;
        if let Err(e) = declared {
            bail!("DLQ_QUEUE (--queue) {queue:?}: no such queue ({e})");
        }
        let mut held = Vec::new();
        while let Some(m) = channel
            .basic_get(
                ShortString::from(queue.as_str()),
                BasicGetOptions { no_ack: false },
            )
            .await
            .with_context(|| format!("read the dead-letter queue {queue:?}"))?
        {
            let d = m.delivery;
            let letter = letter(&d.properties, &d.data, held.len());
            held.push(Held {
                tag: d.delivery_tag,
                letter,
                body: d.data,
                properties: d.properties,
            });
            if held.len() % 500 == 0 {
                out.progress(&format!("read {} dead letters from {queue}…", held.len()));
            }
        }
        Ok(Session {
            queue,
            connection,
            channel,
            held,
        })
    }

    /// Returns every message not acked to the queue, and closes the connection.
    async fn close(self, acked: &[u64]) -> anyhow::Result<()> {
        let last_unacked = self
            .held
            .iter()
            .map(|h| h.tag)
            .filter(|t| !acked.contains(t))
            .max();
        if let Some(tag) = last_unacked {
            self.channel
                .basic_nack(
                    tag,
                    BasicNackOptions {
                        multiple: true,
                        requeue: true,
                    },
                )
                .await
                .context("return the dead letters to their queue")?;
        }
        let _ = self.channel.close(200, "done".into()).await;
        let _ = self.connection.close(200, "done".into()).await;
        Ok(())
    }
}

/// Every dead letter of the queue, left in it.
pub(super) async fn browse(dlq: &DlqArgs, out: &Output) -> anyhow::Result<Vec<DeadLetter>> {
    let session = Session::open(dlq, out).await?;
    let letters = session.held.iter().map(|h| h.letter.clone()).collect();
    session.close(&[]).await?;
    Ok(letters)
}

/// Replays (`replay`) or purges (`None`) the selected dead letters.
pub(super) async fn settle(
    dlq: &DlqArgs,
    db: &DbArgs,
    selection: &Selection,
    replay: Option<Replay>,
    out: &Output,
) -> anyhow::Result<Report> {
    // The database first: a wrong DATABASE_URL fails before any message is held.
    let inbox = if replay.is_some() && !selection.dry_run {
        Some(settings::inbox(db).await?)
    } else {
        None
    };
    let session = Session::open(dlq, out).await?;
    let publisher = if replay.is_some() && !selection.dry_run {
        let c = session
            .connection
            .create_channel()
            .await
            .context("open a channel")?;
        c.confirm_select(ConfirmSelectOptions::default())
            .await
            .context("put the channel in confirm mode")?;
        Some(c)
    } else {
        None
    };
    let selected: Vec<&Held> = session
        .held
        .iter()
        .filter(|h| selection.takes(&h.letter))
        .collect();
    let total = selected.len();
    let mut acked = Vec::new();
    let mut done = Vec::new();
    for (i, h) in selected.into_iter().enumerate() {
        let mut line = Done {
            id: h.letter.id.clone(),
            reason: h.letter.reason.clone(),
            fate: Fate::WouldDo,
            key_released: false,
            error: None,
        };
        let destination = match replay
            .as_ref()
            .map(|r| r.destination(&h.properties, &session.queue))
        {
            Some(Err((fate, why))) => {
                line.fate = fate;
                line.error = Some(why);
                None
            }
            Some(Ok(destination)) => Some(destination),
            None => None,
        };
        if replay.is_some() && destination.is_none() {
            // Not replayed: the fate says why.
        } else if !selection.dry_run {
            let outcome = async {
                if let (Some(inbox), Some(channel), Some(destination)) =
                    (&inbox, &publisher, &destination)
                {
                    if let (Some(handler), Some(key)) = (&h.letter.handler, &h.letter.key) {
                        // Before the republish: a copy that arrived first would find the
                        // key dead and be dead-lettered again.
                        line.key_released = inbox
                            .release(handler, key)
                            .await
                            .context("release the inbox key")?;
                    }
                    republish(channel, h, destination).await?;
                }
                session
                    .channel
                    .basic_ack(h.tag, BasicAckOptions::default())
                    .await
                    .context("ack the dead letter")?;
                anyhow::Ok(())
            };
            let outcome = outcome.await;
            if outcome.is_ok() {
                acked.push(h.tag);
            }
            let fate = if replay.is_some() {
                Fate::Replayed
            } else {
                Fate::Purged
            };
            line.settle(outcome, fate);
        }
        if total > 20 && (i + 1) % 100 == 0 {
            out.progress(&format!("{}/{total}…", i + 1));
        }
        done.push(line);
    }
    let read = session.held.len();
    session.close(&acked).await?;
    Ok(Report::new(selection.dry_run, read, done))
}

/// Publishes the held message to `to` without the stripped headers; `Ok` once the broker
/// confirmed it.
async fn republish(channel: &Channel, h: &Held, to: &Destination) -> anyhow::Result<()> {
    let table = h.properties.headers().clone().unwrap_or_default();
    let Destination {
        exchange,
        routing_key,
    } = to;
    let properties = h.properties.clone().with_headers(replay_headers(&table));
    let confirm = channel
        .basic_publish(
            ShortString::from(exchange.as_str()),
            ShortString::from(routing_key.as_str()),
            BasicPublishOptions {
                mandatory: true,
                immediate: false,
            },
            &h.body,
            properties,
        )
        .await
        .with_context(|| format!("republish to exchange {exchange:?}, key {routing_key:?}"))?
        .await
        .with_context(|| format!("republish to exchange {exchange:?}, key {routing_key:?}"))?;
    match confirm {
        Confirmation::Ack(None) => Ok(()),
        Confirmation::Ack(Some(_)) | Confirmation::Nack(Some(_)) => {
            bail!("exchange {exchange:?} routes key {routing_key:?} to no queue")
        }
        Confirmation::Nack(None) => bail!("the broker refused the republished copy"),
        Confirmation::NotRequested => bail!("the channel is not in confirm mode"),
    }
}

/// The headers of a replayed copy: the dead letter's without [`STRIPPED`].
fn replay_headers(table: &FieldTable) -> FieldTable {
    let mut kept = FieldTable::default();
    for (k, v) in table.inner() {
        if !STRIPPED.contains(&k.as_str()) {
            kept.insert(k.clone(), v.clone());
        }
    }
    kept
}

/// The message as the commands show it; `position` names one without a message id.
fn letter(p: &BasicProperties, body: &[u8], position: usize) -> DeadLetter {
    let table = p.headers().as_ref();
    let headers: BTreeMap<String, String> = table
        .map(|t| {
            t.inner()
                .iter()
                .map(|(k, v)| (k.to_string(), text(v)))
                .collect()
        })
        .unwrap_or_default();
    let mut properties = BTreeMap::new();
    let mut put = |name: &str, v: Option<String>| {
        if let Some(v) = v {
            properties.insert(name.to_owned(), v);
        }
    };
    put("message_id", p.message_id().as_ref().map(|s| s.to_string()));
    put(
        "content_type",
        p.content_type().as_ref().map(|s| s.to_string()),
    );
    put(
        "correlation_id",
        p.correlation_id().as_ref().map(|s| s.to_string()),
    );
    put("timestamp", p.timestamp().map(|t| t.to_string()));
    put("delivery_mode", p.delivery_mode().map(|m| m.to_string()));
    let id = p
        .message_id()
        .as_ref()
        .map(|s| s.to_string())
        .unwrap_or_else(|| format!("#{position}"));
    let origin = string_header(table, headers::ORIGINAL_ROUTING_KEY).map(|rk| {
        let ex = string_header(table, headers::ORIGINAL_EXCHANGE).unwrap_or_default();
        format!("{ex}/{rk}")
    });
    DeadLetter {
        id,
        reason: headers
            .get(headers::DEAD_LETTER_REASON)
            .cloned()
            .unwrap_or_else(|| "unknown".to_owned()),
        handler: headers.get(headers::HANDLER).cloned(),
        key: headers.get(headers::KEY).cloned(),
        error: headers.get(headers::ERROR).cloned(),
        origin,
        headers,
        properties,
        payload: String::from_utf8_lossy(body).into_owned(),
    }
}

/// A header value as text: strings as they are, everything else in lapin's notation.
fn text(v: &AMQPValue) -> String {
    match v {
        AMQPValue::LongString(s) => s.to_string(),
        AMQPValue::ShortString(s) => s.to_string(),
        AMQPValue::LongLongInt(n) => n.to_string(),
        AMQPValue::LongInt(n) => n.to_string(),
        AMQPValue::ShortInt(n) => n.to_string(),
        AMQPValue::Boolean(b) => b.to_string(),
        other => format!("{other:?}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_replay_strips_the_framework_and_broker_headers_only() {
        let mut t = FieldTable::default();
        for name in STRIPPED {
            t.insert((*name).into(), AMQPValue::LongString("x".into()));
        }
        t.insert("trace-id".into(), AMQPValue::LongString("t-1".into()));
        t.insert("x-tenant".into(), AMQPValue::LongLongInt(7));
        let kept = replay_headers(&t);
        let names: Vec<&str> = kept.inner().keys().map(|k| k.as_str()).collect();
        assert_eq!(names, ["trace-id", "x-tenant"]);
        assert!(STRIPPED.contains(&headers::ATTEMPT));
        assert!(STRIPPED.contains(&headers::DEAD_LETTER_REASON));
        assert!(STRIPPED.contains(&"x-death"));
    }

    #[test]
    fn a_letter_names_its_origin_and_reason() {
        let mut t = FieldTable::default();
        t.insert(
            headers::DEAD_LETTER_REASON.into(),
            AMQPValue::LongString("permanent_error".into()),
        );
        t.insert(
            headers::ORIGINAL_EXCHANGE.into(),
            AMQPValue::LongString("".into()),
        );
        t.insert(
            headers::ORIGINAL_ROUTING_KEY.into(),
            AMQPValue::LongString("orders".into()),
        );
        let p = BasicProperties::default()
            .with_headers(t)
            .with_message_id("m-1".into());
        let l = letter(&p, b"{}", 0);
        assert_eq!(
            (l.id.as_str(), l.reason.as_str()),
            ("m-1", "permanent_error")
        );
        assert_eq!(l.origin.as_deref(), Some("/orders"));
        let unnamed = letter(&BasicProperties::default(), b"", 3);
        assert_eq!(
            (unnamed.id.as_str(), unnamed.reason.as_str()),
            ("#3", "unknown")
        );
        assert_eq!(unnamed.origin, None);
    }
}
