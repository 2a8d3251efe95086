//! The board's reads: the [`Board`] every page reads from, with the inbox's, the outbox's,
//! the HTTP store's and the dead letters' tables, and the read-only pages (`GET /`,
//! `GET /letter`).

use std::collections::BTreeMap;
use std::sync::Arc;

use anyhow::Context as _;
use axum::extract::{Query, State};
use axum::http::StatusCode;
use axum::response::{Html, IntoResponse, Response};
use consumer_core::Inbox;
use serde::Deserialize;
use sqlx::Postgres;
use tokio::sync::Mutex;

use super::args::BoardArgs;
use super::page::{age, escape, frame, link, query_value, table};
use crate::dlq;
use crate::dlq::letter::{groups, DeadLetter};
use crate::output::Output;
use crate::settings;
use crate::DlqArgs;

/// What every page reads from.
pub(super) struct Board {
    pub(super) args: BoardArgs,
    pub(super) inbox: Inbox<Postgres>,
    /// The HTTP store's quoted table and its operations table, if named.
    pub(super) http: Option<(String, String)>,
    /// The dead-letter destinations shown, by their number in the pages' links: the one the
    /// settings name and, unless that is it, the inbox's dead-letter table (the webhook
    /// ingress's and the in-memory broker's letters).
    pub(super) destinations: Vec<DlqArgs>,
    /// The token every action form carries: only this process's pages hold it.
    pub(super) token: String,
    /// One look at the dead letters at a time: reading a RabbitMQ DLQ holds its messages.
    pub(super) dlq: Mutex<()>,
}

impl Board {
    /// A page for `e`, with the credentials of every URL the board was given scrubbed.
    pub(super) fn failed(&self, what: &str, e: &anyhow::Error) -> Response {
        let mut text = format!("{e:#}");
        for url in [&self.args.db.database_url, &self.args.dlq.amqp_url]
            .into_iter()
            .flatten()
            .filter(|u| !u.is_empty())
        {
            text = settings::scrub(&text, url);
        }
        let body = format!("<p>{}: {}</p>", escape(what), escape(&text));
        (
            StatusCode::INTERNAL_SERVER_ERROR,
            Html(frame("Error", &body)),
        )
            .into_response()
    }
}

impl Board {
    /// Destination `d`, if there is one of that number.
    pub(super) fn destination(&self, d: usize) -> anyhow::Result<&DlqArgs> {
        self.destinations
            .get(d)
            .with_context(|| format!("no dead-letter destination {d}"))
    }

    /// The dead letters of destination `d`, read without consuming.
    pub(super) async fn letters(&self, d: usize) -> anyhow::Result<Vec<DeadLetter>> {
        let destination = self.destination(d)?;
        let _one = self.dlq.lock().await;
        dlq::browse(destination, &self.args.db, &Output::new(false)).await
    }

    /// The handlers' table.
    async fn handlers(&self) -> anyhow::Result<String> {
        let mut rows = Vec::new();
        for (handler, _) in self.inbox.handlers().await? {
            let c = self.inbox.counts(&handler).await?;
            rows.push(vec![
                escape(&handler),
                c.pending.to_string(),
                c.completed.to_string(),
                c.dead.to_string(),
                age(c.stalest_pending.map(|d| d.as_secs_f64())),
            ]);
        }
        Ok(table(
            "handlers",
            &["handler", "pending", "completed", "dead", "stalest pending"],
            &rows,
        ))
    }

    /// The outbox's table.
    async fn outbox(&self) -> anyhow::Result<String> {
        let outbox = self.inbox.outbox();
        let s = outbox.stats().await?;
        Ok(table(
            "outbox",
            &crate::outbox::STATS_COLUMNS,
            &[vec![
                escape(outbox.table()),
                s.pending.to_string(),
                s.failing.to_string(),
                age(s.oldest_pending.map(|d| d.as_secs_f64())),
                s.published.to_string(),
            ]],
        ))
    }

    /// The HTTP store's records by status and its pending operations, if it was named and
    /// exists.
    async fn http(&self) -> anyhow::Result<Option<String>> {
        let Some((records, operations)) = &self.http else {
            return Ok(None);
        };
        let pool = self.inbox.pool();
        let exists = |t: String| async move {
            sqlx::query_scalar::<_, Option<String>>("SELECT to_regclass($1)::text")
                .bind(t)
                .fetch_one(pool)
                .await
                .map(|r| r.is_some())
        };
        if !exists(records.clone()).await? {
            return Ok(Some(format!(
                "<p class=\"note\">{} does not exist.</p>",
                escape(records)
            )));
        }
        let by_status: Vec<(String, i64)> = sqlx::query_as(&format!(
            "SELECT status, count(*) FROM {records} GROUP BY status ORDER BY status"
        ))
        .fetch_all(pool)
        .await?;
        let mut rows: Vec<Vec<String>> = by_status
            .into_iter()
            .map(|(status, n)| {
                vec![
                    escape(&format!("records {status}")),
                    n.to_string(),
                    "-".into(),
                ]
            })
            .collect();
        if exists(operations.clone()).await? {
            let (pending, oldest_secs): (i64, Option<f64>) = sqlx::query_as(&format!(
                "SELECT count(*), (extract(epoch FROM clock_timestamp()) * 1000 \
                 - min(created_at_ms))::float8 / 1000 FROM {operations} WHERE status = 'pending'"
            ))
            .fetch_one(pool)
            .await?;
            rows.push(vec![
                "operations pending".to_owned(),
                pending.to_string(),
                age(oldest_secs),
            ]);
        }
        Ok(Some(table("http", &["what", "count", "oldest"], &rows)))
    }
}

