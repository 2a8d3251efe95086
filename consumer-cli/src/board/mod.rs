//! `consumer board`: a web page over what the other commands read, for an operator's
//! browser: the handlers' keys by status and the stalest pending one, the outbox's backlog,
//! the dead letters of one destination grouped by reason and error fingerprint (each viewable
//! whole), and the HTTP idempotency layer's records and pending operations.
//!
//! The dead letters are those of the destination the settings name (as for `dlq`) and,
//! unless that is it, of the inbox's dead-letter table, each in a section of its own.
//!
//! Read-only unless started with `--allow-actions`: then a group of dead letters, or one,
//! can be replayed (the safe replay of `dlq replay`: keys released, then republished, then
//! taken out of the DLQ) or discarded, each after a confirmation page, through a form that
//! carries a token only this process's pages hold (another site cannot post it). It binds
//! to `127.0.0.1:8089` by default, so only this machine reaches it, and shows no
//! credential: URLs are never printed, errors are scrubbed as the commands' are.
//!
//! Layout: this file serves the routes; `page` writes the HTML.

mod page;

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::Arc;

use anyhow::Context as _;
use axum::extract::{Form, Query, State};
use axum::http::StatusCode;
use axum::response::{Html, IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;
use clap::Args;
use consumer_core::{Identifier, Inbox};
use serde::Deserialize;
use sqlx::Postgres;
use tokio::sync::Mutex;

use crate::dlq::letter::{groups, DeadLetter};
use crate::dlq::{self, Action};
use crate::output::Output;
use crate::settings;
use crate::{DbArgs, DlqArgs, Selection};
use page::{age, escape, frame, link, query_value, table};

/// `consumer board`'s settings.
#[derive(Debug, Args, Clone)]
pub(crate) struct BoardArgs {
    #[command(flatten)]
    db: DbArgs,
    #[command(flatten)]
    dlq: DlqArgs,
    /// Where the page is served (default: this machine only).
    #[arg(long, env = "BOARD_LISTEN", default_value = "127.0.0.1:8089")]
    listen: SocketAddr,
    /// Let the page replay and discard dead letters, each after a confirmation; without it
    /// the page only reads.
    #[arg(long)]
    allow_actions: bool,
    /// The HTTP idempotency store's table (consumer-http's `http_idempotency`), in the
    /// inbox's schema: the page then shows its records by status and its pending operations.
    #[arg(long = "http-table", env = "HTTP_IDEMPOTENCY_TABLE")]
    http_table: Option<String>,
}

/// What every page reads from.
struct Board {
    args: BoardArgs,
    inbox: Inbox<Postgres>,
    /// The HTTP store's quoted table and its operations table, if named.
    http: Option<(String, String)>,
    /// The dead-letter destinations shown, by their number in the pages' links: the one the
    /// settings name and, unless that is it, the inbox's dead-letter table (the webhook
    /// ingress's and the in-memory broker's letters).
    destinations: Vec<DlqArgs>,
    /// The token every action form carries: only this process's pages hold it.
    token: String,
    /// One look at the dead letters at a time: reading a RabbitMQ DLQ holds its messages.
    dlq: Mutex<()>,
}

/// `consumer board`: serves the page until Ctrl-C or SIGTERM.
pub(crate) async fn run(args: BoardArgs) -> anyhow::Result<()> {
    let inbox = settings::inbox(&args.db).await?;
    let http = match &args.http_table {
        Some(t) => {
            let table = Identifier::parse("HTTP_IDEMPOTENCY_TABLE (--http-table)", t)?;
            let operations = Identifier::parse(
                "HTTP_IDEMPOTENCY_TABLE (--http-table)",
                &format!("{t}_operations"),
            )?;
            let qualify = |i: &Identifier| match args.db.schema.as_deref().filter(|s| !s.is_empty())
            {
                Some(s) => Identifier::parse("DB_SCHEMA (--schema)", s)
                    .map(|s| format!("{}.{}", s.quoted(), i.quoted())),
                None => Ok(i.quoted()),
            };
            Some((qualify(&table)?, qualify(&operations)?))
        }
        None => None,
    };
    let listener = tokio::net::TcpListener::bind(args.listen)
        .await
        .with_context(|| format!("BOARD_LISTEN (--listen) {}: cannot listen", args.listen))?;
    let bound = listener.local_addr()?;
    let mut destinations = vec![args.dlq.clone()];
    if args.dlq.broker != crate::Broker::Inbox {
        destinations.push(DlqArgs {
            broker: crate::Broker::Inbox,
            ..args.dlq.clone()
        });
    }
    let board = Arc::new(Board {
        token: token()?,
        http,
        destinations,
        inbox,
        args,
        dlq: Mutex::new(()),
    });
    let mode = if board.args.allow_actions {
        "replay and discard allowed"
    } else {
        "read-only"
    };
    Output::new(false).progress(&format!("board: serving http://{bound}/ ({mode})"));
    let app = Router::new()
        .route("/", get(overview))
        .route("/letter", get(letter))
        .route("/confirm", get(confirm))
        .route("/act", post(act))
        .with_state(board);
    axum::serve(listener, app)
        .with_graceful_shutdown(async {
            let _ = tokio::signal::ctrl_c().await;
        })
        .await
        .context("serve the board")
}

/// 128 random bits as hex, from the system's source (`/dev/urandom`).
fn token() -> anyhow::Result<String> {
    use std::io::Read as _;
    let mut bits = [0u8; 16];
    std::fs::File::open("/dev/urandom")
        .and_then(|mut f| f.read_exact(&mut bits))
        .context("read /dev/urandom for the board's form token")?;
    Ok(bits.iter().map(|b| format!("{b:02x}")).collect())
}

impl Board {
    /// A page for `e`, with the credentials of every URL the board was given scrubbed.
    fn failed(&self, what: &str, e: &anyhow::Error) -> Response {
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
    fn destination(&self, d: usize) -> anyhow::Result<&DlqArgs> {
        self.destinations
            .get(d)
            .with_context(|| format!("no dead-letter destination {d}"))
    }

    /// The dead letters of destination `d`, read without consuming.
    async fn letters(&self, d: usize) -> anyhow::Result<Vec<DeadLetter>> {
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
            &[
                "outbox",
                "pending",
                "failing",
                "oldest pending",
                "published (kept)",
            ],
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
async fn overview(State(board): State<Arc<Board>>) -> Response {
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
struct LetterQuery {
    /// The destination's number (0: the one the settings name).
    #[serde(default)]
    d: usize,
    id: String,
}

/// `GET /letter?id=ID`: one dead letter whole.
async fn letter(State(board): State<Arc<Board>>, Query(q): Query<LetterQuery>) -> Response {
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

/// Which dead letters an action takes: one by id, or a group by reason and fingerprint.
#[derive(Debug, Deserialize)]
struct Target {
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
async fn confirm(State(board): State<Arc<Board>>, Query(t): Query<Target>) -> Response {
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
struct ActForm {
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
async fn act(State(board): State<Arc<Board>>, Form(form): Form<ActForm>) -> Response {
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
