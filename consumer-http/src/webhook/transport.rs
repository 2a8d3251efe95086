//! The worker's side: [`WebhookTransport`], the stream of verified events, and the
//! acknowledger that hands each event's settlement back to the request waiting for it.

use std::pin::Pin;
use std::task::{Context, Poll};

use consumer_core::transport::{Acknowledger, Incoming, Settlement, TransportError};
use futures::future::BoxFuture;
use futures::Stream;
use tokio::sync::{mpsc, oneshot};

/// The [`Source::transport`](consumer_core::transport::Source::transport) of a webhook delivery.
pub const WEBHOOK_TRANSPORT: &str = "webhook";

/// The verified events of a [`WebhookIngress`](super::WebhookIngress), as a
/// [`Transport`](consumer_core::transport::Transport) for a [`Worker`](consumer_core::Worker).
///
/// It ends when the ingress's router (every clone of it) is dropped and the events it
/// buffered are taken. Dropping it (the worker stopped) makes the router answer 503 to new
/// events and to the buffered ones the worker had not taken.
pub struct WebhookTransport {
    pub(super) events: mpsc::Receiver<Incoming>,
}

impl std::fmt::Debug for WebhookTransport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WebhookTransport")
            .field("buffered", &self.events.len())
            .finish_non_exhaustive()
    }
}

impl Stream for WebhookTransport {
    type Item = Result<Incoming, TransportError>;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        self.events.poll_recv(cx).map(|next| next.map(Ok))
    }
}

/// Settles one webhook event by handing its settlement to the request that waits for it.
pub(super) struct Reply {
    pub(super) to: oneshot::Sender<Settlement>,
}

impl Acknowledger for Reply {
    /// `Ok` once the settlement is handed over, and also if the request is gone (its client
    /// hung up, or it stopped waiting): the worker settles only after the inbox committed
    /// the outcome, so nothing is lost, and the provider's resend is answered from the
    /// inbox. A dead letter reaches here only once the worker kept it in the inbox's
    /// dead-letter table (see [`Acknowledger::keeps_dead_letters`]); it is logged here,
    /// whether or not a request still waits.
    fn settle(
        self: Box<Self>,
        settlement: Settlement,
    ) -> BoxFuture<'static, Result<(), TransportError>> {
        if let Settlement::DeadLetter(dead) = &settlement {
            tracing::warn!(
                reason = dead.reason.as_str(),
                handler = %dead.handler,
                key = dead.key.as_deref(),
                attempts = dead.attempts,
                error = %dead.error,
                source = %dead.source,
                "webhook event dead-lettered and kept in the inbox's dead-letter table: answered 2xx, since the provider's resend cannot fix it",
            );
        }
        if self.to.send(settlement).is_err() {
            tracing::debug!(
                "the webhook request ended before its event was settled; the outcome is committed"
            );
        }
        Box::pin(async { Ok(()) })
    }

    /// The ingress has no dead-letter destination: the worker keeps each dead letter in the
    /// inbox's dead-letter table before the provider is answered.
    fn keeps_dead_letters(&self) -> bool {
        false
    }
}
