//! Results on stdout (text or JSON), progress and errors on stderr.

use std::io::Write;

use serde::Serialize;

/// Where a command's results go, and in which form.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Output {
    json: bool,
}

impl Output {
    /// `json`: results as one JSON document each.
    pub(crate) fn new(json: bool) -> Self {
        Output { json }
    }

    /// Prints `value` as JSON, or `text` (which renders it) as text.
    pub(crate) fn result<T: Serialize>(&self, value: &T, text: impl FnOnce(&T) -> String) {
        let rendered = if self.json {
            serde_json::to_string_pretty(value).unwrap_or_else(|e| format!("{{\"error\":\"{e}\"}}"))
        } else {
            text(value)
        };
        let mut stdout = std::io::stdout().lock();
        let _ = writeln!(stdout, "{}", rendered.trim_end());
    }

    /// A progress line on stderr (never in the JSON result).
    pub(crate) fn progress(&self, line: &str) {
        let _ = writeln!(std::io::stderr().lock(), "{line}");
    }

    /// The error that ends the command, on stderr (as JSON with `--json`).
    pub(crate) fn error(&self, e: &anyhow::Error) {
        let text = format!("{e:#}");
        let mut stderr = std::io::stderr().lock();
        if self.json {
            let _ = writeln!(stderr, "{}", serde_json::json!({ "error": text }));
        } else {
            let _ = writeln!(stderr, "error: {text}");
        }
    }
}

/// Text columns: each column as wide as its widest cell.
pub(crate) fn table(header: &[&str], rows: &[Vec<String>]) -> String {
    let mut widths: Vec<usize> = header.iter().map(|h| h.len()).collect();
    for row in rows {
        for (w, cell) in widths.iter_mut().zip(row) {
            *w = (*w).max(cell.chars().count());
        }
    }
    let line = |cells: Vec<String>| {
        let mut s = String::new();
        for (i, (cell, w)) in cells.iter().zip(&widths).enumerate() {
            if i + 1 == cells.len() {
                s.push_str(cell);
            } else {
                s.push_str(&format!("{cell:<w$}  "));
            }
        }
        s.trim_end().to_owned()
    };
    let mut out = line(header.iter().map(|h| h.to_string()).collect());
    out.push('\n');
    for row in rows {
        out.push_str(&line(row.clone()));
        out.push('\n');
    }
    out
}
