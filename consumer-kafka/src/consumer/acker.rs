//! How the acknowledger of one record ([`KafkaAcker`]) settles it: an ack marks its offset
//! settled, a retry writes a copy or defers the record in place, a dead letter writes its
//! copy first.

use std::sync::Arc;
use std::time::Duration;

use consumer_core::transport::{AckResults, Acknowledger, Settlement, TransportError};
use futures::future::BoxFuture;
use rdkafka::error::KafkaError;
use rdkafka::types::RDKafkaErrorCode;

use super::copies::{dead_letter_copy, reference_letter, retry_copy};
use super::partitions::KafkaAcker;
use crate::config::RetryMode;
use crate::producer;
use crate::Error;

/// A dead-letter or retry copy that could not be written is tried again after this long.
const REWRITE_DELAY: Duration = Duration::from_secs(1);

impl Acknowledger for KafkaAcker {
    fn settle(
        self: Box<Self>,
        settlement: Settlement,
    ) -> BoxFuture<'static, Result<(), TransportError>> {
        let mut this = self;
        if let Settlement::Ack = settlement {
            // Marking the offset is all an ack does: done here, with nothing to box.
            let marked = this.shared.mark_settled(this.generation, &this.record);
            this.done = true;
            return match marked {
                Ok(()) => consumer_core::transport::settled_now(),
                Err(e) => Box::pin(std::future::ready(Err(e))),
            };
        }
        Box::pin(async move {
            let result = this.apply(settlement).await;
            this.done = true;
            result
        })
    }

    /// The records of this consumer among `others` are marked settled with this one, under
    /// one hold of the partition table's lock; the others are settled on their own.
    fn ack_with(
        self: Box<Self>,
        others: Vec<Box<dyn Acknowledger>>,
    ) -> BoxFuture<'static, AckResults> {
        let same_consumer = |a: &KafkaAcker, b: &KafkaAcker| Arc::ptr_eq(&a.shared, &b.shared);
        consumer_core::transport::ack_together(self, others, same_consumer, |run| {
            let shared = run[0].shared.clone();
            Box::pin(std::future::ready(shared.mark_all_settled(run)))
        })
    }

    /// With a retry topic, a retry writes a copy that this consumer group reads back from
    /// the retry topic; a blocking retry puts the record back in place, and a replay of it is
    /// then its only copy.
    fn copy_scope(&self) -> Option<&str> {
        match self.shared.settings.retry {
            RetryMode::RetryTopic => Some(&self.shared.settings.copy_scope),
            RetryMode::Blocking => None,
        }
    }
}

impl KafkaAcker {
    async fn apply(&self, settlement: Settlement) -> Result<(), TransportError> {
        let shared = &self.shared;
        let (generation, record) = (self.generation, &self.record);
        match settlement {
            // `settle` applies acks itself, without a future: the same step.
            Settlement::Ack => shared.mark_settled(generation, record),
            Settlement::Retry { delay, attempt } => match shared.settings.retry {
                RetryMode::Blocking => shared.defer(generation, record, delay, attempt),
                RetryMode::RetryTopic => {
                    if !shared.owned(&record.tp, generation) {
                        return Err(shared.revoked_error(record));
                    }
                    let topic = format!("{}{}", record.origin(), shared.settings.retry_suffix);
                    let out = retry_copy(record, &shared.settings, delay, attempt);
                    match producer::send(
                        &shared.producer,
                        &topic,
                        &out,
                        shared.settings.produce_timeout,
                    )
                    .await
                    {
                        Ok(_) => {
                            // The copy is the outcome: once it is written the retry is done,
                            // even if the partition was revoked meanwhile. The new owner's
                            // replay of this record is then superseded by the copy (see
                            // `copy_scope`).
                            if let Err(e) = shared.mark_settled(generation, record) {
                                tracing::debug!(error = %e, "retry copy written after a revoke");
                            }
                            Ok(())
                        }
                        Err(e) => {
                            // Not written: retry in place instead, so the record is not stuck.
                            let _ = shared.defer(generation, record, delay, attempt);
                            Err(TransportError::new("writing the retry copy failed", e))
                        }
                    }
                }
            },
            Settlement::DeadLetter(dl) => {
                if !shared.owned(&record.tp, generation) {
                    return Err(shared.revoked_error(record));
                }
                let topic = format!("{}{}", record.origin(), shared.settings.dead_letter_suffix);
                let out = dead_letter_copy(record, &dl);
                let timeout = shared.settings.produce_timeout;
                let mut written = producer::send(&shared.producer, &topic, &out, timeout).await;
                if written.as_ref().is_err_and(is_too_large) {
                    // A copy that can never be written would be retried for good, holding
                    // the partition: a dead letter pointing at the original (which stays
                    // where it is until this one is written) takes its place.
                    tracing::warn!(
                        record = %record.location(),
                        bytes = record.bytes,
                        "the dead letter is too large to write; writing a reference to the record instead"
                    );
                    let out = reference_letter(record, &dl, &shared.settings);
                    written = producer::send(&shared.producer, &topic, &out, timeout).await;
                }
                match written {
                    Ok(_) => shared.mark_settled(generation, record),
                    Err(e) => {
                        // The redelivery is dead-lettered again (the inbox remembers why).
                        let _ = shared.defer(generation, record, REWRITE_DELAY, record.attempt);
                        Err(TransportError::new("writing the dead letter failed", e))
                    }
                }
            }
        }
    }
}

/// Whether a write failed because the record is larger than the producer or the broker
/// accepts: writing it again can never succeed.
fn is_too_large(e: &Error) -> bool {
    let Error::Produce { source, .. } = e else {
        return false;
    };
    matches!(
        source.downcast_ref::<KafkaError>(),
        Some(KafkaError::MessageProduction(
            RDKafkaErrorCode::MessageSizeTooLarge
        ))
    )
}
