//! The settle stage, applying the verdicts: each becomes a [`Settled`], the verdict with the
//! acknowledger that applies it ([`Inner::settled`]: a retry copy's is recorded in the inbox
//! by [`RecordRetry`], a duplicate request's reply is sent again by [`ResendReply`]); a batch's
//! are applied together ([`settle_all`]) and its outcomes counted ([`Inner::count_all`]).
//! How an attempt's end becomes a verdict is [`super::verdict`]'s.

use std::time::Duration;

use futures::future::BoxFuture;
use futures::FutureExt;

use super::inner::Inner;
use super::job::{Job, Outcome, Verdict};
use crate::delivery::{Acknowledger, Settlement};
use crate::error::TransportError;
use crate::handler::Handler;
use crate::header_names::REPLY_TO;
use crate::inbox::{Backend, HandlerInbox};
use crate::outbox::reply;

/// A verdict waiting to be applied, with its acknowledger.
pub(super) struct Settled {
    pub(super) acker: Box<dyn Acknowledger>,
    pub(super) verdict: Verdict,
}

/// Applies a batch's settlements, all under way at once, and returns each outcome with its
/// result, in order. The acks go together, through the first acked delivery's
/// [`Acknowledger::ack_with`] (a RabbitMQ batch is then one `multiple` ack, not one
/// settlement a delivery); the other settlements each through their own acknowledger. Most
/// settle at their first poll (a Kafka ack marks an offset): those are polled in place, and
/// only the rest are joined, so a batch does not pay a task and a wake-up per delivery.
pub(super) async fn settle_all(
    settled: Vec<Settled>,
) -> Vec<(Outcome, Result<(), TransportError>)> {
    let mut done = Vec::with_capacity(settled.len());
    // The acked deliveries: where each one's result goes, and its acknowledger.
    let mut acked = Vec::with_capacity(settled.len());
    let mut ackers: Vec<Box<dyn Acknowledger>> = Vec::with_capacity(settled.len());
    let mut alone = Vec::new();
    for (i, Settled { acker, verdict }) in settled.into_iter().enumerate() {
        done.push((verdict.outcome, Ok(())));
        match verdict.settlement {
            Settlement::Ack => {
                acked.push(i);
                ackers.push(acker);
            }
            other => alone.push((i, acker, other)),
        }
    }
    // One ack (the per-message mode) goes as any other settlement.
    let acking = match ackers.len() {
        0 => None,
        1 => {
            alone.extend(
                acked
                    .drain(..)
                    .zip(ackers.drain(..))
                    .map(|(i, a)| (i, a, Settlement::Ack)),
            );
            None
        }
        _ => {
            // The others stay in the vector they are in (no second one), in their order.
            let first = ackers.remove(0);
            Some(first.ack_with(ackers))
        }
    };
    let mut waiting = Vec::new();
    for (i, acker, settlement) in alone {
        let mut settling = acker.settle(settlement);
        match futures::poll!(settling.as_mut()) {
            std::task::Poll::Ready(result) => done[i].1 = result,
            std::task::Poll::Pending => waiting.push(settling.map(move |result| (i, result))),
        }
    }
    let (acks, others) = futures::future::join(
        async move {
            match acking {
                Some(acking) => acking.await,
                None => Vec::new(),
            }
        },
        futures::future::join_all(waiting),
    )
    .await;
    for (i, result) in acked.into_iter().zip(acks) {
        done[i].1 = result;
    }
    for (i, result) in others {
        done[i].1 = result;
    }
    done
}

/// Settles a retry through the transport's acker, then records in the inbox that the copy
/// (carrying `attempt`, due after `delay`) is with the broker, on its way to the acker's
/// [`Acknowledger::copy_scope`] (see [`Backend::record_retry`]). If the record cannot be
/// written, a redelivery of this delivery runs once more, as it would without it.
pub(super) struct RecordRetry<DB: Backend> {
    acker: Box<dyn Acknowledger>,
    inbox: HandlerInbox<DB>,
    key: String,
    attempt: u32,
    scope: String,
    delay: Duration,
}

