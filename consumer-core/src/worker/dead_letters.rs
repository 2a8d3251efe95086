//! Keeping the dead letters of a transport that has none of its own: [`KeepDeadLetter`]
//! writes the whole message to the inbox's dead-letter table before the transport settles
//! it (see [`Acknowledger::keeps_dead_letters`]).

use futures::future::BoxFuture;

use super::job::Verdict;
use super::settle::Settled;
use super::Inner;
use crate::delivery::{Acknowledger, Delivery, Settlement};
use crate::error::TransportError;
use crate::handler::Handler;
use crate::headers::Headers;
use crate::inbox::{Backend, Inbox, LetterToKeep};
use crate::message_id::MessageId;

/// Settles a dead letter of a transport without a dead-letter destination: first keeps the
/// message in the inbox's dead-letter table, then settles. If the letter cannot be kept,
/// the delivery is retried after `delay` instead, as `attempt` (a webhook provider is answered 503 and
/// resends; the in-memory broker delivers a copy), and the letter is kept when it is
/// dead-lettered again.
struct KeepDeadLetter<DB: Backend> {
    acker: Box<dyn Acknowledger>,
    inbox: Inbox<DB>,
    message_id: Option<MessageId>,
    headers: Headers,
    payload: bytes::Bytes,
    attempt: u32,
    delay: std::time::Duration,
}

impl<DB: Backend> Acknowledger for KeepDeadLetter<DB> {
    fn settle(
        self: Box<Self>,
        settlement: Settlement,
    ) -> BoxFuture<'static, Result<(), TransportError>> {
        Box::pin(async move {
            let this = *self;
            if let Settlement::DeadLetter(letter) = &settlement {
                let kept = this.inbox.keep_dead_letter(LetterToKeep {
                    letter,
                    message_id: this.message_id.as_deref(),
                    headers: &this.headers,
                    payload: &this.payload,
                });
                if let Err(e) = kept.await {
                    tracing::warn!(
                        reason = letter.reason.as_str(),
                        error = %e,
                        "could not keep the dead letter in the inbox; the message comes back later"
                    );
                    let (delay, attempt) = (this.delay, this.attempt);
                    return this
                        .acker
                        .settle(Settlement::Retry { delay, attempt })
                        .await;
                }
            }
            this.acker.settle(settlement).await
        })
    }

    fn copy_scope(&self) -> Option<&str> {
        self.acker.copy_scope()
    }

    fn keeps_dead_letters(&self) -> bool {
        self.acker.keeps_dead_letters()
    }
}

impl<DB: Backend, H: Handler<DB>> Inner<DB, H> {
    /// `verdict` to apply through `acker`, which first keeps the message of `delivery` in the
    /// inbox when the verdict dead-letters it and the transport keeps no dead letters.
    pub(super) fn keep_dead_letter(
        &self,
        delivery: &Delivery,
        acker: Box<dyn Acknowledger>,
        verdict: Verdict,
    ) -> Settled {
        let keep = matches!(verdict.settlement, Settlement::DeadLetter(_));
        let acker: Box<dyn Acknowledger> = if keep && !acker.keeps_dead_letters() {
            Box::new(KeepDeadLetter {
                acker,
                inbox: self.inbox.inbox().clone(),
                message_id: delivery.message_id.clone(),
                headers: delivery.headers.clone(),
                payload: delivery.payload.clone(),
                // A copy numbered one up, after the backoff for its number: a table that
                // stays out of reach is retried less and less often, not in a tight loop.
                attempt: delivery.attempt.saturating_add(1),
                delay: self.settings.backoff.next_delay(delivery.attempt),
            })
        } else {
            acker
        };
        Settled { acker, verdict }
    }
}
