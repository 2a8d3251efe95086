//! `consumer board`'s settings: the inbox's and the dead letters' (as for the other
//! commands), where the page is served, whether it may act, and the HTTP store it shows.

use std::net::SocketAddr;

use clap::Args;

use crate::{DbArgs, DlqArgs};

/// `consumer board`'s settings.
#[derive(Debug, Args, Clone)]
pub(crate) struct BoardArgs {
    #[command(flatten)]
    pub(super) db: DbArgs,
    #[command(flatten)]
    pub(super) dlq: DlqArgs,
    /// Where the page is served (default: this machine only).
    #[arg(long, env = "BOARD_LISTEN", default_value = "127.0.0.1:8089")]
    pub(super) listen: SocketAddr,
    /// Let the page replay and discard dead letters, each after a confirmation; without it
    /// the page only reads.
    #[arg(long)]
    pub(super) allow_actions: bool,
    /// The HTTP idempotency store's table (consumer-http's `http_idempotency`), in the
    /// inbox's schema: the page then shows its records by status and its pending operations.
    #[arg(long = "http-table", env = "HTTP_IDEMPOTENCY_TABLE")]
    pub(super) http_table: Option<String>,
}
