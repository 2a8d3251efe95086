//! The prepare stage: a delivery becomes a [`Job`] (decoded and keyed once), or a verdict
//! that settles it without a run (undecodable, too large, no key).

use serde_json::Value;

use super::config::Settings;
use crate::canonical::is_canonical;
use crate::delivery::{Acknowledger, DeadLetter, DeadLetterReason, Delivery, Incoming, Settlement};
use crate::key::{check_key, PayloadHash};

/// One delivery on its way through the pipeline: the delivery, the means to settle it, its
/// key and payload hash, the attempt it runs as, and the decoded message.
pub(super) struct Job<M> {
    pub(super) delivery: Delivery,
    pub(super) acker: Box<dyn Acknowledger>,
    key: Key,
    pub(super) hash: PayloadHash,
    /// The delivery's bounded number until the claim; then the number the attempt runs as
    /// (see [`super::attempt`]).
    pub(super) attempt: u32,
    /// The inbox found it fresh (see [`crate::log_marks::Freshness`]): it claims its key in
    /// the handler's transaction, counting nothing ahead.
    pub(super) fresh: bool,
    /// The key's id in the inbox's in-process lock table, computed once: the lease locks it,
    /// and a batch finds a repeated key by it.
    pub(super) lock_id: i64,
    message: Option<M>,
}

/// Where a job's key is: most keys are the message id, which the delivery holds already.
enum Key {
    /// The delivery's message id.
    MessageId,
    /// Rendered from the handler's template, or the payload's hash.
    Derived(String),
}

impl Key {
    /// The key of the job of `delivery`.
    fn of<'a>(&'a self, delivery: &'a Delivery) -> &'a str {
        match self {
            Key::MessageId => delivery.message_id.as_deref().unwrap_or_default(),
            Key::Derived(key) => key,
        }
    }
}

impl<M> Job<M> {
    /// The job's idempotency key.
    pub(super) fn key(&self) -> &str {
        self.key.of(&self.delivery)
    }
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
) -> Result<Key, String> {
    if let Some(template) = &s.key {
        return template
            .render(payload)
            .map(Key::Derived)
            .map_err(|e| format!("key template {:?}: {e}", template.as_str()));
    }
    untemplated_key(s, delivery, hash)
}

/// The key of a delivery whose handler has no key template: the message id, else (if
/// allowed) the payload's canonical hash.
fn untemplated_key(s: &Settings, delivery: &Delivery, hash: &PayloadHash) -> Result<Key, String> {
    if delivery
        .message_id
        .as_deref()
        .is_some_and(|id| !id.is_empty())
    {
        return Ok(Key::MessageId);
    }
    if s.payload_hash {
        return Ok(Key::Derived(format!("sha256:{}", hash.as_str())));
    }
    Err("the message has no message id, the handler has no key template, and payload hashing is not allowed".to_owned())
}

