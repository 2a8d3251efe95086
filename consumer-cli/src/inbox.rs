//! `migrate` and the `inbox` commands.
//!
//! `stats` lists the handlers that have rows and asks [`Inbox::counts`] for each (the
//! pending rows, and how long the stalest has seen no attempt: the idle time their
//! retention counts), and counts the marks of settled Kafka dead letters (see
//! `dlq::kafka`), if any were written; `purge`
//! deletes rows by status and age with one statement on [`Inbox::table`] (the validated,
//! quoted table name), for the operator's cases that the handlers' retention does not
//! cover (e.g. dead keys nobody will replay).

use std::time::Duration;

use anyhow::{bail, Context as _};
use clap::ValueEnum;
use consumer_core::inbox::{EntryStatus, InboxCounts};
use consumer_core::Inbox;
use serde::Serialize;
use sqlx::Postgres;

use crate::output::{table, Output};
use crate::settings;
use crate::{DbArgs, InboxCommand};

/// The rows `inbox purge` may delete.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub(crate) enum PurgeStatus {
    /// Dead-lettered keys: a later replay of their message runs as new.
    Dead,
    /// Completed keys: a later redelivery of their message runs again.
    Completed,
}

impl PurgeStatus {
    fn as_str(self) -> &'static str {
        match self {
            PurgeStatus::Dead => "dead",
            PurgeStatus::Completed => "completed",
        }
    }
}

/// `30d`, `12h`, `15m`, `90s` (a number and a unit) as a duration.
pub(crate) fn parse_age(s: &str) -> Result<Duration, String> {
    let s = s.trim();
    let split = s.find(|c: char| !c.is_ascii_digit()).unwrap_or(s.len());
    let (n, unit) = s.split_at(split);
    let n: u64 = n
        .parse()
        .map_err(|_| format!("{s:?}: expected a number and a unit, e.g. 30d"))?;
    let secs = match unit {
        "d" => 86_400,
        "h" => 3_600,
        "m" => 60,
        "s" => 1,
        _ => return Err(format!("{s:?}: the unit is one of d, h, m, s")),
    };
    Ok(Duration::from_secs(n.saturating_mul(secs)))
}

/// `consumer migrate`.
pub(crate) async fn migrate(db: &DbArgs, out: &Output) -> anyhow::Result<()> {
    let inbox = settings::inbox(db).await?;
    let done = serde_json::json!({ "migrated": inbox.table() });
    out.result(&done, |_| format!("migrated {}", inbox.table()));
    Ok(())
}

/// The `inbox` subcommands.
pub(crate) async fn run(command: InboxCommand, out: &Output) -> anyhow::Result<()> {
    match command {
        InboxCommand::Stats { db, handler } => stats(&db, handler, out).await,
        InboxCommand::Show { db, handler, key } => show(&db, &handler, &key, out).await,
        InboxCommand::Release { db, handler, key } => release(&db, &handler, &key, out).await,
        InboxCommand::Purge {
            db,
            status,
            older_than,
            dry_run,
        } => purge(&db, status, older_than, dry_run, out).await,
    }
}

/// One handler's line of `inbox stats`.
#[derive(Debug, Serialize)]
struct HandlerStats {
    handler: String,
    pending: u64,
    completed: u64,
    dead: u64,
    /// Seconds since the stalest pending key saw an attempt.
    stalest_pending_secs: Option<f64>,
}

impl HandlerStats {
    fn new(handler: String, c: InboxCounts) -> Self {
        HandlerStats {
            handler,
            pending: c.pending,
            completed: c.completed,
            dead: c.dead,
            stalest_pending_secs: c.stalest_pending.map(|d| d.as_secs_f64()),
        }
    }
}

/// The handlers that have rows in the inbox, sorted.
async fn handlers(inbox: &Inbox<Postgres>) -> anyhow::Result<Vec<String>> {
    let handlers = inbox
        .handlers()
        .await
        .context("list the inbox's handlers")?;
    Ok(handlers.into_iter().map(|(h, _)| h).collect())
}

/// `inbox stats`' result: the handlers' lines, and the Kafka dead letters' settled marks.
#[derive(Debug, Serialize)]
struct Stats {
    handlers: Vec<HandlerStats>,
    /// `None` when no Kafka dead letter was ever replayed or purged beside this inbox.
    kafka_dlq_settled: Option<SettledStats>,
}

/// The marks of replayed and purged Kafka dead letters (see `dlq::kafka`).
#[derive(Debug, Serialize)]
struct SettledStats {
    marks: i64,
    /// Seconds since the oldest mark was written.
    oldest_secs: Option<f64>,
}

/// The settled marks' count and age, if their table exists.
async fn settled_stats(inbox: &Inbox<Postgres>) -> anyhow::Result<Option<SettledStats>> {
    let table = crate::dlq::kafka::settled_table_name(inbox)?;
    let exists: Option<String> = sqlx::query_scalar("SELECT to_regclass($1)::text")
        .bind(&table)
        .fetch_one(inbox.pool())
        .await
        .context("look for the settled dead letters' table")?;
    if exists.is_none() {
        return Ok(None);
    }
    let (marks, oldest_secs): (i64, Option<f64>) = sqlx::query_as(&format!(
        "SELECT count(*), extract(epoch FROM now() - min(settled_at))::float8 FROM {table}"
    ))
    .fetch_one(inbox.pool())
    .await
    .context("count the settled dead letters")?;
    Ok(Some(SettledStats { marks, oldest_secs }))
}

