//! A dead letter as the commands see it, whatever the broker: its error fingerprint, the
//! groups `list` prints, and which dead letters a selection takes.

use std::collections::BTreeMap;

use anyhow::bail;
use serde::Serialize;

use crate::Selection;

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
    /// The origin its `x-original-*` headers name, `exchange/routing-key` or the topic;
    /// `None` without them. A replay goes there (on RabbitMQ, once its signature
    /// verifies).
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
    groups.sort_by_key(|g| std::cmp::Reverse(g.count));
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
            || self.ids.contains(&letter.id)
            || self.reason.as_deref() == Some(letter.reason.as_str())
    }
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
