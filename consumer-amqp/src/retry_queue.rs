//! The retry queues' consumers: every connection of an [`crate::AmqpConsumer`] also takes
//! the copies waiting in its work queue's retry queues, holds each one until it is due
//! ([`headers::RETRY_DUE`]), publishes it back to the work queue with a publisher confirm
//! and only then acks it.
//!
//! A copy is never dropped on the way: until the work queue has confirmed it, it stays
//! unacked in its retry queue, and a lost connection, a killed worker or a node that dies
//! returns it there for another consumer. A copy returned and then lost before its ack is
//! returned twice; the inbox takes the second for a duplicate. The broker's own
//! dead-lettering (a TTL on the retry queue) is not used: on a cluster a leader change can
//! leave its copies stranded in the retry queue for minutes (seen with RabbitMQ 3.10 after
//! the node holding a retry queue's leader was killed).
//!
//! A copy is held at most [`Topology::max_hold`](crate::topology::Topology) (half the
//! broker's consumer timeout) at a time: one due later goes back to the tail of its own
//! retry queue and waits again, so a retry delay longer than the broker's patience works.

use std::sync::Arc;
use std::time::{Duration, SystemTime};

use futures::stream::FuturesUnordered;
use futures::StreamExt;
use lapin::message::Delivery;
use lapin::options::{BasicAckOptions, BasicConsumeOptions, BasicNackOptions};
use lapin::types::FieldTable;
use lapin::Connection;

use crate::config::AmqpConfig;
use crate::headers;
use crate::link::{self, Link};
use crate::redacted_url::RedactedUrl;
use crate::topology::{short, RetryBucket};
use crate::Error;

/// How long a copy waits before it is offered again to a queue that refused it (a
/// `max-length` policy with `overflow: reject-publish`, a disk alarm).
const REFUSED_COPY_RETRY: Duration = Duration::from_secs(1);

/// Consumes each retry queue of `link`'s topology on a channel of its own on `connection`
/// (`prefetch` copies held per queue at most) and spawns one task per queue that returns
/// its copies. The tasks end when the link is retired; one that fails asks the session for
/// a new connection ([`Link::request_reset`]).
pub(crate) async fn start(
    connection: &Connection,
    url: &RedactedUrl,
    config: &AmqpConfig,
    link: &Arc<Link>,
) -> Result<(), Error> {
    let channel = link::consuming_channel(connection, url, config.prefetch).await?;
    for bucket in link.topology.retry_buckets() {
        let consumer = channel
            .basic_consume(
                short(&bucket.queue),
                short(""),
                BasicConsumeOptions::default(),
                FieldTable::default(),
            )
            .await
            .map_err(|e| Error::Topology {
                what: format!("consumer on retry queue {:?}", bucket.queue),
                source: e.into(),
            })?;
        tokio::spawn(return_copies(consumer, bucket.clone(), link.clone()));
    }
    Ok(())
}

/// Where a held copy went.
enum Moved {
    /// Back to the work queue: it was due.
    Returned,
    /// To the tail of its own retry queue: it is due after the longest hold.
    Requeued,
}

/// Takes `bucket`'s copies as they come and returns each once due, many at a time (each
/// waits for its own time and confirm); acks a copy once it was moved, and gives it back
/// to its queue if it could not be.
async fn return_copies(mut consumer: lapin::Consumer, bucket: RetryBucket, link: Arc<Link>) {
    let mut moving = FuturesUnordered::new();
    loop {
        tokio::select! {
            biased;
            () = link.retired() => return,
            Some((delivery, moved)) = moving.next() => {
                if !settle(delivery, moved, &bucket, &link).await {
                    link.request_reset();
                    return;
                }
            }
            next = consumer.next() => match next {
                Some(Ok(delivery)) => moving.push(hold_and_move(delivery, &bucket, &link)),
                Some(Err(e)) => {
                    tracing::warn!(queue = %bucket.queue, error = %e, "retry queue consumer lost");
                    link.request_reset();
                    return;
                }
                None => {
                    tracing::warn!(queue = %bucket.queue, "the broker cancelled the retry queue's consumer (queue deleted?)");
                    link.request_reset();
                    return;
                }
            },
        }
    }
}

/// Holds `delivery` until it is due (at most the longest hold), then publishes it to the
/// work queue, or back to its retry queue if it is not due yet. A copy the broker refuses
/// is offered again every [`REFUSED_COPY_RETRY`].
async fn hold_and_move(
    delivery: Delivery,
    bucket: &RetryBucket,
    link: &Link,
) -> (Delivery, Result<Moved, Error>) {
    let received = SystemTime::now();
    // Never later than the queue's delay from now: a copy's time is its publisher's clock,
    // and a producer may write the header.
    let due = headers::millis(delivery.properties.headers().as_ref(), headers::RETRY_DUE)
        .map_or(received, |due| due.min(received + bucket.delay));
    let wait = due.duration_since(received).unwrap_or_default();
    let hold = wait.min(link.topology.max_hold);
    tokio::time::sleep(hold).await;
    let (queue, moved) = if hold < wait {
        (bucket.queue.as_str(), Moved::Requeued)
    } else {
        (link.topology.queue.as_str(), Moved::Returned)
    };
    loop {
        let published = link
            .publisher
            .publish("", queue, &delivery.data, delivery.properties.clone())
            .await;
        match published {
            Ok(()) => return (delivery, Ok(moved)),
            Err(e @ Error::Nacked { .. }) => {
                tracing::warn!(queue, error = %e.chain(), retry_in = ?REFUSED_COPY_RETRY, "the broker refused a retry copy's return; offering it again");
                tokio::time::sleep(REFUSED_COPY_RETRY).await;
            }
            Err(e) => return (delivery, Err(e)),
        }
    }
}

/// Acks a moved copy, or gives one that could not be moved back to its queue. `false` when
/// the connection should be replaced.
async fn settle(
    delivery: Delivery,
    moved: Result<Moved, Error>,
    bucket: &RetryBucket,
    link: &Link,
) -> bool {
    match moved {
        Ok(moved) => {
            if let Err(e) = delivery.acker.ack(BasicAckOptions::default()).await {
                // The copy was published: the broker redelivers this one, and the inbox
                // takes the second return for a duplicate.
                tracing::warn!(queue = %bucket.queue, error = %e, "acking a returned retry copy failed");
                return false;
            }
            let what = match moved {
                Moved::Returned => "returned",
                Moved::Requeued => "requeued",
            };
            metrics::counter!("consumer_amqp_retry_copies_total", "queue" => link.topology.queue.clone(), "moved" => what)
                .increment(1);
            true
        }
        Err(e) => {
            tracing::warn!(queue = %bucket.queue, error = %e.chain(), "a retry copy could not be returned; giving it back and reconnecting");
            let requeue = BasicNackOptions {
                multiple: false,
                requeue: true,
            };
            let _ = delivery.acker.nack(requeue).await;
            false
        }
    }
}
