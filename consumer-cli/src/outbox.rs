//! The `outbox` commands: what waits in the outbox beside the inbox, through
//! [`consumer_core::Outbox::stats`].

use anyhow::Context as _;
use serde::Serialize;

use crate::output::{table, Output};
use crate::settings;
use crate::{DbArgs, OutboxCommand};

/// The columns of an outbox's stats, in the CLI's table and on the board.
pub(crate) const STATS_COLUMNS: [&str; 5] = [
    "outbox",
    "pending",
    "failing",
    "oldest pending",
    "published (kept)",
];

/// `outbox stats`, as printed.
#[derive(Debug, Serialize)]
struct Stats {
    outbox: String,
    pending: u64,
    failing: u64,
    /// Seconds since the oldest unpublished row was written.
    oldest_pending_secs: Option<f64>,
    published: u64,
}

/// The `outbox` subcommands.
pub(crate) async fn run(command: OutboxCommand, out: &Output) -> anyhow::Result<()> {
    match command {
        OutboxCommand::Stats { db } => stats(&db, out).await,
    }
}

async fn stats(db: &DbArgs, out: &Output) -> anyhow::Result<()> {
    let inbox = settings::inbox(db).await?;
    let outbox = inbox.outbox();
    let s = outbox.stats().await.context("read the outbox's stats")?;
    let stats = Stats {
        outbox: outbox.table().to_owned(),
        pending: s.pending,
        failing: s.failing,
        oldest_pending_secs: s.oldest_pending.map(|d| d.as_secs_f64()),
        published: s.published,
    };
    out.result(&stats, |s| {
        let oldest = s
            .oldest_pending_secs
            .map(|secs| format!("{secs:.0}s"))
            .unwrap_or_else(|| "-".to_owned());
        table(
            &STATS_COLUMNS,
            &[vec![
                s.outbox.clone(),
                s.pending.to_string(),
                s.failing.to_string(),
                oldest,
                s.published.to_string(),
            ]],
        )
    });
    Ok(())
}
