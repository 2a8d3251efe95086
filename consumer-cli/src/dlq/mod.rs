//! What the dead-letter commands share, whatever the broker: a dead letter as read, its
//! error fingerprint, the groups `list` prints, which dead letters a selection takes, and
//! the report of a replay or purge.

mod amqp;
mod kafka;

use std::collections::BTreeMap;

use anyhow::bail;
use serde::Serialize;

use crate::output::{table, Output};
use crate::{Broker, DlqCommand, Selection};

/// A dead letter as read from its queue or topic.
#[derive(Debug, Clone, Serialize)]
pub(crate) struct DeadLetter {
    /// RabbitMQ: the message id; Kafka: `partition/offset`.
    pub(crate) id: String,
    /// `x-dead-letter-reason` (`unknown` when absent: dead-lettered by the broker itself).
    pub(crate) reason: String,
    /// `x-handler`.
    pub(crate) handler: Option<String>,
    /// `x-key`.
    pub(crate) key: Option<String>,
    /// `x-error`.
    pub(crate) error: Option<String>,
    /// Where a replay republishes it: `exchange/routing-key` or the topic; `None` without the
    /// framework's `x-original-*` headers.
    pub(crate) origin: Option<String>,
    /// Every header, as text.
    pub(crate) headers: BTreeMap<String, String>,
    /// Message properties (RabbitMQ) or the record's key and timestamp (Kafka), as text.
    pub(crate) properties: BTreeMap<String, String>,
    /// The payload: UTF-8 text as it is, other bytes lossily.
    pub(crate) payload: String,
}

impl DeadLetter {
    /// The error text with what differs between messages of one cause (ids, numbers)
    /// replaced by `#`: every word holding a digit becomes `#`.
    pub(crate) fn fingerprint(&self) -> String {
        fingerprint(self.error.as_deref().unwrap_or(""))
    }
}

/// See [`DeadLetter::fingerprint`].
pub(crate) fn fingerprint(error: &str) -> String {
    let mut out = String::with_capacity(error.len());
    let mut word = String::new();
    let flush = |word: &mut String, out: &mut String| {
        if word.chars().any(|c| c.is_ascii_digit()) {
            out.push('#');
        } else {
            out.push_str(word);
        }
        word.clear();
    };
    for c in error.chars() {
        if c.is_alphanumeric() || matches!(c, '_' | '-' | '.' | ':' | '/') {
            word.push(c);
        } else {
            flush(&mut word, &mut out);
            out.push(c);
        }
    }
    flush(&mut word, &mut out);
    // Trailing punctuation of an id (`order 12.`) is part of the word; keep texts short.
    out.chars().take(200).collect()
}

/// Dead letters of one reason and error fingerprint.
#[derive(Debug, Serialize, PartialEq, Eq)]
pub(crate) struct Group {
    pub(crate) reason: String,
    pub(crate) fingerprint: String,
    pub(crate) count: usize,
    /// The handlers that dead-lettered them.
    pub(crate) handlers: Vec<String>,
    /// Up to five ids, for `dlq show`.
    pub(crate) sample_ids: Vec<String>,
}

/// The dead letters grouped, largest group first.
pub(crate) fn groups(letters: &[DeadLetter]) -> Vec<Group> {
    let mut by: BTreeMap<(String, String), Group> = BTreeMap::new();
    for l in letters {
        let fp = l.fingerprint();
        let g = by
            .entry((l.reason.clone(), fp.clone()))
            .or_insert_with(|| Group {
                reason: l.reason.clone(),
                fingerprint: fp,
                count: 0,
                handlers: Vec::new(),
                sample_ids: Vec::new(),
            });
        g.count += 1;
        if let Some(h) = &l.handler {
            if !g.handlers.contains(h) {
                g.handlers.push(h.clone());
            }
        }
        if g.sample_ids.len() < 5 {
            g.sample_ids.push(l.id.clone());
        }
    }
    let mut groups: Vec<Group> = by.into_values().collect();
    groups.sort_by(|a, b| b.count.cmp(&a.count));
    groups
}

impl Selection {
    /// `Err` unless it names something: ids, `--reason` or `--all`.
    pub(crate) fn check(&self) -> anyhow::Result<()> {
        if self.ids.is_empty() && self.reason.is_none() && !self.all {
            bail!("say which dead letters: IDs, --reason REASON or --all");
        }
        Ok(())
    }

    /// Whether the selection takes `letter`.
    pub(crate) fn takes(&self, letter: &DeadLetter) -> bool {
        self.all
            || self.ids.iter().any(|id| *id == letter.id)
            || self.reason.as_deref() == Some(letter.reason.as_str())
    }
}

/// What happened to one selected dead letter.
#[derive(Debug, Clone, Copy, Serialize, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub(crate) enum Fate {
    /// `--dry-run`: would have been replayed or purged.
    WouldDo,
    /// Republished (after its key was released) and removed from the DLQ.
    Replayed,
    /// Removed from the DLQ.
    Purged,
    /// Not replayed: it has no `x-original-*` headers to say where to.
    NoOrigin,
    /// The republish or the removal failed; it stays in the DLQ.
    Failed,
}

