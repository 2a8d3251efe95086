//! The prepare stage: a delivery becomes a [`Job`] (decoded and keyed once), or a verdict
//! that settles it without a run (undecodable, too large, no key).

use serde_json::Value;

use super::config::Settings;
use crate::delivery::{Acknowledger, DeadLetter, DeadLetterReason, Delivery, Incoming, Settlement};
use crate::key::{check_key, PayloadHash};

/// One delivery on its way through the pipeline: the delivery, the means to settle it, its
/// key and payload hash, the attempt it runs as, and the decoded message.
pub(super) struct Job<M> {
    pub(super) delivery: Delivery,
    pub(super) acker: Box<dyn Acknowledger>,
    pub(super) key: String,
    pub(super) hash: PayloadHash,
    /// The delivery's bounded number until the claim; then the number the attempt runs as
    /// (see [`super::attempt`]).
    pub(super) attempt: u32,
    /// The inbox found it fresh (see [`crate::log_marks::Freshness`]): it claims its key in
    /// the handler's transaction, counting nothing ahead.
    pub(super) fresh: bool,
    message: Option<M>,
}

impl<M: serde::de::DeserializeOwned> Job<M> {
    /// The message, for a run. Decoded once; a second run (after a rolled-back batch moved
    /// the message into its handlers) decodes it again from the payload.
    pub(super) fn take_message(&mut self) -> Result<M, serde_json::Error> {
        match self.message.take() {
            Some(m) => Ok(m),
            None => serde_json::from_slice(&self.delivery.payload),
        }
    }

    /// The job as the delivery it came from, to go through the pipeline again.
    pub(super) fn into_incoming(self) -> Incoming {
        Incoming {
            delivery: self.delivery,
            acker: self.acker,
        }
    }
}

/// How one delivery ended, for the span and the counters.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Outcome {
    Completed,
    Duplicate,
    Superseded,
    ConflictSkipped,
    /// Sent back for a delayed retry. `counted`: after a failed attempt the inbox counted
    /// (not after a database error), so its copy is recorded (see
    /// [`super::settle::RecordRetry`]).
    Retry {
        counted: bool,
    },
    /// Dead-lettered, for the reason.
    DeadLettered(DeadLetterReason),
}

impl Outcome {
    pub(super) fn as_str(self) -> &'static str {
        match self {
            Outcome::Completed => "completed",
            Outcome::Duplicate => "duplicate",
            Outcome::Superseded => "superseded",
            Outcome::ConflictSkipped => "conflict_skipped",
            Outcome::Retry { .. } => "retry",
            Outcome::DeadLettered(_) => "dead_lettered",
        }
    }
}

/// How to settle a delivery, and what that means for the counters.
#[derive(Debug)]
pub(super) struct Verdict {
    pub(super) settlement: Settlement,
    pub(super) outcome: Outcome,
}

impl Verdict {
    /// Acked: done, or nothing to do.
    pub(super) fn ack(outcome: Outcome) -> Self {
        Verdict {
            settlement: Settlement::Ack,
            outcome,
        }
    }

    /// Dead-lettered with `reason`.
    pub(super) fn dead_letter(
        handler: &str,
        delivery: &Delivery,
        reason: DeadLetterReason,
        key: Option<&str>,
        attempts: u32,
        error: String,
    ) -> Self {
        tracing::warn!(reason = reason.as_str(), error = %error, "dead-lettering");
        Verdict {
            settlement: Settlement::DeadLetter(DeadLetter {
                reason,
                handler: handler.to_owned(),
                key: key.map(str::to_owned),
                attempts,
                error,
                source: delivery.source.clone(),
            }),
            outcome: Outcome::DeadLettered(reason),
        }
    }
}

/// The key of `payload`: the handler's template, else the message id, else (if allowed) the
/// payload's canonical hash, `hash`.
fn derive_key(
    s: &Settings,
    delivery: &Delivery,
    payload: &Value,
    hash: &PayloadHash,
) -> Result<String, String> {
    if let Some(template) = &s.key {
        return template
            .render(payload)
            .map_err(|e| format!("key template {:?}: {e}", template.as_str()));
    }
    if let Some(id) = delivery.message_id.as_deref().filter(|id| !id.is_empty()) {
        return Ok(id.to_owned());
    }
    if s.payload_hash {
        return Ok(format!("sha256:{}", hash.as_str()));
    }
    Err("the message has no message id, the handler has no key template, and payload hashing is not allowed".to_owned())
}

/// Decodes the payload and derives the key. `Err` gives the delivery back with the verdict
/// of a message that cannot run (too large, undecodable, no key, a key the inbox cannot
/// hold).
// The `Err` is a settlement, not an error: moved once, on a cold path.
#[allow(clippy::result_large_err)]
pub(super) fn prepare<M: serde::de::DeserializeOwned>(
    s: &Settings,
    incoming: Incoming,
) -> Result<Job<M>, (Incoming, Verdict)> {
    let Incoming {
        mut delivery,
        acker,
    } = incoming;
    delivery.attempt = super::attempt::delivered(delivery.attempt);
    match decode(s, &delivery) {
        Ok((message, key, hash)) => Ok(Job {
            attempt: delivery.attempt,
            delivery,
            acker,
            key,
            hash,
            fresh: false,
            message: Some(message),
        }),
        Err(verdict) => Err((Incoming { delivery, acker }, verdict)),
    }
}

/// The message, key and payload hash of `delivery`, or the verdict on a message that cannot
/// run.
#[allow(clippy::result_large_err)]
fn decode<M: serde::de::DeserializeOwned>(
    s: &Settings,
    delivery: &Delivery,
) -> Result<(M, String, PayloadHash), Verdict> {
    let refuse = |reason, key: Option<&str>, error: String| {
        Verdict::dead_letter(&s.name, delivery, reason, key, 0, error)
    };
    let id = delivery.message_id.as_deref();
    let limit = s.max_payload_bytes;
    if delivery.payload.len() > limit {
        let error = format!(
            "payload of {} bytes exceeds the limit of {limit} bytes",
            delivery.payload.len()
        );
        return Err(refuse(DeadLetterReason::PayloadTooLarge, id, error));
    }
    // The key and hash are taken from the decoded value first, so the message can then be
    // built from the value by move (its strings are not copied again); an undecodable
    // payload is still reported as such before a missing key.
    let decoded = serde_json::from_slice::<Value>(&delivery.payload).and_then(|value| {
        let hash = PayloadHash::of(&value);
        let key = derive_key(s, delivery, &value, &hash);
        Ok((M::deserialize(value)?, key, hash))
    });
    let (message, key, hash) =
        decoded.map_err(|e| refuse(DeadLetterReason::Undecodable, id, e.to_string()))?;
    let key = key.map_err(|e| refuse(DeadLetterReason::MissingKey, None, e))?;
    check_key(&key).map_err(|e| refuse(DeadLetterReason::InvalidKey, None, e))?;
    Ok((message, key, hash))
}
