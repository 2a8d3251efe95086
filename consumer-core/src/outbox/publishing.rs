//! How a relay publishes the rows of a round: each key's rows one after another, each once
//! the one before it is confirmed, and every key (and every row without one) at once, so
//! that a slow confirm holds back its own key only and the broker sees the whole round
//! in flight (RabbitMQ: the confirms awaited together; Kafka: the producer batches them).

use std::collections::HashMap;

use futures::future::try_join_all;

use super::publisher::Publisher;
use crate::inbox::OutboxRow;
use crate::Error;

/// A check at a fault point: its error (a crash there) ends the round.
pub(super) type Fault<'f> = dyn Fn(RelayPoint, &OutboxRow) -> Result<(), Error> + Sync + 'f;

/// The fault points of a round.
#[derive(Clone, Copy)]
pub(super) enum RelayPoint {
    BeforePublish,
    AfterPublish,
}

/// A row whose publish failed.
pub(super) struct Failed {
    pub(super) id: i64,
    /// Its publishes so far, this one counted.
    pub(super) attempts: u32,
    pub(super) error: String,
    /// Whether the broker refused the message (rather than being unavailable).
    pub(super) refused: bool,
}

/// What publishing a round's rows did.
#[derive(Default)]
pub(super) struct Published {
    /// The rows the broker confirmed.
    pub(super) ids: Vec<i64>,
    /// The rows whose publish failed; the later rows of their keys were not tried.
    pub(super) failed: Vec<Failed>,
}

/// Publishes `rows` (in id order) through `publisher`. `fault` is checked before and after
/// each publish; its error (a crash at a fault point) ends the publishing at once.
pub(super) async fn publish_rows(
    publisher: &dyn Publisher,
    rows: Vec<OutboxRow>,
    fault: &Fault<'_>,
) -> Result<Published, Error> {
    let keys = try_join_all(
        by_key(rows)
            .into_iter()
            .map(|rows| publish_key(publisher, rows, fault)),
    )
    .await?;
    let mut all = Published::default();
    for key in keys {
        all.ids.extend(key.ids);
        all.failed.extend(key.failed);
    }
    Ok(all)
}

/// Publishes one key's `rows` in order, each after the one before it was confirmed; a
/// failed row holds back the rest.
async fn publish_key(
    publisher: &dyn Publisher,
    rows: Vec<OutboxRow>,
    fault: &Fault<'_>,
) -> Result<Published, Error> {
    let mut done = Published::default();
    for row in rows {
        fault(RelayPoint::BeforePublish, &row)?;
        match publisher.publish(&row.message).await {
            Ok(()) => {
                fault(RelayPoint::AfterPublish, &row)?;
                done.ids.push(row.id);
            }
            Err(e) => {
                let attempts = row.attempts.saturating_add(1);
                let id = row.message.message_id.as_deref().unwrap_or_default();
                let refused = e.is_refused();
                if refused {
                    tracing::error!(message_id = id, destination = %row.message.destination,
                        attempts, error = %e, "outbox: the broker refused a message; it stays in the outbox");
                } else {
                    tracing::warn!(message_id = id, destination = %row.message.destination,
                        attempts, error = %e, "outbox: publish failed; it will be tried again");
                }
                done.failed.push(Failed {
                    id: row.id,
                    attempts,
                    error: e.to_string(),
                    refused,
                });
                break;
            }
        }
    }
    Ok(done)
}

/// `rows` (in id order) as one list a key, each in id order, and one list a row without a
/// key, in the order of their first rows.
fn by_key(rows: Vec<OutboxRow>) -> Vec<Vec<OutboxRow>> {
    let mut lists: Vec<Vec<OutboxRow>> = Vec::with_capacity(rows.len());
    let mut of_key: HashMap<String, usize> = HashMap::new();
    for row in rows {
        let Some(key) = &row.message.key else {
            lists.push(vec![row]);
            continue;
        };
        match of_key.get(key) {
            Some(&i) => lists[i].push(row),
            None => {
                of_key.insert(key.clone(), lists.len());
                lists.push(vec![row]);
            }
        }
    }
    lists
}