/// One line of a replay's or purge's report.
#[derive(Debug, Serialize)]
pub(crate) struct Done {
    pub(crate) id: String,
    pub(crate) reason: String,
    pub(crate) fate: Fate,
    /// Whether its inbox key was dead and is now released (replay only).
    pub(crate) key_released: bool,
    pub(crate) error: Option<String>,
}

/// A replay's or purge's report: the summary and one line per selected dead letter.
#[derive(Debug, Serialize)]
pub(crate) struct Report {
    pub(crate) dry_run: bool,
    /// Dead letters read.
    pub(crate) read: usize,
    pub(crate) selected: usize,
    pub(crate) replayed: usize,
    pub(crate) purged: usize,
    pub(crate) failed: usize,
    pub(crate) messages: Vec<Done>,
}

impl Report {
    pub(crate) fn new(dry_run: bool, read: usize, messages: Vec<Done>) -> Self {
        let count = |f: Fate| messages.iter().filter(|d| d.fate == f).count();
        Report {
            dry_run,
            read,
            selected: messages.len(),
            replayed: count(Fate::Replayed),
            purged: count(Fate::Purged),
            failed: count(Fate::Failed) + count(Fate::NoOrigin),
            messages,
        }
    }

    fn text(&self) -> String {
        let rows: Vec<Vec<String>> = self
            .messages
            .iter()
            .map(|d| {
                vec![
                    d.id.clone(),
                    d.reason.clone(),
                    serde_json::to_value(d.fate)
                        .ok()
                        .and_then(|v| v.as_str().map(str::to_owned))
                        .unwrap_or_default(),
                    d.error.clone().unwrap_or_default(),
                ]
            })
            .collect();
        let mut s = table(&["ID", "REASON", "FATE", "ERROR"], &rows);
        s.push_str(&format!(
            "{}read {}, selected {}, replayed {}, purged {}, failed {}\n",
            if self.dry_run { "dry run: " } else { "" },
            self.read,
            self.selected,
            self.replayed,
            self.purged,
            self.failed
        ));
        s
    }
}

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
            let letters = match broker {
                Broker::Amqp => amqp::browse(&dlq, out).await?,
                Broker::Kafka => kafka::browse(&dlq, &db, out).await?,
            };
            print_groups(&letters, out);
        }
        DlqCommand::Show { dlq, db, id } => {
            let letters = match broker {
                Broker::Amqp => amqp::browse(&dlq, out).await?,
                Broker::Kafka => kafka::browse(&dlq, &db, out).await?,
            };
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
        DlqCommand::Replay { dlq, db, selection } => {
            selection.check()?;
            let report = match broker {
                Broker::Amqp => amqp::settle(&dlq, &db, &selection, true, out).await?,
                Broker::Kafka => kafka::settle(&dlq, &db, &selection, true, out).await?,
            };
            finish(report, out)?;
        }
        DlqCommand::Purge { dlq, db, selection } => {
            selection.check()?;
            let report = match broker {
                Broker::Amqp => amqp::settle(&dlq, &db, &selection, false, out).await?,
                Broker::Kafka => kafka::settle(&dlq, &db, &selection, false, out).await?,
            };
            finish(report, out)?;
        }
    }
    Ok(())
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
            "{} dead letters in {} groups\n",
            letters.len(),
            groups.len()
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

#[cfg(test)]
mod tests {
    use super::*;

    fn letter(id: &str, reason: &str, error: &str) -> DeadLetter {
        DeadLetter {
            id: id.to_owned(),
            reason: reason.to_owned(),
            handler: Some("h".to_owned()),
            key: Some(id.to_owned()),
            error: Some(error.to_owned()),
            origin: None,
            headers: BTreeMap::new(),
            properties: BTreeMap::new(),
            payload: String::new(),
        }
    }

    #[test]
    fn fingerprints_ignore_ids_and_numbers() {
        assert_eq!(
            fingerprint("order ord_17_abc-3 rejected: code 4711"),
            "order # rejected: code #"
        );
        assert_eq!(
            fingerprint("timeout after 30s on 10.0.0.1:5432"),
            "timeout after # on #"
        );
        assert_eq!(fingerprint("no digits here"), "no digits here");
    }

    #[test]
    fn groups_by_reason_and_fingerprint() {
        let letters = [
            letter("a1", "permanent_error", "order 1 rejected"),
            letter("a2", "permanent_error", "order 2 rejected"),
            letter("a3", "max_attempts_exceeded", "order 3 timed out"),
            letter("a4", "permanent_error", "order 4 timed out"),
        ];
        let g = groups(&letters);
        assert_eq!(g.len(), 3);
        assert_eq!(
            (g[0].reason.as_str(), g[0].count, g[0].fingerprint.as_str()),
            ("permanent_error", 2, "order # rejected")
        );
        assert_eq!(g[0].sample_ids, ["a1", "a2"]);
    }

    #[test]
    fn a_selection_must_name_something() {
        let none = Selection {
            ids: vec![],
            reason: None,
            all: false,
            dry_run: false,
        };
        assert!(none.check().is_err());
        let by_reason = Selection {
            reason: Some("undecodable".to_owned()),
            ..none.clone()
        };
        assert!(by_reason.takes(&letter("x", "undecodable", "")));
        assert!(!by_reason.takes(&letter("x", "permanent_error", "")));
    }
}
