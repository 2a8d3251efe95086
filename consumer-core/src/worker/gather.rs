//! The intake's batch window: what the transport has ready, and what arrives within
//! [`BatchConfig::max_wait`] after a batch's first delivery, up to
//! [`BatchConfig::max_messages`].

use std::future::Future;
use std::task::Poll;

use futures::StreamExt;

use super::config::BatchConfig;
use crate::delivery::{Incoming, Transport};

/// Adds what arrives within the batch window to `batch`; `true` if the transport ended.
///
/// The transport is polled here directly, each delivery pushed where it arrives: a
/// delivery is moved once on its way into the batch, not through the futures of a `next()`
/// and a timeout. What is ready is taken without arming the window's timer.
pub(super) async fn gather<T: Transport>(
    transport: &mut T,
    batch: &mut Vec<Incoming>,
    config: &BatchConfig,
) -> bool {
    let deadline = tokio::time::Instant::now() + config.max_wait;
    let mut window: Option<std::pin::Pin<Box<tokio::time::Sleep>>> = None;
    std::future::poll_fn(|cx| loop {
        if batch.len() >= config.max_messages {
            return Poll::Ready(false);
        }
        match transport.poll_next_unpin(cx) {
            Poll::Ready(Some(Ok(incoming))) => batch.push(incoming),
            Poll::Ready(Some(Err(e))) => {
                tracing::warn!(error = %e, "transport error while receiving");
            }
            Poll::Ready(None) => return Poll::Ready(true),
            Poll::Pending => {
                let window =
                    window.get_or_insert_with(|| Box::pin(tokio::time::sleep_until(deadline)));
                return window.as_mut().poll(cx).map(|()| false);
            }
        }
    })
    .await
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use futures::channel::mpsc;
    use futures::StreamExt;

    use super::gather;
    use crate::delivery::Incoming;
    use crate::error::TransportError;
    use crate::memory::{MemoryBroker, Message};
    use crate::BatchConfig;

    /// `n` deliveries of the in-memory broker.
    async fn deliveries(n: usize) -> Vec<Incoming> {
        let broker = MemoryBroker::new();
        for i in 0..n {
            broker.publish(
                "q",
                Message::json(format!("m-{i}"), &serde_json::json!({ "i": i })),
            );
        }
        broker
            .consume("q")
            .take(n)
            .map(Result::unwrap)
            .collect()
            .await
    }

    type Sent = mpsc::UnboundedSender<Result<Incoming, TransportError>>;

    fn window(max_messages: usize) -> BatchConfig {
        BatchConfig::new(max_messages, Duration::from_millis(50))
    }

    #[tokio::test(start_paused = true)]
    async fn a_batch_takes_what_is_ready_and_what_comes_within_its_window() {
        let (tx, mut rx): (Sent, _) = mpsc::unbounded();
        let mut ready = deliveries(5).await.into_iter();
        for incoming in ready.by_ref().take(2) {
            tx.unbounded_send(Ok(incoming)).unwrap();
        }
        // One more 30 ms into the window, one after it.
        let later = tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(30)).await;
            tx.unbounded_send(Ok(ready.next().unwrap())).unwrap();
            tokio::time::sleep(Duration::from_millis(40)).await;
            tx.unbounded_send(Ok(ready.next().unwrap())).unwrap();
            tx
        });
        let started = tokio::time::Instant::now();
        let mut batch = Vec::new();
        assert!(!gather(&mut rx, &mut batch, &window(10)).await);
        assert_eq!(batch.len(), 3);
        assert_eq!(started.elapsed(), Duration::from_millis(50));
        // The late one is the next batch's.
        let _tx = later.await.unwrap();
        assert!(rx.next().await.is_some());
    }

    #[tokio::test(start_paused = true)]
    async fn a_full_batch_does_not_wait_and_an_ended_transport_ends_it() {
        let (tx, mut rx): (Sent, _) = mpsc::unbounded();
        for incoming in deliveries(5).await {
            tx.unbounded_send(Ok(incoming)).unwrap();
        }
        let started = tokio::time::Instant::now();
        let mut batch = Vec::new();
        assert!(!gather(&mut rx, &mut batch, &window(3)).await);
        assert_eq!((batch.len(), started.elapsed()), (3, Duration::ZERO));
        // An error is passed over; the end of the transport closes the batch at once.
        tx.unbounded_send(Err(TransportError::msg("lost one")))
            .unwrap();
        drop(tx);
        let mut batch = Vec::new();
        assert!(gather(&mut rx, &mut batch, &window(10)).await);
        assert_eq!((batch.len(), started.elapsed()), (2, Duration::ZERO));
    }
}