/// Decodes the payload and derives the key, and its in-process lock id through `lock_id`.
/// `Err` gives the delivery back with the verdict of a message that cannot run (too large,
/// undecodable, no key, a key the inbox cannot hold).
// The `Err` is a settlement, not an error: moved once, on a cold path.
#[allow(clippy::result_large_err)]
pub(super) fn prepare<M: serde::de::DeserializeOwned>(
    s: &Settings,
    incoming: Incoming,
    lock_id: impl Fn(&str) -> i64,
) -> Result<Job<M>, (Incoming, Verdict)> {
    let Incoming {
        mut delivery,
        acker,
    } = incoming;
    delivery.attempt = super::attempt::delivered(delivery.attempt);
    match decode(s, &delivery) {
        Ok((message, key, hash)) => Ok(Job {
            lock_id: lock_id(key.of(&delivery)),
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

/// How much older than the handler's retention `delivery` is, if it is: its key's row may
/// have been purged (see [`WorkerConfig::dead_letter_too_old`](super::WorkerConfig::dead_letter_too_old)).
/// `None` if it is younger, or its transport does not know when it was published.
pub(super) fn past_retention(s: &Settings, delivery: &Delivery) -> Option<std::time::Duration> {
    let age = delivery.published_at?.elapsed().ok()?;
    age.checked_sub(s.retention).filter(|past| !past.is_zero())
}

/// The verdict on a delivery older than the handler's retention, when such are
/// dead-lettered.
pub(super) fn too_old(s: &Settings, delivery: &Delivery, past: std::time::Duration) -> Verdict {
    let error = format!(
        "published {past:?} longer ago than the handler's retention of {:?}: its key's row may \
         have been purged, so a run could repeat its effect",
        s.retention
    );
    let id = delivery.message_id.as_deref();
    Verdict::dead_letter(&s.name, delivery, DeadLetterReason::TooOld, id, 0, error)
}

/// The message, key and payload hash of `delivery`, or the verdict on a message that cannot
/// run.
#[allow(clippy::result_large_err)]
fn decode<M: serde::de::DeserializeOwned>(
    s: &Settings,
    delivery: &Delivery,
) -> Result<(M, Key, PayloadHash), Verdict> {
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
    // An undecodable payload is reported as such before a missing key.
    let decoded = if s.key.is_none() && is_canonical(&delivery.payload) {
        // The bytes are their canonical form, so they are the hash's input as they are, and
        // no template reads a tree: the message is decoded from them directly.
        serde_json::from_slice::<M>(&delivery.payload).map(|message| {
            let hash = PayloadHash::of_canonical(&delivery.payload);
            let key = untemplated_key(s, delivery, &hash);
            (message, key, hash)
        })
    } else {
        // The key and hash are taken from the decoded tree first, so the message can then
        // be built from the tree by move (its strings are not copied again).
        serde_json::from_slice::<Value>(&delivery.payload).and_then(|value| {
            let hash = PayloadHash::of(&value);
            let key = derive_key(s, delivery, &value, &hash);
            Ok((M::deserialize(value)?, key, hash))
        })
    };
    let (message, key, hash) =
        decoded.map_err(|e| refuse(DeadLetterReason::Undecodable, id, e.to_string()))?;
    let key = key.map_err(|e| refuse(DeadLetterReason::MissingKey, None, e))?;
    check_key(key.of(delivery)).map_err(|e| refuse(DeadLetterReason::InvalidKey, None, e))?;
    Ok((message, key, hash))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::delivery::{Location, Origin, Source};
    use crate::error::TransportError;
    use crate::handler::HandlerOptions;
    use crate::key::canonical_hash;
    use crate::worker::WorkerConfig;

    struct Unused;

    impl Acknowledger for Unused {
        fn settle(
            self: Box<Self>,
            _: Settlement,
        ) -> futures::future::BoxFuture<'static, Result<(), TransportError>> {
            crate::delivery::settled_now()
        }
    }

    fn incoming(payload: &str) -> Incoming {
        Incoming {
            delivery: Delivery {
                message_id: None,
                payload: bytes::Bytes::copy_from_slice(payload.as_bytes()),
                headers: crate::headers::Headers::new(),
                redelivered: false,
                attempt: 1,
                origin: Origin::Unknown,
                source: Source {
                    transport: "test",
                    location: Location::from("q"),
                },
                published_at: None,
            },
            acker: Box::new(Unused),
        }
    }

    #[derive(Debug, PartialEq, serde::Deserialize)]
    struct Order {
        id: u64,
        items: Vec<String>,
    }

    /// The payload's spelling does not change its hash, its key or its message, whether it
    /// is already canonical (decoded straight from the bytes) or not (through the tree).
    #[test]
    fn a_payload_keys_and_decodes_alike_in_every_spelling() {
        let settings = |options: HandlerOptions| {
            Settings::validate(options, &WorkerConfig::default()).expect("valid")
        };
        let by_hash = settings(HandlerOptions::new("orders").payload_hash(true));
        let by_template = settings(HandlerOptions::new("orders").key("order-{id}"));
        let canonical = r#"{"id":7,"items":["a","b"]}"#;
        assert!(is_canonical(canonical.as_bytes()));
        let value: Value = serde_json::from_str(canonical).expect("json");
        let expected = Order {
            id: 7,
            items: vec!["a".into(), "b".into()],
        };
        for payload in [canonical, r#"{"items": ["a","b"], "id": 7}"#] {
            let Ok(mut job) = prepare::<Order>(&by_hash, incoming(payload), |_| 0) else {
                panic!("{payload} did not prepare");
            };
            assert_eq!(job.hash.as_str(), canonical_hash(&value), "{payload}");
            assert_eq!(job.key(), format!("sha256:{}", canonical_hash(&value)));
            assert_eq!(job.take_message().expect("decodes"), expected);
            let Ok(job) = prepare::<Order>(&by_template, incoming(payload), |_| 0) else {
                panic!("{payload} did not prepare");
            };
            assert_eq!(job.key(), "order-7");
            assert_eq!(job.hash.as_str(), canonical_hash(&value), "{payload}");
        }
        // A canonical payload that is not the message is undecodable, as through the tree.
        let Err((_, verdict)) = prepare::<Order>(&by_hash, incoming(r#"{"id":7}"#), |_| 0) else {
            panic!("a payload without items prepared");
        };
        assert_eq!(
            verdict.outcome,
            Outcome::DeadLettered(DeadLetterReason::Undecodable)
        );
    }
}