/// `GET /`: every section.
pub(super) async fn overview(State(board): State<Arc<Board>>) -> Response {
    let mut body = String::new();
    let sections = async {
        body.push_str("<h2>Handlers</h2>");
        body.push_str(&board.handlers().await.context("the inbox")?);
        body.push_str("<h2>Outbox</h2>");
        body.push_str(&board.outbox().await.context("the outbox")?);
        if let Some(http) = board.http().await.context("the HTTP store")? {
            body.push_str("<h2>HTTP idempotency</h2>");
            body.push_str(&http);
        }
        for d in 0..board.destinations.len() {
            let letters = board.letters(d).await.context("the dead letters")?;
            body.push_str(&dead_letters(&board, d, &letters));
        }
        anyhow::Ok(())
    };
    match sections.await {
        Ok(()) => Html(frame("Overview", &body)).into_response(),
        Err(e) => board.failed("reading", &e),
    }
}

/// The section of destination `d`: its groups, largest first, each with its letters.
fn dead_letters(board: &Board, d: usize, letters: &[DeadLetter]) -> String {
    let where_ = escape(&destination(&board.destinations[d]));
    let mode = if board.args.allow_actions {
        "replay and discard allowed, each after a confirmation"
    } else {
        "read-only"
    };
    let mut out = format!(
        "<h2>Dead letters: {where_}</h2><p>{} dead letter{} in {where_} ({mode}).</p>",
        letters.len(),
        if letters.len() == 1 { "" } else { "s" },
    );
    let rows: Vec<Vec<String>> = groups(letters)
        .iter()
        .map(|g| {
            let ids: Vec<String> = letters
                .iter()
                .filter(|l| l.reason == g.reason && l.fingerprint() == g.fingerprint)
                .map(|l| link(&format!("/letter?d={d}&id={}", query_value(&l.id)), &l.id))
                .collect();
            let mut row = vec![
                format!("<span class=\"count\">{}</span>", g.count),
                escape(&g.reason),
                escape(&g.handlers.join(", ")),
                escape(&g.fingerprint),
                ids.join("<br>"),
            ];
            if board.args.allow_actions {
                let group = format!(
                    "d={d}&reason={}&fingerprint={}",
                    query_value(&g.reason),
                    query_value(&g.fingerprint)
                );
                row.push(format!(
                    "{} {}",
                    link(&format!("/confirm?action=replay&{group}"), "Replay group"),
                    link(&format!("/confirm?action=discard&{group}"), "Discard group"),
                ));
            }
            row
        })
        .collect();
    let mut header = vec![
        "count",
        "reason",
        "handlers",
        "error (fingerprint)",
        "letters",
    ];
    if board.args.allow_actions {
        header.push("actions");
    }
    out.push_str(&table(&format!("groups-{d}"), &header, &rows));
    out
}

/// The destination the board reads, for people: the broker and the queue or topic.
fn destination(dlq: &DlqArgs) -> String {
    match dlq.broker {
        crate::Broker::Amqp => format!("RabbitMQ queue {}", dlq.queue.as_deref().unwrap_or("?")),
        crate::Broker::Kafka => format!("Kafka topic {}", dlq.topic.as_deref().unwrap_or("?")),
        crate::Broker::Inbox => "the inbox's dead-letter table".to_owned(),
    }
}

#[derive(Debug, Deserialize)]
pub(super) struct LetterQuery {
    /// The destination's number (0: the one the settings name).
    #[serde(default)]
    d: usize,
    id: String,
}

/// `GET /letter?id=ID`: one dead letter whole.
pub(super) async fn letter(
    State(board): State<Arc<Board>>,
    Query(q): Query<LetterQuery>,
) -> Response {
    let letters = match board.letters(q.d).await {
        Ok(l) => l,
        Err(e) => return board.failed("reading the dead letters", &e),
    };
    let Some(l) = letters.iter().find(|l| l.id == q.id) else {
        let body = format!(
            "<p>No dead letter {} (replayed or discarded?).</p>",
            escape(&q.id)
        );
        return (StatusCode::NOT_FOUND, Html(frame("Dead letter", &body))).into_response();
    };
    let pairs = |map: &BTreeMap<String, String>| -> Vec<Vec<String>> {
        map.iter()
            .map(|(k, v)| vec![escape(k), escape(v)])
            .collect()
    };
    let mut body = format!(
        "<p>id {} · reason {}</p><h2>Error</h2><pre>{}</pre>",
        escape(&l.id),
        escape(&l.reason),
        escape(l.error.as_deref().unwrap_or("-"))
    );
    body.push_str("<h2>Properties</h2>");
    body.push_str(&table(
        "properties",
        &["name", "value"],
        &pairs(&l.properties),
    ));
    body.push_str("<h2>Headers</h2>");
    body.push_str(&table("headers", &["name", "value"], &pairs(&l.headers)));
    body.push_str(&format!(
        "<h2>Payload</h2><pre id=\"payload\">{}</pre>",
        escape(&l.payload)
    ));
    if board.args.allow_actions {
        let which = format!("d={}&id={}", q.d, query_value(&l.id));
        body.push_str(&format!(
            "<p>{} {}</p>",
            link(&format!("/confirm?action=replay&{which}"), "Replay"),
            link(&format!("/confirm?action=discard&{which}"), "Discard")
        ));
    }
    Html(frame("Dead letter", &body)).into_response()
}