async fn stats(db: &DbArgs, handler: Option<String>, out: &Output) -> anyhow::Result<()> {
    let inbox = settings::inbox(db).await?;
    let names = match handler {
        Some(h) => vec![h],
        None => handlers(&inbox).await?,
    };
    let mut lines = Vec::new();
    for name in names {
        let counts = inbox
            .counts(&name)
            .await
            .context("count the inbox's keys")?;
        lines.push(HandlerStats::new(name, counts));
    }
    let stats = Stats {
        handlers: lines,
        kafka_dlq_settled: settled_stats(&inbox).await?,
    };
    out.result(&stats, |stats| {
        let rows: Vec<Vec<String>> = stats
            .handlers
            .iter()
            .map(|l| {
                vec![
                    l.handler.clone(),
                    l.pending.to_string(),
                    l.completed.to_string(),
                    l.dead.to_string(),
                    l.stalest_pending_secs
                        .map(|s| format!("{s:.0}s"))
                        .unwrap_or_else(|| "-".to_owned()),
                ]
            })
            .collect();
        let mut text = table(
            &["HANDLER", "PENDING", "COMPLETED", "DEAD", "STALEST PENDING"],
            &rows,
        );
        if let Some(s) = &stats.kafka_dlq_settled {
            let oldest = s
                .oldest_secs
                .map_or_else(|| "-".to_owned(), |s| format!("{s:.0}s"));
            text.push_str(&format!(
                "\nKafka dead letters settled: {} marks, the oldest written {oldest} ago\n",
                s.marks
            ));
        }
        text
    });
    Ok(())
}

fn status_name(s: EntryStatus) -> &'static str {
    match s {
        EntryStatus::Pending => "pending",
        EntryStatus::Completed => "completed",
        EntryStatus::Dead => "dead",
    }
}

/// `inbox show`'s result.
#[derive(Debug, Serialize)]
struct Shown {
    handler: String,
    key: String,
    status: &'static str,
    attempts: u32,
    payload_hash: String,
    last_error: Option<String>,
    retried_to: u32,
}

async fn show(db: &DbArgs, handler: &str, key: &str, out: &Output) -> anyhow::Result<()> {
    let inbox = settings::inbox(db).await?;
    let Some(e) = inbox.entry(handler, key).await.context("read the key")? else {
        bail!("no inbox row for handler {handler:?} and key {key:?}");
    };
    let shown = Shown {
        handler: handler.to_owned(),
        key: key.to_owned(),
        status: status_name(e.status),
        attempts: e.attempts,
        payload_hash: e.payload_hash,
        last_error: e.last_error,
        retried_to: e.retried_to,
    };
    out.result(&shown, |s| {
        format!(
            "handler:      {}\nkey:          {}\nstatus:       {}\nattempts:     {}\npayload hash: {}\nlast error:   {}\n",
            s.handler,
            s.key,
            s.status,
            s.attempts,
            s.payload_hash,
            s.last_error.as_deref().unwrap_or("-")
        )
    });
    Ok(())
}

async fn release(db: &DbArgs, handler: &str, key: &str, out: &Output) -> anyhow::Result<()> {
    let inbox = settings::inbox(db).await?;
    let released = inbox
        .release(handler, key)
        .await
        .context("release the key")?;
    let result = serde_json::json!({ "handler": handler, "key": key, "released": released });
    out.result(&result, |_| {
        if released {
            format!("released {handler}/{key}: a replay of its message runs as new")
        } else {
            format!("{handler}/{key} is not dead: nothing released")
        }
    });
    Ok(())
}

async fn purge(
    db: &DbArgs,
    status: PurgeStatus,
    older_than: Duration,
    dry_run: bool,
    out: &Output,
) -> anyhow::Result<()> {
    let inbox = settings::inbox(db).await?;
    let entry_status = match status {
        PurgeStatus::Dead => EntryStatus::Dead,
        PurgeStatus::Completed => EntryStatus::Completed,
    };
    let n = inbox
        .purge_older(entry_status, older_than, dry_run)
        .await
        .context(if dry_run {
            "count the rows"
        } else {
            "delete the rows"
        })?;
    let result = serde_json::json!({
        "status": status.as_str(),
        "older_than_secs": older_than.as_secs(),
        "dry_run": dry_run,
        "rows": n,
    });
    out.result(&result, |_| {
        let verb = if dry_run { "would delete" } else { "deleted" };
        format!("{verb} {n} {} rows", status.as_str())
    });
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_ages() {
        assert_eq!(parse_age("30d"), Ok(Duration::from_secs(30 * 86_400)));
        assert_eq!(parse_age("12h"), Ok(Duration::from_secs(12 * 3_600)));
        assert_eq!(parse_age("15m"), Ok(Duration::from_secs(900)));
        assert_eq!(parse_age("0s"), Ok(Duration::ZERO));
        assert!(parse_age("30").is_err());
        assert!(parse_age("d").is_err());
        assert!(parse_age("3w").is_err());
    }
}