impl<DB: Backend> Acknowledger for RecordRetry<DB> {
    fn settle(
        self: Box<Self>,
        settlement: Settlement,
    ) -> BoxFuture<'static, Result<(), TransportError>> {
        Box::pin(async move {
            let RecordRetry {
                acker,
                inbox,
                key,
                attempt,
                scope,
                delay,
            } = *self;
            acker.settle(settlement).await?;
            if let Err(e) = inbox.record_retry(&key, attempt, &scope, delay).await {
                tracing::debug!(error = %e, "could not record the retry copy in the inbox");
            }
            Ok(())
        })
    }

    fn copy_scope(&self) -> Option<&str> {
        Some(&self.scope)
    }
}

/// Settles a duplicate of a request that names a reply address: first writes the reply
/// kept with its key (if its handler replied) to the outbox again, for the duplicate's reply
/// address, then acks. If the reply cannot be written, the duplicate is delivered again
/// after `delay` instead, so that the requester still gets its answer.
pub(super) struct ResendReply<DB: Backend> {
    acker: Box<dyn Acknowledger>,
    inbox: HandlerInbox<DB>,
    key: String,
    /// The duplicate's reply address and correlation id.
    to: String,
    correlation: Option<String>,
    attempt: u32,
    delay: Duration,
}

impl<DB: Backend> Acknowledger for ResendReply<DB> {
    fn settle(
        self: Box<Self>,
        settlement: Settlement,
    ) -> BoxFuture<'static, Result<(), TransportError>> {
        Box::pin(async move {
            let ResendReply {
                acker,
                inbox,
                key,
                to,
                correlation,
                attempt,
                delay,
            } = *self;
            let correlation = correlation.as_deref();
            match inbox.resend_reply(&key, &to, correlation).await {
                Ok(_) => acker.settle(settlement).await,
                Err(e) => {
                    tracing::warn!(error = %e, "could not answer a duplicate request with its reply; it comes back later");
                    acker.settle(Settlement::Retry { delay, attempt }).await
                }
            }
        })
    }

    fn copy_scope(&self) -> Option<&str> {
        self.acker.copy_scope()
    }
}

impl<DB: Backend, H: Handler<DB>> Inner<DB, H> {
    /// A job's verdict to apply. The retry of an attempt the inbox counted, when the
    /// transport writes a copy (see [`Acknowledger::copy_scope`]), settles through a
    /// [`RecordRetry`], so that a redelivery of this delivery is known to be superseded. A
    /// retry after a database error is not recorded: the database is likely still
    /// unreachable, and waiting for it would hold the settlement back.
    pub(super) fn settled(&self, job: Job<H::Message>, verdict: Verdict) -> Settled {
        let acker = match (&verdict.settlement, verdict.outcome) {
            (Settlement::Retry { attempt, delay }, Outcome::Retry { counted: true }) => {
                match job.acker.copy_scope().map(str::to_owned) {
                    Some(scope) => Box::new(RecordRetry {
                        key: job.key().to_owned(),
                        acker: job.acker,
                        inbox: self.inbox.clone(),
                        attempt: *attempt,
                        scope,
                        delay: *delay,
                    }),
                    None => job.acker,
                }
            }
            (Settlement::Ack, Outcome::Duplicate) => match job.delivery.headers.get(REPLY_TO) {
                Some(to) => Box::new(ResendReply {
                    to: to.to_owned(),
                    correlation: reply::correlation(&job.delivery).map(str::to_owned),
                    attempt: job.delivery.attempt,
                    delay: self.settings.backoff.next_delay(1),
                    key: job.key().to_owned(),
                    acker: job.acker,
                    inbox: self.inbox.clone(),
                }),
                None => job.acker,
            },
            _ => job.acker,
        };
        self.keep_dead_letter(&job.delivery, acker, verdict)
    }

