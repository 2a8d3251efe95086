//! The oracle: what the effect ledger, the provider's log, the outbox and the dead-letter
//! queues must hold after a run, and the table of figures.

use std::collections::{BTreeMap, HashMap};

use sqlx::PgPool;

use invoices::Part;

use crate::workload::Workload;
use crate::DeadSeen;

/// What the oracle found.
#[derive(Debug, Default)]
pub(crate) struct Verdict {
    /// Valid jobs missing an effect (a ledger row of either handler, or the provider send).
    pub(crate) lost: u64,
    /// Valid jobs with more than one ledger row for a handler, or more than one send.
    pub(crate) duplicated: u64,
    /// Ledger rows or sends for jobs that were never published as valid.
    pub(crate) unexpected: u64,
    /// Jobs with an email (a `send_email` ledger row or a provider send) but no committed
    /// invoice: an event published for a transaction that did not commit.
    pub(crate) email_without_invoice: u64,
    /// `invoice_ready` events the handlers wrote to the outbox, and how many are not
    /// published.
    pub(crate) events: u64,
    pub(crate) events_unpublished: u64,
    /// Dead letters, copies included.
    pub(crate) dead_lettered: u64,
    /// Extra copies of an expected dead letter (same message, same queue).
    pub(crate) dead_letter_copies: u64,
    /// Expected dead letters (poison, bad input) missing from a queue.
    pub(crate) dead_letter_missing: u64,
    /// Dead letters of valid jobs.
    pub(crate) valid_dead_lettered: u64,
    /// Dead letters that are neither expected nor valid jobs, or carry no reason.
    pub(crate) dead_letter_unexplained: u64,
    /// Dead-letter reasons seen, with counts.
    pub(crate) reasons: BTreeMap<String, u64>,
    /// Human-readable examples of each violation (a few of each).
    pub(crate) examples: Vec<String>,
}

impl Verdict {
    pub(crate) fn passed(&self) -> bool {
        self.lost == 0
            && self.duplicated == 0
            && self.unexpected == 0
            && self.email_without_invoice == 0
            && self.events_unpublished == 0
            && self.dead_letter_missing == 0
            && self.valid_dead_lettered == 0
            && self.dead_letter_unexplained == 0
    }

    fn example(&mut self, s: String) {
        if self.examples.len() < 20 {
            self.examples.push(s);
        }
    }
}

