//! The board's actions, only with `--allow-actions`: which dead letters an action takes
//! ([`Target`]), the confirmation page (`GET /confirm`) and the form it posts (`POST /act`),
//! which replays or discards them as `dlq` does.

use std::sync::Arc;

use axum::extract::{Form, Query, State};
use axum::http::StatusCode;
use axum::response::{Html, IntoResponse, Response};
use serde::Deserialize;

use super::page::{escape, frame, link};
use super::read::Board;
use crate::dlq::letter::DeadLetter;
use crate::dlq::{self, Action};
use crate::output::Output;
use crate::Selection;

/// Which dead letters an action takes: one by id, or a group by reason and fingerprint.
#[derive(Debug, Deserialize)]
pub(super) struct Target {
    action: String,
    /// The destination's number (0: the one the settings name).
    #[serde(default)]
    d: usize,
    id: Option<String>,
    reason: Option<String>,
    fingerprint: Option<String>,
}

impl Target {
    /// Whether it takes `letter`.
    fn takes(&self, letter: &DeadLetter) -> bool {
        match (&self.id, &self.reason, &self.fingerprint) {
            (Some(id), _, _) => &letter.id == id,
            (None, Some(reason), Some(fp)) => {
                &letter.reason == reason && &letter.fingerprint() == fp
            }
            _ => false,
        }
    }

    /// What it does: replay or discard.
    fn action(&self) -> Option<Action<'static>> {
        match self.action.as_str() {
            "replay" => Some(Action::Replay(None)),
            "discard" => Some(Action::Purge),
            _ => None,
        }
    }
}

/// `GET /confirm`: what an action would take, and the form that does it.
pub(super) async fn confirm(State(board): State<Arc<Board>>, Query(t): Query<Target>) -> Response {
    if !board.args.allow_actions {
        return refused("the board is read-only: start it with --allow-actions");
    }
    if t.action().is_none() {
        return refused("the action is replay or discard");
    }
    let letters = match board.letters(t.d).await {
        Ok(l) => l,
        Err(e) => return board.failed("reading the dead letters", &e),
    };
    let taken: Vec<&DeadLetter> = letters.iter().filter(|l| t.takes(l)).collect();
    let hidden = |name: &str, value: Option<&str>| {
        value.map_or_else(String::new, |v| {
            format!(
                "<input type=\"hidden\" name=\"{name}\" value=\"{}\">",
                escape(v)
            )
        })
    };
    let verb = if t.action == "replay" {
        "Replay"
    } else {
        "Discard"
    };
    let list: Vec<String> = taken
        .iter()
        .map(|l| format!("<li>{} ({})</li>", escape(&l.id), escape(&l.reason)))
        .collect();
    let body = format!(
        "<p id=\"what\">{verb} {n} dead letter{s}?</p><ul>{list}</ul>\
         <form method=\"post\" action=\"/act\">{a}{d}{id}{reason}{fp}{token}\
         <button id=\"confirm\" type=\"submit\">{verb} {n}</button></form><p>{back}</p>",
        n = taken.len(),
        s = if taken.len() == 1 { "" } else { "s" },
        list = list.join(""),
        a = hidden("action", Some(&t.action)),
        d = hidden("d", Some(&t.d.to_string())),
        id = hidden("id", t.id.as_deref()),
        reason = hidden("reason", t.reason.as_deref()),
        fp = hidden("fingerprint", t.fingerprint.as_deref()),
        token = hidden("token", Some(&board.token)),
        back = link("/", "Cancel"),
    );
    Html(frame(&format!("{verb} dead letters"), &body)).into_response()
}

/// The confirmation page's form: its [`Target`] and the board's token (fields of their own:
/// a flattened `Target` would not parse its number from a form).
#[derive(Debug, Deserialize)]
pub(super) struct ActForm {
    action: String,
    #[serde(default)]
    d: usize,
    id: Option<String>,
    reason: Option<String>,
    fingerprint: Option<String>,
    token: String,
}

impl ActForm {
    fn target(self) -> (Target, String) {
        let target = Target {
            action: self.action,
            d: self.d,
            id: self.id,
            reason: self.reason,
            fingerprint: self.fingerprint,
        };
        (target, self.token)
    }
}

/// `POST /act`: does what the confirmation page showed, with the safe replay of `dlq`.
pub(super) async fn act(State(board): State<Arc<Board>>, Form(form): Form<ActForm>) -> Response {
    if !board.args.allow_actions {
        return refused("the board is read-only: start it with --allow-actions");
    }
    let (target, token) = form.target();
    if token != board.token {
        return refused("this form is not one of this board's pages");
    }
    let Some(action) = target.action() else {
        return refused("the action is replay or discard");
    };
    let done = async {
        let destination = board.destination(target.d)?;
        let _one = board.dlq.lock().await;
        let out = Output::new(false);
        let letters = dlq::browse(destination, &board.args.db, &out).await?;
        let ids: Vec<String> = letters
            .iter()
            .filter(|l| target.takes(l))
            .map(|l| l.id.clone())
            .collect();
        if ids.is_empty() {
            anyhow::bail!("nothing to do: the selected dead letters are gone");
        }
        let selection = Selection {
            ids,
            reason: None,
            all: false,
            dry_run: false,
        };
        dlq::settle(destination, &board.args.db, &selection, action, &out).await
    };
    match done.await {
        Ok(report) => {
            let body = format!(
                "<p id=\"result\">selected {}, replayed {}, discarded {}, failed {}</p><p>{}</p>",
                report.selected,
                report.replayed,
                report.purged,
                report.failed,
                link("/", "Back to the overview")
            );
            Html(frame("Done", &body)).into_response()
        }
        Err(e) => board.failed("the action", &e),
    }
}

/// A 403 page saying why.
fn refused(why: &str) -> Response {
    let body = format!("<p>{}</p>", escape(why));
    (StatusCode::FORBIDDEN, Html(frame("Not allowed", &body))).into_response()
}