    /// Counts the outcomes of a batch: each counter moves once for the batch, not once a
    /// delivery (a dead letter is counted as it comes, with its reason).
    pub(super) fn count_all(&self, outcomes: impl IntoIterator<Item = Outcome>) {
        let stats = &self.stats;
        let (mut completed, mut duplicates, mut superseded, mut skipped, mut retries) =
            (0, 0, 0, 0, 0);
        for outcome in outcomes {
            match outcome {
                Outcome::Completed => completed += 1,
                Outcome::Duplicate => duplicates += 1,
                Outcome::Superseded => superseded += 1,
                Outcome::ConflictSkipped => skipped += 1,
                Outcome::Retry { .. } => retries += 1,
                Outcome::DeadLettered(reason) => stats.dead_letter(reason),
            }
        }
        for (count, n) in [
            (&stats.completed, completed),
            (&stats.duplicates, duplicates),
            (&stats.superseded, superseded),
            (&stats.conflicts, skipped),
            (&stats.conflicts_skipped, skipped),
            (&stats.retries, retries),
        ] {
            if n > 0 {
                count.add(n);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::{Arc, Mutex};

    use super::*;

    /// What the acknowledgers of a test batch were asked: each call's ids, `ack_with`'s
    /// first.
    type Calls = Arc<Mutex<Vec<(&'static str, Vec<usize>)>>>;

    /// Acks a batch together, refusing the odd ids.
    struct Grouping {
        id: usize,
        calls: Calls,
    }

    fn result_of(id: usize) -> Result<(), TransportError> {
        if id % 2 == 1 {
            Err(TransportError::msg(format!("refused {id}")))
        } else {
            Ok(())
        }
    }

    impl Acknowledger for Grouping {
        fn settle(
            self: Box<Self>,
            s: Settlement,
        ) -> BoxFuture<'static, Result<(), TransportError>> {
            let what = if matches!(s, Settlement::Ack) {
                "ack"
            } else {
                "retry"
            };
            self.calls
                .lock()
                .expect("calls")
                .push((what, vec![self.id]));
            Box::pin(std::future::ready(result_of(self.id)))
        }

        fn ack_with(
            self: Box<Self>,
            others: Vec<Box<dyn Acknowledger>>,
        ) -> BoxFuture<'static, crate::delivery::AckResults> {
            let mut ids = vec![self.id];
            for other in others {
                let Ok(other) = crate::acks::downcast_acker::<Grouping>(other) else {
                    panic!("a batch of one kind");
                };
                ids.push(other.id);
            }
            let results = ids.iter().map(|&id| result_of(id)).collect();
            self.calls.lock().expect("calls").push(("ack_with", ids));
            Box::pin(std::future::ready(results))
        }
    }

    fn batch(calls: &Calls, retried: &[usize], n: usize) -> Vec<Settled> {
        (0..n)
            .map(|id| {
                let verdict = if retried.contains(&id) {
                    Verdict {
                        settlement: Settlement::Retry {
                            delay: Duration::from_secs(1),
                            attempt: 2,
                        },
                        outcome: Outcome::Retry { counted: true },
                    }
                } else {
                    Verdict::ack(Outcome::Completed)
                };
                Settled {
                    acker: Box::new(Grouping {
                        id,
                        calls: calls.clone(),
                    }),
                    verdict,
                }
            })
            .collect()
    }

    #[tokio::test]
    async fn a_batch_acks_together_and_settles_the_rest_alone() {
        let calls = Calls::default();
        let done = settle_all(batch(&calls, &[2, 5], 7)).await;
        // Each outcome keeps its own result, in the batch's order.
        for (id, (outcome, result)) in done.iter().enumerate() {
            let retried = matches!(outcome, Outcome::Retry { .. });
            assert_eq!(retried, id == 2 || id == 5, "{id}");
            assert_eq!(result.is_err(), id % 2 == 1, "{id}: {result:?}");
        }
        let calls = calls.lock().expect("calls").clone();
        assert_eq!(
            calls,
            [
                ("ack_with", vec![0, 1, 3, 4, 6]),
                ("retry", vec![2]),
                ("retry", vec![5]),
            ]
        );
    }

    #[tokio::test]
    async fn a_single_ack_settles_as_any_other() {
        let calls = Calls::default();
        let done = settle_all(batch(&calls, &[0], 2)).await;
        assert!(done[0].1.is_ok() && done[1].1.is_err());
        let calls = calls.lock().expect("calls").clone();
        assert_eq!(calls, [("retry", vec![0]), ("ack", vec![1])]);
    }
}
