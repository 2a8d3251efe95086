//! The run's report: the figures of what was injected and what the oracle found, a row
//! each, then the dead-letter reasons, violations, unexpected worker exits and errors.

use std::time::Duration;

use crate::database::{self, DbFigures};
use crate::fleet::Counts;
use crate::oracle::{Verdict, WorkerFigures};
use crate::profile::{Args, BrokerKind};
use crate::workload::Workload;
use crate::Happened;

/// Everything the report reads of one finished run.
pub(crate) struct Run<'a> {
    pub(crate) broker_name: &'a str,
    pub(crate) args: &'a Args,
    pub(crate) workload: &'a Workload,
    pub(crate) happened: &'a Happened,
    pub(crate) counts: &'a Counts,
    pub(crate) figures: &'a WorkerFigures,
    pub(crate) verdict: &'a Verdict,
    pub(crate) db_figures: &'a DbFigures,
    /// From the start until the run had drained (or gave up).
    pub(crate) drained_after: Duration,
    pub(crate) elapsed: Duration,
}

/// Prints the report of `run` on standard output.
pub(crate) fn print(run: &Run<'_>) {
    // RabbitMQ flags a redelivery; a Kafka record carries no such flag, so there a
    // redelivery is a replayed record the inbox already had: a duplicate beyond the copies
    // that were published twice (each group reads every copy), or a replay superseded by its
    // retry copy. Killed workers lose their last second of counters, so both figures are
    // lower bounds.
    let redeliveries = match run.args.broker {
        BrokerKind::Amqp => run.figures.redelivered,
        BrokerKind::Kafka => {
            let copies = u64::try_from(run.workload.duplicates)
                .unwrap_or(u64::MAX)
                .saturating_add(run.happened.publish_retries);
            let copies = i64::try_from(copies).unwrap_or(i64::MAX);
            (run.figures.duplicates - 2 * copies).max(0) + run.figures.superseded
        }
    };
    let mut rows: Vec<(&str, String)> = vec![
        ("broker", run.broker_name.to_owned()),
        (
            "profile / seed",
            format!("{} / {}", run.args.profile.name, run.args.seed),
        ),
        (
            "mode",
            match run.args.batch {
                0 => "per message".to_owned(),
                n => format!("batched ({n})"),
            },
        ),
        (
            "ack before commit (broken)",
            if run.args.broken { "ON" } else { "off" }.to_owned(),
        ),
        ("published (messages)", run.happened.published.to_string()),
        ("  unique valid jobs", run.workload.valid.len().to_string()),
        (
            "  republished duplicates",
            run.workload.duplicates.to_string(),
        ),
        ("  poison jobs", run.args.profile.poison.to_string()),
        (
            "  bad inputs",
            (run.workload.expected_dead.len() - run.args.profile.poison).to_string(),
        ),
        (
            "  publish retries",
            run.happened.publish_retries.to_string(),
        ),
        ("worker processes started", run.counts.starts.to_string()),
        ("kills (SIGKILL)", run.counts.kills.to_string()),
        (
            "ended by SIGTERM while starting",
            run.counts.termed_starting.to_string(),
        ),
        ("pauses (SIGSTOP/SIGCONT)", run.counts.stops.to_string()),
        (
            "members added / removed",
            format!("{} / {}", run.counts.joined, run.counts.left),
        ),
        ("broker restarts", run.happened.broker_restarts.to_string()),
        (
            "fault-point aborts (SIGABRT)",
            run.counts.aborts.to_string(),
        ),
        ("redeliveries seen", redeliveries.to_string()),
        ("duplicates skipped", run.figures.duplicates.to_string()),
        (
            "superseded by a retry copy",
            run.figures.superseded.to_string(),
        ),
        ("retries", run.figures.retries.to_string()),
        (
            "extra attempts (inbox)",
            run.figures.extra_attempts.to_string(),
        ),
        ("quarantined", run.figures.quarantined.to_string()),
        ("dead-lettered", run.verdict.dead_lettered.to_string()),
        (
            "  dead-letter copies (deduped)",
            run.verdict.dead_letter_copies.to_string(),
        ),
        (
            "  expected but missing",
            run.verdict.dead_letter_missing.to_string(),
        ),
        (
            "  valid jobs dead-lettered",
            run.verdict.valid_dead_lettered.to_string(),
        ),
        (
            "  unexplained",
            run.verdict.dead_letter_unexplained.to_string(),
        ),
        (
            "invoice_ready events (outbox)",
            run.verdict.events.to_string(),
        ),
        (
            "  not published",
            run.verdict.events_unpublished.to_string(),
        ),
        ("lost", run.verdict.lost.to_string()),
        ("duplicated", run.verdict.duplicated.to_string()),
        ("unexpected", run.verdict.unexpected.to_string()),
        (
            "emails without an invoice",
            run.verdict.email_without_invoice.to_string(),
        ),
        (
            "drained",
            format!(
                "{} (at {:.0}s)",
                run.happened.drained,
                run.drained_after.as_secs_f64()
            ),
        ),
        ("elapsed", format!("{:.0}s", run.elapsed.as_secs_f64())),
    ];
    let at_db = rows
        .iter()
        .position(|(name, _)| *name == "fault-point aborts (SIGABRT)")
        .unwrap_or(rows.len());
    rows.splice(at_db..at_db, database::rows(run.db_figures));
    println!();
    for (name, value) in rows {
        println!("{name:<32}{value:>12}");
    }
    let reasons: Vec<String> = run
        .verdict
        .reasons
        .iter()
        .map(|(r, n)| format!("{r}={n}"))
        .collect();
    println!("dead-letter reasons: {}", reasons.join(", "));
    for e in &run.verdict.examples {
        println!("  violation: {e}");
    }
    for e in &run.counts.unexpected_exits {
        println!("  unexpected worker exit: {e}");
    }
    for e in &run.happened.errors {
        println!("  error: {e}");
    }
}