/// Checks the ledger, the provider log, the outbox and the dead letters against the
/// workload: every valid job has one invoice, one email and one provider send; no email
/// goes out without its invoice; every event was published.
pub(crate) async fn check(
    pool: &PgPool,
    workload: &Workload,
    dead: &[DeadSeen],
) -> anyhow::Result<Verdict> {
    let mut v = Verdict::default();
    let rows: Vec<(i64, String, i64)> =
        sqlx::query_as("SELECT job_id, handler, count(*) FROM effect_ledger GROUP BY 1, 2")
            .fetch_all(pool)
            .await?;
    let mut ledger: HashMap<(i64, String), i64> = HashMap::new();
    for (job, handler, n) in rows {
        ledger.insert((job, handler), n);
    }
    let sends: Vec<(String, i64)> =
        sqlx::query_as("SELECT idempotency_key, count(*) FROM provider_calls GROUP BY 1")
            .fetch_all(pool)
            .await?;
    let sends: HashMap<String, i64> = sends.into_iter().collect();
    let email_key = |id: i64| {
        consumer_core::idempotency_key(
            Part::Emails.handler(),
            &format!("invoice-email-{id}"),
            "invoice-ready-email",
        )
    };

    for &id in &workload.valid {
        let mut lost = Vec::new();
        let mut dup = Vec::new();
        for part in [Part::Invoices, Part::Emails] {
            match ledger.get(&(id, part.handler().to_owned())).copied() {
                None => lost.push(part.handler().to_owned()),
                Some(1) => {}
                Some(n) => dup.push(format!("{} x{n}", part.handler())),
            }
        }
        match sends.get(&email_key(id)).copied() {
            None => lost.push("provider send".to_owned()),
            Some(1) => {}
            Some(n) => dup.push(format!("provider send x{n}")),
        }
        if !lost.is_empty() {
            v.lost += 1;
            v.example(format!("lost: job {id}: no {}", lost.join(", ")));
        }
        if !dup.is_empty() {
            v.duplicated += 1;
            v.example(format!("duplicated: job {id}: {}", dup.join(", ")));
        }
    }
    // No email without a committed invoice: the event exists only if the invoice's
    // transaction committed.
    let invoiced = |id: i64| ledger.contains_key(&(id, Part::Invoices.handler().to_owned()));
    let mut emailed: Vec<i64> = ledger
        .keys()
        .filter(|(_, handler)| handler == Part::Emails.handler())
        .map(|(job, _)| *job)
        .chain(
            workload
                .valid
                .iter()
                .copied()
                .filter(|&id| sends.contains_key(&email_key(id))),
        )
        .collect();
    emailed.sort_unstable();
    emailed.dedup();
    for id in emailed.into_iter().filter(|&id| !invoiced(id)) {
        v.email_without_invoice += 1;
        v.example(format!("email without an invoice: job {id}"));
    }
    let (events, unpublished): (i64, i64) = sqlx::query_as(
        "SELECT count(*), count(*) FILTER (WHERE published_at IS NULL) FROM consumer_inbox_outbox",
    )
    .fetch_one(pool)
    .await?;
    v.events = u64::try_from(events).unwrap_or(0);
    v.events_unpublished = u64::try_from(unpublished).unwrap_or(0);
    if unpublished > 0 {
        v.example(format!(
            "{unpublished} invoice_ready events never published"
        ));
    }

    let mut strays: Vec<i64> = ledger
        .keys()
        .map(|(job, _)| *job)
        .filter(|job| !workload.valid.contains(job))
        .collect();
    strays.sort_unstable();
    strays.dedup();
    let valid_keys: std::collections::HashSet<String> =
        workload.valid.iter().map(|&id| email_key(id)).collect();
    let stray_sends = sends.keys().filter(|k| !valid_keys.contains(*k)).count();
    v.unexpected = strays.len() as u64 + stray_sends as u64;
    for job in strays.iter().take(5) {
        v.example(format!(
            "unexpected: ledger row for job {job}, never published as valid"
        ));
    }
    if stray_sends > 0 {
        v.example(format!(
            "unexpected: {stray_sends} provider sends for no valid job"
        ));
    }

    // Dead letters: each expected message once in the invoice handler's queue, with a
    // reason; none in the email handler's (its events come only from committed invoices).
    v.dead_lettered = dead.len() as u64;
    let mut seen: HashMap<(Part, &str), u64> = HashMap::new();
    for d in dead {
        *seen.entry((d.part, d.label.as_str())).or_default() += 1;
        let reason = d.reason.clone().unwrap_or_else(|| "(none)".to_owned());
        *v.reasons.entry(reason).or_default() += 1;
        if d.reason.is_none() {
            v.dead_letter_unexplained += 1;
            v.example(format!(
                "dead letter without a reason: {} in {:?}",
                d.label, d.part
            ));
        }
    }
    for (label, what) in &workload.expected_dead {
        match seen
            .get(&(Part::Invoices, label.as_str()))
            .copied()
            .unwrap_or(0)
        {
            0 => {
                v.dead_letter_missing += 1;
                v.example(format!(
                    "not dead-lettered by {}: {what} ({label})",
                    Part::Invoices.handler()
                ));
            }
            1 => {}
            n => v.dead_letter_copies += n - 1,
        }
    }
    for ((part, label), _) in seen {
        if part == Part::Invoices && workload.expected_dead.contains_key(label) {
            continue;
        }
        let valid = label
            .strip_prefix("invoice-job-")
            .and_then(|id| id.parse::<i64>().ok())
            .is_some_and(|id| workload.valid.contains(&id));
        if valid {
            v.valid_dead_lettered += 1;
            v.example(format!(
                "valid job dead-lettered by {}: {label}",
                part.handler()
            ));
        } else {
            v.dead_letter_unexplained += 1;
            v.example(format!(
                "unexpected dead letter in {}: {label}",
                part.handler()
            ));
        }
    }
    Ok(v)
}

/// Counters the workers wrote to `worker_stats` and the inbox's attempt counts.
#[derive(Debug, Default)]
pub(crate) struct WorkerFigures {
    pub(crate) redelivered: i64,
    pub(crate) duplicates: i64,
    pub(crate) superseded: i64,
    pub(crate) retries: i64,
    pub(crate) quarantined: i64,
    pub(crate) extra_attempts: i64,
}

pub(crate) async fn worker_figures(pool: &PgPool) -> anyhow::Result<WorkerFigures> {
    let (redelivered, duplicates, superseded, retries, quarantined): (i64, i64, i64, i64, i64) =
        sqlx::query_as(
            "SELECT coalesce(sum(redelivered), 0)::bigint, coalesce(sum(duplicates), 0)::bigint, \
             coalesce(sum(superseded), 0)::bigint, coalesce(sum(retries), 0)::bigint, \
             coalesce(sum(quarantined), 0)::bigint FROM worker_stats",
        )
        .fetch_one(pool)
        .await?;
    let extra_attempts: i64 =
        sqlx::query_scalar("SELECT coalesce(sum(attempts - 1), 0)::bigint FROM consumer_inbox")
            .fetch_one(pool)
            .await?;
    Ok(WorkerFigures {
        redelivered,
        duplicates,
        superseded,
        retries,
        quarantined,
        extra_attempts,
    })
}
