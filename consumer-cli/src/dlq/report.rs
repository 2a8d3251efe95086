//! The report of a replay or purge: what happened to each selected dead letter, and the
//! counts.

use serde::Serialize;

use crate::output::table;

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
    /// Not replayed: its `x-original-*` headers are not signed with the workers' origin
    /// secret, so a producer may have written them (RabbitMQ; `--to` names a destination).
    UnverifiedOrigin,
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

impl Done {
    /// Sets the fate from how replaying or purging the message went: `fate` if it did,
    /// [`Fate::Failed`] with the error if not.
    pub(crate) fn settle(&mut self, outcome: anyhow::Result<()>, fate: Fate) {
        match outcome {
            Ok(()) => self.fate = fate,
            Err(e) => {
                self.fate = Fate::Failed;
                self.error = Some(format!("{e:#}"));
            }
        }
    }
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
            failed: count(Fate::Failed) + count(Fate::NoOrigin) + count(Fate::UnverifiedOrigin),
            messages,
        }
    }

    /// The report as a table and a summary line.
    pub(crate) fn text(&self) -> String {
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
