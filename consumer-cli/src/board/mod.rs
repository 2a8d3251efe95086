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
//! Layout: this file wires the routes and serves them; `args` holds the command's settings;
//! `read` the `Board` every page reads from and the read-only pages (`/`, `/letter`); `act`
//! the actions (`/confirm`, `/act`), refused unless `--allow-actions`; `page` writes the
//! HTML.

mod act;
mod args;
mod page;
mod read;

use std::sync::Arc;

use anyhow::Context as _;
use axum::routing::{get, post};
use axum::Router;
use consumer_core::ident::Identifier;
use tokio::sync::Mutex;

use crate::output::Output;
use crate::settings;
use crate::DlqArgs;
use act::{act, confirm};
pub(crate) use args::BoardArgs;
use read::{letter, overview, Board};

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
