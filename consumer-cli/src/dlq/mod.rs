//! The `dlq` commands: `letter` (a dead letter, its fingerprint, the groups, the
//! selection) and `report` (what a replay or purge did) are shared; `amqp` and `kafka`
//! read, republish and settle on each broker; `origin` chooses where a RabbitMQ replay
//! goes; `reference` reads the record a Kafka `copy_too_large` letter refers to;
//! `inbox_table` works on the inbox's dead-letter table (the webhook ingress's and the
//! in-memory broker's letters).

mod amqp;
mod inbox_table;
pub(crate) mod kafka;
pub(crate) mod letter;
mod origin;
mod reference;
pub(crate) mod report;

use anyhow::bail;

use crate::output::{table, Output};
use crate::{Broker, DbArgs, DlqArgs, DlqCommand, Selection};
use letter::{groups, DeadLetter};
use report::Report;

/// The `dlq` subcommands.
pub(crate) async fn run(command: DlqCommand, out: &Output) -> anyhow::Result<()> {
    let broker = match &command {
        DlqCommand::List { dlq, .. }
        | DlqCommand::Show { dlq, .. }
        | DlqCommand::Replay { dlq, .. }
        | DlqCommand::Purge { dlq, .. } => dlq.broker,
    };
    match command {
        DlqCommand::List { dlq, db } => {
            let letters = browse(&dlq, &db, out).await?;
            print_groups(&letters, out);
        }
        DlqCommand::Show { dlq, db, id } => {
            let letters = browse(&dlq, &db, out).await?;
            let found: Vec<&DeadLetter> = letters.iter().filter(|l| l.id == id).collect();
            if found.is_empty() {
                bail!("no dead letter with id {id:?} in the DLQ");
            }
            out.result(&found, |found| {
                found
                    .iter()
                    .map(|l| show_text(l))
                    .collect::<Vec<_>>()
                    .join("\n")
            });
        }
        DlqCommand::Replay {
            dlq,
            db,
            selection,
            to,
        } => {
            selection.check()?;
            match (broker, &to) {
                (Broker::Kafka, Some(_)) => bail!(
                    "--to is for RabbitMQ: a Kafka replay goes to each record's \
                     x-original-topic"
                ),
                (Broker::Inbox, Some(_)) => {
                    bail!("--to is for RabbitMQ: an inbox letter is replayed to --replay-url")
                }
                _ => {}
            }
            let report = settle(&dlq, &db, &selection, Action::Replay(to.as_deref()), out).await?;
            finish(report, out)?;
        }
        DlqCommand::Purge { dlq, db, selection } => {
            selection.check()?;
            let report = settle(&dlq, &db, &selection, Action::Purge, out).await?;
            finish(report, out)?;
        }
    }
    Ok(())
}

/// Every dead letter of the destination `dlq` names (Kafka: but those recorded settled in
/// `db`), read without consuming.
pub(crate) async fn browse(
    dlq: &DlqArgs,
    db: &DbArgs,
    out: &Output,
) -> anyhow::Result<Vec<DeadLetter>> {
    match dlq.broker {
        Broker::Amqp => amqp::browse(dlq, out).await,
        Broker::Kafka => kafka::browse(dlq, db, out).await,
        Broker::Inbox => inbox_table::browse(db).await,
    }
}

/// What [`settle`] does to the selected dead letters.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Action<'a> {
    /// Release their keys and republish them: to their origins, or (RabbitMQ) to this
    /// `EXCHANGE/ROUTING_KEY`.
    Replay(Option<&'a str>),
    /// Drop them for good.
    Purge,
}

/// Replays or purges the dead letters of `dlq` that `selection` takes: the safe replay of
/// the module docs of `main`.
pub(crate) async fn settle(
    dlq: &DlqArgs,
    db: &DbArgs,
    selection: &Selection,
    action: Action<'_>,
    out: &Output,
) -> anyhow::Result<Report> {
    let replay = matches!(action, Action::Replay(_));
    match (dlq.broker, action) {
        (Broker::Amqp, Action::Replay(to)) => {
            let replay = origin::Replay::new(to)?;
            amqp::settle(dlq, db, selection, Some(replay), out).await
        }
        (Broker::Amqp, Action::Purge) => amqp::settle(dlq, db, selection, None, out).await,
        (Broker::Kafka, _) => kafka::settle(dlq, db, selection, replay, out).await,
        (Broker::Inbox, _) => inbox_table::settle(dlq, db, selection, replay, out).await,
    }
}

fn finish(report: Report, out: &Output) -> anyhow::Result<()> {
    out.result(&report, Report::text);
    if report.failed > 0 {
        bail!("{} selected dead letters were not settled", report.failed);
    }
    Ok(())
}

fn print_groups(letters: &[DeadLetter], out: &Output) {
    let groups = groups(letters);
    let result = serde_json::json!({ "total": letters.len(), "groups": groups });
    out.result(&result, |_| {
        let rows: Vec<Vec<String>> = groups
            .iter()
            .map(|g| {
                vec![
                    g.count.to_string(),
                    g.reason.clone(),
                    g.handlers.join(","),
                    g.fingerprint.clone(),
                ]
            })
            .collect();
        let mut s = table(
            &["COUNT", "REASON", "HANDLER", "ERROR (fingerprint)"],
            &rows,
        );
        s.push_str(&format!(
            "{} dead letter{} in {} group{}\n",
            letters.len(),
            if letters.len() == 1 { "" } else { "s" },
            groups.len(),
            if groups.len() == 1 { "" } else { "s" },
        ));
        s
    });
}

fn show_text(l: &DeadLetter) -> String {
    let mut s = format!("id: {}\nreason: {}\n", l.id, l.reason);
    s.push_str("properties:\n");
    for (k, v) in &l.properties {
        s.push_str(&format!("  {k}: {v}\n"));
    }
    s.push_str("headers:\n");
    for (k, v) in &l.headers {
        s.push_str(&format!("  {k}: {v}\n"));
    }
    s.push_str(&format!("payload:\n{}\n", l.payload));
    s
}
