//! What the runner publishes: unique invoice jobs, republished duplicates (same message id),
//! poison jobs and bad inputs, in a seeded random order.

use std::collections::{BTreeMap, BTreeSet};

use invoices::{InvoiceJob, POISON_ORDERS};
use sha2::{Digest, Sha256};

use crate::rng::Rng;

/// One message to publish.
#[derive(Debug, Clone)]
pub(crate) struct Outgoing {
    /// The message id (`None`: published without one).
    pub(crate) message_id: Option<String>,
    /// The body.
    pub(crate) payload: Vec<u8>,
}

impl Outgoing {
    /// How the oracle recognises this message in a dead-letter queue.
    pub(crate) fn label(&self) -> String {
        label(self.message_id.as_deref(), &self.payload)
    }
}

/// The message id, or (without one) a hash of the body.
pub(crate) fn label(message_id: Option<&str>, payload: &[u8]) -> String {
    match message_id.filter(|id| !id.is_empty()) {
        Some(id) => id.to_owned(),
        None => format!(
            "body-sha256:{}",
            &hex::encode(Sha256::digest(payload))[..16]
        ),
    }
}

/// The whole workload of a run.
#[derive(Debug)]
pub(crate) struct Workload {
    /// Everything to publish, in publishing order.
    pub(crate) messages: Vec<Outgoing>,
    /// The orders to place before publishing (valid and poison jobs).
    pub(crate) orders: Vec<InvoiceJob>,
    /// Order ids of the valid jobs: each must have exactly one effect per handler.
    pub(crate) valid: BTreeSet<i64>,
    /// How many valid jobs were published twice.
    pub(crate) duplicates: usize,
    /// Label → what it is, for every message that must be dead-lettered (once per queue).
    pub(crate) expected_dead: BTreeMap<String, String>,
}

/// Order ids for the bad inputs' bodies: never placed, never valid.
const BAD_ORDER: i64 = 800_000_000;

impl Workload {
    pub(crate) fn new(unique: usize, poison: usize, large_bytes: usize, rng: &mut Rng) -> Self {
        let unique = i64::try_from(unique).unwrap_or(i64::MAX);
        let jobs: Vec<InvoiceJob> = (1..=unique).map(InvoiceJob::sample).collect();
        let poison_jobs: Vec<InvoiceJob> = (1..=i64::try_from(poison).unwrap_or(0))
            .map(|i| InvoiceJob::sample(POISON_ORDERS.start + i))
            .collect();
        let job_message = |job: &InvoiceJob| Outgoing {
            message_id: Some(job.message_id()),
            payload: serde_json::to_vec(job).unwrap_or_default(),
        };
        let mut messages: Vec<Outgoing> = jobs.iter().map(job_message).collect();
        // 10 % republished, chosen by the seed.
        let mut duplicates = 0;
        for job in &jobs {
            if rng.below(10) == 0 {
                messages.push(job_message(job));
                duplicates += 1;
            }
        }
        let mut expected_dead = BTreeMap::new();
        for job in &poison_jobs {
            let m = job_message(job);
            expected_dead.insert(m.label(), format!("poison job {}", job.order_id));
            messages.push(m);
        }
        let large = InvoiceJob {
            order_id: BAD_ORDER + 2,
            amount: 1,
            email: "x".repeat(large_bytes),
        };
        let bad = [
            (
                "invalid JSON",
                Outgoing {
                    message_id: Some("bad-invalid-json".to_owned()),
                    payload: b"{\"order_id\": 800000000, \"amount\": ".to_vec(),
                },
            ),
            (
                "wrong schema",
                Outgoing {
                    message_id: Some("bad-wrong-schema".to_owned()),
                    payload: br#"{"order_id": "eight hundred million", "total": 1}"#.to_vec(),
                },
            ),
            (
                // Decodes (serde reads a struct from a JSON array), but the handlers' key
                // templates find no `order_id` field, and there is no message id either.
                "no key and no message id",
                Outgoing {
                    message_id: None,
                    payload: format!(r#"[{}, 1, "nokey@example.com"]"#, BAD_ORDER + 1).into_bytes(),
                },
            ),
            (
                "payload of several MiB",
                Outgoing {
                    message_id: Some("bad-too-large".to_owned()),
                    payload: serde_json::to_vec(&large).unwrap_or_default(),
                },
            ),
        ];
        for (what, m) in bad {
            expected_dead.insert(m.label(), what.to_owned());
            messages.push(m);
        }
        // Fisher–Yates with the seed.
        for i in (1..messages.len()).rev() {
            let j = usize::try_from(rng.below(i as u64 + 1)).unwrap_or(0);
            messages.swap(i, j);
        }
        Workload {
            messages,
            valid: jobs.iter().map(|j| j.order_id).collect(),
            orders: jobs.into_iter().chain(poison_jobs).collect(),
            duplicates,
            expected_dead,
        }
    }
}
