//! The oracle: what the effect ledger, the provider's log and the dead-letter queues must
//! hold after a run, and the table of figures.

use std::collections::{BTreeMap, HashMap};

use sqlx::PgPool;

use crate::fleet::Role;
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

/// Checks the ledger, the provider log and the dead letters against the workload.
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
            Role::Email.handler(),
            &format!("invoice-email-{id}"),
            "invoice-ready-email",
        )
    };

    for &id in &workload.valid {
        let mut lost = Vec::new();
        let mut dup = Vec::new();
        for role in [Role::Invoice, Role::Email] {
            match ledger.get(&(id, role.handler().to_owned())).copied() {
                None => lost.push(role.handler().to_owned()),
                Some(1) => {}
                Some(n) => dup.push(format!("{} x{n}", role.handler())),
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

    // Dead letters: per queue (handler), each expected message once, with a reason.
    v.dead_lettered = dead.len() as u64;
    let mut seen: HashMap<(Role, &str), u64> = HashMap::new();
    for d in dead {
        *seen.entry((d.role, d.label.as_str())).or_default() += 1;
        let reason = d.reason.clone().unwrap_or_else(|| "(none)".to_owned());
        *v.reasons.entry(reason).or_default() += 1;
        if d.reason.is_none() {
            v.dead_letter_unexplained += 1;
            v.example(format!(
                "dead letter without a reason: {} in {:?}",
                d.label, d.role
            ));
        }
    }
    for role in [Role::Invoice, Role::Email] {
        for (label, what) in &workload.expected_dead {
            match seen.get(&(role, label.as_str())).copied().unwrap_or(0) {
                0 => {
                    v.dead_letter_missing += 1;
                    v.example(format!(
                        "not dead-lettered by {}: {what} ({label})",
                        role.handler()
                    ));
                }
                1 => {}
                n => v.dead_letter_copies += n - 1,
            }
        }
    }
    for ((role, label), _) in seen {
        if workload.expected_dead.contains_key(label) {
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
                role.handler()
            ));
        } else {
            v.dead_letter_unexplained += 1;
            v.example(format!(
                "unexpected dead letter in {}: {label}",
                role.handler()
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
